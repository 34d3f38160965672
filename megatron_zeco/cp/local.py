"""Strategy ``none``: GLA on one rank, as an autograd op over the local backend."""

import torch

from ..ops import gla_bwd, gla_fwd, state_dtype


class LocalGLA(torch.autograd.Function):
    """Differentiable local GLA; ``final`` is a zero tensor when not requested."""

    @staticmethod
    def forward(ctx, q, k, v, g, h0, scale, output_final_state, cu_seqlens=None):
        ctx.h0_dtype = None if h0 is None else h0.dtype
        h0 = None if h0 is None else h0.to(state_dtype(q.dtype))
        o, ht, ctx.saved = gla_fwd(q, k, v, g, scale, h0, output_final_state, cu_seqlens=cu_seqlens)
        ctx.output_final_state = output_final_state
        if ht is None:
            ht = q.new_zeros(0)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        dq, dk, dv, dg, dh0 = gla_bwd(ctx.saved, do, dht if ctx.output_final_state else None)
        return dq, dk, dv, dg, None if dh0 is None else dh0.to(ctx.h0_dtype), None, None, None


def initial_state_grad(ctx, dh0, like):
    """Gradient for a context-parallel op's ``initial_state`` input: the scan's result on the
    rank where the state entered, zeros on the others (their sum over ranks is the gradient)."""
    if not ctx.needs_input_grad[4]:
        return None
    return (torch.zeros_like(like) if dh0 is None else dh0).to(ctx.h0_dtype)
