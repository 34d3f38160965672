"""ZeCO's local GLA on CUDA: fla's chunk kernels with the scan's state added between them.

fla's ``chunk_gla`` runs as a few kernels: the in-chunk log-gate cumsum, the per-chunk
states ``h`` (one sequential pass), the in-chunk attention, and the output; backward
recomputes ``h``, walks the state gradients ``dh`` backwards, then forms dq, dk, dv, dg.
A piece of a ZeCO sequence needs the state entering it (``S_in``) for ``h`` and the
gradient of the state leaving it (``D``) for ``dh``, and both arrive from the scan,
which needs this piece's summary first. So, per piece:

forward: ``h`` from a zero state (its final state is ``E``; ``gamma`` from the chunk
    sums of the gates) and the in-chunk attention -- scan -- ``h[c] += Diag(decay from
    the piece's start to chunk c) S_in`` -- output kernel;
backward: ``h`` from ``S_in``, ``dh`` from the outputs' gradient alone (its initial-state
    gradient is ``A``) and the in-chunk gradients -- reverse scan --
    ``dh[c] += Diag(decay from chunk c's end to the piece's end) D`` -- dv and dq/dk/dg kernels.

This adds one pass over ``h`` and one over ``dh`` (``kernels/decayed_add.py``) to fla's
own work, and the results are those of fla's ``chunk_gla`` with ``initial_state=S_in``
and final-state gradient ``D``, with the same roundings: the forward's ``h`` is kept in
float32 until the incoming state is added, then rounded to the input dtype once. The chunk decays are summed in float64 (prefix sums
of per-chunk totals; a difference of float32 sums would lose the small decays of a
piece that follows a long one).

Built on fla-core's internal kernels (checked with fla-core 0.6).
"""

from typing import Optional, Tuple

import torch
import triton

from ..kernels.decayed_add import add_decayed_states_

Tensor = torch.Tensor


def _fla():
    from fla.ops.common import chunk_h
    from fla.ops.gla import chunk as gla
    from fla.ops.utils import prepare_chunk_indices
    from fla.ops.utils.constant import RCP_LN2
    from fla.ops.utils.cumsum import chunk_local_cumsum
    return chunk_h, gla, prepare_chunk_indices, RCP_LN2, chunk_local_cumsum


