"""The layer specs and the GLA module as Megatron-Core and pretrain_gpt.py use them."""

import logging
import os
import subprocess
import sys

import pytest
import torch

from distributed import host_as_cuda, run_ranks

SPEC_NAMES = ["gla_local_spec", "gla_te_spec"] + [f"gla_{flavour}_{s}_spec" for flavour in ("local", "te")
                                                   for s in ("lasp1", "lasp2", "a2a")]


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_spec_imports_as_pretrain_gpt_does(name):
    """pretrain_gpt.py --spec megatron_zeco.specs NAME: import_module, used without calling."""
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    from megatron_zeco.specs import HAVE_TE

    spec = import_module(["megatron_zeco.specs", name])
    assert isinstance(spec, ModuleSpec)
    if "_te_" in name or name == "gla_te_spec":
        if not HAVE_TE:
            return
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_zeco.layer import GatedLinearAttention

    assert spec.module is TransformerLayer
    mixer = spec.submodules.self_attention
    assert mixer.module is GatedLinearAttention
    expected = name.split("_")[2] if name.count("_") == 3 else "zeco"
    assert mixer.params["cp_strategy"] == expected and mixer.params["cp_layout"] == "zigzag"
    assert "input_layernorm." not in spec.submodules.sharded_state_dict_keys_map


def _config(**kw):
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                hidden_dropout=0.0, attention_dropout=0.0)
    return TransformerConfig(**{**base, **kw})


def _layer_interface(rank, world):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_zeco.specs import gla_local_spec

    parallel_state.initialize_model_parallel(1, 1)
    results = {}
    mixer = gla_local_spec.submodules.self_attention
    # Every keyword TransformerLayer passes in 0.16 .. 0.19+.
    layer = build_module(mixer, config=_config(), layer_number=1, cp_comm_type="p2p",
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                         pp_layer_offset=0, name="decoder.layers.0.self_attention")
    x = torch.randn(12, 2, 32)
    out, bias = layer(x, attention_mask=None)
    results["shape"], results["bias"] = tuple(out.shape), bias

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megatron_zeco.layer").addHandler(handler)
    rotary = torch.randn(12, 1, 1, 8)
    with_rotary = layer(x, attention_mask=None, rotary_pos_emb=rotary)[0]
    layer(x, attention_mask=None, rotary_pos_emb=rotary)
    results["rotary_ignored"] = torch.equal(with_rotary, out)
    results["rotary_warnings"] = sum("rotary" in r.getMessage() for r in records)

    from megatron.core.packed_seq_params import PackedSeqParams

    for fmt in ("thd", "sbhd"):
        try:
            layer(x, attention_mask=None, packed_seq_params=PackedSeqParams(qkv_format=fmt))
        except (ValueError, NotImplementedError) as e:
            results[fmt] = str(e)
    return results


def test_layer_accepts_transformer_layer_keywords():
    (r,) = run_ranks(_layer_interface, 1)
    assert r["shape"] == (12, 2, 32) and r["bias"] is None
    assert r["rotary_ignored"] and r["rotary_warnings"] == 1
    assert "no document offsets" in r["thd"] and "only 'thd'" in r["sbhd"]  # packed: tests/test_packed.py


def _config_error(rank, world, tp, cp, kwargs, params):
    from megatron.core import parallel_state
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from megatron_zeco.specs import gla_local_spec

    parallel_state.initialize_model_parallel(tp, 1, context_parallel_size=cp)
    base = gla_local_spec.submodules.self_attention
    spec = ModuleSpec(module=base.module, params={**base.params, **params}, submodules=base.submodules)
    try:
        build_module(spec, config=_config(tensor_model_parallel_size=tp, context_parallel_size=cp, **kwargs))
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("tp,cp,kwargs,params,message", [
    (1, 2, dict(num_attention_heads=3, hidden_size=30), {"cp_strategy": "a2a"}, "--context-parallel-size (2)"),
    (1, 1, {}, {"cp_num_blocks": 3}, "cp_num_blocks (3) must divide --kv-channels (8)"),
    (1, 1, {}, {"cp_strategy": "ring"}, "cp_strategy 'ring'"),
    (1, 1, {}, {"cp_layout": "diagonal"}, "unknown context-parallel layout"),
    (1, 1, {}, {"cp_packed_split": "docs"}, "cp_packed_split 'docs'"),
])
def test_bad_configuration_fails_at_build_naming_the_flag(tp, cp, kwargs, params, message):
    for error in run_ranks(_config_error, tp * cp, tp, cp, kwargs, params):
        assert error is not None and message in error, error


