"""All-Scan and the all-gather scan on real process groups, against a sequential fold.

Runs two CP groups side by side in one world, with strided global ranks (as
Megatron's CP groups are under tensor parallelism), so peers must be found
through the group, never by rank +- 1 on the world. All-Scan runs over both
transports: the group's messages, and peer memory (host shared memory and the
Triton hop kernel under TRITON_INTERPRET=1 here; symmetric memory on GPUs).
Diagonal transitions (GLA's decays) throughout; dense ones (the gated delta rule's
matrices) through every scan at the end.
"""

import contextlib
import itertools
import time

import pytest
import torch
import torch.distributed as dist

from megatron_zeco.comm import Layout, Route, all_scan, gather_scan
from tests.helpers.checks import assert_no_failures
from tests.helpers.distributed import run_ranks
from tests.helpers.marks import slow, slow_except
from tests.helpers.reference import fold, rel_err
from tests.helpers.streams import recorded_streams

RANK_POOL = dict(world=4, pg_timeout=120)


def _scan_worker(rank, world, seed, groups):
    handles = [dist.new_group(ranks) for ranks in groups]  # every rank creates every group
    gid = next(i for i, ranks in enumerate(groups) if rank in ranks)
    group, P = handles[gid], len(groups[gid])
    me = dist.get_rank(group)
    failures = []
    cases = itertools.product(Layout, (1, 4), (False, True), (False, True),
                              ("all_scan send_recv", "all_scan peer_memory", "gather_scan"))
    for n, (layout, blocks, reverse, with_init, impl) in enumerate(cases):
        if impl == "all_scan peer_memory" and (blocks == 4) != reverse:
            continue  # the interpreted hop kernel is most of the time: half the combinations (every value of each)
        gen = torch.Generator().manual_seed(seed + 1000 * gid + n)  # each group scans different data
        pieces = layout.num_pieces(P)
        gammas = [torch.rand(2, 3, 4, generator=gen, dtype=torch.float64) for _ in range(pieces)]
        deltas = [torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64) for _ in range(pieces)]
        init = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64) if with_init else None
        mine = layout.pieces(me, P)
        kwargs = dict(reverse=reverse)
        route = Route(layout, group, blocks, impl.split()[1]) if impl.startswith("all_scan") else Route(layout, group)
        scan = all_scan if impl.startswith("all_scan") else gather_scan
        my_gammas, my_deltas = [gammas[p] for p in mine], [deltas[p] for p in mine]
        if n % 2:  # as ScanGLA calls it: the slots are strided views of one batch, written in place
            my_gammas, my_deltas = (torch.stack(xs, dim=1).unbind(1) for xs in (my_gammas, my_deltas))
            kwargs["out"] = torch.full((2, len(mine), 3, 4, 5), float("nan"), dtype=torch.float64).unbind(1)
            if n % 4 == 3:  # views no single dim-0 stride addresses (peer memory: via contiguous copies)
                kwargs["out"] = torch.full((2, 3, len(mine), 4, 5), float("nan"), dtype=torch.float64).unbind(2)
        seen = []  # per call of while_waiting: which slots of out were written by then
        if impl.startswith("all_scan"):
            kwargs["while_waiting"] = lambda: seen.append(
                [not o.isnan().any().item() for o in kwargs["out"]] if "out" in kwargs else None)
        entering, last = scan(my_gammas, my_deltas, init, route, **kwargs)
        if "out" in kwargs and not all(e is o for e, o in zip(entering, kwargs["out"])):
            failures.append(f"{impl}: the result is not out")
        if impl.startswith("all_scan"):
            # before the rank first waits for a peer: the rank holding the walk's first piece has
            # written it (zigzag: rank 0 either way, the chain then comes back to it; contiguous:
            # that is its only piece), the others nothing yet
            starter = P - 1 if layout is Layout.CONTIGUOUS and reverse else 0
            first_slot = layout.links(me, P, reverse)[0].slot
            written = [P == 1 or (me == starter and slot == first_slot) for slot in range(len(mine))]
            if len(seen) != 1:
                failures.append(f"{impl}: while_waiting called {len(seen)} times")
            elif seen[0] is not None and n % 4 != 3 and seen[0] != written:  # (n % 4 == 3: copied back at the end)
                failures.append(f"{impl} {layout.value} reverse={reverse}: while_waiting ran with slots written "
                                f"{seen[0]}, expected {written} (just before its first wait)")
        order = range(pieces - 1, -1, -1) if reverse else range(pieces)
        want, want_last = fold(gammas, deltas, init, order)
        ok = all(torch.allclose(entering[s], want[p], rtol=1e-12, atol=1e-12) for s, p in enumerate(mine))
        ends_here = layout.owner(order[-1], P)[0] == me
        ok &= (last is not None) == ends_here and (last is None or torch.allclose(last, want_last, rtol=1e-12, atol=1e-12))
        if not ok:
            failures.append(f"{impl} {layout.value} blocks={blocks} reverse={reverse} init={with_init}")
    return failures


