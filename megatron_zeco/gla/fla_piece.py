"""ZeCO's local GLA on CUDA: fla's chunk kernels with the scan's state added between them.

fla's ``chunk_gla`` runs as a few kernels: the in-chunk log-gate cumsum, the per-chunk
states ``h`` (one sequential pass), the in-chunk attention, and the output; backward
recomputes ``h``, walks the state gradients ``dh`` backwards, then forms dq, dk, dv, dg.
A piece of a ZeCO sequence needs the state entering it (``S_in``) for ``h`` and the
gradient of the state leaving it (``D``) for ``dh``, and both arrive from the scan,
which needs this piece's summary first. So, per piece:

forward: ``h`` from a zero state (its final state is ``E``; ``gamma`` from the chunk
    sums of the gates) and the in-chunk attention -- scan -- the output kernel, which adds
    ``Diag(decay from the piece's start to chunk c) S_in`` to each chunk's ``h[c]``;
backward: ``dh`` from the outputs' gradient alone (its initial-state gradient is ``A``)
    -- reverse scan -- ``h`` from ``S_in`` and the in-chunk gradients, then the dv and
    dq/dk/dg kernels, which add ``Diag(decay from chunk c's end to the piece's end) D``
    to each chunk's ``dh[c]``.

fla's own kernels do the rest; the three that read ``h`` or ``dh`` after the scan, and the
one that sums the chunk decays (float64, one launch), are this project's
(``gla/kernels.py``), so ZeCO adds no pass over the states or the inputs. Results
are those of fla's ``chunk_gla`` with ``initial_state=S_in`` and final-state gradient
``D``, up to rounding: the forward adds the ``S_in`` term as its own product (``S_in``
unrounded) rather than rounding it into ``h``; the backward adds ``D`` to the float32
``dh`` as fla does.

Built on fla-core's internal kernels (checked with fla-core 0.6); the two chunk-state kernels
are launched here, not through fla's wrappers, which synchronise the host for packed input.
"""

import functools
from types import SimpleNamespace
from typing import Optional, Tuple

import torch
import triton

from ..common.backend import require_fla
from ..cp.operator import Piece
from .kernels import chunk_decays, chunk_dqkg_with_state, chunk_dv_with_state, chunk_o_with_state

Tensor = torch.Tensor


@functools.lru_cache(maxsize=None)
def _fla() -> SimpleNamespace:
    """fla's internal kernels this module calls (imported on first use: fla needs a GPU driver)."""
    require_fla("a ZeCO piece of GLA on CUDA")
    from fla.ops.common.chunk_h import chunk_bwd_kernel_dh, chunk_fwd_kernel_h
    from fla.ops.gla import chunk as gla
    from fla.ops.utils import prepare_chunk_indices, prepare_chunk_offsets
    from fla.ops.utils.constant import RCP_LN2
    from fla.ops.utils.cumsum import chunk_local_cumsum
    return SimpleNamespace(chunk_fwd_kernel_h=chunk_fwd_kernel_h, chunk_bwd_kernel_dh=chunk_bwd_kernel_dh, gla=gla,
                           RCP_LN2=RCP_LN2, chunk_local_cumsum=chunk_local_cumsum,
                           prepare_chunk_indices=prepare_chunk_indices, prepare_chunk_offsets=prepare_chunk_offsets)


class _Chunks:
    """The chunking of a dense ``[B, T]`` or packed (``cu_seqlens``) input: the chunk size and,
    packed, fla's launch tables (cached by fla for the same ``cu_seqlens``)."""

    def __init__(self, T: int, cu_seqlens: Optional[Tensor], cu_seqlens_cpu: Optional[Tensor]):
        self.size = BT = min(64, max(16, triton.next_power_of_2(T)))
        self.cu = cu_seqlens
        self.indices = self.offsets = None
        if cu_seqlens is not None:
            self.indices = _fla().prepare_chunk_indices(cu_seqlens, BT, cu_seqlens_cpu=cu_seqlens_cpu)
            self.offsets = _fla().prepare_chunk_offsets(cu_seqlens, BT)

    @property
    def kw(self) -> dict:
        return dict(cu_seqlens=self.cu, chunk_size=self.size)

    def sequences(self, B: int) -> int:
        return B if self.cu is None else len(self.cu) - 1

    def count(self, T: int) -> int:
        """Chunks per batch entry (dense) or in all segments (packed), known on the host."""
        return triton.cdiv(T, self.size) if self.cu is None else len(self.indices)

    def launch_states(self, kernel, B: int, T: int, H: int, K: int, V: int, **kw) -> None:
        """fla's chunk-state kernel ``kernel`` (fwd ``h`` or bwd ``dh``) with per-key gates, launched
        as fla's ``chunk_fwd_h`` / ``chunk_bwd_dh`` do, except that with packed input those read the
        chunk count back from the GPU (``.item()``): a host synchronisation per call, which held
        each CP rank's host until its GPU caught up, so the ranks' hops waited on each other."""
        N = self.sequences(B)
        kernel[lambda meta: (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]) * N * H,)](
            cu_seqlens=self.cu, split_offsets=self.offsets, T=T, H=H, K=K, V=V, BT=self.size, BS=self.size,
            g=None, g_gamma=None, gv=None, USE_G=False, USE_G_GAMMA=False, USE_GK=True, USE_GV=False,
            STATE_V_FIRST=False, **kw)


