"""Megatron-Core's Gated DeltaNet with ZeCO context parallelism (megatron_zeco.gated_delta_rule.layer) in HybridModel
stacks and a GPTModel, on real gloo processes (megatron-core >= 0.19; skipped, with the reason, on 0.16).

Under CP = 2, 3 and 4 (and TP 2 x CP 2) the loss and every parameter's gradient (summed over CP) equal
one process's in float64 to 1e-10: both layouts, the zeco, lasp2 and a2a strategies, softmax-attention and
MLP layers beside (RoPE too), packed batches under both splits (and on one process every document
alone), CP = 4 over 2 value heads and TP 2 x CP 2 over 1 value head per TP rank, which Megatron's head
all-to-all cannot split; at CP = 4 pieces are 2 tokens long, so a convolution's halo (3 tokens) comes
from two ranks. The layer's parameters and sharded checkpoint keys are Megatron's own GatedDeltaNet's;
bad configurations fail at build (or at the first forward, where only the data shows the problem)
naming what to change.

One launch of 4 processes runs everything on the CPU: Megatron's groups for CP = 1, 2, 4 and TP 2, and
for CP = 3 ranks 0-2 with a CP group passed to the model explicitly (Megatron's process-group
collection). The layer's GPU tests (fla's kernels under it, NCCL) are in tests/gated_delta_rule/test_gpu.py.
"""

import importlib.util
import traceback
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers.distributed import run_ranks
from tests.helpers.megatron import (check_loss_and_grads, cp_summed_grads, cross_entropy, documents_alone, host_rope,
                                    transformer_config)
from tests.helpers.reference import draw_seed, rel_err, token_batch

HAVE_HYBRID_MODEL = importlib.util.find_spec("megatron.core.models.hybrid") is not None
pytestmark = [pytest.mark.megatron, pytest.mark.slow]
needs_gdn = pytest.mark.skipif(not HAVE_HYBRID_MODEL, reason="the Gated DeltaNet layer subclasses megatron-core "
                               "0.19's GatedDeltaNet (Python >= 3.12 wheels; .ci/run runs these tests in its "
                               "megatron-core 0.19 pass)")

WORLD = 4
TOL = 1e-10  # float64
MEGATRON_TOL = 1e-4  # against Megatron's own module, whose PyTorch gated delta rule runs in float32
HIDDEN, HEADS, VOCAB, T, B = 32, 2, 32, 24, 2
# Gated DeltaNet heads: 2 query/key heads, 6 value heads (grouped: each q/k head serves 3), dims 8,
# a convolution of 4 taps; a2a splits the 6 value heads over CP = 2 and 3.
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4)
PACKED = {"document": [0, 12, 36, 48],  # documents cut by Megatron's THD split: lengths multiples of 2 x CP
          "sequence": [0, 5, 30, 31, 48]}  # the whole packed sequence cut (--dataloader-inter-document-masking)


def _case(name, pattern, **kw):
    return {**dict(name=name, pattern=pattern, strategy="zeco", layout="zigzag", rope=False, packed=None, tp=1,
                   gpt=False, linear=LINEAR, t=T, blocks=1, cps=(2, 3), transport="auto"), **kw}


CASES = [
    _case("G-G- zigzag", "G-G-"),
    _case("G-G- contiguous", "G-G-", layout="contiguous"),
    _case("G-G- zigzag, All-Scan in 2 blocks", "G-G-", blocks=2, cps=(3,)),
    # the dense hop kernel (interpreted here) moving the states through peer memory
    _case("G-G- zigzag, All-Scan through peer memory", "G-G-", transport="peer_memory", cps=(2,)),
    _case("G-G- lasp2 contiguous", "G-G-", strategy="lasp2", layout="contiguous"),
    _case("G-G- a2a", "G-G-", strategy="a2a"),
    _case("G*G- zigzag rope", "G*G-", rope=True),
    _case("G*G- packed per document", "G*G-", packed="document"),
    _case("G-G- packed whole sequence", "G-G-", packed="sequence"),
    _case("GPTModel G* rope", "G*", rope=True, gpt=True, cps=(2,)),
    _case("GPTModel G* through peer memory", "G*", gpt=True, transport="peer_memory", cps=(3,)),
    # CP = 4 over 2 value heads (one q/k head); zigzag pieces of 2 tokens, shorter than the halo
    _case("G-G- CP 4, 2 heads", "G-G-", linear=dict(LINEAR, linear_num_key_heads=1, linear_num_value_heads=2),
          t=16, cps=(4,)),
    # TP 2 x CP 2: one value head and one q/k head per TP rank
    _case("G*G- TP 2, 1 head per TP rank", "G*G-", tp=2,
          linear=dict(LINEAR, linear_num_key_heads=2, linear_num_value_heads=2), cps=(2,)),
]
RUNS = [(c, cp) for c in CASES for cp in c["cps"]]