@slow
@pytest.mark.parametrize("groups", [
    [[0], [1, 2, 3]],            # a group of one (zigzag: both pieces on it), and of odd size
    [[0, 2], [1, 3]],            # strided groups (CP under TP = 2)
    [[0, 1, 2, 3, 4]],           # odd size, zigzag turn-around on rank 4
])
def test_scans_match_sequential_fold(seed, groups):
    world = sum(len(g) for g in groups)
    assert_no_failures(run_ranks(_scan_worker, world, seed, groups))


def _slow_receiver_worker(rank, world, seed, calls):
    """Some ranks sleep inside every scan (in ``while_waiting``, before their first wait for a peer:
    after sending what they send at once) while the others run ahead into the next call: a sender
    must wait for the acknowledgements, never overwrite a tile its receiver has not read. Slow
    ranks: all but one (a different one each call); or, under zigzag on even calls, rank 0 alone,
    which then reads the return leg's map late while the map's sender is already in the next call.
    One more rank is late at random before and after each of its kernels (``inject.scan_delays``).
    64 key rows in one block move as two 32-row tiles; on every other call of a rank its kernels run
    as one program taking every tile in turn (as sends beside the local work do on GPUs)."""
    from megatron_zeco.comm import inject
    from megatron_zeco.kernels import scan_hop

    group = dist.group.WORLD
    failures = []
    shape = scan_hop._shape
    for layout, call in itertools.product(Layout, range(calls)):  # calls of one layout back to back
        scan_hop._shape = (lambda delta, tiles, programs=None, lane=None: shape(delta, tiles, 1, lane)) if (call + rank) % 2 \
            else shape
        gen = torch.Generator().manual_seed(seed + call)
        pieces, mine = layout.num_pieces(world), layout.pieces(rank, world)
        gammas = [torch.rand(3, 64, generator=gen, dtype=torch.float64) for _ in range(pieces)]
        deltas = [torch.randn(3, 64, 2, generator=gen, dtype=torch.float64) for _ in range(pieces)]
        slow = rank == 0 if layout is Layout.ZIGZAG and call % 2 == 0 else rank != call % world
        late = inject.scan_delays(0.05, seed=seed + call) if rank == (call + 1) % world else contextlib.nullcontext()
        with late:
            entering, _ = all_scan([gammas[p] for p in mine], [deltas[p] for p in mine], None,
                                   Route(layout, group, transport="peer_memory"),
                                   while_waiting=(lambda: time.sleep(0.3)) if slow else None)
        want, _ = fold(gammas, deltas, None, range(pieces))
        if not all(torch.allclose(entering[s], want[p], rtol=1e-12, atol=1e-12) for s, p in enumerate(mine)):
            failures.append(f"call {call} {layout.value}")
    return failures


@slow
def test_peer_memory_waits_for_slow_receivers(seed):
    assert_no_failures(run_ranks(_slow_receiver_worker, 3, seed, 4))


