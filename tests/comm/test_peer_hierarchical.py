"""The hierarchical All-Scan over the device transports (``comm/peer_hierarchical.py``) on real process groups,
against a float64 sequential fold.

Peer memory here is host shared memory and the Triton hop kernels run under TRITON_INTERPRET=1 (symmetric
memory on GPUs, NVSHMEM the same kernels with puts: ``tests/gla/test_gpu.py``). Nodes are forced
(``node_size``): 1 (every rank a node: only the rounds between nodes), 2 and 3 (odd: a node of one rank at
the end), both layouts, both directions, with and without an initial state, diagonal (GLA) and dense (the
gated delta rule) transitions, decays near 0 and near 1.
"""

import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_zeco.comm import Layout, Route, all_scan
from megatron_zeco.comm.hierarchical import Walk
from megatron_zeco.comm.peer_hierarchical import _plan, fan_steps
from tests.helpers.checks import assert_no_failures
from tests.helpers.marks import slow_except
from tests.helpers.reference import fold, rel_err

RANK_POOL = dict(world=4, pg_timeout=120)


def _transitions(kind, pieces, k, gen, decay):
    if kind == "dense":
        return [torch.randn(2, 3, k, k, generator=gen, dtype=torch.float64) / (2 * k ** 0.5) for _ in range(pieces)]
    low, high = {"near 0": (0.0, 1e-3), "near 1": (1 - 1e-3, 1.0), "any": (0.0, 1.0)}[decay]
    return [low + (high - low) * torch.rand(2, 3, k, generator=gen, dtype=torch.float64) for _ in range(pieces)]


def _cases(group, seed, node_sizes, kinds):
    P, me = group.size(), group.rank()
    failures = []
    cases = itertools.product(Layout, node_sizes, (False, True), (False, True), kinds)
    for n, (layout, node_size, reverse, with_init, kind) in enumerate(cases):
        gen = torch.Generator().manual_seed(seed + n)
        pieces = layout.num_pieces(P)
        decay = ("any", "near 0", "near 1")[n % 3]
        k, v = 4, 5
        Ts = _transitions(kind, pieces, k, gen, decay)
        deltas = [torch.randn(2, 3, k, v, generator=gen, dtype=torch.float64) for _ in range(pieces)]
        init = torch.randn(2, 3, k, v, generator=gen, dtype=torch.float64) if with_init else None
        mine = layout.pieces(me, P)
        my_Ts, my_deltas = [Ts[p] for p in mine], [deltas[p] for p in mine]
        kw = dict(reverse=reverse)
        if n % 2:  # as ScanGLA calls it: the slots are strided views of one batch, written in place
            my_Ts, my_deltas = (torch.stack(xs, dim=1).unbind(1) for xs in (my_Ts, my_deltas))
            kw["out"] = torch.full((2, len(mine), 3, k, v), float("nan"), dtype=torch.float64).unbind(1)
        route = Route(layout, group, 1, "peer_memory", node_size, "hierarchical")
        entering, last = all_scan(my_Ts, my_deltas, init, route, **kw)
        if "out" in kw and not all(e is o for e, o in zip(entering, kw["out"])):
            failures.append(f"{kind}: the result is not out")
        order = range(pieces - 1, -1, -1) if reverse else range(pieces)
        want, want_last = fold(Ts, deltas, init, order)
        errors = [rel_err(entering[s], want[p]) for s, p in enumerate(mine)]
        ends_here = layout.owner(order[-1], P)[0] == me
        ok = all(e < 1e-12 for e in errors) and (last is not None) == ends_here
        ok = ok and (last is None or rel_err(last, want_last) < 1e-12)
        if not ok:
            failures.append(f"P={P} {kind} {layout.value} node_size={node_size} reverse={reverse} init={with_init} "
                            f"decay={decay}: errors {errors}")
    return failures


def _alone(group, seed):
    """Each rank of ``group`` scans on a group of its own (a rank alone: one segment, phase A alone)."""
    own = [dist.new_group([r]) for r in range(group.size())]  # collective: every rank makes each
    return _cases(own[group.rank()], seed + group.rank(), [1], ("diagonal", "dense"))


@pytest.mark.parametrize("P", slow_except([1, 2, 3, 4], 4))
def test_hierarchical_scan_over_peer_memory_matches_sequential_fold(pool, seed, P):
    if P == 1:
        assert_no_failures(pool.run(_alone, 2, seed))
        return
    assert_no_failures(pool.run(_cases, P, seed, sorted({1, 2, 3} & set(range(1, P + 1))), ("diagonal", "dense")))


def test_every_region_is_written_by_one_peer_and_read_by_one():
    """The plans of every rank, for every layout, node size and direction: each launch's destination region is
    the region its receiver waits on (and the receiver acknowledges into the sender's region), each region is
    one sender's and one receiver's, a rank's sends come before its receives within a step, and the tree
    inside a segment takes ceil(log2 n) steps."""
    for P, layout, node_size, reverse in itertools.product((2, 3, 5, 8), Layout, (1, 2, 3), (False, True)):
        nodes = [r // node_size for r in range(P)]
        walk = Walk(layout, P, nodes, reverse)

        def region(rank, role, index, slot):
            return 0 if rank is None else hash((rank, role, index, slot)) & (2 ** 62 - 1) or 1

        plans = {r: _plan(walk, r, region) for r in range(P)}
        sends = {}  # destination region -> (sender, its sending region)
        for r, plan in plans.items():
            for hop in plan:
                here, sent, src, dst = hop.regions
                if dst:
                    assert dst not in sends, (P, layout, node_size, reverse, hop)
                    sends[dst] = (r, sent)
        received = set()
        for r, plan in plans.items():
            for hop in plan:
                here, sent, src, dst = hop.regions
                if hop.peers[0] is not None:
                    sender, sending = sends[here]
                    assert sender == hop.peers[0] and sending == src, (P, layout, node_size, reverse, hop)
                    assert here not in received
                    received.add(here)
        assert received == set(sends), (P, layout, node_size, reverse)
        for j in range(1, len(walk.segments)):
            n = len({walk.rank(i) for i in walk.segments[j]})
            steps = {int(h.label.rsplit("step ", 1)[1].rstrip(")")) for plan in plans.values() for h in plan
                     if h.segment == j and "inside its node" in h.label}
            assert len(steps) == fan_steps(n), (P, layout, node_size, reverse, j)


def test_fan_steps():
    assert [fan_steps(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]
