"""Strategies ``zeco`` and ``lasp2``: pass states, never activations.

Forward, on each rank and for each piece it holds:
  1. summary of the piece from a zero state: ``E`` and decay ``gamma``;
  2. scan across ranks: ``S_in(p+1) = gamma_p * S_in(p) + E_p``;
  3. local GLA started from ``S_in``: exactly the output of GLA over the whole sequence.
Backward runs the same scan in reverse on ``dL/dS_in = A_p + gamma_p * D(p)``
(``A_p`` from q, g and the output gradient only), then the local GLA backward
from ``S_in`` with final-state gradient ``D(p)`` gives exact dq, dk, dv, dg.

``zeco`` scans with the pipelined All-Scan; ``lasp2`` with an all-gather.
"""

import torch

from ..comm import all_scan, gather_scan
from ..ops import gla_bwd, gla_fwd, gla_state, gla_state_grad
from .local import initial_state_grad


class ScanGLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, h0, scale, layout, group, num_blocks, use_all_scan, output_final_state):
        n = len(layout.pieces(0, group.size()))
        qs, ks, vs, gs = (x.chunk(n, dim=1) for x in (q, k, v, g))
        E, gamma = zip(*(gla_state(ks[s], vs[s], gs[s]) for s in range(n)))
        ctx.h0_dtype = None if h0 is None else h0.dtype
        h0 = None if h0 is None else h0.to(E[0].dtype)
        S_in, last = _scan(gamma, E, h0, layout, group, num_blocks, use_all_scan, reverse=False)
        o = torch.cat([gla_fwd(qs[s], ks[s], vs[s], gs[s], scale, S_in[s])[0] for s in range(n)], dim=1)
        ctx.save_for_backward(q, k, v, g, *S_in, *gamma)
        ctx.n, ctx.scale, ctx.output_final_state = n, scale, output_final_state
        ctx.scan_args = (layout, group, num_blocks, use_all_scan)
        return o, (last if last is not None else torch.zeros_like(E[0]))

    @staticmethod
    def backward(ctx, do, dht):
        n = ctx.n
        q, k, v, g, *rest = ctx.saved_tensors
        S_in, gamma = rest[:n], rest[n:]
        qs, ks, vs, gs, dos = (x.chunk(n, dim=1) for x in (q, k, v, g, do))
        A = [gla_state_grad(qs[s], gs[s], dos[s], ctx.scale) for s in range(n)]
        dht = dht.to(A[0].dtype) if ctx.output_final_state else None
        D, dh0 = _scan(gamma, A, dht, *ctx.scan_args, reverse=True)
        grads = [gla_bwd(qs[s], ks[s], vs[s], gs[s], ctx.scale, S_in[s], dos[s], D[s])[:4] for s in range(n)]
        dq, dk, dv, dg = (torch.cat(parts, dim=1) for parts in zip(*grads))
        dh0 = initial_state_grad(ctx, dh0, S_in[0])
        return dq, dk, dv, dg, dh0, None, None, None, None, None, None


def _scan(gamma, delta, init, layout, group, num_blocks, use_all_scan, reverse):
    if use_all_scan:
        return all_scan(gamma, delta, init, layout=layout, group=group, num_blocks=num_blocks, reverse=reverse)
    return gather_scan(gamma, delta, init, layout=layout, group=group, reverse=reverse)