def _varying_counts_worker(rank, world, seed, counts):
    """Scans over peer memory whose number of states changes from call to call (one per document
    under the per-document packed split): right every time, from a few shared channels."""
    from megatron_zeco.comm import peer

    group = dist.new_group(list(range(world)))
    failures = []
    for call, n in enumerate(counts):
        gen = torch.Generator().manual_seed(seed + call)
        gammas = [torch.rand(n, 4, generator=gen, dtype=torch.float64) for _ in range(2 * world)]
        deltas = [torch.randn(n, 4, 3, generator=gen, dtype=torch.float64) for _ in range(2 * world)]
        mine = Layout.ZIGZAG.pieces(rank, world)
        for reverse in (False, True):
            entering, _ = all_scan([gammas[p] for p in mine], [deltas[p] for p in mine], None,
                                   Route(Layout.ZIGZAG, group, 2, "peer_memory"), reverse=reverse)
            order = range(2 * world - 1, -1, -1) if reverse else range(2 * world)
            want, _ = fold(gammas, deltas, None, order)
            if not all(torch.allclose(entering[s], want[p], rtol=1e-12, atol=1e-12) for s, p in enumerate(mine)):
                failures.append(f"call {call}: {n} states, reverse={reverse}")
    return failures, sum(key[0] is group for key in peer._CHANNELS)


@slow
def test_peer_memory_state_counts_change_between_calls(seed):
    """Channels come in powers of two of states and are reused: 3, 5, 4, 2, 7 states need the
    channels for 4, 8 and 2, not one per count (each is a collective allocation kept alive)."""
    results = run_ranks(_varying_counts_worker, 3, seed, [3, 5, 4, 2, 7])
    assert not any(failures for failures, _ in results), results
    assert [channels for _, channels in results] == [3, 3, 3], results


def _bad_transport_worker(rank, world):
    from megatron_zeco.cp import CPConfig
    from megatron_zeco.cp.plan import make_plan

    with pytest.raises(ValueError, match="cp_transport 'nvlink' is not one of auto, send_recv, peer_memory, nvshmem"):
        CPConfig(transport="nvlink")
    with pytest.raises(ValueError, match="a scan's transport is one of send_recv, peer_memory, nvshmem"):
        Route(Layout.CONTIGUOUS, dist.group.WORLD, transport="auto")
    with pytest.raises(ValueError, match="'nvshmem' needs CUDA tensors; use transport='send_recv'"):
        make_plan(CPConfig(transport="nvshmem"), dist.group.WORLD, like=torch.rand(2, 3))
    return True


@slow
def test_unknown_transport_is_refused():
    """An unknown transport, a scan's transport left unresolved, and NVSHMEM for CPU tensors fail with the
    fix named."""
    assert all(run_ranks(_bad_transport_worker, 2))


def _default_overlap_worker(rank, world):
    from megatron_zeco.cp import CPConfig
    from megatron_zeco.cp.plan import make_plan

    like = torch.rand(2, 3)
    got = {}
    for operator in ("gla", "gated_delta_rule", "kda"):
        for transport in ("peer_memory", "send_recv"):
            for overlap in (None, True, False):
                plan = make_plan(CPConfig(operator=operator, transport=transport, overlap=overlap), dist.group.WORLD,
                                 like=like, name="test")
                got[operator, transport, overlap] = plan.overlap
    return got


def test_the_overlap_is_on_by_default_where_the_operators_rules_say_so():
    """``overlap=None`` resolves once, in the plan: the side stream over a device transport for GLA (its in-chunk
    attention and gradients hide the scan) and the delta rules (their zero-state output, their backward's
    recompute), as their rules' ``auto_overlap`` says, never over send/recv; set, it is what was asked for."""
    for got in run_ranks(_default_overlap_worker, 2):
        for (operator, transport, overlap), on in got.items():
            want = overlap if overlap is not None else transport == "peer_memory"
            assert on is want, (operator, transport, overlap, on)