def _config(case, cp, **extra):
    return transformer_config(**{**dict(
        num_layers=len(case["pattern"]), hidden_size=HIDDEN, num_attention_heads=HEADS, **case["linear"],
        activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False, init_method_std=0.1,
        context_parallel_size=cp, tensor_model_parallel_size=case["tp"], params_dtype=torch.float64), **extra})


def _model(case, cp, pg_collection=None):
    """This rank's model (float64), the same weights whatever the CP size."""
    from megatron.core.models.gpt import GPTModel

    from megatron_zeco.models import build_hybrid_model
    from megatron_zeco.specs import hybrid_layer_spec, hybrid_stack_spec

    knobs = dict(cp_strategy=case["strategy"], cp_layout=case["layout"], cp_num_blocks=case["blocks"],
                 cp_packed_split=case["packed"] or "auto", cp_transport=case["transport"], mixer="gdn")
    position = "rope" if case["rope"] else "none"
    torch.manual_seed(0)
    if case["gpt"]:
        return GPTModel(_config(case, cp), hybrid_layer_spec(case["pattern"], **knobs), VOCAB, 64,
                        position_embedding_type=position, pg_collection=pg_collection)
    return build_hybrid_model(_config(case, cp), case["pattern"], VOCAB, 64, hybrid_stack_spec(**knobs),
                              pg_collection=pg_collection, position_embedding_type=position)


def _batch(case, seed):
    return token_batch(seed, VOCAB, B, case["t"], PACKED.get(case["packed"]))


def _run(case, cp, seed, pg_collection=None):
    """Loss (mean over the batch's tokens) and every parameter's gradient summed over CP; at CP = 1 on
    a packed batch also those of every document alone; and this rank's TP rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_zeco import Layout, packed_positions

    model = _model(case, cp, pg_collection).double()  # Megatron's torch norms ignore params_dtype
    tokens, labels, cu = _batch(case, seed)
    cp_group = ps.get_context_parallel_group() if pg_collection is None else pg_collection.cp
    params = None
    if cu is not None:
        mine = packed_positions(cu, case["layout"], cp, cp_group.rank(), case["packed"] == "document")
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=int(cu[-1]),
                                 max_seqlen_kv=int(cu[-1]))
    else:
        mine = Layout(case["layout"]).shard(torch.arange(case["t"]), cp_group.rank(), cp, dim=0)
    with host_rope():
        # logits gathered over TP: the loss over the whole vocabulary
        logits = model(tokens[:, mine], None, None, packed_seq_params=params, runtime_gather_output=True)
        loss = cross_entropy(logits, labels[:, mine]) / labels.numel()
        loss.backward()
        alone = documents_alone(model, tokens, labels, cu) if cu is not None and cp == 1 else None
    loss = loss.detach()
    dist.all_reduce(loss, group=cp_group)
    grads = cp_summed_grads(model, cp_group)
    from megatron_zeco.mcore.common import LayerCP

    plans = [m.cp.plan for m in model.modules() if isinstance(getattr(m, "cp", None), LayerCP)]
    transports = [plan.transport for plan in plans if plan is not None]
    return float(loss), grads, alone, ps.get_tensor_model_parallel_rank(), transports


# Megatron's groups the launch sets up in turn: (TP, CP), data parallel over the rest of the 4 ranks.
PHASES = [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2)]


def _worker(rank, world, seed):
    """Per phase: its runs of RUNS and CP = 1 references, each computed once (the data-parallel replicas
    share the cases out); in phase (1, 1) also CP = 3 on ranks 0-2; in phase (2, 1) the checkpoint
    layout; in every phase the misconfigurations of its TP and CP sizes."""
    import torch._dynamo
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    # Megatron's GatedDeltaNet torch.compile's its gate and norm helpers (jit_fuser): compiling for the
    # CPU takes ~20 s per function and shape; eager runs the same operations.
    torch._dynamo.config.disable = True
    out = {"misuse": {}}
    for tp, cp in PHASES:
        ps.initialize_model_parallel(tp, 1, context_parallel_size=cp, create_gloo_process_groups=False)
        try:
            mine = [c for c in CASES if c["tp"] == tp and (cp == 1 or cp in c["cps"])]
            replica, replicas = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
            for case in mine[replica::replicas]:
                out[case["name"], cp] = _run(case, cp, seed)
            if (tp, cp) == (1, 1):
                # CP = 3 on ranks 0-2: Megatron's groups (TP = CP = 1) with a CP group of their own
                three = dist.new_group([0, 1, 2])  # collective: every rank makes it
                if rank < 3:
                    pgs = ProcessGroupCollection.use_mpu_process_groups()
                    pgs.cp = three
                    for case in [c for c in CASES if 3 in c["cps"]]:
                        out[case["name"], 3] = _run(case, 3, seed, pgs)
            if (tp, cp) == (2, 1):
                try:
                    out["checkpoint"] = _checkpoint_layout()
                except Exception:  # noqa: BLE001  (reported by its own test, not by every test of the launch)
                    out["checkpoint"] = traceback.format_exc()
            if (tp, cp) == (1, 1):
                out["out norm"] = _out_norm_forms()
            out["misuse"].update(_misuse(tp, cp))
        finally:
            ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    """One launch of 4 processes: {(case name, CP): [(loss, gradients, alone, TP rank) of each rank that ran it]},
    and each rank's checkpoint layout and misconfiguration errors."""
    launch = run_ranks(_worker, WORLD, draw_seed())
    runs = {}
    for rank_result in launch:
        for key, value in rank_result.items():
            if isinstance(key, tuple):
                runs.setdefault(key, []).append(value)
    return runs, launch


