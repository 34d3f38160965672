"""The hierarchical All-Scan over the device transports (``comm/peer_hierarchical.py``) on real process groups,
against a float64 sequential fold.

Peer memory here is host shared memory and the Triton hop kernels run under TRITON_INTERPRET=1 (symmetric
memory on GPUs, NVSHMEM the same kernels with puts: ``tests/gla/test_gpu.py``). Nodes are forced
(``node_size``): 1 (every rank a node: only the rounds between nodes), 2 and 3 (odd: a node of one rank at
the end), both layouts, both directions, with and without an initial state, diagonal (GLA) and dense (the
gated delta rule) transitions, decays near 0 and near 1, states that fill the lanes of B and C evenly, unevenly
and not at all.
"""

import collections
import importlib
import itertools
import os

import pytest
import torch
import torch.distributed as dist

from megatron_zeco.comm import Layout, Route, all_scan
from megatron_zeco.comm.hierarchical import Walk
from megatron_zeco.comm.peer_hierarchical import _Hop, _fused, _plan, messages
from tests.helpers.checks import assert_no_failures
from tests.helpers.marks import slow_except
from tests.helpers.reference import fold, rel_err
from tests.helpers.streams import recorded_streams

RANK_POOL = dict(world=4, pg_timeout=120)


def _transitions(kind, pieces, k, gen, decay, dims=(2, 3)):
    if kind == "dense":
        return [torch.randn(*dims, k, k, generator=gen, dtype=torch.float64) / (2 * k ** 0.5) for _ in range(pieces)]
    low, high = {"near 0": (0.0, 1e-3), "near 1": (1 - 1e-3, 1.0), "any": (0.0, 1.0)}[decay]
    return [low + (high - low) * torch.rand(*dims, k, generator=gen, dtype=torch.float64) for _ in range(pieces)]