def _dense_scans(group, seed):
    """all_scan (the chain in blocks of columns over messages and over peer memory, and the
    hierarchical shape over nodes of two ranks) and gather_scan with dense transitions, against a
    sequential fold (the hierarchical shape also with GLA's diagonal ones). Peer memory also in
    float32 with 32 x 32 states, where the hop kernel multiplies through tl.dot."""
    P, me = group.size(), group.rank()
    failures = []
    impls = ("chain", "chain peer_memory", "hierarchical", "gather", "hierarchical diagonal", "chain peer_memory dot")
    for n, (layout, blocks, reverse, with_init, impl) in enumerate(
            itertools.product(Layout, (1, 3), (False, True), (False, True), impls)):
        if (not impl.startswith("chain") or impl.endswith("dot")) and blocks > 1:
            continue
        gen = torch.Generator().manual_seed(seed + n)
        pieces = layout.num_pieces(P)
        k, v = (32, 32) if impl.endswith("dot") else (4, 6)
        shape = (2, 3, k) if impl.endswith("diagonal") else (2, 3, k, k)
        Ms = [torch.randn(*shape, generator=gen, dtype=torch.float64) / (2 * k ** 0.5) for _ in range(pieces)]
        deltas = [torch.randn(2, 3, k, v, generator=gen, dtype=torch.float64) for _ in range(pieces)]
        init = torch.randn(2, 3, k, v, generator=gen, dtype=torch.float64) if with_init else None
        mine = layout.pieces(me, P)
        dtype, tol = (torch.float32, 1e-5) if impl.endswith("dot") else (torch.float64, 1e-12)
        my_Ms, my_deltas = [Ms[p].to(dtype) for p in mine], [deltas[p].to(dtype) for p in mine]
        kw = dict(reverse=reverse)
        if impl == "gather":
            entering, last = gather_scan(my_Ms, my_deltas, init, Route(layout, group), **kw)
        else:
            transport = "peer_memory" if "peer_memory" in impl else "send_recv"
            if n % 2 and transport == "peer_memory":  # as ScanOp calls it: slots are strided views of one batch
                my_Ms, my_deltas = (torch.stack(xs, dim=1).unbind(1) for xs in (my_Ms, my_deltas))
                kw["out"] = torch.full((2, len(mine), 3, k, v), float("nan"), dtype=dtype).unbind(1)
            route = Route(layout, group, blocks, transport, 2, impl.split()[0])
            entering, last = all_scan(my_Ms, my_deltas, None if init is None else init.to(dtype), route, **kw)
            if "out" in kw and not all(e is o for e, o in zip(entering, kw["out"])):
                failures.append(f"{impl}: the result is not out")
        order = range(pieces - 1, -1, -1) if reverse else range(pieces)
        want, want_last = fold(Ms, deltas, init, order)
        ok = all(rel_err(entering[s], want[p]) < tol for s, p in enumerate(mine))
        ends_here = layout.owner(order[-1], P)[0] == me
        ok &= (last is not None) == ends_here and (last is None or rel_err(last, want_last) < tol)
        if not ok:
            failures.append(f"{impl} {layout.value} blocks={blocks} reverse={reverse} init={with_init}")
    return failures


@pytest.mark.parametrize("world", slow_except([3, 4], 3))
def test_dense_scans_match_sequential_fold(pool, seed, world):
    assert_no_failures(pool.run(_dense_scans, world, seed))