@needs_gdn
@pytest.mark.parametrize("case,cp", RUNS, ids=[f"{c['name']}-cp{cp}" for c, cp in RUNS])
def test_cp_matches_one_process(results, case, cp):
    """float64: the loss and every parameter's gradient (summed over CP) equal CP = 1's to 1e-10 (each
    rank against CP = 1 on the same TP rank); packed: CP = 1 equals every document alone."""
    runs, _ = results
    references = {r[3]: r for r in runs[case["name"], 1]}
    assert sorted(references) == list(range(case["tp"])), references.keys()
    ranks = runs[case["name"], cp]
    assert len(ranks) == cp * case["tp"], f"{len(ranks)} ranks ran it"  # one CP group per TP rank set
    for rank, result in enumerate(ranks):
        where = f"{case['name']} CP={cp} (rank {rank} of the group)"
        check_loss_and_grads([result], references[result[3]], where, TOL)
        want = "send_recv" if case["transport"] == "auto" or case["strategy"] != "zeco" else case["transport"]
        assert result[4] and set(result[4]) == {want}, f"{case['name']} rank {rank}: scans over {result[4]}"
    if case["packed"]:
        for reference in references.values():
            check_loss_and_grads([reference], reference[2], f"{case['name']} CP=1 against each document alone", TOL)


# --- parameters and checkpoints: Megatron's own ------------------------------------------------------

