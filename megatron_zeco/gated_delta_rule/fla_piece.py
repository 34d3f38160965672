"""ZeCO's local gated delta rule on CUDA: one GPU's own work, plus a correction for the entering state.

A piece of a ZeCO sequence gets its entering state ``S_in`` and the gradient of its leaving state ``D``
from the scans, which need the piece's map ``S_out = M S_in + E`` first. The piece runs fla's ordinary
forward from a zero state at once (what one GPU computes anyway: the output ``o^0``, the chunk
states, and the final state, which is ``E``) and adds what ``S_in`` contributes afterwards, a term
linear in ``S_in`` (``megatron_zeco/kernels/delta_correction.py``, shared with KDA's piece):

    o_c = o^0_c + Qt_c (M_{<c} S_in),   Qt_c = scale (q_c exp(G)) - Aqk_c w_c,   M_{<c} = T_{c-1} ... T_0

so, per piece:

forward: fla's cumsum and WY transform; then, side by side, fla's state pass from a zero state
    (``E``; on a stream of the highest priority, so that its few programs take their SMs ahead of the
    maps' many) and this package's maps (``Qt``, the transformed queries ``R_c = Qt_c M_{<c}`` over
    sub-pieces of the piece computed in parallel, their prefix products ``P`` and ``M``: on a
    second CUDA stream, beside fla's state pass, which leaves most SMs idle) -- while the scan is in
    flight, fla's output kernel (``o^0``) -- once ``S_in`` is there, ``o = o^0 + R (P S_in)``, every
    chunk at once;
backward: ``A = sum_c R_c^T do_c`` (through ``P^T``), the entering state's gradient from the outputs
    alone, every chunk at once -- while the reverse scan is in flight, what fla's backward computes
    before it reads the leaving state's gradient (``w`` and ``u`` again, the chunk states from ``S_in``,
    the in-chunk value gradient) -- once ``D`` is there, the rest of fla's backward with final-state
    gradient ``D``: one GPU's backward, cut in two where it first reads ``D``.

Results are those of fla's ``chunk_gated_delta_rule`` with ``initial_state=S_in`` and final-state
gradient ``D``, up to rounding. For 16-bit inputs the maps' products round their float32 operands to
the input dtype, as fla's own state pass rounds its states; for float32 inputs they keep float32
accuracy (``delta_correction.py``, "Precision"). Dense input (B sequences of T tokens) runs on fla's dense
kernels, packed documents on its varlen ones; this package's kernels see B sequences as B segments of
one row either way (the same memory).

Built on fla-core's internal functions (signatures of fla-core 0.6, ``common.backend.FLA_VERSION``);
imported on first use.
"""

import contextlib
import functools
from types import SimpleNamespace
from typing import Optional, Tuple

import torch

from ..common.backend import fla_varlen, require_fla
from ..cp.operator import Piece
from ..kernels.delta_correction import PieceCorrection, segment_plan, urgent_stream

Tensor = torch.Tensor
CHUNK = 64  # fla's chunk size for the gated delta rule


@functools.lru_cache(maxsize=None)
def _fla() -> SimpleNamespace:
    require_fla("a ZeCO piece of the gated delta rule on CUDA")
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local, chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd, recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
    from fla.ops.utils.constant import RCP_LN2
    return SimpleNamespace(**{f.__name__: f for f in (
        chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h, chunk_bwd_dqkwg, chunk_bwd_dv_local, chunk_fwd_o,
        chunk_gated_delta_rule_fwd_intra, prepare_wy_repr_bwd, recompute_w_u_fwd, chunk_local_cumsum,
        prepare_chunk_indices)}, RCP_LN2=RCP_LN2)


