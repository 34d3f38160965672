"""The layer specs and the GLA module as Megatron-Core and pretrain_gpt.py use them."""

import logging
import os
import subprocess
import sys

import pytest
import torch

from distributed import run_ranks

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

    try:
        layer(x, attention_mask=None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    except NotImplementedError as e:
        results["packed"] = str(e)
    return results


def test_layer_accepts_transformer_layer_keywords():
    (r,) = run_ranks(_layer_interface, 1)
    assert r["shape"] == (12, 2, 32) and r["bias"] is None
    assert r["rotary_ignored"] and r["rotary_warnings"] == 1
    assert "packed sequences" in r["packed"]


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
