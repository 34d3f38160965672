"""Packed sequences (cu_seqlens, Megatron's THD format) through zeco_gla on real gloo groups.

Reference: every document alone through the float64 loop. Random document lengths
(fresh seeds): one-token documents, documents shorter than a piece, one longer than
half of the whole packed sequence (so spanning every rank), documents starting exactly
at piece boundaries. Both splits: the layout over the whole packed sequence, and per
document (Megatron's THD split with zigzag). Outputs and all gradients to 1e-10.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from distributed import host_as_cuda, run_ranks
from megatron_zeco import Layout, packed_positions, zeco_gla
from megatron_zeco.cp.packed import Packing
from reference import problem, reference, rel_err

TOL = 1e-10
K, V = 8, 4
SPLITS = (("contiguous", False), ("zigzag", False), ("zigzag", True), ("contiguous", True))


def _lengths(gen, total, short, multiple):
    """Random document lengths (multiples of ``multiple``) summing to ``total``: one longer than
    half of it, the rest between one unit and ``short`` tokens."""
    units, short = total // multiple, max(short // multiple, 1)
    long = units // 2 + 1 + int(torch.randint(0, max(units // 4, 1), (1,), generator=gen))
    rest = []
    while sum(rest) < units - long:
        rest.append(min(int(torch.randint(1, short + 1, (1,), generator=gen)), units - long - sum(rest)))
    rest.insert(int(torch.randint(0, len(rest) + 1, (1,), generator=gen)), long)
    return [n * multiple for n in rest]


def _documents(seed, world, local_len, per_document):
    """Document lengths of each case: random draws; per document, also the shortest documents
    (one token per piece); else many one- to three-token documents and one document per zigzag
    piece (documents start at every piece's first token); and one document over everything."""
    gen = torch.Generator().manual_seed(seed)
    total, pieces = world * local_len, 2 * world
    if per_document:
        cases = [_lengths(gen, total, total // 2, pieces) for _ in range(2)] + [[pieces] * (total // pieces)]
    else:
        cases = [_lengths(gen, total, total // pieces, 1) for _ in range(2)]
        cases += [_lengths(gen, total, 3, 1), [total // pieces] * pieces]
    return cases + [[total]]


def _check(rank, world, seed, local_len):
    group = dist.new_group(list(range(world)))
    heads = world if world > 2 else 2  # a2a needs H divisible by the group size
    failures = []
    for n_split, (layout, per_document) in enumerate(SPLITS):
        for n_case, lengths in enumerate(_documents(seed + n_split, world, local_len, per_document)):
            case_seed = seed + 100 * n_split + n_case
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            x = problem(case_seed, 1, world * local_len, heads, K, V, gate="mixed" if n_case == 1 else "normal",
                        initial_state=False)
            ref = {name: [] for name in ("o", "dq", "dk", "dv", "dg")}
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):  # every document alone
                alone = reference({**{n: x[n][:, a:b] for n in ("q", "k", "v", "g", "do")}, "h0": None},
                                  output_final_state=False)
                for name in ref:
                    ref[name].append(alone[name])
            ref = {name: torch.cat(parts, dim=1) for name, parts in ref.items()}
            mine = packed_positions(cu, layout, world, rank, per_document)
            runs = [(s, v, "auto") for s in ("zeco", "lasp2", "a2a") for v in (True, False)]
            if per_document and layout == "zigzag" and world <= 3:  # Megatron's THD split as on one GPU
                runs.append(("zeco", True, "peer_memory"))  # node: zeco over peer memory (hop kernel, interpreted)
            for strategy, validate, transport in runs:
                local = {n: x[n][:, mine].requires_grad_() for n in ("q", "k", "v", "g")}
                o, _ = zeco_gla(*local.values(), group=group, strategy=strategy, layout=layout,
                                num_blocks=2 if strategy == "zeco" else 1, cu_seqlens=cu,
                                per_document=per_document, validate=validate, transport=transport)
                grads = torch.autograd.grad((o * x["do"][:, mine]).sum(), list(local.values()))
                errors = {"o": rel_err(o, ref["o"][:, mine])}
                errors.update({"d" + n: rel_err(d, ref["d" + n][:, mine]) for n, d in zip(local, grads)})
                bad = {k: f"{e:.1e}" for k, e in errors.items() if not e < TOL}
                if bad:
                    failures.append(f"{strategy} {layout} per_document={per_document} validate={validate} "
                                    f"transport={transport} lengths={lengths}: {bad}")
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_packed_documents_match_each_document_alone(seed, world):
    # 16 tokens per rank: zigzag pieces of 8; per-document pieces from 1 token up.
    failures = run_ranks(_check, world, seed, 16)
    assert not any(failures), "\n".join(f"rank {r}: {f}" for r, fs in enumerate(failures) for f in fs)


def test_offsets_are_read_again_after_an_in_place_change(seed):
    """The layers of a step share one reading of cu_seqlens; changing the tensor in place is seen."""
    x = problem(seed, B=1, T=24, H=2, K=K, V=V, gate="normal")
    cu = torch.tensor([0, 10, 24])
    args = (x["q"], x["k"], x["v"], x["g"])
    zeco_gla(*args, cu_seqlens=cu)
    cu[1] = 5  # now documents [0, 5) and [5, 24)
    o, _ = zeco_gla(*args, cu_seqlens=cu)
    want = torch.cat([zeco_gla(*(t[:, a:b] for t in args))[0] for a, b in ((0, 5), (5, 24))], dim=1)
    assert rel_err(o, want) < 1e-12
    same = [Packing.cached(cu, Layout.ZIGZAG, 2, 1, 12, False, "cpu") for _ in range(2)]
    assert same[0] is same[1]


BAD = {  # name: (keyword arguments for rank r, expected message)
    "offsets do not end at the group's length": (lambda r: {"cu_seqlens": torch.tensor([0, 5, 20])}, "from 0 to"),
    "offsets decrease": (lambda r: {"cu_seqlens": torch.tensor([0, 9, 5, 24])}, "nondecreasing"),
    "offsets differ across ranks": (lambda r: {"cu_seqlens": torch.tensor([0, 4 + r, 24])}, "same on every rank"),
    "float offsets": (lambda r: {"cu_seqlens": torch.tensor([0.0, 24.0])}, "1-D integer tensor"),
    "document not a multiple of 2P": (lambda r: {"cu_seqlens": torch.tensor([0, 6, 24]), "per_document": True,
                                                 "layout": "zigzag"}, "multiples of 4"),
    "per_document without offsets": (lambda r: {"per_document": True}, "pass cu_seqlens"),
    "initial state": (lambda r: {"cu_seqlens": torch.tensor([0, 24]),
                                 "initial_state": torch.zeros(1, 2, K, V, dtype=torch.float64)}, "zero state"),
    "lasp1": (lambda r: {"cu_seqlens": torch.tensor([0, 24]), "strategy": "lasp1"}, "does not support packed"),
    "batch of two": (lambda r: {"cu_seqlens": torch.tensor([0, 24]), "batch": 2}, "batch size 1"),
}


def _bad(rank, world):
    messages = {}
    for name, (make, _) in BAD.items():
        kwargs = make(rank)
        batch = kwargs.pop("batch", 1)
        q, k, v, g = (torch.randn(batch, 12, 2, d, dtype=torch.float64) for d in (K, K, V, K))
        for validate in (True, False):
            if not validate and name == "offsets differ across ranks":
                continue  # only the all-gathered check can see that
            try:
                zeco_gla(q, k, v, -g.abs(), group=dist.group.WORLD, validate=validate, **kwargs)
                messages[name, validate] = None
            except ValueError as e:
                messages[name, validate] = str(e)
    return messages


def test_bad_packed_input_fails_on_every_rank():
    results = run_ranks(_bad, 2, timeout=120)
    for (name, validate), message in results[0].items():
        expected = BAD[name][1]
        for rank, messages in enumerate(results):
            assert messages[name, validate] is not None, f"{name} (validate={validate}): rank {rank} accepted it"
            assert expected in messages[name, validate], f"{name}: rank {rank}: {messages[name, validate]}"
        if validate:
            assert results[1][name, validate] == message, name  # the same message everywhere


def test_positions_are_transformer_engines_thd_split():
    """per_document + zigzag gives each rank the tokens TE's thd_get_partitioned_indices gives it
    (its CUDA kernel, transcribed: token i of rank r's part of a document of length L lies in the
    first half-piece at rank r's piece, else at piece 2P-1-r)."""
    cu = torch.tensor([0, 8, 40, 48, 72])
    for world in (1, 2, 4):
        for rank in range(world):
            want = []
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
                half = (b - a) // (2 * world)
                for i in range(2 * half):
                    piece = rank if i < half else 2 * world - 2 - rank
                    want.append(a + half * piece + i)
            assert packed_positions(cu, "zigzag", world, rank, True).tolist() == want, (world, rank)


def _mixer_spec(kind, split):
    """The GLA mixer's spec, or the hybrid models' softmax self-attention's (K, V all-gathered)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_zeco.specs import gla_local_spec, softmax_layer_spec

    if kind == "attention":
        return softmax_layer_spec(cp_packed_split=split).submodules.self_attention
    base = gla_local_spec.submodules.self_attention
    config = dataclasses.replace(base.params["cp_config"], packed_split=split)
    return ModuleSpec(module=base.module, params={**base.params, "cp_config": config}, submodules=base.submodules)


def _mixer(rank, world, seed, kind):
    """A mixer (``kind``: GLA, or softmax attention) on a packed batch (float64) under each packed
    split, at CP = world: this rank's output and input gradient, and every parameter's gradient
    summed over CP; at CP = 1 also each document alone through the unpacked mixer."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer import TransformerConfig

    with host_as_cuda():
        parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world)
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                                   hidden_dropout=0.0, attention_dropout=0.0, context_parallel_size=world)
        gen = torch.Generator().manual_seed(seed)
        x, dy = (torch.randn(60, 1, 32, generator=gen, dtype=torch.float64) for _ in range(2))
        out = {}
        # Per document: real lengths 5, 12, 9 and 17 padded at the end of each to multiples of 12
        # (2 x CP for CP = 1, 2, 3).
        real = torch.tensor([0, 5, 17, 26, 43], dtype=torch.int32)
        padded = torch.tensor([0, 12, 24, 36, 60], dtype=torch.int32)
        whole = torch.tensor([0, 1, 7, 30, 31, 60], dtype=torch.int32)
        cases = {"document": (padded, PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                                                      cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)),
                 "sequence": (whole, PackedSeqParams(qkv_format="thd", cu_seqlens_q=whole, cu_seqlens_kv=whole))}
        cases["auto"] = cases["document"]  # without Megatron-LM's arguments: megatron.core's THD split
        for split, (cu, params) in cases.items():
            torch.manual_seed(0)
            mixer = build_module(_mixer_spec(kind, split), config=config, layer_number=1).double()

            def layer(x, **kw):  # (output, bias added later or None) -> output with its bias
                y, bias = mixer(x, None, **kw)
                return y if bias is None else y + bias

            mine = packed_positions(cu, "zigzag", world, rank, split != "sequence")
            x_local = x[mine].requires_grad_()
            y = layer(x_local, packed_seq_params=params)
            (y * dy[mine]).sum().backward()
            grads = {name: p.grad.clone() for name, p in mixer.named_parameters()}
            for g in grads.values():
                dist.all_reduce(g, group=parallel_state.get_context_parallel_group())
            out[split] = (mine, y.detach(), x_local.grad, grads)
            if world == 1:  # the reference: every document alone, no packing
                mixer.zero_grad()
                x_ref = x.clone().requires_grad_()
                y_ref = torch.cat([layer(x_ref[a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
                (y_ref * dy).sum().backward()
                out[split, "alone"] = (y_ref.detach(), x_ref.grad, {n: p.grad.clone() for n, p in
                                                                    mixer.named_parameters()})
        return out


@pytest.mark.megatron
@pytest.mark.parametrize("kind", ["gla", "attention"])
def test_layer_with_packed_seq_params_matches_each_document_alone(seed, kind):
    """The GLA layer's mixer, and a hybrid model's softmax attention, on packed batches (Megatron's
    ``packed_seq_params``) at CP = 1, 2 (3 for attention) under both splits: outputs and all gradients
    equal every document run alone, unpacked, at CP = 1 (float64)."""
    (ref,) = run_ranks(_mixer, 1, seed, kind)
    worlds = (2, 3) if kind == "attention" else (2,)
    for world, results in ((1, [ref]), *((w, run_ranks(_mixer, w, seed, kind)) for w in worlds)):
        for rank, result in enumerate(results):
            for split in ("document", "sequence", "auto"):
                y_ref, dx_ref, grads_ref = ref[split, "alone"]
                mine, y, dx, grads = result[split]
                where = f"CP={world} rank {rank} split={split}"
                assert rel_err(y, y_ref[mine]) < TOL and rel_err(dx, dx_ref[mine]) < TOL, where
                for name, g in grads.items():
                    assert rel_err(g, grads_ref[name]) < TOL, f"{where}: grad of {name}"


@pytest.mark.megatron
def test_layer_packed_split_follows_megatron_lm_arguments(monkeypatch):
    """cp_packed_split='auto' reads pretrain_gpt.py's flags; --reset-attention-mask alone is refused."""
    import sys
    import types
    from argparse import Namespace

    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_zeco.gla.layer import GatedLinearAttention

    cu = torch.tensor([0, 4, 8])
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    from megatron_zeco.cp import CPConfig

    layer = types.SimpleNamespace(cp_config=CPConfig(packed_split="auto"), cp=types.SimpleNamespace(plan=None))
    global_vars = types.ModuleType("megatron.training.global_vars")
    monkeypatch.setitem(sys.modules, "megatron.training", types.ModuleType("megatron.training"))
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    for flags, per_document in (({"sft": True}, True), ({"dataloader_inter_document_masking": True}, False),
                                ({"dataloader_inter_document_masking": True, "sft": True}, True), ({}, True)):
        global_vars.get_args = lambda: Namespace(**flags)
        assert GatedLinearAttention._packed(layer, params)["per_document"] is per_document, flags
    global_vars.get_args = lambda: Namespace(reset_attention_mask=True)
    with pytest.raises(ValueError, match="--dataloader-inter-document-masking"):
        GatedLinearAttention._packed(layer, None)
