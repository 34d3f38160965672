"""A CP peer that dies, stalls or comes back late in the middle of a scan (real gloo processes).

Over the group's messages (zeco's ``send_recv``, lasp1, lasp2) every other rank fails within the
process group's timeout with an error naming the layer, the operation and the peer; none may hang
or return a result.

Over peer memory (the Triton hop kernels, interpreted, over /dev/shm) the kernels' own waits are
bounded: the rank waiting on the faulty one gives up and names it, and the ranks after it in the
chain give up at once, naming the rank that gave up first. A scan that gives up does not raise in
the call (on GPUs its kernels run after the host has moved on): it delivers NaN, so every output and
gradient computed from it is NaN, and ``check_scans()`` -- run before every optimizer step --
raises ``ScanTimeoutError``. No step may end with finite values computed from a state that did
not arrive. A peer that is merely slow (under the bound) changes nothing, bit for bit. (Megatron's
gradient finalisation and optimizer step after a give-up: tests/mcore/test_step_check.py.)
"""

import contextlib
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_zeco import ScanTimeoutError, check_scans, zeco_gla
from tests.helpers.distributed import run_ranks
from tests.helpers.marks import slow, slow_except
from tests.helpers.reference import problem, reference, rel_err

PG_TIMEOUT = 5.0
LAYER = "GatedLinearAttention (layer 7)"
OPERATION = {"zeco": "zeco All-Scan", "lasp1": "lasp1 ring", "lasp2": "lasp2 all-gather scan"}


def _rendezvous(rank, world):
    """Wait until every rank has reached this point, through the default group's store (no connection
    of the group under test is involved, so leaving right after it cannot break a peer's)."""
    store = dist.distributed_c10d._get_default_store()
    store.add("connected", 1)
    while store.add("connected", 0) < world:
        time.sleep(0.01)


def _faulty(rank, world, strategy, fault, phase):
    os.environ.pop("MEGATRON_ZECO_SCAN_TIMEOUT", None)  # the waits are bounded by the group's timeout here
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    # The fault comes in the scan: every rank has connected its group before the faulty rank leaves (one
    # that left while a peer was still connecting would fail that peer in ``new_group``, not in the scan).
    _rendezvous(rank, world)
    x = problem(0, B=1, T=world * 16, H=2, K=8, V=4)
    leaves = [x[n][:, rank * 16:(rank + 1) * 16].clone().requires_grad_() for n in ("q", "k", "v", "g")]
    # The chain runs forward from rank 0 and backward from the last rank: fault the one the others wait on.
    bad = 0 if phase == "forward" else world - 1

    def misbehave():
        if fault == "stall":  # past the others' timeout (they fail after PG_TIMEOUT)
            time.sleep(2 * PG_TIMEOUT)
        return None  # "die": return at once; the process group is torn down under the peers

    kw = dict(group=group, strategy=strategy, layout="contiguous", validate=False, name=LAYER)
    if rank == bad and phase == "forward":
        return misbehave()
    start = time.monotonic()
    try:
        o, _ = zeco_gla(*leaves, **kw)
        if rank == bad:
            return misbehave()
        o.sum().backward()
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return "finished without an error", time.monotonic() - start


@slow
@pytest.mark.parametrize("strategy", ["zeco", "lasp1", "lasp2"])
@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("fault", ["die", "stall"])
def test_peer_fault_fails_every_other_rank_with_a_named_error(strategy, fault, phase):
    world = 3
    results = run_ranks(_faulty, world, strategy, fault, phase, pg_timeout=60, timeout=120)
    bad = 0 if phase == "forward" else world - 1
    for rank, result in enumerate(results):
        if rank == bad:
            continue
        message, elapsed = result
        assert LAYER in message and OPERATION[strategy] in message and phase in message, message
        assert "global rank" in message, message
        assert elapsed < 3 * PG_TIMEOUT, f"rank {rank} took {elapsed:.1f} s: {message}"


