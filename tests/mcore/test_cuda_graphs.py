"""Megatron-Core's own CUDA graphs of layers over this package's layers (``cuda_graph_impl="local"``,
Megatron-LM's ``--cuda-graph-impl local``): a TransformerBlock of two GLA, Gated DeltaNet or KDA layers
records its first forward and backward eagerly, ``create_cudagraphs()`` captures each layer's forward and
backward, and from then on every step replays them. Each replayed step, on fresh inputs, must give the
output, the input's gradient and every parameter's gradient (accumulated into ``main_grad`` inside the
graph, as Megatron's DDP expects) of an eager copy of the block on the same inputs.

At one GPU the layers run the strategy of one rank; at CP = 2 (two GPUs) the All-Scan goes over peer
memory (the device transport: its counters and flags live on the GPU) and the convolutions' halo exchange
over NCCL, both inside the captured graphs. Skipped without CUDA and fla.
"""

import importlib.util

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.reference import rel_err

HAVE_FLA = importlib.util.find_spec("fla") is not None
pytestmark = [pytest.mark.megatron,
              pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_FLA),
                                 reason="needs CUDA and flash-linear-attention (fla-core)")]
SAME = 1e-3  # the same kernels on the same inputs: equal up to the order of reductions
HIDDEN, HEADS, TOKENS, BATCH = 256, 4, 256, 2


def _blocks(mixer, world):
    """Two TransformerBlocks of two ``mixer`` layers with the same weights: Megatron's CUDA graphs of layers,
    and eager."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_zeco.cp import CPConfig, registry

    kind = registry.mixer(mixer)
    cp = CPConfig(operator=kind.operator, strategy="zeco", layout="zigzag", transport="peer_memory")
    spec = kind.build_layer_spec(cp_config=cp)
    blocks = []
    for graphs in ("local", "none"):
        config = TransformerConfig(
            num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, context_parallel_size=world,
            params_dtype=torch.bfloat16, bf16=True, hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=True, cuda_graph_impl=graphs, cuda_graph_warmup_steps=1,
            **kind.transformer_config_fields(HIDDEN, HEADS))
        blocks.append(TransformerBlock(config, spec).cuda().to(torch.bfloat16))
    blocks[1].load_state_dict(blocks[0].state_dict())
    for p in blocks[0].parameters():  # the graphed backward accumulates into main_grad (Megatron's DDP buffers)
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    return blocks


def _step(block, x, dy, graphed):
    """Output, input gradient and parameter gradients (float32, on the host) of one forward + backward."""
    leaf = x.clone().requires_grad_()
    params = dict(block.named_parameters())
    block.zero_grad(set_to_none=True)
    if graphed:
        for p in params.values():
            p.main_grad.zero_()
    y = block(hidden_states=leaf, attention_mask=None)
    (y.float() * dy).sum().backward()
    # graphed: the layers' parameters' gradients in main_grad, the block's final norm's (not in a layer's graph) in grad
    grads = {n: p.main_grad + (0 if p.grad is None else p.grad) if graphed else p.grad for n, p in params.items()}
    return {"output": y.detach().float().cpu(), "input": leaf.grad.float().cpu(),
            **{n: g.float().cpu() for n, g in grads.items()}}


def graph_replays(rank, world, mixer, seed, steps=4):
    """Failures (one line each) of replayed steps against the eager block; empty: every replay matched."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.cuda_graphs import CudaGraphManager, _CudagraphGlobalRecord, create_cudagraphs

    ps.initialize_model_parallel(1, 1, context_parallel_size=world)
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True, force_reset_rng=True)
    failures = []
    try:
        graphed, eager = _blocks(mixer, world)
        gen = torch.Generator().manual_seed(seed + rank)

        def fresh():
            return [torch.randn(TOKENS // world, BATCH, HIDDEN, generator=gen).to("cuda", torch.bfloat16),
                    torch.randn(TOKENS // world, BATCH, HIDDEN, generator=gen).cuda()]

        _step(graphed, *fresh(), graphed=False)  # recorded eagerly
        create_cudagraphs()
        runners = [r for layer in graphed.layers for r in layer.cudagraph_manager.cudagraph_runners]
        if not runners or any(r.fwd_graph is None or r.bwd_graph is None for r in runners):
            failures.append(f"{mixer}: the layers' forward and backward were not captured ({len(runners)} runners)")
        for step in range(1, steps + 1):
            x, dy = fresh()
            got, want = _step(graphed, x, dy, graphed=True), _step(eager, x, dy, graphed=False)
            errors = {n: rel_err(got[n], want[n]) for n in want}
            worst = max(errors, key=errors.get)
            if not errors[worst] <= SAME:
                failures.append(f"{mixer} CP={world} step {step}: {worst} off by {errors[worst]:.1e}")
    finally:
        _CudagraphGlobalRecord.cudagraph_created = False
        _CudagraphGlobalRecord.cudagraph_record = []
        CudaGraphManager.global_mempool = None
        torch.cuda.synchronize()
        ps.destroy_model_parallel()
    return failures


def _needs(mixer):
    from megatron_zeco.cp import registry

    path = registry.mixer(mixer).megatron_core_path
    if path and importlib.util.find_spec("megatron." + path.replace("/", ".")) is None:
        pytest.skip(f"the {mixer} layer needs megatron-core >= 0.19")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mixer", ["gla", "gdn", "kda"])
def test_megatron_cuda_graphs_of_layers_replay_eager(seed, mixer, world):
    _needs(mixer)
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    failures = run_ranks(graph_replays, world, mixer, seed, backend="nccl", timeout=600)
    assert not any(failures), failures
