"""ZeCO's local KDA on CUDA: one GPU's own work, plus a correction for the entering state.

As the gated delta rule's piece (``gated_delta_rule/fla_piece.py``), with KDA's decay per key channel. A
piece gets its entering state ``S_in`` and the gradient of its leaving state ``D`` from the scans, which
need the piece's map ``S_out = M S_in + E`` first. The piece runs fla's KDA forward from a zero state at
once (what one GPU computes anyway: the output ``o^0``, the chunk states, and the final state, which is
``E``) and adds what ``S_in`` contributes afterwards, a term linear in ``S_in``
(``megatron_zeco/kernels/delta_correction.py``, the kernels both delta rules share):

    o_c = o^0_c + Qt_c (M_{<c} S_in),   Qt_c = scale (q_c * exp(G_c)) - Aqk_c w_c,
    M_{<c} = T_{c-1} ... T_0,   T_c = Diag(exp(G_last)) - (k_c * exp(G_last - G_c))^T w_c

with ``G`` the in-chunk cumulative log decay, a K-vector per token, and ``w``, ``Aqk`` fla's WY factor and
in-chunk attention. Per piece:

forward: fla's gate cumsum and intra-chunk pass (``w``, ``u``, the decayed keys, ``Aqk``, the WY matrix);
    then, side by side, fla's state pass from a zero state (``E``) and this package's maps (``Qt`` from
    fla's ``Aqk``, the transformed queries ``R_c = Qt_c M_{<c}`` over sub-pieces of the piece computed in
    parallel, their prefix products ``P`` and ``M``: on a second CUDA stream) -- while the scan is in
    flight, fla's output kernel (``o^0``) -- once ``S_in`` is there, ``o = o^0 + R (P S_in)``, every chunk
    at once;
backward: ``A = sum_c R_c^T do_c`` (through ``P^T``), the entering state's gradient from the outputs
    alone, every chunk at once -- while the reverse scan is in flight, what fla's KDA backward recomputes
    before it reads the leaving state's gradient (``w``, ``u``, the gated queries and keys, the chunk
    states from ``S_in``) -- once ``D`` is there, fla's KDA backward from those (``disable_recompute``)
    with final-state gradient ``D``: one GPU's backward.

Results are those of fla's ``chunk_kda`` (``use_gate_in_kernel=False``, ``safe_gate=False``, chunks of 64)
with ``initial_state=S_in`` and final-state gradient ``D``, up to rounding. For 16-bit inputs the maps'
products round their float32 operands to the input dtype, as fla's own state pass rounds its states and
decayed keys; for float32 inputs they keep float32 accuracy. Dense input (B sequences of T tokens) runs on
fla's dense kernels, packed documents on its varlen ones; this package's kernels see B sequences as B
segments of one row either way (the same memory). Grouped value heads (fewer query/key heads than value
heads) as fla's.

Built on fla-core's internal functions (signatures of fla-core 0.6, ``common.backend.FLA_VERSION``);
imported on first use.
"""

import functools
from types import SimpleNamespace
from typing import Optional, Tuple

import torch

from ..common.backend import fla_varlen, require_fla
from ..cp.operator import Piece
from ..kernels.delta_correction import PieceCorrection, segment_plan

Tensor = torch.Tensor
CHUNK = 64  # fla's chunk size for KDA (chunk_kda's default)


@functools.lru_cache(maxsize=None)
def _fla() -> SimpleNamespace:
    require_fla("a ZeCO piece of KDA on CUDA")
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.kda.wy_fast import recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
    from fla.ops.utils.constant import RCP_LN2
    return SimpleNamespace(**{f.__name__: f for f in (
        chunk_gated_delta_rule_fwd_h, chunk_gla_fwd_o_gk, chunk_kda_bwd, chunk_kda_fwd_intra, chunk_local_cumsum,
        prepare_chunk_indices, recompute_w_u_fwd)}, RCP_LN2=RCP_LN2)