def _relay(rank, world, timeouts, transition):
    """Peer memory: rank 0 stalls in the second scan; the others wait with their own timeouts. Diagonal
    transitions (GLA's hop kernel) or dense ones (the gated delta rule's). Returns what the scan
    delivered, the error ``check_scans`` raised and how long the scan took."""
    import torch

    from megatron_zeco.comm import Layout, Route, all_scan

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))
    shape = (1, 2, 4, 4) if transition == "dense" else (1, 2, 4)
    gamma, delta = [torch.rand(*shape, dtype=torch.float64)], [torch.randn(1, 2, 4, 3, dtype=torch.float64)]
    route = Route(Layout.CONTIGUOUS, group, transport="peer_memory", what=LAYER)
    all_scan(gamma, delta, None, route)
    dist.barrier(group=group)
    if rank == 0:  # stalls past rank 1's timeout; rank 2 must not wait out its own (longer) one
        time.sleep(timeouts[1] + 3)
        return None
    os.environ["MEGATRON_ZECO_SCAN_TIMEOUT"] = str(timeouts[rank])
    start = time.monotonic()
    (s_in,), last = all_scan(gamma, delta, None, route)
    elapsed = time.monotonic() - start
    try:
        check_scans()
    except ScanTimeoutError as e:
        return str(e), elapsed, s_in, last
    return "finished without an error", elapsed, s_in, last


@slow
@pytest.mark.parametrize("transition", ["diagonal", "dense"])
def test_peer_memory_relays_a_give_up_down_the_chain(transition):
    """Rank 1 gives up on the stalled rank 0 after 2 s; rank 2, allowed 40 s, gives up as soon as rank 1's
    poisoned flag arrives, naming rank 1 as the rank that gave up first. Both deliver NaN states."""
    timeouts = [None, 2.0, 40.0]
    _, (first, t1, s1, _), (second, t2, s2, last) = run_ranks(_relay, 3, timeouts, transition, timeout=120)
    assert "from global rank 0" in first and "none came within 2 s" in first, first
    assert "from global rank 1" in second and "gave up first" in second, second
    assert t2 < timeouts[2] / 2, f"rank 2 waited {t2:.1f} s: {second}"
    for name, state in (("rank 1's incoming state", s1), ("rank 2's incoming state", s2), ("the last state", last)):
        assert state.isnan().all(), f"{name} is not NaN where its scan gave up: {state}"


def _relay_across_nodes(rank, world, timeouts, transition):
    """The hierarchical scan over peer memory on two nodes of two (node_size 2): rank 0 stalls in the second
    scan. Returns what ``check_scans`` raised and the state entering this rank's piece."""
    import torch

    from megatron_zeco.comm import Layout, Route, all_scan

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))
    shape = (1, 2, 4, 4) if transition == "dense" else (1, 2, 4)
    gamma, delta = [torch.rand(*shape, dtype=torch.float64)], [torch.randn(1, 2, 4, 3, dtype=torch.float64)]
    route = Route(Layout.CONTIGUOUS, group, 1, "peer_memory", 2, "hierarchical", what=LAYER)
    all_scan(gamma, delta, None, route)
    dist.barrier(group=group)
    if rank == 0:
        time.sleep(timeouts[1] + 3)
        return None
    os.environ["MEGATRON_ZECO_SCAN_TIMEOUT"] = str(timeouts[rank])
    start = time.monotonic()
    (s_in,), _ = all_scan(gamma, delta, None, route)
    elapsed = time.monotonic() - start
    try:
        check_scans()
    except ScanTimeoutError as e:
        return str(e), elapsed, s_in
    return "finished without an error", elapsed, s_in


