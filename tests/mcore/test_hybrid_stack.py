"""Megatron-Core's HybridModel (megatron-core >= 0.19) from megatron_zeco.specs' hybrid stack spec, without
TransformerEngine: under CP = 2, 3 (every strategy, both layouts, packed batches) and over pipeline
segments ('|') it computes what one process computes; the stack builds the right layers per stage."""

import importlib.util

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_ranks
from tests.helpers.megatron import (check_loss_and_grads, cp_summed_grads, cross_entropy, documents_alone, host_as_cuda,
                                    host_rope, transformer_config)
from tests.helpers.reference import draw_seed, rel_err, token_batch

HAVE_HYBRID_MODEL = importlib.util.find_spec("megatron.core.models.hybrid") is not None
pytestmark = [pytest.mark.megatron, pytest.mark.slow]
needs_hybrid_model = pytest.mark.skipif(not HAVE_HYBRID_MODEL,
                                        reason="HybridModel needs megatron-core >= 0.19 (Python >= 3.12 wheels; "
                                               ".ci/run runs these tests in its megatron-core 0.19 pass)")

TOL = 1e-10  # float64: packing and CP change the order of every sum, not the result
HIDDEN, HEADS, VOCAB, T, B = 24, 6, 32, 24, 2  # 6 heads: the a2a strategy splits them over CP = 2 and 3
PACKED = {"document": [0, 12, 36, 48],  # documents cut by Megatron's THD split: lengths multiples of 2 x CP
          "sequence": [0, 5, 30, 31, 48]}  # the whole packed sequence cut (--dataloader-inter-document-masking)


def _case(name, pattern, **kw):
    return {**dict(name=name, pattern=pattern, strategy="zeco", layout="zigzag", rope=False, packed=None, pp=1,
                   mixer="gla"), **kw}


# Every case at CP = 2 and 3 unless it says otherwise.
CASES = [
    _case("G-G- zigzag", "G-G-"),
    _case("G-G- contiguous", "G-G-", layout="contiguous"),
    _case("G-G- lasp1", "G-G-", strategy="lasp1"),
    _case("G-G- lasp2 contiguous", "G-G-", strategy="lasp2", layout="contiguous"),
    _case("G-G- a2a", "G-G-", strategy="a2a"),
    _case("G*G- zigzag rope", "G*G-", rope=True),
    _case("G*G- contiguous", "G*G-", layout="contiguous"),
    _case("G*G- packed per document", "G*G-", packed="document"),
    _case("G*G- packed whole sequence", "G*G-", packed="sequence"),
    _case("G-GE MoE", "G-GE", cps=(2,)),
]
# Pipeline segments, PP = 2 (CP = 1): stage 0 builds 'G*', stage 1 'G-'; G = GLA or Gated DeltaNet.
PP_CASES = [_case("G*|G- PP=2", "G*|G-", pp=2), _case("G*|G- Gated DeltaNet PP=2", "G*|G-", pp=2, mixer="gdn")]
# Gated DeltaNet's heads and dims (megatron-core's config.linear_*); its convolution has 4 taps.
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
           linear_conv_kernel_dim=4)


def _batch(case, seed):
    """Tokens and labels of the whole batch: [B, T], or one packed sequence [1, 48] and its offsets."""
    return token_batch(seed, VOCAB, B, T, PACKED.get(case["packed"]))


