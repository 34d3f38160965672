"""GLA on one device: the local operations the context-parallel strategies are built from.

Each rank runs these on its own piece of the sequence; only states cross ranks.

* ``gla_fwd`` / ``gla_bwd``: GLA over a piece from a given initial state, and its
  gradient from the output gradient and the final-state gradient. On CUDA this is
  flash-linear-attention's ``chunk_gla`` (fla-core); elsewhere, and for float64, the
  PyTorch chunked form of ``chunk.py``. The forward keeps the backend's own autograd
  record, so the backward costs what the backend's backward costs.
* ``gla_piece``: the same forward and backward cut in two around the scan of the ZeCO
  and LASP-2 strategies: first the piece's summary (``E``, ``gamma``), then the output
  from the state entering it; first ``A``, then the gradients from the state leaving it.
  On CUDA this is fla's chunk kernels with the incoming state added between them
  (``fla_piece.py``: no extra pass over the inputs); elsewhere two reductions of
  ``chunk.py`` ahead of ``gla_fwd`` / ``gla_bwd``.

All take fla's ``cu_seqlens`` for packed input (``[1, T, ...]`` holding N segments,
one state each, in and out), and, as fla does, an optional host copy ``cu_seqlens_cpu``:
fla builds its launch tables from it instead of reading the offsets back from the device
(a copy that would wait for all queued GPU work).

``MEGATRON_ZECO_BACKEND=torch`` forces the PyTorch forms everywhere (``common/backend.py``).
"""

from typing import Optional, Tuple, Union

import torch

from ..common.backend import Saved, fla, record, replay, uses_kernels, varlen
from ..cp.operator import Piece
from .chunk import chunk_gla, chunk_gla_state, chunk_gla_state_grad

Tensor = torch.Tensor


def gla_fwd(
    inputs: Tuple[Tensor, Tensor, Tensor, Tensor], scale: float, initial_state: Optional[Tensor] = None,
    output_final_state: bool = False, cu_seqlens: Optional[Tensor] = None, cu_seqlens_cpu: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor], Saved]:
    """Local GLA forward.

    Args:
        inputs: ``(q, k, v, g)``: q, k, g ``[B, T, H, K]``; v ``[B, T, H, V]``, one floating dtype.
        initial_state: ``[B, H, K, V]`` float32 (float64 for float64 inputs) or None.
        cu_seqlens: ``[N+1]`` int64 segment offsets (B = 1); states are then ``[N, H, K, V]``.
        cu_seqlens_cpu: the same offsets on the host, or None.
    Returns:
        ``o [B, T, H, V]`` (input dtype), the final state ``[B, H, K, V]`` or None, and
        what :func:`gla_bwd` takes.
    """
    q = inputs[0]
    return record(_local_gla(q), inputs, initial_state, scale=scale, output_final_state=output_final_state,
                  **varlen(q, cu_seqlens, cu_seqlens_cpu))