class FlaPiece(Piece):
    """One rank's piece of the sequence on fla's KDA kernels and this package's correction kernels (see the
    module docstring; the protocol: ``cp.operator.Piece``). ``E [N, HV, K, V]``, ``M [N, HV, K, K]``
    float32."""

    # the maps (K1..K3) on a second CUDA stream beside fla's state pass; False: after it, on the current stream
    # (benchmarks/profile_piece.py's one-stream case times what the second stream buys)
    side_stream = True
    # K1 apart, Qt stored in R's dtype; True: K1 inside K2, Qt never stored (profile_piece.py's
    # "K1 inside K2" case times the two)
    fused_maps = False

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                 cu_seqlens: Optional[Tensor] = None, cu_seqlens_cpu: Optional[Tensor] = None):
        fla = _fla()
        B, T, _, K = q.shape
        HV = v.shape[2]
        self.dtypes, self.scale = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype), scale
        packed = cu_seqlens is not None  # else B sequences of T tokens: B segments for this package's kernels
        offsets = tuple(int(x) for x in cu_seqlens_cpu) if packed else tuple(range(0, (B + 1) * T, T))
        fla_kw = fla_varlen(offsets, CHUNK, q.device) if packed else {}
        plan = segment_plan(offsets, CHUNK, HV, K, q.device)
        self.q, self.k, self.v, self.beta = (x.contiguous() for x in (q, k, v, beta))
        self.kw = {n: x for n, x in fla_kw.items() if n != "cu_seqlens_cpu"}
        self.g = fla.chunk_local_cumsum(g.contiguous(), chunk_size=CHUNK, scale=fla.RCP_LN2, **self.kw)
        w, u, _, kg, self.Aqk, self.Akk = fla.chunk_kda_fwd_intra(
            q=self.q, k=self.k, v=self.v, gk=self.g, beta=self.beta, scale=scale, chunk_size=CHUNK, **self.kw)
        # the maps beside fla's state pass (on a side stream; fla's backward recomputes w)
        self.correction = PieceCorrection(self.q, self.k, w, self.g, scale, plan, aqk=self.Aqk,
                                          beside=self.side_stream, fused=self.fused_maps)
        self.h, self.v_new, self.E = fla.chunk_gated_delta_rule_fwd_h(
            k=kg, w=w, u=u, gk=self.g, initial_state=None, output_final_state=True, chunk_size=CHUNK,
            **fla_kw)
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
            self.o0 = _fla().chunk_gla_fwd_o_gk(q=self.q, v=self.v_new, g=self.g, A=self.Aqk, h=self.h,
                                                scale=self.scale, chunk_size=CHUNK, **self.kw)
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
        """What fla's KDA backward (``chunk_kda_bwd``) recomputes before it reads the leaving state's gradient:
        ``w``, ``u``, the gated queries and keys, and the chunk states from ``S_in`` (runs while the reverse scan
        is in flight)."""
        fla, kw = _fla(), self.kw
        w, u, qg, kg = fla.recompute_w_u_fwd(q=self.q, k=self.k, v=self.v, beta=self.beta, A=self.Akk, gk=self.g,
                                             **kw)
        h, v_new, _ = fla.chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=self.g, initial_state=self.S_in,
                                                       output_final_state=False, chunk_size=CHUNK, **kw)
        self._local = dict(w=w, u=u, qg=qg, kg=kg, v_new=v_new, h=h)

    def grads(self, D: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """dq, dk, dv, dg, dbeta (dtypes of the inputs) given ``D [N, HV, K, V]``, the gradient of the state
        leaving the piece: fla's KDA backward from ``initial_state=S_in`` with ``dht=D``, from what
        :meth:`before_grads` recomputed."""
        if self._local is None:
            self.before_grads()
        local, self._local = self._local, None
        dq, dk, dv, dbeta, dg, *_ = _fla().chunk_kda_bwd(
            q=self.q, k=self.k, v=self.v, beta=self.beta, Aqk=self.Aqk, Akk=self.Akk, scale=self.scale,
            initial_state=self.S_in, do=self.do, dht=D.contiguous(), g=self.g, chunk_size=CHUNK,
            disable_recompute=True, **local, **self.kw)
        return tuple(x.to(dtype) for x, dtype in zip((dq, dk, dv, dg, dbeta), self.dtypes))