def _megatron_gdn_and_ours(tp):
    """Megatron's GatedDeltaNet and ZecoGatedDeltaNet for one config (Megatron-Core linears and norm),
    Megatron's in its deterministic mode: its forward in PyTorch (F.conv1d, torch_chunk_gated_delta_rule)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules, common
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_zeco.mcore.host import host_as_cuda
    from megatron_zeco.gated_delta_rule.layer import ZecoGatedDeltaNet

    # 2 q/k heads and 4 value heads per TP rank: grouped heads as Megatron groups them
    case = _case("checkpoint", "G", tp=tp, linear=dict(LINEAR, linear_num_key_heads=4, linear_num_value_heads=8))
    config = _config(case, 1, perform_initialization=False, deterministic_mode=True)
    submodules = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                         out_proj=RowParallelLinear)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    with mock.patch.object(common, "HAVE_FLA", True), host_as_cuda():  # its constructor needs neither
        theirs = GatedDeltaNet(config, submodules, layer_number=1, pg_collection=pgs).double()
    ours = ZecoGatedDeltaNet(config, submodules, layer_number=1, pg_collection=pgs).double()
    return theirs, ours


def _checkpoint_layout():
    """state_dict and sharded_state_dict (keys, global and local shapes) of Megatron's GatedDeltaNet
    and of ours at TP = 2; whether each loads the other's state_dict; the checkpoint keys of the
    local stack's G layer; and the two modules' outputs and gradients on the same weights."""
    theirs, ours = _megatron_gdn_and_ours(tp=2)
    layout = {}
    for name, module in (("theirs", theirs), ("ours", ours)):
        sharded = _flat(module.sharded_state_dict(prefix="self_attention."))
        layout[name] = ({k: None if v is None else tuple(v.shape) for k, v in module.state_dict().items()},
                        {k: (tuple(v.global_shape), tuple(getattr(v, "local_shape", ()))) for k, v in sharded.items()})
    ours.load_state_dict(theirs.state_dict())  # strict
    theirs.load_state_dict(ours.state_dict())
    layer = _model(_case("keys", "G-", tp=2), 1).decoder.layers[0]
    layout["layer keys"] = sorted(_flat(layer.sharded_state_dict(prefix="")))
    layout["against Megatron"] = _against_megatron(theirs, ours)
    layout["reference stack"] = _reference_stack()
    return layout


def _reference_stack():
    """The G mixers' classes and the state_dict shapes of a HybridModel built from ``throughput.py``'s
    comparison stack (benchmarks/reference_specs.py: Megatron's own GatedDeltaNet) and from
    gdn_hybrid_stack_local_spec, on the same config."""
    from megatron.core.ssm.gated_delta_net import common

    from benchmarks.reference_specs import megatron_gdn_hybrid_stack_local_spec
    from megatron_zeco.mcore.host import host_as_cuda
    from megatron_zeco.models import build_hybrid_model
    from megatron_zeco.specs import gdn_hybrid_stack_local_spec

    case = _case("reference", "G*G-", tp=2, linear=dict(LINEAR, linear_num_key_heads=2, linear_num_value_heads=2))
    out = {}
    for name, spec in (("theirs", megatron_gdn_hybrid_stack_local_spec), ("ours", gdn_hybrid_stack_local_spec)):
        with mock.patch.object(common, "HAVE_FLA", True), host_as_cuda():
            # deterministic: Megatron's mixer takes its PyTorch gated delta rule (fla's is None here); shapes
            # only, so no initialisation (Megatron's forks a CUDA RNG)
            model = build_hybrid_model(_config(case, 1, deterministic_mode=True, perform_initialization=False),
                                       case["pattern"], VOCAB, 64, spec,
                                       position_embedding_type="none")
        mixers = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")})
        out[name] = (mixers, {k: None if v is None else tuple(v.shape) for k, v in model.state_dict().items()})
    return out


def _against_megatron(theirs, ours):
    """Relative errors of ours against Megatron's GatedDeltaNet (CP = 1, the same random weights and
    input; fla's l2norm in Megatron's replaced by ours, the same formula): the output, the input's
    gradient and each parameter's gradient."""
    from megatron.core.ssm.gated_delta_net import common

    from megatron_zeco.mcore.host import host_as_cuda
    from megatron_zeco.common.conv import l2norm

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    ours.load_state_dict(theirs.state_dict())
    x, dy = (torch.randn(T, B, HIDDEN, generator=gen, dtype=torch.float64) for _ in range(2))
    runs = []
    for module in (theirs, ours):
        leaf = x.clone().requires_grad_()
        with mock.patch.object(common, "l2norm", l2norm), host_as_cuda():
            y, _ = module(leaf, None)
        params = dict(module.named_parameters())
        runs.append((y, dict(zip(["input", *params], torch.autograd.grad((y * dy).sum(), [leaf, *params.values()])))))
    (y_theirs, g_theirs), (y_ours, g_ours) = runs
    return {"output": rel_err(y_ours, y_theirs), **{n: rel_err(g, g_theirs[n]) for n, g in g_ours.items()}}


def _flat(sharded):
    """Sharded tensors by key (in_proj and conv1d come as factories of named sections: their parts)."""
    out = {}
    for key, value in sharded.items():
        if hasattr(value, "global_shape"):
            out[value.key] = value  # the key it is stored under (a layer's keys map renames some)
        else:  # ShardedTensorFactory: the sections it builds
            built = value.build()
            for part in (built.values() if isinstance(built, dict) else built):
                out[part.key] = part
    return out