def _cases(group, seed, node_sizes, kinds):
    P, me = group.size(), group.rank()
    failures = []
    cases = itertools.product(Layout, node_sizes, (False, True), (False, True), kinds)
    for n, (layout, node_size, reverse, with_init, kind) in enumerate(cases):
        gen = torch.Generator().manual_seed(seed + n)
        pieces = layout.num_pieces(P)
        decay = ("any", "near 0", "near 1")[n % 3]
        k, v = 4, 5
        # states: 6 (as many in every lane of 2 or 3), 5 (lanes of unequal parts), 1 (lanes holding none)
        dims = ((2, 3), (1, 5), (1, 1))[(n // 3) % 3]
        Ts = _transitions(kind, pieces, k, gen, decay, dims)
        deltas = [torch.randn(*dims, k, v, generator=gen, dtype=torch.float64) for _ in range(pieces)]
        init = torch.randn(*dims, k, v, generator=gen, dtype=torch.float64) if with_init else None
        mine = layout.pieces(me, P)
        my_Ts, my_deltas = [Ts[p] for p in mine], [deltas[p] for p in mine]
        kw = dict(reverse=reverse)
        if n % 2:  # as ScanGLA calls it: the slots are strided views of one batch, written in place
            my_Ts, my_deltas = (torch.stack(xs, dim=1).unbind(1) for xs in (my_Ts, my_deltas))
            kw["out"] = torch.full((dims[0], len(mine), dims[1], k, v), float("nan"), dtype=torch.float64).unbind(1)
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
    """The plans of every rank, for every layout, node size and direction, diagonal maps and dense (their
    composes launches of their own): each launch's destination region is the region its receiver waits on (and
    the receiver acknowledges into the sender's region), each region's tiles of a lane are one sender's and one
    receiver's (the lanes of B and C share a region, each its own states), a rank's sends come before its
    receives within a step; C inside a segment: every rank of it gets each lane's part of the state entering it
    once (received, or kept by the lane's own rank); dense maps: no run of steps in one launch composes."""
    runs = collections.Counter()  # rounds launches (runs of steps passing one map on), diagonal and dense maps
    for P, layout, node_size, reverse, dense in itertools.product((2, 3, 5, 8), Layout, (1, 2, 3), (False, True),
                                                                  (False, True)):
        nodes = [r // node_size for r in range(P)]
        walk = Walk(layout, P, nodes, reverse)

        def region(rank, role, index, slot):
            return 0 if rank is None else hash((rank, role, index, slot)) & (2 ** 62 - 1) or 1

        launches = {r: _plan(walk, r, region, dense) for r in range(P)}
        if dense:
            assert not any(step.kind == "compose" for plan in launches.values() for hop in plan for step in hop.steps)
        runs[dense] += sum(hop.kind == "rounds" for plan in launches.values() for hop in plan)
        plans = {r: messages(plan) for r, plan in launches.items()}
        sends = {}  # (destination region, lane) -> (sender, its sending region)
        for r, plan in plans.items():
            for hop in plan:
                here, sent, src, dst = hop.regions
                if dst:
                    assert (dst, hop.lane) not in sends, (P, layout, node_size, reverse, hop)
                    sends[dst, hop.lane] = (r, sent)
        received = set()
        for r, plan in plans.items():
            for hop in plan:
                here, sent, src, dst = hop.regions
                if hop.peers[0] is not None:
                    sender, sending = sends[here, hop.lane]
                    assert sender == hop.peers[0] and sending == src, (P, layout, node_size, reverse, hop)
                    assert (here, hop.lane) not in received
                    received.add((here, hop.lane))
        assert received == set(sends), (P, layout, node_size, reverse)
        # a region several messages share is one lane's tiles each: every lane of one count, none of every state
        for region_of in ({k[0] for k in sends}, {k[0] for k in received}):
            for address in region_of:
                lanes = [lane for a, lane in sends if a == address] or [lane for a, lane in received if a == address]
                if len(lanes) > 1:
                    assert None not in lanes and len({L for _, L in lanes}) == 1, (P, layout, node_size, lanes)
        for j in range(1, len(walk.segments)):
            ranks = {walk.rank(i) for i in walk.segments[j]}
            L = next((h.lane[1] for plan in plans.values() for h in plan if h.lane is not None), 1)
            for r in ranks:
                got = collections.Counter(h.lane or (0, 1) for h in plans[r]
                                          if (h.kind == "receive" and h.segment == j)
                                          or (h.kind == "carry" and h.segment == j - 1))
                assert got == collections.Counter((g, L) for g in range(L)), (P, layout, node_size, reverse, j, r, got)
    assert runs[False] and runs[True], runs


def _op(group, seed):
    """zeco_gla over peer memory in the hierarchical shape (nodes of two ranks, forced by
    $MEGATRON_ZECO_SCAN_SHAPE), forward and backward with initial and final states, against the float64
    loop; every scan of the op takes the device path (counted)."""
    from megatron_zeco import zeco_gla
    from megatron_zeco.comm.all_scan import SHAPE_ENV
    from tests.helpers.checks import above
    from tests.helpers.reference import problem, reference

    P, me = group.size(), group.rank()
    failures, calls = [], []
    module = importlib.import_module("megatron_zeco.comm.all_scan")
    real = module.peer_hierarchical_scan
    module.peer_hierarchical_scan = lambda *a, **k: calls.append(1) or real(*a, **k)
    os.environ[SHAPE_ENV] = "hierarchical"
    try:
        for n, layout in enumerate(Layout):
            x = problem(seed + n, 2, P * 16, 2, 4, 3, "normal", True)
            ref = reference(x, output_final_state=True)
            local = {name: layout.shard(x[name], me, P).requires_grad_() for name in "qkvg"}
            h0 = x["h0"].clone().requires_grad_()
            o, ht = zeco_gla(*local.values(), group=group, layout=layout, initial_state=h0, output_final_state=True,
                             transport="peer_memory", node_size=2)
            loss = (o * layout.shard(x["do"], me, P)).sum() + (me == 0) * (ht * x["dht"]).sum()
            grads = dict(zip(["q", "k", "v", "g", "h0"], torch.autograd.grad(loss, [*local.values(), h0])))
            dist.all_reduce(grads["h0"], group=group)
            errors = {"o": rel_err(o, layout.shard(ref["o"], me, P)), "ht": rel_err(ht, ref["ht"])}
            for name, grad in grads.items():
                full = ref["d" + name]
                errors["d" + name] = rel_err(grad, full if name == "h0" else layout.shard(full, me, P))
            bad = above(errors, 1e-10)
            if bad:
                failures.append(f"P={P} {layout.value}: {bad}")
    finally:
        module.peer_hierarchical_scan = real
        os.environ.pop(SHAPE_ENV, None)
    if len(calls) != 2 * len(Layout):
        failures.append(f"the device path ran {len(calls)} times, expected {2 * len(Layout)}")
    return failures


@pytest.mark.parametrize("P", slow_except([3, 4], 4))
def test_zeco_gla_over_the_device_hierarchical_scan_matches_the_loop(pool, seed, P):
    assert_no_failures(pool.run(_op, P, seed))


def test_a_launch_is_issued_only_where_it_makes_something_read():
    """Every host operation a scan issues lands on a step the host issues no faster than the GPU runs it, so a
    plan holds no launch whose results nothing reads: a last segment of one piece (it enters with the state C
    brings it, its map goes nowhere) issues no phase-A launch, and on two ranks as two nodes each rank issues
    one launch per direction, as the chain does. A last segment of several pieces keeps its chain."""
    region = lambda rank, role, index, slot: 0 if rank is None else 1  # noqa: E731
    for reverse in (False, True):
        walk = Walk(Layout.CONTIGUOUS, 2, [0, 1], reverse)
        plans = [_plan(walk, r, region) for r in range(2)]
        assert [len(plan) for plan in plans] == [1, 1], (reverse, plans)
        last = walk.rank(walk.segments[-1][0])
        assert [hop.kind for hop in plans[last]] == ["receive"], (reverse, plans[last])
    for P, layout, node_size, reverse in itertools.product((3, 4, 5, 8), Layout, (1, 2, 3), (False, True)):
        walk = Walk(layout, P, [r // node_size for r in range(P)], reverse)
        prefixes = {i for r in range(P) for hop in _plan(walk, r, region) if hop.kind == "prefix" for i in hop.at}
        for j, indices in enumerate(walk.segments):
            alone = j == len(walk.segments) - 1 and j > 0 and len(indices) == 1
            assert prefixes.isdisjoint(indices) if alone else set(indices) <= prefixes, (P, layout, node_size, j)


def test_a_map_folded_on_the_host_leaves_from_a_launch_of_its_own():
    """A segment's map changed by a local product (``fold``: B between two segments one rank leads) is sent by
    a launch of its own, never by the launch that made the map before the fold, which would send it stale.
    The plans built today put a compose between such a fold and the next send (or the send already rides on
    that launch), so ``_fused`` is checked on the hops themselves."""
    walk = Walk(Layout.CONTIGUOUS, 2, [0, 1], False)
    prefix = _Hop("prefix", 0, (0,), (1, 2, 0, 0), (None, None), "the prefix map", carries="A")
    fold = _Hop("fold", 0, (), (0, 0, 0, 0), (None, None), "a fold")
    send = _Hop("send", 0, (), (3, 3, 0, 4), (None, 1), "the map on", carries="B")
    assert [hop.kind for hop in _fused([prefix, send], walk)] == ["prefix"]  # the map leaves with its maker
    assert [hop.kind for hop in _fused([prefix, fold, send], walk)] == ["prefix", "fold", "send"]


def test_the_cost_model_replays_the_device_plans():
    """``comm.shape.hierarchical_steps(..., tree=True)`` (what the cost model and the run-time choice time
    for the device transports) holds the messages the device plans send, phase by phase: A along each
    segment, B between leaders, C into each segment and through it (at most two steps: the lanes' parts into
    the next segments, then the all-gather), diagonal maps and dense."""
    from megatron_zeco.comm.shape import hierarchical_steps

    for P, layout, node_size, reverse, dense in itertools.product((2, 3, 5, 8, 12), Layout, (1, 2, 3, 4),
                                                                  (False, True), (False, True)):
        nodes = [r // node_size for r in range(P)]
        walk = Walk(layout, P, nodes, reverse)
        region = lambda rank, role, index, slot: 0 if rank is None else 1  # noqa: E731
        sent = {"A": [], "B": [], "C": []}
        for r in range(P):
            for hop in messages(_plan(walk, r, region, dense)):
                if hop.peers[1] is not None:
                    sent[hop.carries].append((r, hop.peers[1]))
        steps = hierarchical_steps(P, layout.value, node_size, reverse, tree=True)
        modelled = {"A": [], "B": [], "C": []}
        for step in steps:
            for a, b, _, phase in step:
                modelled[phase].append((a, b))
        for phase in "ABC":
            assert sorted(sent[phase]) == sorted(modelled[phase]), (P, layout, node_size, reverse, dense, phase)
        assert len([step for step in steps if step[0][3] == "C"]) <= 2, (P, layout, node_size, reverse)


def _aside(group, seed, node_size):
    """With a side stream (the overlap, as ScanOp calls it), streams stood in for by recorders: every launch
    on the side stream on at most ``ASIDE_PROGRAMS`` programs, the first that waits for a peer just before the
    local work (``while_waiting``, on the current stream), every launch after it and the local products
    (``finish``) behind the local work, then the current stream waits for the side stream. The results are the
    fold's."""
    from megatron_zeco.comm import peer, peer_hierarchical
    from megatron_zeco.kernels import scan_hop

    log = []
    P, me = group.size(), group.rank()
    failures = []
    saved = {name: getattr(scan_hop, name) for name in ("all_scan_hop", "all_scan_dense_hop", "all_scan_rounds")}
    real_finish = peer_hierarchical._Run.finish
    with recorded_streams(log) as (main, side, current):
        def recorded(kernel):
            def launch(*args, programs=None, **kwargs):
                # a rounds launch waits where a step of its table (args[2]) has a source
                waits = kwargs["has_src"] if "has_src" in kwargs else bool((args[2][:, 2] != 0).any())
                log.append(("launch", current[-1].name, programs, waits))
                return kernel(*args, programs=programs, **kwargs)
            return launch

        def finish(self, inputs):
            log.append(("finish", current[-1].name))
            return real_finish(self, inputs)

        try:
            for name, kernel in saved.items():
                setattr(scan_hop, name, recorded(kernel))
            peer_hierarchical._Run.finish = finish
            for n, (layout, dense, reverse) in enumerate(itertools.product(Layout, (False, True), (False, True))):
                gen = torch.Generator().manual_seed(seed + n)
                pieces, mine = layout.num_pieces(P), layout.pieces(me, P)
                Ts = _transitions("dense" if dense else "diagonal", pieces, 4, gen, "any")
                deltas = [torch.randn(2, 3, 4, 3, generator=gen, dtype=torch.float64) for _ in range(pieces)]
                log.clear()
                route = Route(layout, group, 1, "peer_memory", node_size, "hierarchical")
                entering, _ = all_scan([Ts[p] for p in mine], [deltas[p] for p in mine], None, route, reverse=reverse,
                                       aside=side, while_waiting=lambda: log.append(("local", current[-1].name)))
                what = f"{layout.value} dense={dense} reverse={reverse}"
                want, _ = fold(Ts, deltas, None, range(pieces - 1, -1, -1) if reverse else range(pieces))
                if not all(rel_err(entering[s], want[p]) < 1e-12 for s, p in enumerate(mine)):
                    failures.append(f"{what}: wrong states")
                launches = [e for e in log if e[0] == "launch"]
                at = next((i + 1 for i, e in enumerate(launches) if e[-1]), len(launches))
                expected = ([("wait", "aside", "main")] + launches[:at] + [("local", "main")] + launches[at:]
                            + [("finish", "aside"), ("wait", "main", "aside")])
                if not launches or log != expected:
                    failures.append(f"{what}: issued {log}")
                if any(s != "aside" or programs != peer.ASIDE_PROGRAMS for _, s, programs, _ in launches):
                    failures.append(f"{what}: launches {launches}")
        finally:
            for name, kernel in saved.items():
                setattr(scan_hop, name, kernel)
            peer_hierarchical._Run.finish = real_finish
    return failures


def test_the_overlap_issues_the_first_waiting_launch_beside_the_local_work_and_the_rest_behind_it(pool, seed):
    assert_no_failures(pool.run(_aside, 4, seed, 2))


def _op_gdn(group, seed):
    """zeco_gated_delta_rule over peer memory in the hierarchical shape (nodes of two ranks): dense maps,
    pieces off the chunk (26 tokens a rank, zigzag pieces of 13), every gradient against the float64 loop
    (``tests/gated_delta_rule/test_op.py``'s check); every scan takes the device path."""
    from megatron_zeco.comm.all_scan import SHAPE_ENV
    from megatron_zeco.comm.nodes import NODE_SIZE_ENV
    from tests.gated_delta_rule.test_op import _check

    module = importlib.import_module("megatron_zeco.comm.all_scan")
    real, calls = module.peer_hierarchical_scan, []
    module.peer_hierarchical_scan = lambda *a, **k: calls.append(1) or real(*a, **k)
    os.environ[SHAPE_ENV], os.environ[NODE_SIZE_ENV] = "hierarchical", "2"
    try:
        cases = [("zeco", layout, 1, "mixed", True, True, "peer_memory") for layout in Layout]
        failures = _check(group, seed, 26, cases)
    finally:
        module.peer_hierarchical_scan = real
        os.environ.pop(SHAPE_ENV, None)
        os.environ.pop(NODE_SIZE_ENV, None)
    if not calls:
        failures.append("the device path never ran")
    return failures


@pytest.mark.parametrize("P", slow_except([3, 4], 3))
def test_zeco_gated_delta_rule_over_the_device_hierarchical_scan_matches_the_loop(pool, seed, P):
    assert_no_failures(pool.run(_op_gdn, P, seed))
