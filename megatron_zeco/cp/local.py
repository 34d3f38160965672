"""Strategy ``none``'s helpers: the state handed to a local op, and the gradient of a CP op's initial state."""

from typing import Optional

import torch

from ..common.chunked import state_dtype


def initial_state_to(h0: Optional[torch.Tensor], like: torch.Tensor) -> Optional[torch.Tensor]:
    """``h0`` in the state dtype of inputs like ``like`` (float32, float64 for float64 inputs), or None."""
    return None if h0 is None else h0.to(state_dtype(like.dtype))


def initial_state_grad(ctx, dh0, like, index):
    """Gradient for a context-parallel op's ``initial_state`` input (argument ``index`` of its
    ``apply``): the scan's result on the rank where the state entered, zeros on the others (their
    sum over ranks is the gradient)."""
    if not ctx.needs_input_grad[index]:
        return None
    return (torch.zeros_like(like) if dh0 is None else dh0).to(ctx.h0_dtype)
