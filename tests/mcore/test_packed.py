"""Packed batches (Megatron's ``packed_seq_params``, THD) through the layers: the GLA mixer and the hybrid
models' softmax attention against every document run alone, and the packed split that Megatron-LM's
arguments choose (mcore/common.py). The operator on packed input: tests/cp/test_packed.py."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_zeco import packed_positions
from tests.helpers.distributed import run_ranks
from tests.helpers.megatron import host_as_cuda, transformer_config
from tests.helpers.reference import rel_err

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

TOL = 1e-10


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

    with host_as_cuda():
        parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world)
        config = transformer_config(context_parallel_size=world)
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


def test_layer_packed_split_follows_megatron_lm_arguments(monkeypatch):
    """A layer's cp_packed_split='auto' (mcore.common.LayerCP.packed, what every layer calls) reads
    pretrain_gpt.py's flags; --reset-attention-mask alone is refused."""
    import sys
    import types
    from argparse import Namespace

    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_zeco.mcore.common import LayerCP

    cu = torch.tensor([0, 4, 8])
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    from megatron_zeco.cp import CPConfig

    layer_cp = types.SimpleNamespace(config=CPConfig(packed_split="auto"), plan=None, who="GatedLinearAttention")
    global_vars = types.ModuleType("megatron.training.global_vars")
    monkeypatch.setitem(sys.modules, "megatron.training", types.ModuleType("megatron.training"))
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    for flags, per_document in (({"sft": True}, True), ({"dataloader_inter_document_masking": True}, False),
                                ({"dataloader_inter_document_masking": True, "sft": True}, True), ({}, True)):
        global_vars.get_args = lambda: Namespace(**flags)
        assert LayerCP.packed(layer_cp, params)["per_document"] is per_document, flags
    global_vars.get_args = lambda: Namespace(reset_attention_mask=True)
    with pytest.raises(ValueError, match="--dataloader-inter-document-masking"):
        LayerCP.packed(layer_cp, None)
