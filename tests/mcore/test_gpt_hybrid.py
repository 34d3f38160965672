"""Hybrid GLA / softmax-attention GPTModels (mcore/gpt_hybrid.py): trained under CP against one process,
on packed batches against every document alone, and the layer pattern over pipeline stages. (The
softmax attention alone: tests/mcore/test_attention.py.)"""

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_ranks
from tests.helpers.megatron import check_training_matches, host_rope, train_steps, transformer_config
from tests.helpers.reference import rel_err

pytestmark = [pytest.mark.megatron, pytest.mark.slow]  # megatron: run under each megatron-core release (.ci/run)

# Layer 1 GLA, layer 2 softmax attention. RoPE needs Megatron's zigzag split under CP; the
# contiguous layout trains without positions.
MODELS = {"zigzag-rope": dict(pattern="G*", position_embedding="rope"),
          "contiguous": dict(pattern="G*", layout="contiguous")}
RUNS = {2: [("zigzag-rope", dict(cp=2)), ("contiguous", dict(cp=2))],
        4: [("zigzag-rope", dict(cp=4)), ("contiguous", dict(cp=4)), ("zigzag-rope", dict(tp=2, cp=2))]}


# --- a hybrid GPTModel under context parallelism ------------------------------------------------

def _train_configs(rank, world, configs):
    """train_steps (tests/helpers/megatron.py) for each config in turn."""
    with host_rope():
        return [train_steps(rank, world, config) for config in configs]


@pytest.fixture(scope="module")
def hybrid_reference():
    results = run_ranks(_train_configs, 1, [dict(model, cp=1) for model in MODELS.values()])[0]
    return dict(zip(MODELS, results))


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.variant), 4])  # 4: every config of 2 and TP
def test_hybrid_training_matches_single_process(hybrid_reference, world):
    """GLA + softmax layers at CP = world (and TP 2 x CP 2): losses and gradients of 4 SGD steps
    as one process (float64 to 1e-10, float32 to 1e-5)."""
    results = run_ranks(_train_configs, world, [dict(MODELS[model], **parallel) for model, parallel in RUNS[world]])
    for i, (model, parallel) in enumerate(RUNS[world]):
        print(model, parallel)
        check_training_matches([r[i] for r in results], hybrid_reference[model])


# --- a hybrid GPTModel on packed batches -----------------------------------------------------------

