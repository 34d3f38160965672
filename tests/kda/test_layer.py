"""KDA layers (megatron_zeco.kda.layer.KimiDeltaAttention) in Megatron-Core models on real gloo process
groups: a GPTModel hybrid (pretrain_gpt.py's route: KDA and softmax attention by --pattern) and a
HybridModel 'G-G-' (pretrain_hybrid.py's, megatron-core >= 0.19) give CP = 1's losses and every
gradient at CP = 2 and 3 in both layouts, under TP x CP, for every strategy (float64 to 1e-10, float32
to 1e-5); a distributed checkpoint saved at CP = 2 resumes at CP = 4 with the same losses; the specs
build the layer with the parameters docs/kda.md names, and refuse misuse by name.
"""

import importlib.util
import os

import pytest
import torch

from tests.helpers.distributed import Batched, run_ranks
from tests.helpers.megatron import check_training_matches, train_steps

pytestmark = pytest.mark.megatron  # run under each megatron-core release (.ci/run)

HAVE_HYBRID_MODEL = importlib.util.find_spec("megatron.core.models.hybrid") is not None
needs_hybrid_model = pytest.mark.skipif(not HAVE_HYBRID_MODEL, reason="HybridModel needs megatron-core >= 0.19 "
                                        "(.ci/run runs these tests in its megatron-core 0.19 pass)")
GPT = dict(mixer="kda", pattern="G*")
# Cases making the megatron-core calls another case makes (.ci/run's second pass leaves them out).
VARIANT = pytest.mark.variant
HYBRID = dict(mixer="kda", model="hybrid", layers=None, hybrid_layer_pattern="G-G-")


@pytest.fixture(scope="module")
def gpt_reference():
    return run_ranks(train_steps, 1, GPT)[0]


@pytest.fixture(scope="module")
def hybrid_reference():
    return run_ranks(train_steps, 1, HYBRID)[0] if HAVE_HYBRID_MODEL else None


@pytest.fixture(scope="module")
def gpt_launches(request):
    """The selected GPTModel cases below, one launch per world size."""
    return Batched(request, "test_gpt_hybrid_under_cp_matches_one_process", train_steps,
                   lambda p: ({**GPT, **p["overrides"]},))


@pytest.fixture(scope="module")
def hybrid_launches(request):
    """The selected HybridModel cases below, one launch per world size."""
    return Batched(request, "test_hybrid_model_under_cp_matches_one_process", train_steps,
                   lambda p: ({**HYBRID, **p["overrides"]},))


def _id(x):
    return str(x) if isinstance(x, int) else ",".join(f"{k}={v}" for k, v in x.items())


@pytest.mark.slow
@pytest.mark.parametrize("world,overrides", [
    (2, dict(cp=2)),
    pytest.param(3, dict(cp=3), marks=VARIANT),
    pytest.param(2, dict(cp=2, layout="contiguous"), marks=VARIANT),
    pytest.param(3, dict(cp=3, layout="contiguous", num_blocks=2), marks=VARIANT),
    pytest.param(2, dict(cp=2, strategy="lasp2"), marks=VARIANT),
    pytest.param(2, dict(cp=2, strategy="a2a"), marks=VARIANT),
    pytest.param(4, dict(tp=2, cp=2), marks=[pytest.mark.slow, VARIANT]),
], ids=_id)
def test_gpt_hybrid_under_cp_matches_one_process(gpt_reference, gpt_launches, world, overrides):
    check_training_matches(gpt_launches(world, {**GPT, **overrides}), gpt_reference)


@needs_hybrid_model
@pytest.mark.slow
@pytest.mark.parametrize("world,overrides", [
    (2, dict(cp=2)),
    pytest.param(3, dict(cp=3), marks=pytest.mark.variant),
    pytest.param(2, dict(cp=2, layout="contiguous"), marks=pytest.mark.variant),
    (3, dict(cp=3, layout="contiguous")),
], ids=_id)
def test_hybrid_model_under_cp_matches_one_process(hybrid_reference, hybrid_launches, world, overrides):
    check_training_matches(hybrid_launches(world, {**HYBRID, **overrides}), hybrid_reference)


# --- save at CP = 2, resume at CP = 4 -------------------------------------------------------------

RESUME = dict(mixer="kda", pattern="G*", layers=2, hidden=32, heads=4, seq_len=32, batch=4, steps=6,
              dtype="float64", log_interval=10**6)


def _resume_runs(rank, world, root):
    """Losses of 6 steps straight at CP 2 x DP 2; 3 steps saved at CP 2 x DP 2 and resumed at CP 4, and at
    TP 2 x CP 2."""
    from megatron_zeco import train as T

    def run(**flags):
        return [loss for loss, _ in T.train(T.TrainConfig(**{**RESUME, **flags}), log=lambda line: None)]

    ckpt = os.path.join(root, "ckpt")
    return {"straight": run(cp=2, dp=2), "first": run(cp=2, dp=2, save=ckpt, exit_interval=3),
            "resumed": run(cp=4, load=ckpt), "tp2": run(tp=2, cp=2, load=ckpt)}