class _Chunks:
    """The chunks of a dense ``[B, T]`` or packed (``cu_seqlens``) input: fla's launch tables,
    the segment of every chunk and the offsets of each segment's chunks (all on the device)."""

    def __init__(self, B: int, T: int, device, cu_seqlens: Optional[Tensor], cu_seqlens_cpu: Optional[Tensor]):
        _, _, prepare_chunk_indices, _, _ = _fla()
        self.size = BT = min(64, max(16, triton.next_power_of_2(T)))
        self.cu = cu_seqlens
        if cu_seqlens is None:
            NT = triton.cdiv(T, BT)
            self.indices = None
            self.segment = torch.arange(B * NT, device=device) // NT
            self.offsets = torch.arange(B + 1, device=device) * NT
            t = torch.arange(B * NT, device=device) % NT
            start, end = self.segment * T, (self.segment + 1) * T
        else:
            self.indices = prepare_chunk_indices(cu_seqlens, BT, cu_seqlens_cpu=cu_seqlens_cpu)
            self.segment, t = self.indices.unbind(1)
            counts = (cu_seqlens.diff() + BT - 1) // BT
            self.offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
            start, end = cu_seqlens[self.segment], cu_seqlens[self.segment + 1]
        self.last = torch.minimum(start + (t + 1) * BT, end) - 1  # last token of every chunk

    def decays(self, g_cumsum: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """log2-decays ``[C, H, K]`` from each segment's start to each chunk's start (forward) and
        from each chunk's end to its segment's end (backward), and per segment ``[N, H, K]``."""
        totals = g_cumsum.flatten(0, 1)[self.last].double()  # chunk totals (g_cumsum is in log2 units)
        prefix = torch.nn.functional.pad(totals.cumsum(0), (0, 0, 0, 0, 1, 0))  # [C + 1, H, K]
        first, after = self.offsets[self.segment], self.offsets[self.segment + 1]
        chunks = torch.arange(len(self.segment), device=totals.device)
        into = prefix[chunks] - prefix[first]
        out_of = prefix[after] - prefix[chunks + 1]
        return into.float(), out_of.float(), (prefix[self.offsets[1:]] - prefix[self.offsets[:-1]]).float()

    @property
    def kw(self) -> dict:
        return dict(cu_seqlens=self.cu, chunk_size=self.size)


class FlaPiece:
    """One rank's piece of the sequence through fla's kernels (see the module docstring).

    ``FlaPiece(q, k, v, g, scale)`` runs what needs no outside state and holds the piece's
    summary ``E [N, H, K, V]`` and ``gamma [N, H, K]`` (float32; N = B, or one per segment
    with ``cu_seqlens``). Then ``output(S_in)`` gives ``o``; ``entering_grad(do)`` gives
    ``A`` (the outputs' gradient with respect to ``S_in``); ``grads(D)`` gives dq, dk, dv, dg.
    """

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float,
                 cu_seqlens: Optional[Tensor] = None, cu_seqlens_cpu: Optional[Tensor] = None):
        chunk_h, gla, _, RCP_LN2, chunk_local_cumsum = _fla()
        self.q, self.k, self.v, self.g = (x.contiguous() for x in (q, k, v, g))
        self.scale = scale
        self.chunks = c = _Chunks(q.shape[0], q.shape[1], q.device, cu_seqlens, cu_seqlens_cpu)
        g_cumsum = chunk_local_cumsum(self.g, c.size, scale=RCP_LN2, cu_seqlens=c.cu, chunk_indices=c.indices)
        # float32 states: the incoming state is added before the one rounding to bf16 (as fla rounds)
        self._h, self.E = chunk_h.chunk_fwd_h(k=self.k, v=self.v, gk=g_cumsum, h0=None, output_final_state=True,
                                              states_in_fp32=True, **c.kw)
        self._into, _, log2_gamma = c.decays(g_cumsum)
        self.gamma = torch.exp2(log2_gamma)
        self.A = gla.chunk_gla_fwd_intra_gk(q=self.q, k=self.k, g=g_cumsum, scale=scale, chunk_indices=c.indices,
                                            **c.kw)
        self._g_cumsum = g_cumsum

    def output(self, S_in: Tensor) -> Tensor:
        """``o [B, T, H, V]`` of the piece entered by ``S_in [N, H, K, V]`` (float32)."""
        _, gla, _, _, _ = _fla()
        c = self.chunks
        h = add_decayed_states_(self._h, self._into, S_in, c.segment, out_dtype=self.k.dtype)
        o = gla.chunk_gla_fwd_o_gk(q=self.q, v=self.v, g=self._g_cumsum, A=self.A, h=h, scale=self.scale,
                                   chunk_indices=c.indices, **c.kw)
        self.S_in = S_in
        del self._h, self._into, self._g_cumsum  # backward recomputes them, as fla does
        return o

    def entering_grad(self, do: Tensor) -> Tensor:
        """``A [N, H, K, V]``: the gradient of ``<do, o>`` with respect to ``S_in``."""
        chunk_h, gla, _, RCP_LN2, chunk_local_cumsum = _fla()
        c, q, k, v = self.chunks, self.q, self.k, self.v
        self.do = do = do.contiguous()
        self._g_cumsum = g_cumsum = chunk_local_cumsum(self.g, c.size, scale=RCP_LN2, cu_seqlens=c.cu,
                                                       chunk_indices=c.indices)
        self._h, _ = chunk_h.chunk_fwd_h(k=k, v=v, gk=g_cumsum, h0=self.S_in, states_in_fp32=True, **c.kw)
        self._dh, A = chunk_h.chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=self.S_in, dht=None, gk=g_cumsum,
                                           scale=self.scale, states_in_fp32=True, **c.kw)
        dA = gla.chunk_gla_bwd_dA(v=v, do=do, scale=self.scale, chunk_indices=c.indices, **c.kw)
        self._dq, self._dk = gla.chunk_gla_bwd_dqk_intra(q=q, k=k, g=g_cumsum, dA=dA, chunk_indices=c.indices,
                                                         **c.kw)
        return A

    def grads(self, D: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """dq, dk, dv, dg (dtypes of the inputs) given ``D [N, H, K, V]``, the gradient of the
        state leaving the piece."""
        _, gla, _, _, _ = _fla()
        c, g_cumsum = self.chunks, self._g_cumsum
        _, out_of, _ = c.decays(g_cumsum)
        dh = add_decayed_states_(self._dh, out_of, D, c.segment)
        dv = gla.chunk_gla_bwd_dv(k=self.k, g=g_cumsum, A=self.A, do=self.do, dh=dh, chunk_indices=c.indices,
                                  **c.kw)
        dq, dk, dg = gla.chunk_gla_bwd_dqkg(q=self.q, k=self.k, v=self.v, h=self._h, g=g_cumsum, do=self.do,
                                            dh=dh, dq=self._dq, dk=self._dk, scale=self.scale,
                                            chunk_indices=c.indices, **c.kw)
        return dq.to(self.q.dtype), dk.to(self.k.dtype), dv.to(self.v.dtype), dg.to(self.g.dtype)
