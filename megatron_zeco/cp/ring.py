"""Strategy ``lasp1``: the sequential ring of LASP-1.

Each rank waits for the state entering its piece, runs its local op from it, and passes the final
state on; backward walks back the same way. Exact, but the ranks work one after another: P times
the latency of one piece.
"""

from dataclasses import replace

import torch

from ..comm import chain_scan
from ..common.chunked import state_dtype
from .local import initial_state_grad


class RingOp(torch.autograd.Function):
    """lasp1 over an operator's ``ring = (forward, backward)`` hooks (:class:`~megatron_zeco.cp.operator.Operator`):
    ``forward(inputs, scale, h0) -> (o, final, saved)`` and ``backward(saved, do, dht) -> (*grads, dh0)``."""

    @staticmethod
    def forward(ctx, ring, plan, call, h0, *inputs):
        forward, _ = ring
        n = plan.pieces_per_rank
        chunks = [x.chunk(n, dim=1) for x in inputs]
        q, v = inputs[0], inputs[2]
        B, _, H, K = q.shape
        like = q.new_empty(B, H, K, v.shape[-1], dtype=state_dtype(q.dtype))
        ctx.h0_dtype = None if h0 is None else h0.dtype
        outs, ctx.saved = [None] * n, [None] * n

        def step(slot, rows, state):
            outs[slot], final, ctx.saved[slot] = forward(tuple(c[slot] for c in chunks), call.scale, state)
            return final

        h0 = None if h0 is None else h0.to(like.dtype)
        S_in, last = chain_scan(step, h0, like, _ring(plan, "forward"))
        ctx.save_for_backward(*S_in)
        ctx.ring, ctx.plan, ctx.call, ctx.n = ring, plan, call, n
        return torch.cat(outs, dim=1), (last if last is not None else torch.zeros_like(like))

    @staticmethod
    def backward(ctx, do, dht):
        _, backward = ctx.ring
        S_in = ctx.saved_tensors
        dos = do.chunk(ctx.n, dim=1)
        grads = [None] * ctx.n

        def step(slot, rows, d_out):
            *grads[slot], d_in = backward(ctx.saved[slot], dos[slot], d_out)
            return d_in

        init = dht.to(S_in[0].dtype) if ctx.call.output_final_state else None
        _, dh0 = chain_scan(step, init, S_in[0], _ring(ctx.plan, "backward"), reverse=True)
        inputs = tuple(torch.cat(parts, dim=1) for parts in zip(*grads))
        return (None, None, None, initial_state_grad(ctx, dh0, S_in[0], index=3), *inputs)


def _ring(plan, direction: str):
    """The ring's route: a piece runs whole once its state has arrived, so the state travels in one block."""
    return replace(plan.route(f"{plan.name}: lasp1 ring ({direction})"), num_blocks=1)
