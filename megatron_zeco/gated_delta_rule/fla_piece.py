"""ZeCO's local gated delta rule on CUDA: fla's kernels, cut around the scan.

fla's ``chunk_gated_delta_rule`` runs as: the in-chunk log-decay cumsum, the WY transform (``w``,
``u``), the chunk states ``h`` (one sequential pass from the initial state), the output; backward
recomputes ``w``, ``u`` and ``h``, walks the state gradients ``dh`` backwards from the final-state
gradient, then forms every input's gradient. A piece of a ZeCO sequence gets its entering state
``S_in`` and the gradient of its leaving state ``D`` from the scans, which need the piece's map
first. So, per piece:

forward: cumsum and WY transform; the summary ``[E | M]`` (fla's context-parallel pre-processing
    kernel ``chunk_cp_fwd_h``, one program per column block and head, every segment at once)
    -- scan -- ``h`` from ``S_in`` and the output (fla's kernels, as fla's forward runs them);
backward: ``A``, the entering state's gradient from the outputs alone (fla's ``dh`` pass with no
    final-state gradient) -- reverse scan -- fla's whole backward from ``S_in`` with final-state
    gradient ``D``.

Results are those of fla's ``chunk_gated_delta_rule`` with ``initial_state=S_in`` and final-state
gradient ``D``; the backward runs fla's ``dh`` pass twice (once for ``A``, once inside fla's
backward), as fla's own context parallelism does. Dense input (B sequences of T tokens) runs as one
packed row of B segments, so every kernel takes the varlen path.

Built on fla-core's internal functions (signatures of fla-core 0.6); imported on first use.
"""

import functools
from types import SimpleNamespace
from typing import Optional, Tuple

import torch

from ..common.backend import require_fla

Tensor = torch.Tensor
CHUNK = 64  # fla's chunk size for the gated delta rule


@functools.lru_cache(maxsize=None)
def _fla() -> SimpleNamespace:
    require_fla("a ZeCO piece of the gated delta rule on CUDA")
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dv_local, chunk_fwd_o
    from fla.ops.cp.chunk_fwd import chunk_cp_fwd_h
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
    from fla.ops.utils.constant import RCP_LN2
    return SimpleNamespace(**{f.__name__: f for f in (
        chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h, chunk_bwd_dv_local, chunk_fwd_o, chunk_cp_fwd_h,
        chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd_intra, recompute_w_u_fwd, chunk_local_cumsum,
        prepare_chunk_indices)}, RCP_LN2=RCP_LN2)


class FlaDeltaPiece:
    """One rank's piece of the sequence through fla's kernels (see the module docstring and
    ``delta_backend.gdn_piece`` for the protocol). ``E [N, H, K, V]``, ``M [N, H, K, K]`` float32."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                 cu_seqlens: Optional[Tensor] = None, cu_seqlens_cpu: Optional[Tensor] = None):
        fla = _fla()
        B, T, H, K = q.shape
        V = v.shape[-1]
        self.shape, self.dtypes, self.scale = (B, T), (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype), scale
        if cu_seqlens is None:  # B sequences of T tokens: B segments of one row
            cu_seqlens_cpu = torch.arange(B + 1) * T
            cu_seqlens = cu_seqlens_cpu.to(q.device)
            q, k, v, g, beta = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
        self.q, self.k, self.v, self.beta = (x.contiguous() for x in (q, k, v, beta))
        self.cu, self.cu_cpu = cu_seqlens.long(), cu_seqlens_cpu
        self.indices = fla.prepare_chunk_indices(self.cu, CHUNK, cu_seqlens_cpu=cu_seqlens_cpu)
        self.kw = dict(cu_seqlens=self.cu, chunk_indices=self.indices)
        self.g = fla.chunk_local_cumsum(g.contiguous(), chunk_size=CHUNK, scale=fla.RCP_LN2, **self.kw)
        self.w, self.u, self.A_wy = fla.chunk_gated_delta_rule_fwd_intra(k=self.k, v=self.v, g=self.g, beta=self.beta,
                                                                         chunk_size=CHUNK, **self.kw)
        hm = self.k.new_zeros(len(self.cu) - 1, H, K, V + K, dtype=torch.float32)
        fla.chunk_cp_fwd_h(k=self.k, w=self.w, u=self.u, hm=hm, g=self.g, cu_seqlens=self.cu, chunk_size=CHUNK,
                           multi_seqs=True)
        self.E, self.M = hm[..., :V].contiguous(), hm[..., V:].contiguous()

    @property
    def transition(self) -> Tensor:
        return self.M

    def before_output(self) -> None:  # nothing of the forward's rest runs without S_in
        pass

    def before_grads(self) -> None:
        pass

    def _dense(self, x: Tensor) -> Tensor:
        """``[1, B*T, ...]`` -> the caller's ``[B, T, ...]``."""
        return x.reshape(*self.shape, *x.shape[2:])

    def output(self, S_in: Tensor) -> Tensor:
        """``o [B, T, H, V]`` of the piece entered by ``S_in [N, H, K, V]`` (float32)."""
        fla = _fla()
        self.S_in = S_in.contiguous()
        h, v_new, _ = fla.chunk_gated_delta_rule_fwd_h(k=self.k, w=self.w, u=self.u, g=self.g, initial_state=self.S_in,
                                                       output_final_state=False, chunk_size=CHUNK,
                                                       cu_seqlens_cpu=self.cu_cpu, **self.kw)
        o = fla.chunk_fwd_o(q=self.q, k=self.k, v=v_new, h=h, g=self.g, scale=self.scale, chunk_size=CHUNK, **self.kw)
        del self.w, self.u  # backward recomputes them from A_wy, as fla does
        return self._dense(o)

    def entering_grad(self, do: Tensor) -> Tensor:
        """``A [N, H, K, V]``: the gradient of ``<do, o>`` with respect to ``S_in``."""
        fla = _fla()
        self.do = do.reshape(self.q.shape[:3] + do.shape[-1:]).contiguous()
        w, _ = fla.recompute_w_u_fwd(k=self.k, v=self.v, beta=self.beta, A=self.A_wy, g=self.g, **self.kw)
        dv = fla.chunk_bwd_dv_local(q=self.q, k=self.k, do=self.do, g=self.g, scale=self.scale, chunk_size=CHUNK,
                                    **self.kw)
        _, A, _ = fla.chunk_gated_delta_rule_bwd_dhu(q=self.q, k=self.k, w=w, do=self.do, dv=dv, g=self.g, h0=self.S_in,
                                                     dht=None, scale=self.scale, chunk_size=CHUNK, **self.kw)
        return A

    def grads(self, D: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """dq, dk, dv, dg, dbeta (dtypes of the inputs) given ``D [N, H, K, V]``, the gradient of the
        state leaving the piece."""
        dq, dk, dv, dbeta, dg, *_ = _fla().chunk_gated_delta_rule_bwd(
            q=self.q, k=self.k, v=self.v, g=self.g, beta=self.beta, A=self.A_wy, scale=self.scale,
            initial_state=self.S_in, do=self.do, dht=D.contiguous(), chunk_size=CHUNK, **self.kw)
        return tuple(self._dense(x).to(dtype) for x, dtype in zip((dq, dk, dv, dg, dbeta), self.dtypes))
