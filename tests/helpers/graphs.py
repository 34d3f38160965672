"""CUDA-graph replays of an operator against its eager calls (the GPU tests of each operator).

``replays(rank, world, seed, operator, transport)`` captures ``operator``'s forward + backward at CP =
``world`` in one CUDA graph (after warm-up calls on a side stream), then loads fresh inputs into the
captured tensors and replays, with eager calls between replays (which advance the scan's call counters
on the device too): every replay must equal the eager op on the same inputs, up to reduction order.
Returns the failures, one line each (empty: every replay matched).
"""

import itertools

import torch
import torch.distributed as dist

from megatron_zeco import Layout, zeco_gated_delta_rule, zeco_kda
from tests.helpers.reference import delta_problem, kda_problem, rel_err

OPERATORS = {  # name -> (the op, its problem, the inputs, their dtypes on the GPU)
    "gated_delta_rule": (zeco_gated_delta_rule, delta_problem, ("q", "k", "v", "g", "beta"), {}),
    "kda": (zeco_kda, kda_problem, ("q", "k", "v", "g", "beta"), {"g": torch.float32}),
}
SAME = 1e-3  # the same kernels on the same inputs: equal up to the order of reductions


def replays(rank, world, seed, operator, transport, calls=6):
    op, make, names, dtypes = OPERATORS[operator]
    group = dist.new_group(list(range(world))) if world > 1 else None
    kw = dict(group=group, transport=transport) if world > 1 else {}
    failures = []
    for layout in (Layout if world > 1 else [Layout.CONTIGUOUS]):
        shape = make(seed, B=2, T=128, H=4, K=64, V=64)
        static = {n: torch.zeros_like(shape[n], device="cuda", dtype=dtypes.get(n, torch.bfloat16))
                  for n in (*names, "do")}
        leaves = [static[n].requires_grad_() for n in names]

        def step():
            o, _ = op(*leaves, layout=layout, **kw)
            return (o, *torch.autograd.grad(o, leaves, static["do"]))

        def load(call):
            x = make(seed + 17 * call + rank, B=2, T=128, H=4, K=64, V=64)
            with torch.no_grad():
                for n in static:
                    static[n].copy_(x[n])

        load(0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        for call, eager_between in zip(range(1, calls + 1), itertools.cycle((True, False))):
            load(call)
            if eager_between:
                step()
            want = [t.clone() for t in step()]
            graph.replay()
            errors = [rel_err(a.float().cpu(), b.float().cpu()) for a, b in zip(captured, want)]
            if not max(errors) <= SAME:
                failures.append(f"{operator} {layout.value} over {transport} call {call}: {max(errors):.1e}")
    return failures
