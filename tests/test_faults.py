"""A CP peer that dies or stalls in the middle of a scan, forward or backward (real gloo processes).

Every other rank must fail within the process group's timeout with an error naming the layer,
the operation and the peer; none may hang or return a result. Over peer memory (the Triton hop
kernels, interpreted, over /dev/shm) the kernels' own waits are bounded by the group's timeout:
the rank waiting on the faulty one gives up and names it, and the ranks after it in the chain give
up at once, naming the rank that gave up first.
"""

import datetime
import os
import time

import pytest
import torch.distributed as dist

from distributed import run_ranks
from megatron_zeco import zeco_gla
from reference import problem

PG_TIMEOUT = 5.0
LAYER = "GatedLinearAttention (layer 7)"
OPERATION = {"zeco": "zeco All-Scan", "zeco@peer_memory": "zeco All-Scan", "lasp1": "lasp1 ring",
             "lasp2": "lasp2 all-gather scan"}


def _faulty(rank, world, strategy, fault, phase):
    os.environ.pop("MEGATRON_ZECO_SCAN_TIMEOUT", None)  # the waits are bounded by the group's timeout here
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    x = problem(0, B=1, T=world * 16, H=2, K=8, V=4)
    leaves = [x[n][:, rank * 16:(rank + 1) * 16].clone().requires_grad_() for n in ("q", "k", "v", "g")]
    # The chain runs forward from rank 0 and backward from the last rank: fault the one the others wait on.
    bad = 0 if phase == "forward" else world - 1

    def misbehave():
        if fault == "stall":
            time.sleep(3 * PG_TIMEOUT)
        return None  # "die": return at once; the process group is torn down under the peers

    strategy, _, transport = strategy.partition("@")
    kw = dict(group=group, strategy=strategy, layout="contiguous", validate=False, name=LAYER)
    if transport:  # a first step together: the peer-memory buffers are set up (a collective) and used once
        kw.update(transport=transport)
        zeco_gla(*leaves, **kw)[0].sum().backward()
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


@pytest.mark.parametrize("strategy", ["zeco", "zeco@peer_memory", "lasp1", "lasp2"])
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
        if strategy.endswith("peer_memory"):  # the kernels' own bounded waits name the rank waited for
            waited_on_bad = rank == (1 if phase == "forward" else world - 2)
            assert f"from global rank {bad if waited_on_bad else rank + (-1 if phase == 'forward' else 1)}" \
                in message, message
            if waited_on_bad:
                assert "none came within" in message, message


def _relay(rank, world, timeouts, transition):
    """Peer memory: rank 0 stalls in the second scan; the others wait with their own timeouts. Diagonal
    transitions (GLA's hop kernel) or dense ones (the gated delta rule's)."""
    import torch

    from megatron_zeco.comm import Layout, all_scan

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))
    shape = (1, 2, 4, 4) if transition == "dense" else (1, 2, 4)
    gamma, delta = [torch.rand(*shape, dtype=torch.float64)], [torch.randn(1, 2, 4, 3, dtype=torch.float64)]
    kw = dict(layout=Layout.CONTIGUOUS, group=group, transport="peer_memory", what=LAYER)
    all_scan(gamma, delta, None, **kw)
    dist.barrier(group=group)
    if rank == 0:  # stalls past rank 1's timeout; rank 2 must not wait out its own (longer) one
        time.sleep(timeouts[1] + 8)
        return None
    os.environ["MEGATRON_ZECO_SCAN_TIMEOUT"] = str(timeouts[rank])
    start = time.monotonic()
    try:
        all_scan(gamma, delta, None, **kw)
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return "finished without an error", time.monotonic() - start


@pytest.mark.parametrize("transition", ["diagonal", "dense"])
def test_peer_memory_relays_a_give_up_down_the_chain(transition):
    """Rank 1 gives up on the stalled rank 0 after 2 s; rank 2, allowed 40 s, gives up as soon as rank 1's
    poisoned flag arrives, naming rank 1 as the rank that gave up first."""
    timeouts = [None, 2.0, 40.0]
    _, (first, t1), (second, t2) = run_ranks(_relay, 3, timeouts, transition, timeout=120)
    assert "from global rank 0" in first and "none came within 2 s" in first, first
    assert "from global rank 1" in second and "gave up first" in second, second
    assert t2 < timeouts[2] / 2, f"rank 2 waited {t2:.1f} s: {second}"