def gla_bwd(saved: Saved, do: Tensor, dht: Optional[Tensor]
            ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Local GLA backward from the output gradient ``do`` and the final-state gradient ``dht``
    (None: the final state is not used; the forward must have output it otherwise).

    Returns ``dq, dk, dv, dg`` and ``dh0`` (None when the forward had no initial state).
    """
    grads, dh0 = replay(saved, do, dht)
    return (*grads, dh0)


def gla_piece(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float, cu_seqlens: Optional[Tensor] = None,
              cu_seqlens_cpu: Optional[Tensor] = None):
    """A piece of a sequence whose incoming state comes later (from a scan): a
    :class:`~megatron_zeco.cp.operator.Piece` whose transition is the decays ``gamma [N, H, K]``
    (``S_out = Diag(gamma) S_in + E``). Inputs as :func:`gla_fwd`; ``grads`` gives dq, dk, dv, dg."""
    if uses_kernels(q.device, q.dtype):
        _fla_chunk_gla()  # the clear ImportError if fla is missing
        from .fla_piece import FlaPiece
        return FlaPiece(q, k, v, g, scale, cu_seqlens, cu_seqlens_cpu)
    return _TorchPiece(q, k, v, g, scale, cu_seqlens)


class _TorchPiece(Piece):
    """``gla_piece`` on ``chunk.py``: the summary and ``A`` as separate reductions, the rest as a whole once
    the state is known."""

    def __init__(self, q, k, v, g, scale, cu_seqlens):
        self.inputs, self.scale, self.cu = (q, k, v, g), scale, cu_seqlens
        self.E, self.gamma = chunk_gla_state(k, v, g, cu_seqlens=cu_seqlens)

    @property
    def transition(self) -> Tensor:
        """The linear part of the piece's map: the decays ``gamma`` (``comm/transition.py``)."""
        return self.gamma

    def output(self, S_in: Tensor) -> Tensor:
        o, _, self.saved = gla_fwd(self.inputs, self.scale, S_in, output_final_state=True, cu_seqlens=self.cu)
        return o

    def entering_grad(self, do: Tensor) -> Tensor:
        q, _, _, g = self.inputs
        self.do = do
        return chunk_gla_state_grad(q, g, do, self.scale, cu_seqlens=self.cu)

    def grads(self, D: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        return gla_bwd(self.saved, self.do, D)[:4]


def require_backend(device: Union[torch.device, str], dtype: torch.dtype) -> None:
    """Raise ``ImportError`` now if GLA on ``device`` in ``dtype`` needs flash-linear-attention
    and it cannot be imported: the layer calls this at model build, not at the first step."""
    if uses_kernels(device, dtype):
        _fla_chunk_gla()


def _local_gla(x: Tensor):
    return _fla_chunk_gla() if uses_kernels(x.device, x.dtype) else chunk_gla


def _fla_chunk_gla():
    return fla("GLA on CUDA", "fla.ops.gla.chunk_gla")


class LocalGLA(torch.autograd.Function):
    """GLA over this rank's tokens from ``h0`` (state dtype), differentiable; ``final`` is an empty
    tensor when not requested.

    Packed input (``documents``: ``cu_seqlens`` and its host copy; no initial or final state) runs as a
    piece entered by zero states: fla's own ``chunk_gla`` reads the offsets back from the GPU at every state kernel
    (a host synchronisation, and no CUDA graph), the piece's kernels take them from the host copy.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, h0, scale, output_final_state, documents):
        ctx.piece = None
        if documents is not None:
            cu_seqlens, cu_seqlens_cpu = documents
            ctx.piece = piece = gla_piece(q, k, v, g, scale, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
            return piece.output(torch.zeros_like(piece.E)), q.new_zeros(0)
        o, ht, ctx.saved = gla_fwd((q, k, v, g), scale, h0, output_final_state)
        ctx.output_final_state = output_final_state
        return o, (q.new_zeros(0) if ht is None else ht)

    @staticmethod
    def backward(ctx, do, dht):
        if ctx.piece is not None:
            A = ctx.piece.entering_grad(do)
            return (*ctx.piece.grads(torch.zeros_like(A)), None, None, None, None)
        dq, dk, dv, dg, dh0 = gla_bwd(ctx.saved, do, dht if ctx.output_final_state else None)
        return dq, dk, dv, dg, dh0, None, None, None


def gla_local(*inputs: Tensor, scale: float, initial_state: Optional[Tensor] = None, output_final_state: bool = False,
              cu_seqlens: Optional[Tensor] = None, cu_seqlens_cpu: Optional[Tensor] = None
              ) -> Tuple[Tensor, Optional[Tensor]]:
    """GLA over ``inputs = (q, k, v, g)`` on this device, differentiable in every input and ``initial_state``:
    the operator's local op (a :class:`~megatron_zeco.cp.operator.LocalOp`, fla's calling convention;
    packed input takes no initial or final state)."""
    documents = None if cu_seqlens is None else (cu_seqlens, cu_seqlens_cpu)
    o, final = LocalGLA.apply(*inputs, initial_state, scale, output_final_state, documents)
    return o, (final if output_final_state else None)


def gla_ring_forward(inputs: Tuple[Tensor, ...], scale: float, h0: Optional[Tensor]):
    """lasp1's step: the piece's output, final state and what :func:`gla_ring_backward` needs."""
    return gla_fwd(inputs, scale, h0, True)


def gla_ring_backward(saved: Saved, do: Tensor, dht: Tensor):
    """lasp1's step back: ``(dq, dk, dv, dg, dh0)``."""
    return gla_bwd(saved, do, dht)