def _model(case):
    """This rank's HybridModel chunk (float64), with the same weights whatever the CP size."""
    from megatron_zeco.models import build_hybrid_model
    from megatron_zeco.specs import hybrid_stack_spec

    layers = len(case["pattern"].replace("|", ""))
    extra = dict(num_moe_experts=2, moe_router_topk=1, moe_router_pre_softmax=True) if "E" in case["pattern"] else {}
    if case["mixer"] == "gdn":  # its short convolution and output gate apply SiLU
        extra.update(GDN, activation_func=torch.nn.functional.silu)
    config = transformer_config(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                add_bias_linear=False, init_method_std=0.1, context_parallel_size=case["cp"],
                                pipeline_model_parallel_size=case["pp"], pipeline_dtype=torch.float64,
                                params_dtype=torch.float64, **extra)
    spec = hybrid_stack_spec(cp_strategy=case["strategy"], cp_layout=case["layout"],
                             cp_packed_split=case["packed"] or "auto", mixer=case["mixer"])
    torch.manual_seed(0)
    model = build_hybrid_model(config, case["pattern"], VOCAB, 64, spec,
                               position_embedding_type="rope" if case["rope"] else "none")
    return model.double()  # Megatron's torch norms ignore params_dtype


def _global_name(name, offset):
    """``decoder.layers.<i>`` of a pipeline stage -> the whole model's layer number."""
    if name.startswith("decoder.layers."):
        i, rest = name[len("decoder.layers."):].split(".", 1)
        return f"decoder.layers.{int(i) + offset}.{rest}"
    return name


def _run(case, seed, full_state=None):
    """Loss (mean cross-entropy over the whole batch) and every parameter's gradient, summed over CP; the
    layers (number, class, kind); at CP = 1 on a packed batch every document alone; the G layers' mixers."""
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_zeco import Layout, packed_positions

    model = _model(case)
    offset = model.decoder.layers[0].layer_number - 1 if len(model.decoder.layers) else 0
    if full_state is not None:  # a pipeline stage: the whole model's weights
        model.load_state_dict({k: full_state[_global_name(k, offset)] for k in model.state_dict()})
    tokens, labels, cu = _batch(case, seed)
    cp_group, cp, cp_rank = ps.get_context_parallel_group(), case["cp"], ps.get_context_parallel_rank()
    params = None
    if cu is not None:
        mine = packed_positions(cu, case["layout"], cp, cp_rank, case["packed"] == "document")
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=int(cu[-1]), max_seqlen_kv=int(cu[-1]))
    else:
        mine = Layout(case["layout"]).shard(torch.arange(T), cp_rank, cp, dim=0)
    tokens, labels = tokens[:, mine], labels[:, mine]
    pp_group = ps.get_pipeline_model_parallel_group()
    with host_rope(), host_as_cuda():  # rotary tables and the MoE router assume CUDA
        if case["pp"] > 1 and ps.is_pipeline_first_stage():
            hidden = model(tokens, None, None, packed_seq_params=params)
            dist.send(hidden.detach().contiguous(), ps.get_pipeline_model_parallel_next_rank(), group=pp_group)
            grad = torch.empty_like(hidden)
            dist.recv(grad, ps.get_pipeline_model_parallel_next_rank(), group=pp_group)
            hidden.backward(grad)
            loss = torch.zeros((), dtype=torch.float64)
        else:
            hidden = None
            if case["pp"] > 1:
                hidden = torch.empty(tokens.shape[1], tokens.shape[0], HIDDEN, dtype=torch.float64)
                dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank(), group=pp_group)
                model.set_input_tensor(hidden.requires_grad_())
            logits = model(tokens, None, None, packed_seq_params=params)
            loss = cross_entropy(logits, labels) / (labels.shape[0] * (T if cu is None else int(cu[-1])))
            loss.backward()
            if hidden is not None:
                dist.send(hidden.grad.contiguous(), ps.get_pipeline_model_parallel_prev_rank(), group=pp_group)
            loss = loss.detach().double()
    dist.all_reduce(loss, group=cp_group)
    grads = cp_summed_grads(model, cp_group, lambda name: _global_name(name, offset))
    layers = [(layer.layer_number, type(layer).__name__, getattr(layer, "kind", None))
              for layer in model.decoder.layers]
    alone = documents_alone(model, tokens, labels, cu) if cu is not None and cp == 1 else None
    mixers = [type(layer.self_attention).__name__ for layer in model.decoder.layers if getattr(layer, "kind", 0) == "G"]
    return float(loss), grads, layers, alone, mixers