@needs_gdn
def test_parameters_and_checkpoints_are_megatron_gated_deltanet(results):
    """The same parameters, shapes and sharded checkpoint keys (global and local shapes) as Megatron's
    GatedDeltaNet at TP = 2; each loads the other's state_dict; the local stack's G layer stores its
    input norm under the key of the TE layer's fused norm (self_attention.in_proj.layer_norm_weight);
    on the same weights the same output and gradients as Megatron's module (its PyTorch path); the
    model-level benchmark's comparison stack (benchmarks/reference_specs.py) has Megatron's mixer and
    our parameters."""
    for rank, result in enumerate(results[1]):
        layout = result["checkpoint"]
        assert isinstance(layout, dict), f"rank {rank}: {layout}"
        assert layout["ours"] == layout["theirs"], f"rank {rank}"
        sharded_keys = set(layout["theirs"][1])
        assert "self_attention.in_proj.weight.query" in sharded_keys, sharded_keys  # Megatron's sectioned keys
        layer_keys = set(layout["layer keys"])
        assert layer_keys == sharded_keys | {"self_attention.in_proj.layer_norm_weight"}, layer_keys ^ sharded_keys
        errors = layout["against Megatron"]
        assert max(errors.values()) < MEGATRON_TOL, f"rank {rank}: {errors}"
        # the model-level benchmark's comparison stack: Megatron's mixer, the same parameters as ours
        (theirs_mixers, theirs_shapes), (ours_mixers, ours_shapes) = (layout["reference stack"][n]
                                                                      for n in ("theirs", "ours"))
        assert (theirs_mixers, ours_mixers) == (["GatedDeltaNet"], ["ZecoGatedDeltaNet"]), (theirs_mixers, ours_mixers)
        assert theirs_shapes == ours_shapes, set(theirs_shapes) ^ set(ours_shapes)


# --- the gated output norm: one fused form where Megatron's out_norm is a plain RMSNorm -------------

def _out_norm_forms():
    """Whether the layer fuses its output norm under RMSNorm, LayerNorm and zero-centred gamma, and the fused
    form's output and gradients (the attention output's, the gate's, the norm weight's) against Megatron's
    module form in float64, on rows from 1e-4 (where eps dominates) to 1e2."""
    from types import SimpleNamespace

    from megatron_zeco.gated_delta_rule.layer import _plain_rms_norm

    layer = _build()
    out = {"RMSNorm": layer.fused_out_norm, "LayerNorm": _build(normalization="LayerNorm").fused_out_norm,
           "zero-centred gamma": _plain_rms_norm(layer.out_norm, SimpleNamespace(
               normalization="RMSNorm", layernorm_zero_centered_gamma=True), layer.value_head_dim)}
    gen = torch.Generator().manual_seed(3)
    b, s, h, v = 2, 5, LINEAR["linear_num_value_heads"], LINEAR["linear_value_head_dim"]
    scale = torch.logspace(-4, 2, s, dtype=torch.float64).view(1, s, 1, 1)
    x, gate = torch.randn(b, s, h, v, generator=gen, dtype=torch.float64) * scale, \
        2 * torch.randn(b, s, h, v, generator=gen, dtype=torch.float64)
    dy = torch.randn(s, b, h * v, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        layer.out_norm.weight.copy_(1 + 0.5 * torch.randn(v, generator=gen, dtype=torch.float64))
    forms = []
    for fused in (True, False):
        layer.fused_out_norm = fused
        leaves = [x.clone().requires_grad_(), gate.clone().requires_grad_()]
        y = layer._gated_norm(*leaves)
        forms.append([y, *torch.autograd.grad((y * dy).sum(), [*leaves, layer.out_norm.weight])])
    out["errors"] = {n: rel_err(a, b) for n, a, b in zip(("output", "x", "gate", "weight"), *forms)}
    return out


@needs_gdn
def test_output_norm_fuses_only_a_plain_rms_norm_and_equals_megatrons(results):
    """Under --normalization RMSNorm the layer's gated output norm is common.norm.gated_rms_norm (fla's fused
    kernel on GPUs), equal in float64 to Megatron's ``out_norm(x) * silu(gate)``; LayerNorm and zero-centred
    gamma keep Megatron's module."""
    forms = results[1][0]["out norm"]
    assert (forms["RMSNorm"], forms["LayerNorm"], forms["zero-centred gamma"]) == (True, False, False), forms
    assert max(forms["errors"].values()) < TOL, forms["errors"]


# --- misconfigurations: errors that name what to change ----------------------------------------------

def _build(params=None, **config):
    """The G mixer of gdn_hybrid_stack_local_spec (spec params overridden) on Megatron's groups."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from megatron_zeco.specs import gdn_hybrid_stack_local_spec

    base = gdn_hybrid_stack_local_spec.submodules.gdn_layer.submodules.self_attention
    kept = {k: v for k, v in base.params.items() if not (params and k == "cp_config")}  # the layer's cp_* keywords
    spec = ModuleSpec(module=base.module, params={**kept, **(params or {})}, submodules=base.submodules)
    case = _case("misuse", "G", linear=dict(LINEAR, **{k: config.pop(k) for k in list(config) if k in LINEAR}))
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    return build_module(spec, config=_config(case, pgs.cp.size(), tensor_model_parallel_size=pgs.tp.size(), **config),
                        layer_number=1, pg_collection=pgs)


def _forward(s, b=1, packed=None, layer=None):
    """A forward of ``layer`` (a new one if None) on s tokens of b sequences, or packed (offsets)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    params = None if packed is None else PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor(packed),
                                                         cu_seqlens_kv=torch.tensor(packed))
    layer = layer or _build()
    layer(torch.randn(s, b, HIDDEN, dtype=torch.float64), None, packed_seq_params=params)
    return layer