def test_te_spec_without_transformer_engine_names_the_alternative():
    from megatron_zeco.specs import HAVE_TE

    if HAVE_TE:
        pytest.skip("TransformerEngine is installed")
    from megatron.core.transformer.spec_utils import build_module

    from megatron_zeco.specs import gla_te_spec

    with pytest.raises(ImportError, match="gla_local_spec"):
        build_module(gla_te_spec, config=_config())


def test_main_job_command_runs():
    """The README's main job (torchrun -m megatron_zeco.train), a few steps on 2 processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "megatron_zeco.train",
           "--steps", "3", "--log-interval", "1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TP 1 x CP 2 x DP 1" in done.stdout and "step     3/3" in done.stdout and "done: 3 steps" in done.stdout


def _mixer_grads(rank, world, tp, cp, sp, seed):
    """The GLA mixer alone (float64): this rank's output and input gradient, and every parameter's
    full gradient (TP shards gathered, CP parts summed, sequence-parallel parts summed over TP)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.spec_utils import build_module

    from megatron_zeco import Layout
    from megatron_zeco.specs import gla_local_spec

    with host_as_cuda():
        parallel_state.initialize_model_parallel(tp, 1, context_parallel_size=cp)
        torch.manual_seed(0)  # master weights drawn whole on the CPU: the same for any TP
        config = _config(tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp)
        layer = build_module(gla_local_spec.submodules.self_attention, config=config, layer_number=1).double()
        gen = torch.Generator().manual_seed(seed)
        x, dy = (torch.randn(24, 2, 32, generator=gen, dtype=torch.float64) for _ in range(2))
        cp_rank, tp_rank = parallel_state.get_context_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()

        def local(t):  # Megatron's zigzag CP split, then SP's even split of the local sequence over TP
            t = Layout.ZIGZAG.shard(t, cp_rank, cp, dim=0)
            return t.chunk(tp, dim=0)[tp_rank] if sp else t

        x_local = local(x).requires_grad_()
        y, _ = layer(x_local)
        (y * local(dy)).sum().backward()
        grads = {}
        for name, p in layer.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g, group=parallel_state.get_context_parallel_group())
            if getattr(p, "sequence_parallel", False):
                dist.all_reduce(g, group=parallel_state.get_tensor_model_parallel_group())
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                parts = [torch.empty_like(g) for _ in range(tp)]
                dist.all_gather(parts, g, group=parallel_state.get_tensor_model_parallel_group())
                g = torch.cat(parts, dim=p.partition_dim)
            grads[name] = g
        return local(torch.arange(24.0)).long(), y.detach(), x_local.grad, grads


@pytest.mark.parametrize("tp,cp,sp", [(2, 1, True), (2, 2, True), (2, 2, False)])
def test_mixer_under_tensor_sequence_and_context_parallelism(seed, tp, cp, sp):
    """Megatron-Core 0.16's local spec cannot run sequence parallelism through GPTModel here
    (its torch norms refuse it; apex or TE needed), so the mixer is checked on its own."""
    (_, y_ref, dx_ref, grads_ref), = run_ranks(_mixer_grads, 1, 1, 1, False, seed)
    for rank, (positions, y, dx, grads) in enumerate(run_ranks(_mixer_grads, tp * cp, tp, cp, sp, seed)):
        assert torch.allclose(y, y_ref[positions], rtol=1e-10, atol=1e-12), f"rank {rank}: output"
        assert torch.allclose(dx, dx_ref[positions], rtol=1e-10, atol=1e-12), f"rank {rank}: input grad"
        for name, g in grads.items():
            assert torch.allclose(g, grads_ref[name], rtol=1e-10, atol=1e-12), f"rank {rank}: grad of {name}"