def _packed_hybrid_worker(rank, world, seed):
    """A hybrid GPTModel (``G*``, float64, no positions) on one packed batch, under each packed split at
    CP = world: this rank's logits and every parameter's gradient (summed over CP); at CP = 1 also
    each document alone, unpacked. Under CP, also the error for rotary embeddings with the
    whole-sequence split."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_zeco import packed_positions
    from megatron_zeco.specs import hybrid_layer_spec

    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world)
    config = transformer_config(num_layers=2, hidden_size=16, num_attention_heads=2, context_parallel_size=world)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32, (1, 60), generator=gen)
    weights = torch.randn(1, 60, 32, generator=gen, dtype=torch.float64)  # loss = <logits, weights>
    # per document: 4 documents padded to multiples of 12 (2 x CP for CP = 1, 2, 3); whole sequence: any cuts
    cases = {"document": torch.tensor([0, 12, 24, 36, 60], dtype=torch.int32),
             "sequence": torch.tensor([0, 1, 7, 30, 31, 60], dtype=torch.int32)}
    out = {}
    with host_rope():
        for split, cu in cases.items():
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
            torch.manual_seed(0)
            model = GPTModel(config, hybrid_layer_spec("G*", cp_packed_split=split), vocab_size=32,
                             max_sequence_length=60, position_embedding_type="none").double()
            mine = packed_positions(cu, "zigzag", world, rank, split == "document")
            logits = model(tokens[:, mine], None, None, packed_seq_params=params)
            (logits * weights[:, mine]).sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            for g in grads.values():
                dist.all_reduce(g, group=parallel_state.get_context_parallel_group())
            out[split] = (mine, logits.detach(), grads)
            if world == 1:
                model.zero_grad()
                alone = torch.cat([model(tokens[:, a:b], None, None) for a, b in zip(cu[:-1].tolist(),
                                                                                      cu[1:].tolist())], dim=1)
                (alone * weights).sum().backward()
                out[split, "alone"] = (alone.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        if world > 1:
            model = GPTModel(config, hybrid_layer_spec("G*", cp_packed_split="sequence"), vocab_size=32,
                             max_sequence_length=60, position_embedding_type="rope").double()
            cu = cases["sequence"]
            try:
                model(tokens[:, packed_positions(cu, "zigzag", world, rank, False)], None, None,
                      packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                        max_seqlen_q=60, max_seqlen_kv=60))
                out["rope error"] = None
            except ValueError as e:
                out["rope error"] = str(e)
    return out


def test_hybrid_model_on_packed_batches_matches_each_document_alone(seed):
    """GLA and softmax layers on a packed batch at CP = 1, 2, 3, per-document and whole-sequence
    splits: logits and all parameter gradients equal every document run alone at CP = 1 (float64);
    rotary embeddings with the whole-sequence split under CP are refused."""
    (ref,) = run_ranks(_packed_hybrid_worker, 1, seed)
    for world in (1, 2, 3):
        results = [ref] if world == 1 else run_ranks(_packed_hybrid_worker, world, seed)
        for rank, result in enumerate(results):
            for split in ("document", "sequence"):
                want, want_grads = ref[split, "alone"]
                mine, logits, grads = result[split]
                where = f"CP={world} rank {rank} split={split}"
                assert rel_err(logits, want[:, mine]) < 1e-10, where
                for name, g in grads.items():
                    assert rel_err(g, want_grads[name]) < 1e-10, f"{where}: grad of {name}"
            if world > 1:
                error = result["rope error"]
                assert error is not None and "per-document split" in error, error


# --- the pattern over pipeline stages, and the layer spec -----------------------------------------

PP_CASES = [  # (layers, pattern, TransformerConfig extras): the GPTModel chunks a rank builds
    (4, "GG*", {}),
    (4, "GG*", dict(num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=3)),
    (8, "GGG*", dict(virtual_pipeline_model_parallel_size=2)),
]


def _structure_worker(rank, world):
    """Per PP case, the (global layer number, mixer) of every layer this rank builds; then the
    error of RoPE under a contiguous CP layout."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_zeco.specs import hybrid_layer_spec

    def config(**kw):
        return transformer_config(hidden_size=16, num_attention_heads=2, **kw)

    built = []
    for layers, pattern, extra in PP_CASES:
        vpp = extra.get("virtual_pipeline_model_parallel_size")
        parallel_state.initialize_model_parallel(1, world, virtual_pipeline_model_parallel_size=vpp)
        cfg = config(num_layers=layers, pipeline_model_parallel_size=world, pipeline_dtype=torch.float32, **extra)
        layers_here = []
        for vp_stage in range(vpp or 1):
            stage = dict(ignore_virtual=False, vp_stage=vp_stage)
            model = GPTModel(cfg, hybrid_layer_spec(pattern), vocab_size=32, max_sequence_length=8,
                             position_embedding_type="none", vp_stage=vp_stage if vpp else None,
                             pre_process=parallel_state.is_pipeline_first_stage(**stage),
                             post_process=parallel_state.is_pipeline_last_stage(**stage))
            layers_here += [(layer.layer_number, type(layer.self_attention).__name__) for layer in model.decoder.layers]
        built.append(layers_here)
        parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world)
    spec = hybrid_layer_spec("G*", cp_layout="contiguous")
    with host_rope():
        model = GPTModel(config(num_layers=2, context_parallel_size=world), spec, vocab_size=32, max_sequence_length=8,
                         position_embedding_type="rope")
        try:
            model(torch.zeros(1, 8 // world, dtype=torch.long), None, None)
            rope_error = None
        except ValueError as e:
            rope_error = str(e)
    return built, rope_error


@pytest.fixture(scope="module")
def structure():
    return run_ranks(_structure_worker, 2)


@pytest.mark.parametrize("case", range(len(PP_CASES)), ids=["even", "uneven", "virtual"])
def test_pattern_follows_global_layer_numbers_over_pipeline_stages(structure, case):
    """Every layer is built once over the stages, with the mixer its global number gives."""
    layers, pattern, _ = PP_CASES[case]
    built = sorted(entry for stage, _ in structure for entry in stage[case])
    expected = [(n, "GatedLinearAttention" if pattern[(n - 1) % len(pattern)] == "G" else "SelfAttention")
                for n in range(1, layers + 1)]
    assert built == expected


def test_rope_under_contiguous_cp_layout_is_refused(structure):
    for _, error in structure:
        assert error is not None and "zigzag" in error and "--position-embedding-type none" in error, error


def test_named_specs_and_their_errors():
    from megatron.core.transformer.spec_utils import build_module, import_module

    from megatron_zeco.mcore.gpt_hybrid import HybridTransformerLayer
    from megatron_zeco.specs import HAVE_TE, hybrid_layer_spec

    spec = import_module(["megatron_zeco.specs", "hybrid_local_spec"])  # as pretrain_gpt.py --spec does
    assert spec.module is HybridTransformerLayer and spec.params["pattern"] == "GGG*"
    with pytest.raises(ValueError, match="symbols 'G' .GLA. and '\\*'"):
        hybrid_layer_spec("GA")
    with pytest.raises(ValueError, match="zigzag split only"):
        hybrid_layer_spec(use_te=True, cp_layout="contiguous")
    config = transformer_config(num_layers=2, hidden_size=16, num_attention_heads=2)
    with pytest.raises(ValueError, match="longer than --num-layers"):
        build_module(spec, config=config, layer_number=1)
    if not HAVE_TE:
        with pytest.raises(ImportError, match="hybrid_local_spec"):
            build_module(import_module(["megatron_zeco.specs", "hybrid_te_spec"]), config=config)