@pytest.mark.slow
def test_checkpoint_saved_at_cp2_resumes_at_cp4(tmp_path):
    """Model and AdamW state come back under another CP size, and under TP = 2 (KDA's per-head parameters
    sharded by dist-checkpointing): the resumed steps' losses are the straight run's (float64, 1e-10)."""
    for out in run_ranks(_resume_runs, 4, str(tmp_path)):
        assert out["first"] == out["straight"][:3], out
        for resumed in ("resumed", "tp2"):
            for a, b in zip(out[resumed], out["straight"][3:], strict=True):
                assert a == pytest.approx(b, rel=1e-10, abs=0), (resumed, out)


# --- the layer through its specs ------------------------------------------------------------------

def _build(rank, world, spec_knobs, tp, cp, config):
    """The KDA mixer of ``megatron_zeco.specs.kda_layer_spec(**spec_knobs)`` on Megatron's groups:
    parameter names and shapes, or the error its construction raised."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.spec_utils import build_module

    from megatron_zeco import specs
    from tests.helpers.megatron import transformer_config

    ps.initialize_model_parallel(tp, 1, context_parallel_size=cp)
    try:
        config = dict(config)
        cfg = transformer_config(num_layers=1, hidden_size=32, num_attention_heads=config.pop("heads", 4),
                                 tensor_model_parallel_size=tp, context_parallel_size=cp, **config)
        try:
            spec = specs.kda_layer_spec(**spec_knobs).submodules.self_attention
            layer = build_module(spec, config=cfg, layer_number=1)
        except (ValueError, ImportError) as e:
            return type(e).__name__, str(e)
        return {n: tuple(p.shape) for n, p in layer.named_parameters()}
    finally:
        ps.destroy_model_parallel()


@pytest.mark.slow
def test_parameters_are_those_the_docs_name():
    """H = 4 heads of K = V = 8 (hidden 32), W = 4, one rank; under TP = 2 each rank holds half of every
    per-head tensor."""
    names = run_ranks(_build, 1, {}, 1, 1, {})[0]
    H, D, W, hidden = 4, 8, 4, 32
    assert names == {"in_proj.weight": (H * (3 * D + 1), hidden), "gate_down": (D, hidden),
                     "gate_up.weight": (H * D, D), "out_gate_down": (D, hidden), "out_gate_up.weight": (H * D, D),
                     "out_gate_up.bias": (H * D,), "conv_weight": (H * 3 * D, W), "A_log": (H,), "dt_bias": (H * D,),
                     "out_norm_weight": (D,), "out_proj.weight": (hidden, H * D)}, names
    for shard in run_ranks(_build, 2, {}, 2, 1, {}):
        assert shard["conv_weight"] == (H * 3 * D // 2, W) and shard["A_log"] == (H // 2,), shard


MISUSE = {  # (spec knobs, tp, cp, config): what the error names
    "a2a with too few heads": (dict(cp_strategy="a2a"), 1, 2, dict(heads=1, kv_channels=8),
                               ["a2a strategy", "--context-parallel-size (2)", "kda_hybrid_stack_local_spec"]),
    "blocks do not divide the head dim": (dict(cp_num_blocks=3), 1, 2, dict(kv_channels=8),
                                          ["cp_num_blocks 3 must divide the value head dim (8)",
                                           "the head dim is --kv-channels"]),
    "lasp1": (dict(cp_strategy="lasp1"), 1, 2, {}, ["cp_strategy 'lasp1' is not one of zeco, lasp2, a2a for KDA"]),
    "conv width": (dict(conv_kernel_size=0), 1, 1, {}, ["conv_kernel_size must be a positive int"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", [n if n == "a2a with too few heads" else pytest.param(n, marks=pytest.mark.variant)
                                  for n in MISUSE])
def test_misuse_names_what_to_change(name):
    knobs, tp, cp, config, words = MISUSE[name]
    for result in run_ranks(_build, tp * cp, knobs, tp, cp, config):
        assert isinstance(result, tuple) and all(w in result[1] for w in words), result


SPEC_NAMES = ["kda_local_spec", "kda_te_spec", "kda_hybrid_local_spec", "kda_hybrid_te_spec",
              "kda_hybrid_stack_local_spec", "kda_hybrid_stack_local_lasp2_spec", "kda_hybrid_stack_local_a2a_spec",
              "kda_hybrid_stack_te_spec"]


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_spec_imports_as_pretrain_scripts_do(name):
    """pretrain_gpt.py / pretrain_hybrid.py --spec megatron_zeco.specs NAME: import_module, used without
    calling; the KDA mixer with the strategy the name says (or a stand-in that fails at build, naming
    what to install, where TransformerEngine or HybridModel is missing)."""
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    from megatron_zeco import specs
    from megatron_zeco.kda.layer import KimiDeltaAttention

    spec = import_module(["megatron_zeco.specs", name])
    assert isinstance(spec, ModuleSpec)
    if ("_te_" in name and not specs.HAVE_TE) or ("stack" in name and not specs.HAVE_HYBRID_MODEL):
        assert spec.module.__name__.endswith("Missing"), spec
        return
    if "stack" in name:
        mixer = spec.submodules.gdn_layer.submodules.self_attention
    elif "hybrid" in name:
        mixer = spec.submodules.gla.self_attention
    else:
        mixer = spec.submodules.self_attention
    assert mixer.module is KimiDeltaAttention, mixer
    strategy = name.split("_")[-2] if name.split("_")[-2] in ("lasp2", "a2a") else "zeco"
    config = mixer.params["cp_config"]
    assert (config.operator, config.strategy, config.layout.value) == ("kda", strategy, "zigzag")