def _aside_worker(group, seed):
    """``all_scan`` over peer memory with a side stream (``aside``), as ScanOp calls it with the overlap
    on: CUDA's streams are stood in for by recorders, so that the order in which the launches, the local
    work and the stream waits are issued is seen on the CPU (the interpreted kernels run as issued).
    Every hop kernel is issued on the side stream on at most ``ASIDE_PROGRAMS`` programs; the first that
    waits for a peer just before ``while_waiting()`` on the current stream (so that it spins beside the
    local work), those after it behind the local work (so that, on one hardware queue, no launch waiting
    for another on the side stream holds up the local work); the current stream then waits for the side
    stream. The results are the sequential fold's. Diagonal and dense transitions, both layouts, both
    directions."""
    from megatron_zeco.comm import peer
    from megatron_zeco.kernels import scan_hop

    log = []
    P, me = group.size(), group.rank()
    failures = []
    kernels = ("all_scan_hop", "all_scan_dense_hop", "all_scan_map", "all_scan_close")
    saved = {name: getattr(scan_hop, name) for name in kernels}
    with recorded_streams(log) as (main, side, current):
        def recorded(kernel):
            def launch(*args, programs=None, **kwargs):
                log.append(("launch", kernel.__name__, current[-1].name, programs, kwargs.get("has_src", True)))
                return kernel(*args, programs=programs, **kwargs)
            return launch

        try:
            for name in kernels:
                setattr(scan_hop, name, recorded(saved[name]))
            for n, (layout, dense, reverse) in enumerate(itertools.product(Layout, (False, True), (False, True))):
                gen = torch.Generator().manual_seed(seed + n)
                pieces, mine = layout.num_pieces(P), layout.pieces(me, P)
                shape = (2, 4, 4) if dense else (2, 4)
                gammas = [torch.rand(*shape, generator=gen, dtype=torch.float64) / 2 for _ in range(pieces)]
                deltas = [torch.randn(2, 4, 3, generator=gen, dtype=torch.float64) for _ in range(pieces)]
                log.clear()
                entering, _ = all_scan([gammas[p] for p in mine], [deltas[p] for p in mine], None,
                                       Route(layout, group, transport="peer_memory"), reverse=reverse, aside=side,
                                       while_waiting=lambda: log.append(("local", current[-1].name)))
                what = f"{layout.value} dense={dense} reverse={reverse}"
                order = range(pieces - 1, -1, -1) if reverse else range(pieces)
                want, _ = fold(gammas, deltas, None, order)
                if not all(rel_err(entering[s], want[p]) < 1e-12 for s, p in enumerate(mine)):
                    failures.append(f"{what}: wrong states")
                launches = [e for e in log if e[0] == "launch"]
                at = next((i + 1 for i, e in enumerate(launches) if e[-1]), len(launches))  # just after the first wait
                expected = ([("wait", "aside", "main")] + launches[:at] + [("local", "main")] + launches[at:]
                            + [("wait", "main", "aside")])
                if not launches or log != expected:
                    failures.append(f"{what}: issued {log}")
                if any(stream != "aside" or programs != peer.ASIDE_PROGRAMS for _, _, stream, programs, _ in launches):
                    failures.append(f"{what}: launches {launches}")
        finally:
            for name in kernels:
                setattr(scan_hop, name, saved[name])
    return failures


def test_peer_memory_aside_runs_the_first_waiting_hop_beside_the_local_work(pool, seed):
    assert_no_failures(pool.run(_aside_worker, 3, seed))


def _dense_precision_worker(group, seed):
    """The products each dense hop launch is given, per scan shape over peer memory and per route precision."""
    from megatron_zeco.kernels import scan_hop

    P, me = group.size(), group.rank()
    launch, seen = scan_hop.all_scan_dense_hop, []

    def spy(*args, **kw):
        seen.append(kw.get("precision", "(default)"))
        return launch(*args, **kw)

    scan_hop.all_scan_dense_hop = spy
    out, failures = {}, []
    try:
        for n, (shape, precision) in enumerate(itertools.product(("chain", "hierarchical"), ("tf32x3", "input"))):
            gen = torch.Generator().manual_seed(seed + n)
            Ms = [torch.randn(2, 4, 4, generator=gen, dtype=torch.float64) / 4 for _ in range(P)]
            deltas = [torch.randn(2, 4, 5, generator=gen, dtype=torch.float64) for _ in range(P)]
            seen.clear()
            route = Route(Layout.CONTIGUOUS, group, 1, "peer_memory", 1, shape, precision=precision)
            entering, _ = all_scan([Ms[me]], [deltas[me]], None, route)
            want, _ = fold(Ms, deltas, None, range(P))
            if not rel_err(entering[0], want[me]) < 1e-12:
                failures.append(f"{shape} {precision}: off the fold")
            out[shape, precision] = sorted(set(seen))
        with pytest.raises(ValueError, match="a scan's precision is one of tf32x3, input"):
            Route(Layout.CONTIGUOUS, group, precision="tf32")
    finally:
        scan_hop.all_scan_dense_hop = launch
    return failures, out


def test_dense_hops_multiply_in_the_routes_precision(pool, seed):
    """A route's precision (the pieces' map precision) reaches every dense hop a scan launches, in the chain and in
    the hierarchical shape: ``tf32x3`` for float32 pieces, one TF32 pass (``tf32``) for pieces of 16-bit inputs
    (``scan_hop.dense_precision``); a precision that is not a map precision is refused by name."""
    from megatron_zeco.kernels import dense_precision

    for failures, out in pool.run(_dense_precision_worker, 3, seed):
        assert not failures, failures
        for (shape, precision), seen in out.items():
            assert seen == [dense_precision(precision)], (shape, precision, seen)
    assert dense_precision("input") == "tf32" and dense_precision("tf32x3") == "tf32x3"
