"""Two separate launches give bit-identical results: the CP=2 op (forward + backward), and a few
training steps of the GLA GPTModel under Megatron's deterministic settings."""

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megatron_zeco import Layout, zeco_gla
from reference import problem
from test_megatron_model import _train_steps


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


def _deterministic_steps(rank, world):
    steps = _train_steps(rank, world, dict(cp=2, strategy="zeco", layout="zigzag", deterministic=True), ("float32",))
    assert torch.are_deterministic_algorithms_enabled()
    return steps["float32"]


@pytest.mark.megatron
@pytest.mark.variant  # the same training wiring as test_megatron_model's cases
def test_megatron_training_is_bit_identical_across_launches():
    """GPTModel with the GLA spec at CP=2 (zeco, zigzag), TransformerConfig(deterministic_mode=True)
    and torch's deterministic algorithms (train.py --deterministic, as Megatron-LM's
    --deterministic-mode): every step's loss and gradient norm, the step-1 gradients and the
    final parameters agree to the bit across two launches."""
    first, second = (run_ranks(_deterministic_steps, 2) for _ in range(2))
    for rank in range(2):
        (losses, norms, grads, params), (losses2, norms2, grads2, params2) = first[rank], second[rank]
        assert losses == losses2 and norms == norms2, (rank, losses, losses2)
        for name in grads:
            assert torch.equal(grads[name], grads2[name]), f"rank {rank}: step-1 gradient of {name}"
            assert torch.equal(params[name], params2[name]), f"rank {rank}: final {name}"