def _packed_rows_after_a_first_batch():
    _forward(8, b=2, packed=[0, 8, 16], layer=_forward(8, b=2))  # the first call's checks passed


def _forward_with_reset_attention_mask():
    with mock.patch("megatron_zeco.mcore.common._megatron_lm_arg", lambda name: name == "reset_attention_mask"):
        _forward(8)


# name: (TP, CP, what the user does, the error and what its message must name)
MISUSE = {
    "a2a with too few value heads": (1, 4, lambda: _build({"cp_strategy": "a2a"}), ValueError,
                                     ["--context-parallel-size (4)", "--linear-num-value-heads",
                                      "gdn_hybrid_stack_local_spec"]),
    "heads not divisible by the TP group": (2, 1, lambda: _build(linear_num_key_heads=1, linear_num_value_heads=3),
                                            ValueError, ["--linear-num-key-heads (1)", "--linear-num-value-heads (3)",
                                                         "--tensor-model-parallel-size (2)"]),
    "value heads not a multiple of key heads": (1, 1, lambda: _build(linear_num_value_heads=3), ValueError,
                                                ["--linear-num-value-heads (3)", "--linear-num-key-heads (2)"]),
    "blocks do not divide the value head dim": (1, 1, lambda: _build({"cp_num_blocks": 3}), ValueError,
                                                ["cp_num_blocks 3 must divide the value head dim (8)",
                                                 "the value head dim --linear-value-head-dim"]),
    "unknown strategy": (1, 1, lambda: _build({"cp_strategy": "lasp1"}), ValueError,
                         ["cp_strategy 'lasp1' is not one of zeco, lasp2, a2a"]),
    "unknown layout": (1, 1, lambda: _build({"cp_layout": "diagonal"}), ValueError,
                       ["cp_layout 'diagonal' is not one of contiguous, zigzag"]),
    "unknown packed split": (1, 1, lambda: _build({"cp_packed_split": "docs"}), ValueError,
                             ["cp_packed_split 'docs'"]),
    "unknown transport": (1, 1, lambda: _build({"cp_transport": "nvlink"}), ValueError,
                          ["cp_transport 'nvlink' is not one of auto, send_recv, peer_memory"]),
    "activation other than SiLU": (1, 1, lambda: _build(activation_func=F.gelu), ValueError, ["gelu", "--swiglu"]),
    "fp8 with Megatron-Core linears": (1, 1, lambda: _build(fp8="e4m3"), ValueError,
                                       ["--fp8-format", "gdn_hybrid_stack_te_spec"]),
    "sequence not divisible over CP": (1, 2, lambda: _forward(11), ValueError,
                                       ["T = 11", "--seq-length", "2 x --context-parallel-size"]),
    "packed batch of two rows": (1, 2, lambda: _forward(8, b=2, packed=[0, 8, 16]), ValueError, ["batch size 1"]),
    "packed batch of two rows, not the first batch": (1, 2, _packed_rows_after_a_first_batch, ValueError,
                                                      ["short convolution", "batch size 1"]),
    "--reset-attention-mask without packed sequences": (1, 1, _forward_with_reset_attention_mask, ValueError,
                                                        ["--reset-attention-mask", "cu_seqlens"]),
}