def _worker(rank, world, cases, seed, with_reference):
    """Per case (CP = world, or PP = world): this rank's loss and gradients; with_reference: also
    every case at CP = 1 (data parallel over the ranks, each computing the whole batch)."""
    from megatron.core import parallel_state as ps

    out = {}

    def run(case, key, **extra):
        ps.initialize_model_parallel(1, case["pp"], context_parallel_size=case["cp"])
        try:
            out[key] = _run(case, seed, **extra)
        finally:
            ps.destroy_model_parallel()

    for case in cases:
        whole = dict(case, pattern=case["pattern"].replace("|", ""), cp=1, pp=1)  # one stage: no '|'
        if with_reference:
            run(whole, (case["name"], 1))
        if case["pp"] > 1:
            ps.initialize_model_parallel(1, 1)
            full = _model(whole).state_dict()
            ps.destroy_model_parallel()
            run(dict(case, cp=1), (case["name"], "pp"), full_state=full)
        elif world in case.get("cps", (2, 3)):
            run(dict(case, cp=world), (case["name"], world))
    return out


@pytest.fixture(scope="module")
def results():
    """One launch of 2 processes (CP = 1 references, CP = 2, PP = 2) and one of 3 (CP = 3)."""
    seed = draw_seed()
    two = run_ranks(_worker, 2, CASES + PP_CASES, seed, True)
    three = run_ranks(_worker, 3, [c for c in CASES if 3 in c.get("cps", (2, 3))], seed, False)
    return {2: two, 3: three}


@needs_hybrid_model
@pytest.mark.parametrize("case,cp", [(c, cp) for c in CASES for cp in c.get("cps", (2, 3))],
                         ids=[f"{c['name']}-cp{cp}" for c in CASES for cp in c.get("cps", (2, 3))])
def test_hybrid_model_under_cp_matches_one_process(results, case, cp):
    """float64: the loss and every parameter's gradient (summed over CP) equal CP = 1's to 1e-10; on packed
    batches CP = 1's equal those of every document run alone."""
    reference = results[2][0][case["name"], 1]
    check_loss_and_grads([r[case["name"], cp] for r in results[cp]], reference, f"{case['name']} CP={cp}", TOL)
    if case["packed"]:  # and CP = 1 on the packed batch equals every document alone
        check_loss_and_grads([reference], reference[3], f"{case['name']} CP=1 against each document alone", TOL)


@needs_hybrid_model
@pytest.mark.parametrize("case", PP_CASES, ids=[c["name"] for c in PP_CASES])
def test_pipeline_segments_match_whole_model(results, case):
    """'G*|G-' on two pipeline stages, driven by hand (Megatron's schedules need CUDA): stage 0
    builds layers 1-2 (G, *), stage 1 layers 3-4 (G, -); together every parameter, and the loss and
    gradients of the whole model. G: GLA, and Megatron's Gated DeltaNet (ZecoGatedDeltaNet)."""
    name = case["name"]
    stages = [r[name, "pp"] for r in results[2]]
    assert [s[2] for s in stages] == [[(1, "HybridMixerLayer", "G"), (2, "HybridMixerLayer", "*")],
                                      [(3, "HybridMixerLayer", "G"), (4, "MLPLayer", None)]]
    mixer = {"gla": "GatedLinearAttention", "gdn": "ZecoGatedDeltaNet"}[case["mixer"]]
    assert [s[4] for s in stages] == [[mixer], [mixer]], [s[4] for s in stages]
    ref_loss, ref_grads = results[2][0][name, 1][:2]
    loss = stages[1][0]  # the last stage's
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss), f"{name}: loss {loss} vs {ref_loss}"
    for stage, grads in enumerate(s[1] for s in stages):
        for param, g in grads.items():
            err = rel_err(g, ref_grads[param])
            assert err < TOL, f"{name} stage {stage}: gradient of {param} off by {err:.1e}"
    first, last = set(stages[0][1]), set(stages[1][1])
    assert first | last == set(ref_grads) and not first & last, (first, last)


