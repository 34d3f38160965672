"""Two separate launches give bit-identical results: the CP=2 op (forward + backward). (A few training
steps of the GLA GPTModel under Megatron's deterministic settings: tests/mcore/test_gpt_model.py.)"""

import pytest
import torch
import torch.distributed as dist

from megatron_zeco import Layout, zeco_gla
from tests.helpers.distributed import run_ranks
from tests.helpers.reference import problem

pytestmark = pytest.mark.slow


def _once(rank, world, strategy, layout, dtype):
    group = dist.new_group(list(range(world)))
    x = problem(123, B=2, T=world * 40, H=2, K=8, V=8, dtype=dtype)
    leaves = [layout.shard(x[n], rank, world).requires_grad_() for n in ("q", "k", "v", "g")]
    o, ht = zeco_gla(*leaves, group=group, strategy=strategy, layout=layout, num_blocks=2 if strategy == "zeco" else 1,
                     output_final_state=True)
    loss = (o * layout.shard(x["do"], rank, world)).sum() + (ht * x["dht"].to(ht)).sum()
    return [o.detach(), ht.detach(), *torch.autograd.grad(loss, leaves)]


@pytest.mark.parametrize("strategy,layout", [("zeco", Layout.ZIGZAG), ("zeco", Layout.CONTIGUOUS),
                                             ("lasp2", Layout.CONTIGUOUS)], ids=["zigzag-zeco", "contiguous-zeco",
                                                                                 "contiguous-lasp2"])
def test_two_launches_are_bit_identical(strategy, layout):
    first, second = (run_ranks(_once, 2, strategy, layout, torch.float32) for _ in range(2))
    for rank in range(2):
        for a, b in zip(first[rank], second[rank]):
            assert torch.equal(a, b)