def _misuse(tp, cp):
    """The MISUSE cases of this TP and CP size (on Megatron's groups): the error each raised (None if none)."""
    errors = {}
    for name, (case_tp, case_cp, misuse, *_) in MISUSE.items():
        if (case_tp, case_cp) != (tp, cp):
            continue
        try:
            misuse()
            errors[name] = None
        except Exception as e:  # noqa: BLE001  (the test checks which)
            errors[name] = (type(e), str(e))
    return errors


@needs_gdn
@pytest.mark.parametrize("name", list(MISUSE))
def test_misconfiguration_fails_naming_what_to_change(results, name):
    """At model build (at the first forward where only the data shows the problem) the same error on
    every rank, naming the flag or spec to change."""
    kind, names = MISUSE[name][3:]
    errors = [rank_result["misuse"][name] for rank_result in results[1]]
    for rank, error in enumerate(errors):
        assert error is not None, f"rank {rank} accepted it"
        assert error[0] is kind and all(n in error[1] for n in names), f"rank {rank}: {error}"
    assert len(set(errors)) == 1, errors


# --- the spec names, as pretrain_hybrid.py imports them (one process) --------------------------------

GDN_STACKS = {"gdn_hybrid_stack_local_spec": "zeco", "gdn_hybrid_stack_local_lasp2_spec": "lasp2",
              "gdn_hybrid_stack_local_a2a_spec": "a2a"}


@needs_gdn
def test_stack_specs_as_pretrain_hybrid_imports_them_and_their_errors():
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    from megatron.core.transformer.spec_utils import build_module, import_module

    from megatron_zeco.gated_delta_rule.layer import ZecoGatedDeltaNet
    from megatron_zeco.mcore.hybrid_stack import ZecoHybridStack
    from megatron_zeco.specs import HAVE_TE, hybrid_stack_spec

    for name, strategy in GDN_STACKS.items():
        spec = import_module(["megatron_zeco.specs", name])  # as pretrain_hybrid.py --spec does
        assert spec.module is ZecoHybridStack and isinstance(spec.submodules, HybridStackSubmodules)
        mixer = spec.submodules.gdn_layer.submodules.self_attention
        assert mixer.module is ZecoGatedDeltaNet and mixer.params["cp_config"].strategy == strategy
    for name in ("gdn_local_spec", "gdn_hybrid_local_spec"):  # pretrain_gpt.py's
        assert import_module(["megatron_zeco.specs", name]).module is not None
    config = _config(_case("spec", "GM"), 1)
    with pytest.raises(ValueError, match="no Mamba layer for 'M'; its symbols are 'G' .Gated DeltaNet., '\\*'"):
        build_module(import_module(["megatron_zeco.specs", "gdn_hybrid_stack_local_spec"]), config,
                     layer_type_list=["G", "M"])
    if not HAVE_TE:
        with pytest.raises(ImportError, match="gdn_hybrid_stack_local_spec"):
            build_module(import_module(["megatron_zeco.specs", "gdn_hybrid_stack_te_spec"]), config)
    with pytest.raises(ValueError, match="cp_piece_split applies to GLA only"):
        hybrid_stack_spec(mixer="gdn", cp_piece_split=2)
    with pytest.raises(ValueError, match="mixer 'mamba' is not one of gla, gdn, kda"):
        hybrid_stack_spec(mixer="mamba")


@pytest.mark.skipif(HAVE_HYBRID_MODEL, reason="megatron-core has HybridModel and GatedDeltaNet")
def test_gdn_specs_on_megatron_core_without_gated_deltanet_name_the_version():
    """megatron-core 0.16: the names import; building one says which megatron-core to install."""
    from megatron.core.transformer.spec_utils import build_module, import_module

    config = transformer_config(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS)
    with pytest.raises(ImportError, match="megatron-core >= 0.19"):
        build_module(import_module(["megatron_zeco.specs", "gdn_hybrid_stack_local_spec"]), config)
    for name in ("gdn_local_spec", "gdn_hybrid_local_spec"):
        with pytest.raises(ImportError, match="megatron-core 0.19's GatedDeltaNet"):
            build_module(import_module(["megatron_zeco.specs", name]), config)