# --- the stack's structure over pipeline stages, and its errors ------------------------------------

VPP_PATTERN = "G-|G*|GE|-G"  # 4 segments over PP = 2: two virtual stages per rank


def _structure_worker(rank, world, seed):
    """Per virtual stage: (pre_process, post_process, [(layer number, layer class, kind)], final norm);
    then the GPTModel-to-HybridModel mapping check (_gpt_as_hybrid)."""
    from megatron.core import parallel_state as ps

    from megatron_zeco.models import build_hybrid_model

    ps.initialize_model_parallel(1, world, virtual_pipeline_model_parallel_size=2)
    config = transformer_config(num_layers=8, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                pipeline_model_parallel_size=world, virtual_pipeline_model_parallel_size=2,
                                pipeline_dtype=torch.float32, num_moe_experts=2, add_bias_linear=False)
    built = []
    for vp_stage in range(2):
        model = build_hybrid_model(config, VPP_PATTERN, VOCAB, 64, vp_stage=vp_stage)
        layers = [(layer.layer_number, type(layer).__name__, getattr(layer, "kind", None))
                  for layer in model.decoder.layers]
        norm = type(model.decoder.final_norm).__name__ if hasattr(model.decoder, "final_norm") else None
        built.append((model.pre_process, model.post_process, layers, norm))
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1)
    return built, _gpt_as_hybrid(seed)


def gpt_name_to_hybrid(name: str) -> str:
    """A hybrid GPTModel's parameter name -> the HybridModel's (docs/hybrid-model.md): GPTModel layer i
    is HybridModel layers 2i (norm and mixer) and 2i + 1 (norm and MLP)."""
    if name.startswith("decoder.final_layernorm."):
        return "decoder.final_norm." + name[len("decoder.final_layernorm."):]
    if not name.startswith("decoder.layers."):
        return name
    i, rest = name[len("decoder.layers."):].split(".", 1)
    mlp = rest.startswith(("pre_mlp_layernorm.", "mlp."))
    return f"decoder.layers.{2 * int(i) + mlp}.{rest}"


def _gpt_as_hybrid(seed):
    """A GPTModel of hybrid_layer_spec('G*') (2 layers, RoPE) and the HybridModel 'G-*-' with its weights
    (float64): the logits' relative difference, and the parameter names of each."""
    from megatron.core.models.gpt import GPTModel

    from megatron_zeco.models import build_hybrid_model
    from megatron_zeco.specs import hybrid_layer_spec

    def config(layers):
        return transformer_config(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                  init_method_std=0.1)

    torch.manual_seed(seed)
    gpt = GPTModel(config(2), hybrid_layer_spec("G*"), VOCAB, 64, position_embedding_type="rope").double()
    hybrid = build_hybrid_model(config(4), "G-*-", VOCAB, 64, position_embedding_type="rope").double()
    mapped = {gpt_name_to_hybrid(k): v for k, v in gpt.state_dict().items()}
    hybrid.load_state_dict(mapped)
    tokens = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))
    with host_rope():
        got, want = hybrid(tokens, None, None), gpt(tokens, None, None)
    return rel_err(got, want), sorted(mapped), sorted(hybrid.state_dict())


@pytest.fixture(scope="module")
def structure():
    return run_ranks(_structure_worker, 2, draw_seed())