@slow
@pytest.mark.parametrize("transition", ["diagonal", "dense"])
def test_peer_memory_hierarchical_scan_relays_a_give_up_across_nodes(transition):
    """Rank 1 gives up on the stalled rank 0 (phase A, inside their node) after 2 s; the rank of the next node
    that takes rank 1's lane of the state gives up as soon as rank 1's poisoned part arrives (phase C), and the
    other rank of that node on it, each naming the rank it waited for and that it gave up first: rank 3 takes
    rank 1's lane (the same lane of the next node) and passes it to rank 2 (the all-gather), diagonal and dense
    maps alike. All deliver NaN."""
    timeouts = [None, 2.0, 40.0, 40.0]
    _, *results = run_ranks(_relay_across_nodes, 4, timeouts, transition, timeout=120)
    (first, t1, s1), (second, t2, s2), (third, t3, s3) = results
    assert "from global rank 0" in first and "none came within 2 s" in first, first
    assert "hierarchical" in first and "piece step 1" in first, first
    taker, other = third, second
    assert "from global rank 1" in taker and "gave up first" in taker and "entering segment 1" in taker, taker
    assert "from global rank 3" in other and "gave up first" in other, other
    assert max(t2, t3) < timeouts[2] / 2, f"ranks 2, 3 waited {t2:.1f}, {t3:.1f} s: {second}; {third}"
    for rank, state in ((1, s1), (2, s2), (3, s3)):
        assert state.isnan().all(), f"rank {rank}'s incoming state is not NaN where its scan gave up: {state}"


# --- a stalled step: NaN results and an error before the optimizer step ---------------------------

STALL_BOUND = 2.0  # seconds a wait may last in the stalled steps ($MEGATRON_ZECO_SCAN_TIMEOUT)
STALL = 3 * STALL_BOUND + 2  # how long the stalled rank stays away: its neighbours give up meanwhile


def _stalled_steps(rank, world, phase, bad, seed):
    """zeco_gla over peer memory, float64, one rank a piece, fresh inputs every step. Step 1 runs on every
    rank together. In step 2 rank ``bad`` stalls before the scan of ``phase`` for ``STALL`` s, past its
    neighbours' bound, then comes back and goes on; every rank keeps stepping (forward, backward, then
    the step check ``check_scans``) until a step raises, at most step 3. Returns, per step, this rank's
    outputs and gradients, the float64 loop's over the whole sequence, and the error (or None)."""
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=120))
    T = 8
    mine = slice(rank * T, (rank + 1) * T)
    kw = dict(group=group, strategy="zeco", layout="contiguous", transport="peer_memory", validate=False,
              name=LAYER)

    def step(number, stall_before=None):
        x = problem(seed + number, B=1, T=world * T, H=2, K=8, V=4, initial_state=False)
        expected = {n: t[:, mine] for n, t in reference(x, output_final_state=False).items() if n != "ht"}
        leaves = [x[n][:, mine].clone().requires_grad_() for n in ("q", "k", "v", "g")]
        if stall_before == "forward":
            time.sleep(STALL)
        tensors, error = {}, None
        try:
            o, _ = zeco_gla(*leaves, **kw)
            tensors["o"] = o.detach().clone()
            if stall_before == "backward":
                time.sleep(STALL)
            (o * x["do"][:, mine]).sum().backward()
            tensors.update({f"d{n}": leaf.grad for n, leaf in zip("qkvg", leaves)})
            check_scans()
        except ScanTimeoutError as e:
            error = str(e)
        return tensors, expected, error

    steps = [step(1)]
    assert steps[0][2] is None, steps[0][2]
    os.environ["MEGATRON_ZECO_SCAN_TIMEOUT"] = str(STALL_BOUND)
    dist.barrier(group=group)
    for number in (2, 3):
        steps.append(step(number, phase if rank == bad and number == 2 else None))
        if steps[-1][2] is not None:
            break
    return steps


def _first_failing_step(phase, bad, rank):
    """The step at which ``rank`` must raise, where it depends on the stalled rank within step 2 (None:
    it may finish step 2 with correct values and fail later). Forward: every rank waits on the stalled
    one in step 2 (those after it in the forward scan, those before it in the backward scan). Backward
    (the scan runs from the last rank to rank 0): the ranks before the stalled one in rank order wait
    on it; those after it need nothing from it until step 3's forward scan."""
    if rank == bad:
        return None
    return 2 if phase == "forward" or rank < bad else None


