"""The all-gather softmax attention of the hybrid models under CP (mcore/attention.py) against causal
attention over the whole sequence, and what it refuses."""

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.megatron import transformer_config

pytestmark = [pytest.mark.megatron, pytest.mark.slow]  # megatron: run under each megatron-core release (.ci/run)


def _full_attention(q, k, v):
    """Causal softmax attention over the whole sequence: q [T, B, H, D], k, v [T, B, G, D] ->
    [T, B, H * D]; query head h reads key/value group h // (H / G)."""
    T, B, H, D = q.shape
    group = torch.arange(H) // (H // k.shape[2])
    scores = torch.einsum("sbhd,tbhd->bhst", q, k[:, :, group]) * D ** -0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v[:, :, group]).reshape(T, B, H * D)


def _attention_worker(rank, world, seed):
    """This rank's output and input gradients, for each layout (float64, GQA: 4 query heads, 2 groups)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_zeco import Layout
    from megatron_zeco.mcore.attention import AllGatherDotProductAttention

    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world)
    config = transformer_config(num_query_groups=2, context_parallel_size=world)
    gen = torch.Generator().manual_seed(seed)
    T, B = 12, 2
    q, k, v = (torch.randn(T, B, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    dout = torch.randn(T, B, 32, generator=gen, dtype=torch.float64)
    out = {}
    for layout in Layout:
        attention = AllGatherDotProductAttention(config, 1, AttnMaskType.causal, cp_layout=layout.value)
        local = [layout.shard(t, rank, world, dim=0).requires_grad_() for t in (q, k, v)]
        o = attention(*local, None)
        (o * layout.shard(dout, rank, world, dim=0)).sum().backward()
        out[layout] = (o.detach(), *(t.grad for t in local))
    return (q, k, v, dout), out


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.variant),
                                   pytest.param(2, marks=pytest.mark.variant), 3])
def test_attention_matches_full_sequence_reference(seed, world):
    """Output and dq, dk, dv of every rank's tokens to 1e-10, both layouts."""
    results = run_ranks(_attention_worker, world, seed)
    (q, k, v, dout), _ = results[0]
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _full_attention(q, k, v)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for rank, (_, out) in enumerate(results):
        for layout, got in out.items():
            for name, g, r in zip(("output", "dq", "dk", "dv"), got, (ref, *ref_grads)):
                r = layout.shard(r.detach(), rank, world, dim=0)
                assert torch.allclose(g, r, rtol=1e-10, atol=1e-12), \
                    f"{layout.value} rank {rank}: {name} off by {float((g - r).abs().max()):.1e}"


def test_attention_refuses_what_it_does_not_compute():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_zeco.mcore.attention import AllGatherDotProductAttention

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    with pytest.raises(ValueError, match="--attention-dropout 0"):  # Megatron's default is 0.1
        AllGatherDotProductAttention(config, 1, AttnMaskType.causal)
    config.attention_dropout = 0.0
    with pytest.raises(ValueError, match="only causal self-attention"):
        AllGatherDotProductAttention(config, 1, AttnMaskType.padding)