class FlaPiece(Piece):
    """One rank's piece of the sequence on fla's kernels and this package's correction kernels (see the
    module docstring; the protocol: ``cp.operator.Piece``). ``E [N, H, K, V]``, ``M [N, H, K, K]``
    float32."""

    # the maps (K1..K3) on a second CUDA stream beside fla's state pass; False: after it, on the current stream
    # (benchmarks/profile_piece.py's one-stream case times what the second stream buys)
    side_stream = True
    # K1 apart, Qt stored in R's dtype; True: K1 inside K2, Qt never stored (profile_piece.py's
    # "K1 inside K2" case times the two)
    fused_maps = False
    # fla's state pass on a stream of the highest priority (``urgent_stream``); False: on the current stream
    # (profile_piece.py's "state pass not urgent" case)
    urgent_state_pass = True

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                 cu_seqlens: Optional[Tensor] = None, cu_seqlens_cpu: Optional[Tensor] = None):
        fla = _fla()
        B, T, H, K = q.shape
        self.dtypes, self.scale = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype), scale
        packed = cu_seqlens is not None  # else B sequences of T tokens: B segments for this package's kernels
        offsets = tuple(int(x) for x in cu_seqlens_cpu) if packed else tuple(range(0, (B + 1) * T, T))
        fla_kw = fla_varlen(offsets, CHUNK, q.device) if packed else {}
        plan = segment_plan(offsets, CHUNK, H, K, q.device)
        self.q, self.k, self.v, self.beta = (x.contiguous() for x in (q, k, v, beta))
        self.plan = plan
        self.kw = {n: x for n, x in fla_kw.items() if n != "cu_seqlens_cpu"}
        self.g = fla.chunk_local_cumsum(g.contiguous(), chunk_size=CHUNK, scale=fla.RCP_LN2, **self.kw)
        w, u, self.A_wy = fla.chunk_gated_delta_rule_fwd_intra(k=self.k, v=self.v, g=self.g, beta=self.beta,
                                                               chunk_size=CHUNK, **self.kw)
        # the maps beside fla's state pass (on a side stream; fla's backward recomputes w)
        self.correction = PieceCorrection(self.q, self.k, w, self.g, scale, self.plan, beside=self.side_stream,
                                          fused=self.fused_maps)
        urgent = urgent_stream(q.device) if self.urgent_state_pass and q.device.type == "cuda" else None
        if urgent is not None:  # fla's state pass ahead of K1's pending programs
            main = torch.cuda.current_stream(q.device)
            urgent.wait_stream(main)
            for t in (self.k, w, u, self.g):
                t.record_stream(urgent)
        with torch.cuda.stream(urgent) if urgent is not None else contextlib.nullcontext():
            self.h, self.v_new, self.E = fla.chunk_gated_delta_rule_fwd_h(
                k=self.k, w=w, u=u, g=self.g, initial_state=None, output_final_state=True, chunk_size=CHUNK,
                **fla_kw)
        if urgent is not None:
            main.wait_stream(urgent)
            for t in (self.h, self.v_new, self.E):
                t.record_stream(main)
        self.correction.join()
        self.o0 = None
        self._local = None

    @property
    def M(self) -> Tensor:
        return self.correction.M

    @property
    def transition(self) -> Tensor:
        return self.correction.M

    def before_output(self) -> None:
        """fla's output kernel from the zero-state chunk states: runs while the scan is in flight."""
        if self.o0 is None:
            self.o0 = _fla().chunk_fwd_o(q=self.q, k=self.k, v=self.v_new, h=self.h, g=self.g, scale=self.scale,
                                         chunk_size=CHUNK, **self.kw)
            del self.h, self.v_new

    def output(self, S_in: Tensor) -> Tensor:
        self.before_output()
        self.S_in = S_in.contiguous()
        o = self.correction.output(self.o0, self.S_in)
        self.o0 = None
        return o

    def entering_grad(self, do: Tensor) -> Tensor:
        self.do = do.contiguous()
        return self.correction.entering_grad(self.do)

    def before_grads(self) -> None:
        """What fla's backward (``chunk_gated_delta_rule_bwd``) computes before it reads the leaving state's
        gradient: ``w`` and ``u`` again, the chunk states from ``S_in`` and the in-chunk value gradient (runs
        while the reverse scan is in flight)."""
        fla, kw = _fla(), self.kw
        w, u = fla.recompute_w_u_fwd(k=self.k, v=self.v, beta=self.beta, A=self.A_wy, g=self.g, **kw)
        h, v_new, _ = fla.chunk_gated_delta_rule_fwd_h(k=self.k, w=w, u=u, g=self.g, initial_state=self.S_in,
                                                       output_final_state=False, chunk_size=CHUNK, **kw)
        dv = fla.chunk_bwd_dv_local(q=self.q, k=self.k, g=self.g, do=self.do, scale=self.scale, chunk_size=CHUNK,
                                    **kw)
        self._local = (w, h, v_new, dv)

    def grads(self, D: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """dq, dk, dv, dg, dbeta (dtypes of the inputs) given ``D [N, H, K, V]``, the gradient of the
        state leaving the piece: the rest of fla's backward, in its order."""
        if self._local is None:
            self.before_grads()
        fla, kw, (w, h, v_new, dv) = _fla(), self.kw, self._local
        self._local = None
        q, k, g = self.q, self.k, self.g
        dh, _, dv = fla.chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, g=g, h0=self.S_in, dht=D.contiguous(),
                                                       do=self.do, dv=dv, scale=self.scale, chunk_size=CHUNK, **kw)
        dq, dk, dw, dg = fla.chunk_bwd_dqkwg(q=q, k=k, v=v_new, w=w, g=g, h=h, dv=dv, do=self.do, dh=dh,
                                             scale=self.scale, chunk_size=CHUNK, **kw)
        dk2, dv, dbeta, dg2 = fla.prepare_wy_repr_bwd(k=k, v=self.v, beta=self.beta, g=g, A=self.A_wy, dw=dw, du=dv,
                                                      **kw)
        dk.add_(dk2)
        dg.add_(dg2)
        dg = fla.chunk_local_cumsum(dg, chunk_size=CHUNK, reverse=True, **kw)
        return tuple(x.to(dtype) for x, dtype in zip((dq, dk, dv, dg, dbeta), self.dtypes))