@needs_hybrid_model
def test_virtual_pipeline_segments_build_the_pattern_layers(structure):
    """Segment v x PP + rank on each (rank, virtual stage); embedding on the first, the final norm
    (Megatron-Core's own, no TransformerEngine) and output on the last."""
    kinds = {"G": ("HybridMixerLayer", "G"), "*": ("HybridMixerLayer", "*"), "-": ("MLPLayer", None),
             "E": ("MoETransformerLayer", None)}
    segments = VPP_PATTERN.split("|")
    number = {}
    for index, segment in enumerate(segments):
        start = sum(map(len, segments[:index]))
        number[index] = [(start + i + 1, *kinds[s]) for i, s in enumerate(segment)]
    for rank, (stages, _) in enumerate(structure):
        for vp_stage, (pre, post, layers, norm) in enumerate(stages):
            index = vp_stage * 2 + rank
            assert layers == number[index], (rank, vp_stage, layers)
            assert (pre, post) == (index == 0, index == len(segments) - 1), (rank, vp_stage)
            want = ("LayerNorm", "FusedLayerNorm") if index == len(segments) - 1 else (None,)  # torch's, or apex's
            assert norm in want, (rank, vp_stage, norm)


@needs_hybrid_model
def test_gpt_model_pattern_maps_to_hybrid_model_pattern(structure):
    """docs/hybrid-model.md: GPTModel hybrid_layer_spec('G*') = HybridModel 'G-*-' with the renamed
    weights: every parameter maps, and the logits agree (float64, 1e-12)."""
    for err, mapped, names in (result for _, result in structure):
        assert mapped == names
        assert err < 1e-12, err


@needs_hybrid_model
def test_stack_spec_as_pretrain_hybrid_imports_it_and_its_errors():
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    from megatron.core.transformer.spec_utils import build_module, import_module

    from megatron_zeco.mcore.hybrid_stack import ZecoHybridStack
    from megatron_zeco.models import build_hybrid_model
    from megatron_zeco.gla.layer import GatedLinearAttention
    from megatron_zeco.specs import HAVE_TE

    for name, strategy in [("hybrid_stack_local_spec", "zeco"), ("hybrid_stack_local_lasp1_spec", "lasp1"),
                           ("hybrid_stack_local_lasp2_spec", "lasp2"), ("hybrid_stack_local_a2a_spec", "a2a")]:
        spec = import_module(["megatron_zeco.specs", name])  # as pretrain_hybrid.py --spec does
        assert spec.module is ZecoHybridStack and isinstance(spec.submodules, HybridStackSubmodules)
        mixer = spec.submodules.gdn_layer.submodules.self_attention
        assert mixer.module is GatedLinearAttention and mixer.params["cp_config"].strategy == strategy
    config = transformer_config(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS)
    with pytest.raises(ValueError, match="no Mamba layer for 'M'; its symbols are 'G' .GLA., '\\*'"):
        build_module(import_module(["megatron_zeco.specs", "hybrid_stack_local_spec"]), config,
                     layer_type_list=["G", "M"])
    with pytest.raises(ValueError, match="has 3 layers but the config's num_layers .--num-layers. is 2"):
        build_hybrid_model(config, "G*-", VOCAB, 64)
    if not HAVE_TE:
        with pytest.raises(ImportError, match="hybrid_stack_local_spec"):
            build_module(import_module(["megatron_zeco.specs", "hybrid_stack_te_spec"]), config)
    from megatron_zeco.specs import hybrid_stack_spec

    with pytest.raises(ValueError, match="zigzag split only"):
        hybrid_stack_spec(use_te=True, cp_layout="contiguous")


@pytest.mark.skipif(HAVE_HYBRID_MODEL, reason="megatron-core has HybridModel")
def test_stack_spec_on_megatron_core_without_hybrid_model_names_the_version():
    from megatron.core.transformer.spec_utils import build_module, import_module

    spec = import_module(["megatron_zeco.specs", "hybrid_stack_local_spec"])
    config = transformer_config(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS)
    with pytest.raises(ImportError, match="megatron-core >= 0.19.*hybrid_local_spec"):
        build_module(spec, config)
