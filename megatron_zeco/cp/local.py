"""Strategy ``none``: GLA on one rank, as an autograd op over the local backend."""

import torch

from ..ops import gla_bwd, gla_fwd, gla_piece, state_dtype


class LocalGLA(torch.autograd.Function):
    """Differentiable local GLA; ``final`` is a zero tensor when not requested.

    Packed input (``cu_seqlens`` and its host copy ``cu_seqlens_cpu``; no initial or final
    state) runs as a ZeCO piece entered by zero states: fla's own ``chunk_gla`` reads the
    offsets back from the GPU at every state kernel (a host synchronisation, and no CUDA
    graph), the piece's kernels take them from the host copy.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, h0, scale, output_final_state, cu_seqlens=None, cu_seqlens_cpu=None):
        ctx.piece = None
        if cu_seqlens is not None:
            ctx.piece = piece = gla_piece(q, k, v, g, scale, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
            return piece.output(torch.zeros_like(piece.E)), q.new_zeros(0)
        ctx.h0_dtype = None if h0 is None else h0.dtype
        h0 = None if h0 is None else h0.to(state_dtype(q.dtype))
        o, ht, ctx.saved = gla_fwd(q, k, v, g, scale, h0, output_final_state)
        ctx.output_final_state = output_final_state
        if ht is None:
            ht = q.new_zeros(0)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        if ctx.piece is not None:
            A = ctx.piece.entering_grad(do)
            return (*ctx.piece.grads(torch.zeros_like(A)), None, None, None, None, None)
        dq, dk, dv, dg, dh0 = gla_bwd(ctx.saved, do, dht if ctx.output_final_state else None)
        return dq, dk, dv, dg, None if dh0 is None else dh0.to(ctx.h0_dtype), None, None, None, None


def initial_state_grad(ctx, dh0, like, index=4):
    """Gradient for a context-parallel op's ``initial_state`` input (argument ``index`` of its
    ``apply``): the scan's result on the rank where the state entered, zeros on the others (their
    sum over ranks is the gradient)."""
    if not ctx.needs_input_grad[index]:
        return None
    return (torch.zeros_like(like) if dh0 is None else dh0).to(ctx.h0_dtype)