def _states(c: _Chunks, k: Tensor, v: Tensor, gk: Tensor, h0: Optional[Tensor], output_final_state: bool,
            states_in_fp32: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """Chunk states ``h [B, C, H, K, V]`` and, if asked, the final state (float32)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    h = k.new_empty(B, c.count(T), H, K, V, dtype=torch.float if states_in_fp32 else k.dtype)
    ht = k.new_empty(c.sequences(B), H, K, V, dtype=torch.float) if output_final_state else None
    c.launch_states(_fla().chunk_fwd_kernel_h, B, T, H, K, V, k=k, v=v, h=h, gk=gk, h0=h0, ht=ht)
    return h, ht


def _state_grads(c: _Chunks, q: Tensor, do: Tensor, gk: Tensor, h0: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    """Chunk state gradients ``dh [B, C, H, K, V]`` (float32) of ``<do, o>`` alone (no final-state
    gradient), and the initial state's."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    dh = q.new_empty(B, c.count(T), H, K, V, dtype=torch.float)
    dh0 = torch.empty_like(h0, dtype=torch.float)
    c.launch_states(_fla().chunk_bwd_kernel_dh, B, T, H, K, V, q=q, gk=gk, do=do, dh=dh, dht=None, dh0=dh0,
                    scale=scale, HQ=H, NG=1)
    return dh, dh0


class FlaPiece(Piece):
    """One rank's piece of the sequence through fla's kernels (see the module docstring; the protocol:
    ``cp.operator.Piece``). ``FlaPiece(q, k, v, g, scale)`` runs what needs no outside state and holds
    the summary ``E`` and the decays ``gamma [N, H, K]`` (float32, the transition)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float,
                 cu_seqlens: Optional[Tensor] = None, cu_seqlens_cpu: Optional[Tensor] = None):
        self.q, self.k, self.v, self.g = (x.contiguous() for x in (q, k, v, g))
        self.scale = scale
        self.chunks = c = _Chunks(q.shape[1], cu_seqlens, cu_seqlens_cpu)
        self._g_cumsum = g_cumsum = self._cumsum()
        # states in the input dtype, as fla's forward keeps them
        self._h, self.E = _states(c, self.k, self.v, g_cumsum, None, output_final_state=True, states_in_fp32=False)
        self._into, self._out_of, self.gamma = chunk_decays(g_cumsum, c.size, c.cu, c.indices, c.offsets)
        self.A = None

    @property
    def transition(self) -> Tensor:
        """The linear part of the piece's map: the decays ``gamma``."""
        return self.gamma

    def before_output(self) -> None:
        """The in-chunk attention: needs no incoming state (runs while the scan is in flight)."""
        fla = _fla()
        c = self.chunks
        self.A = fla.gla.chunk_gla_fwd_intra_gk(q=self.q, k=self.k, g=self._g_cumsum, scale=self.scale,
                                                chunk_indices=c.indices, **c.kw)

    def _cumsum(self) -> Tensor:
        """In-chunk cumulative log2 gates (float32)."""
        fla = _fla()
        c = self.chunks
        return fla.chunk_local_cumsum(self.g, c.size, scale=fla.RCP_LN2, cu_seqlens=c.cu, chunk_indices=c.indices)

    def output(self, S_in: Tensor) -> Tensor:
        if self.A is None:
            self.before_output()
        c = self.chunks
        o = chunk_o_with_state(self.q, self.v, self._g_cumsum, self.A, self._h, S_in.contiguous(), self._into,
                               self.scale, c.size, c.cu, c.indices)
        self.S_in = S_in
        del self._h, self._into, self._g_cumsum  # backward recomputes them, as fla does
        return o

    def entering_grad(self, do: Tensor) -> Tensor:
        self.do = do.contiguous()
        self._g_cumsum = self._cumsum()
        self._dh, A = _state_grads(self.chunks, self.q, self.do, self._g_cumsum, self.S_in, self.scale)
        self._local = None
        return A

    def before_grads(self) -> None:
        """What needs no outgoing-state gradient (runs while the reverse scan is in flight):
        the chunk states from ``S_in`` and the in-chunk gradients."""
        fla = _fla()
        c, g_cumsum, q, k, v, do = self.chunks, self._g_cumsum, self.q, self.k, self.v, self.do
        h, _ = _states(c, k, v, g_cumsum, self.S_in, output_final_state=False, states_in_fp32=True)
        dA = fla.gla.chunk_gla_bwd_dA(v=v, do=do, scale=self.scale, chunk_indices=c.indices, **c.kw)
        dq, dk = fla.gla.chunk_gla_bwd_dqk_intra(q=q, k=k, g=g_cumsum, dA=dA, chunk_indices=c.indices, **c.kw)
        self._local = (h, dq, dk)

    def grads(self, D: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """dq, dk, dv, dg (dtypes of the inputs) given ``D [N, H, K, V]``, the gradient of the
        state leaving the piece."""
        if self._local is None:
            self.before_grads()
        c, g_cumsum, q, k, v, do, D = self.chunks, self._g_cumsum, self.q, self.k, self.v, self.do, D.contiguous()
        (h, dq, dk), tables = self._local, (c.size, c.cu, c.indices)
        dv = chunk_dv_with_state(k, g_cumsum, self.A, do, self._dh, D, self._out_of, *tables)
        dq, dk, dg = chunk_dqkg_with_state(q, k, v, g_cumsum, h, do, self._dh, D, self._out_of, dq, dk, self.scale,
                                           *tables)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(self.g.dtype)
