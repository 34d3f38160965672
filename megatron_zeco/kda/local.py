"""The local KDA operations the context-parallel strategies are built from.

* ``kda_local``: KDA over a piece from a given initial state, differentiable, in fla's calling
  convention (``cp.operator.LocalOp``). On CUDA
  flash-linear-attention's ``chunk_kda`` (fla-core); elsewhere, and for float64, the PyTorch chunked
  form of ``chunk.py``. Strategies ``none`` and ``a2a`` run it.
* ``kda_piece``: a piece whose entering state comes from a scan (strategies zeco and lasp2): its
  summary ``(E, M)`` first, then the output from the entering state; the entering-state gradient
  ``A`` first, then the inputs' gradients from the gradient of the state leaving it. On CUDA fla's
  KDA kernels from a zero state and a correction for the entering state (``fla_piece.py``), elsewhere
  the chunked form (``cp.chunked_piece.ChunkedPiece`` on ``chunk.py``).

``MEGATRON_ZECO_BACKEND=torch`` forces the PyTorch forms here too.
"""

import warnings
from typing import Optional, Tuple, Union

import torch

from ..common.backend import fla, uses_kernels, varlen
from ..cp.chunked_piece import ChunkedForms, ChunkedPiece
from .chunk import chunk_kda, chunk_kda_state, chunk_kda_state_grad

Tensor = torch.Tensor
CHUNKED_FORMS = ChunkedForms(chunk_kda, chunk_kda_state, chunk_kda_state_grad)


def kda_local(*inputs: Tensor, scale: float, initial_state: Optional[Tensor] = None,
              output_final_state: bool = False, cu_seqlens: Optional[Tensor] = None,
              cu_seqlens_cpu: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """KDA on this device (differentiable in every input and the initial state): the operator's local op
    (a :class:`~megatron_zeco.cp.operator.LocalOp`, fla's calling convention).

    Args:
        inputs: ``q, k, v, g, beta``: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``;
            beta ``[B, T, HV]``; one floating dtype.
        initial_state: ``[B, HV, K, V]`` (``[N, HV, K, V]`` with ``cu_seqlens``) float32 (float64 for
            float64 inputs), or None.
        cu_seqlens: ``[N+1]`` int64 segment offsets (B = 1); ``cu_seqlens_cpu``: the same on the host, for
            fla's kernels (the PyTorch form reads ``cu_seqlens`` on the host itself).
    Returns:
        ``o [B, T, HV, V]`` (input dtype) and the final state (or None).
    """
    q = inputs[0]
    if uses_kernels(q.device, q.dtype):
        return _fla_chunk_kda()(*inputs, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state, **varlen(q, cu_seqlens, cu_seqlens_cpu))
    return chunk_kda(*inputs, scale, initial_state, output_final_state, cu_seqlens=cu_seqlens)


def kda_piece(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
              cu_seqlens: Optional[Tensor] = None, cu_seqlens_cpu: Optional[Tensor] = None):
    """A piece of a sequence whose entering state comes later (from a scan): a
    :class:`~megatron_zeco.cp.operator.Piece` whose transition is the dense ``M [N, HV, K, K]``
    (``S_out = M S_in + E``; HV the value heads). Inputs as :func:`kda_local`; ``grads`` gives dq, dk,
    dv, dg, dbeta."""
    if uses_kernels(q.device, q.dtype):
        _fla_chunk_kda()  # the clear ImportError if fla is missing
        from .fla_piece import FlaPiece
        return FlaPiece(q, k, v, g, beta, scale, cu_seqlens, cu_seqlens_cpu)
    return ChunkedPiece(CHUNKED_FORMS, (q, k, v, g, beta), scale, cu_seqlens)


def _fla_chunk_kda():
    return fla("KDA on CUDA", "fla.ops.kda.chunk_kda")


def require_backend(device: Union[torch.device, str], dtype: torch.dtype) -> None:
    """Raise ``ImportError`` now if KDA on ``device`` in ``dtype`` needs flash-linear-attention (its KDA,
    causal-convolution and L2-norm kernels) and it cannot be imported: the layer calls this at model
    build, not at the first step."""
    if uses_kernels(device, dtype):
        from ..common.conv import _fla_causal_conv1d, _fla_l2norm

        _fla_chunk_kda(), _fla_causal_conv1d(), _fla_l2norm()


def require_kda_backend(device: Union[torch.device, str], dtype: torch.dtype) -> None:
    """Deprecated: :func:`require_backend` (the module names the operator, the function its role)."""
    warnings.warn("megatron_zeco.kda.require_kda_backend is deprecated; use megatron_zeco.kda.require_backend",
                  DeprecationWarning, stacklevel=2)
    require_backend(device, dtype)