# P = 2, 3, 4; the stalled rank first, in the middle of, or last in the scan's chain.
STALLS = [(2, "forward", 0), (2, "backward", 1), (3, "forward", 1), (3, "backward", 1), (4, "forward", 3),
          (4, "backward", 0)]


@pytest.mark.parametrize("world, phase, bad", slow_except(STALLS, (2, "forward", 0)),  # fast: the first rank stalls
                         ids=[f"P{w}-{p}-rank{b}" for w, p, b in STALLS])
def test_a_scan_that_gives_up_poisons_its_step_and_the_step_check_raises(seed, world, phase, bad):
    """Peer memory, a rank stalled past the bound in the forward or the backward scan of step 2 (and
    back afterwards): no rank ends a step with finite values that differ from the reference; every
    step that does not match it holds NaN and raises ScanTimeoutError (naming the layer and a peer)
    before it ends; the ranks that wait on the stalled one within step 2 raise there; every rank,
    the late one included, has raised by step 3."""
    results = run_ranks(_stalled_steps, world, phase, bad, seed, timeout=240)
    for rank, steps in enumerate(results):
        for number, (tensors, expected, error) in enumerate(steps, start=1):
            wrong = [name for name, t in tensors.items() if not rel_err(t, expected[name]) < 1e-10]
            finite_and_wrong = [name for name in wrong if tensors[name].isfinite().all()]
            assert not finite_and_wrong, (f"rank {rank}, step {number}: {finite_and_wrong} finite but not the "
                                          f"float64 loop's ({error or 'no error'})")
            if error is None:
                assert not wrong, f"rank {rank}, step {number}: {wrong} hold NaN, yet the step check passed"
            else:
                assert LAYER in error and "global rank" in error and "call" in error, error
                assert wrong or len(tensors) < 5, f"rank {rank}, step {number} raised with every result correct"
        raised_at = len(steps) if steps[-1][2] is not None else None
        assert raised_at is not None, f"rank {rank} finished steps 2 and 3 without an error"
        expected_at = _first_failing_step(phase, bad, rank)
        if expected_at is not None:
            assert raised_at == expected_at, f"rank {rank} raised at step {raised_at}, not {expected_at}"


def _slow_peer(rank, world, seed):
    """Peer memory, a bound of 60 s: rank 1 is late (up to 1 s) before and after each of its scan kernels
    for two steps. Returns every step's output and gradients."""
    from megatron_zeco.comm.inject import scan_delays

    os.environ["MEGATRON_ZECO_SCAN_TIMEOUT"] = "60"
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=120))
    T = 8
    x = problem(seed, B=1, T=world * T, H=2, K=8, V=4, initial_state=False)
    leaves = [x[n][:, rank * T:(rank + 1) * T].clone().requires_grad_() for n in ("q", "k", "v", "g")]
    kw = dict(group=group, strategy="zeco", layout="zigzag", transport="peer_memory", validate=False, name=LAYER)
    steps = []
    for late in (False, True, True):
        with scan_delays(1.0, seed=seed) if late and rank == 1 else contextlib.nullcontext():
            o, _ = zeco_gla(*leaves, **kw)
            (o * x["do"][:, rank * T:(rank + 1) * T]).sum().backward()
        check_scans()
        steps.append([o.detach()] + [leaf.grad.clone() for leaf in leaves])
        for leaf in leaves:
            leaf.grad = None
    return steps


@slow
def test_a_slow_peer_under_the_bound_changes_nothing(seed):
    """A rank late by up to a second at each scan kernel, under a 60 s bound: the same results, bit for bit,
    as the step where nobody was late, and no error."""
    for rank, steps in enumerate(run_ranks(_slow_peer, 3, seed, timeout=240)):
        for number, step in enumerate(steps[1:], start=2):
            assert all(torch.equal(a, b) for a, b in zip(step, steps[0])), f"rank {rank}, step {number} differs"
