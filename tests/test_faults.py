"""A CP peer that dies or stalls in the middle of a scan, forward or backward (real gloo processes).

Every other rank must fail within the process group's timeout with an error naming the layer,
the operation and the peer; none may hang or return a result.
"""

import datetime
import time

import pytest
import torch.distributed as dist

from distributed import run_ranks
from megatron_zeco import zeco_gla
from reference import problem

PG_TIMEOUT = 5.0
LAYER = "GatedLinearAttention (layer 7)"
OPERATION = {"zeco": "zeco All-Scan", "lasp1": "lasp1 ring", "lasp2": "lasp2 all-gather scan"}


def _faulty(rank, world, strategy, fault, phase):
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    x = problem(0, B=1, T=world * 16, H=2, K=8, V=4)
    leaves = [x[n][:, rank * 16:(rank + 1) * 16].clone().requires_grad_() for n in ("q", "k", "v", "g")]
    # The chain runs forward from rank 0 and backward from the last rank: fault the one the others wait on.
    bad = 0 if phase == "forward" else world - 1

    def misbehave():
        if fault == "stall":
            time.sleep(3 * PG_TIMEOUT)
        return None  # "die": return at once; the process group is torn down under the peers

    if rank == bad and phase == "forward":
        return misbehave()
    start = time.monotonic()
    try:
        o, _ = zeco_gla(*leaves, group=group, strategy=strategy, layout="contiguous", validate=False, name=LAYER)
        if rank == bad:
            return misbehave()
        o.sum().backward()
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return "finished without an error", time.monotonic() - start


@pytest.mark.parametrize("strategy", ["zeco", "lasp1", "lasp2"])
@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("fault", ["die", "stall"])
def test_peer_fault_fails_every_other_rank_with_a_named_error(strategy, fault, phase):
    world = 3
    results = run_ranks(_faulty, world, strategy, fault, phase, pg_timeout=PG_TIMEOUT, timeout=120)
    bad = 0 if phase == "forward" else world - 1
    for rank, result in enumerate(results):
        if rank == bad:
            continue
        message, elapsed = result
        assert LAYER in message and OPERATION[strategy] in message and phase in message, message
        assert "global rank" in message, message
        assert elapsed < 3 * PG_TIMEOUT, f"rank {rank} took {elapsed:.1f} s: {message}"
