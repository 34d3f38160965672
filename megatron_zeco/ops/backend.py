"""The four local GLA operations the context-parallel strategies are built from.

Each rank runs these on its own piece of the sequence; only states cross ranks.
The PyTorch chunked form serves every device and dtype; on CUDA the two per-piece
reductions (``gla_state``, ``gla_state_grad``) run as Triton kernels (``kernels/state.py``).
"""

import functools
import logging
from typing import Optional, Tuple

import torch

from .chunk import chunk_gla, chunk_gla_state, chunk_gla_state_grad

Tensor = torch.Tensor
logger = logging.getLogger(__name__)


def gla_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float,
    initial_state: Optional[Tensor] = None, output_final_state: bool = False,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Local GLA forward: ``(o [B, T, H, V], final state [B, H, K, V] or None)``."""
    return chunk_gla(q, k, v, g, scale, initial_state, output_final_state)


def gla_bwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float,
    initial_state: Optional[Tensor], do: Tensor, dht: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Local GLA backward from the output gradient ``do`` and the final-state gradient ``dht``.

    Returns ``dq, dk, dv, dg`` and ``dh0`` (None when ``initial_state`` is None).
    Recomputes the forward under autograd, so nothing but inputs is kept from it.
    """
    with torch.enable_grad():
        inputs = [x.detach().requires_grad_() for x in (q, k, v, g)]
        h0 = None if initial_state is None else initial_state.detach().requires_grad_()
        o, ht = chunk_gla(*inputs, scale, h0, output_final_state=dht is not None)
        outputs, grads = [o], [do]
        if dht is not None:
            outputs.append(ht)
            grads.append(dht)
        leaves = inputs + ([h0] if h0 is not None else [])
        result = torch.autograd.grad(outputs, leaves, grads)
    return (*result[:4], result[4] if h0 is not None else None)


def gla_state(k: Tensor, v: Tensor, g: Tensor) -> Tuple[Tensor, Tensor]:
    """Piece summary for the scan: ``E [B, H, K, V]`` and ``gamma [B, H, K]``, ``S_out = gamma * S_in + E``."""
    kernels = _triton_kernels(k)
    if kernels is not None:
        return kernels.chunk_state(k.contiguous(), v.contiguous(), g.contiguous())
    return chunk_gla_state(k, v, g)


def gla_state_grad(q: Tensor, g: Tensor, do: Tensor, scale: float) -> Tensor:
    """Local part of ``dL/dS_in`` for the reverse scan: ``[B, H, K, V]``."""
    kernels = _triton_kernels(q)
    if kernels is not None:
        return kernels.chunk_state_grad(q.contiguous(), g.contiguous(), do.contiguous(), scale)
    return chunk_gla_state_grad(q, g, do, scale)


def _triton_kernels(x: Tensor):
    """This package's Triton kernels for CUDA tensors of a kernel dtype, else None (PyTorch path)."""
    if not x.is_cuda or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    return _load_triton_kernels()


@functools.lru_cache(maxsize=None)
def _load_triton_kernels():
    try:
        from ..kernels import state
    except ImportError as e:  # same numbers either way; only speed differs
        logger.warning("megatron_zeco: Triton unavailable (%s); using the PyTorch state passes", e)
        return None
    return state
