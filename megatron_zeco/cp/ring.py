"""Strategy ``lasp1``: the sequential ring of LASP-1.

Each rank waits for the state entering its piece, runs its local GLA from it,
and passes the final state on; backward walks back the same way. Exact, but the
ranks work one after another: P times the latency of one piece.
"""

import torch

from ..comm import chain_scan
from ..ops import gla_bwd, gla_fwd, state_dtype
from .local import initial_state_grad


class RingGLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, h0, scale, layout, group, output_final_state, name):
        n = len(layout.pieces(0, group.size()))
        qs, ks, vs, gs = (x.chunk(n, dim=1) for x in (q, k, v, g))
        B, _, H, K = q.shape
        like = q.new_empty(B, H, K, v.shape[-1], dtype=state_dtype(q.dtype))
        ctx.h0_dtype = None if h0 is None else h0.dtype
        outs, ctx.saved = [None] * n, [None] * n

        def step(slot, rows, state):
            outs[slot], final, ctx.saved[slot] = gla_fwd(qs[slot], ks[slot], vs[slot], gs[slot], scale, state, True)
            return final

        h0 = None if h0 is None else h0.to(like.dtype)
        S_in, last = chain_scan(step, h0, like, layout=layout, group=group, what=f"{name}: lasp1 ring (forward)")
        ctx.save_for_backward(*S_in)
        ctx.n, ctx.layout, ctx.group, ctx.output_final_state, ctx.name = n, layout, group, output_final_state, name
        return torch.cat(outs, dim=1), (last if last is not None else torch.zeros_like(like))

    @staticmethod
    def backward(ctx, do, dht):
        n = ctx.n
        S_in = ctx.saved_tensors
        dos = do.chunk(n, dim=1)
        grads = [None] * n

        def step(slot, rows, d_out):
            *grads[slot], d_in = gla_bwd(ctx.saved[slot], dos[slot], d_out)
            return d_in

        init = dht.to(S_in[0].dtype) if ctx.output_final_state else None
        _, dh0 = chain_scan(step, init, S_in[0], layout=ctx.layout, group=ctx.group, reverse=True,
                            what=f"{ctx.name}: lasp1 ring (backward)")
        dq, dk, dv, dg = (torch.cat(parts, dim=1) for parts in zip(*grads))
        dh0 = initial_state_grad(ctx, dh0, S_in[0])
        return dq, dk, dv, dg, dh0, None, None, None, None, None
