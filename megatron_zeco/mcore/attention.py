"""Causal softmax attention under context parallelism without TransformerEngine.

Megatron-Core's own ``DotProductAttention`` refuses context parallelism (only
TransformerEngine's attention implements it). :class:`AllGatherDotProductAttention`
takes its place as the ``core_attention`` of Megatron's ``SelfAttention`` in the
softmax layers of hybrid models (``megatron_zeco.specs.hybrid_layer_spec``): each CP
rank all-gathers K and V, as LASP-2H does for its softmax layers, and attends its
own queries to every key at or before their global position, which the layout
(Megatron's zigzag split or contiguous) gives. The backward reduce-scatters dK and dV.
Packed batches (Megatron's THD ``packed_seq_params``) attend within each document only,
under either packed split of the GLA layers (``cp_packed_split``).
"""

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..comm import as_layout
from ..comm.functional import all_gather
from ..cp.packed import Packing
from .common import check_packed_split, packed_arguments


class AllGatherDotProductAttention(MegatronModule):
    """Core attention (Megatron's ``CoreAttention`` interface), causal, with K and V all-gathered over CP.

    Args:
        config: the model's TransformerConfig (``kv_channels``, ``attention_dropout``).
        layer_number, attention_type: as Megatron passes them.
        attn_mask_type: must be ``causal``.
        softmax_scale: None for ``1 / sqrt(kv_channels)``.
        pg_collection: Megatron's process groups (``cp`` used); ``parallel_state`` when absent.
        cp_layout: ``zigzag`` (Megatron's ``get_batch_on_this_cp_rank`` split) or ``contiguous``.
        cp_packed_split: how packed batches are split over CP, as the GLA layers' (``auto``,
            ``document``, ``sequence``; see :class:`megatron_zeco.gla.layer.GatedLinearAttention`).
        **kwargs: anything else Megatron passes (``cp_comm_type``, ...): K and V are always
            all-gathered, whatever ``--cp-comm-type`` says.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 softmax_scale=None, pg_collection=None, cp_layout: str = "zigzag", cp_packed_split: str = "auto",
                 **kwargs):
        super().__init__(config=config)
        name = f"AllGatherDotProductAttention (layer {layer_number})"
        if attn_mask_type != AttnMaskType.causal or attention_type != "self":
            raise ValueError(f"{name}: only causal self-attention is supported, got {attn_mask_type.name} "
                             f"{attention_type}-attention")
        if config.attention_dropout:
            raise ValueError(f"{name}: attention dropout is not supported; pass --attention-dropout 0")
        self.name = name
        self.cp_group = pg_collection.cp if pg_collection is not None \
            else parallel_state.get_context_parallel_group()
        self.layout = as_layout(cp_layout)
        check_packed_split(cp_packed_split, name)
        self.cp_packed_split = cp_packed_split
        self.softmax_scale = config.kv_channels ** -0.5 if softmax_scale is None else softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """``query: [s, b, np, hn]``, ``key, value: [s, b, ng, hn]`` (``np`` a multiple of ``ng``), this
        rank's ``s`` tokens -> ``[s, b, np * hn]``; packed (THD): ``[s, np, hn]``, ``[s, ng, hn]`` ->
        ``[s, 1, np * hn]``.

        Causal by global position, like TransformerEngine's causal attention, and within each
        document for packed batches: ``attention_mask`` (the dataloader's mask) is not read.
        """
        packed = packed_arguments(packed_seq_params, self.cp_packed_split, self.name)
        if packed:  # THD: Megatron squeezed the batch dim of one
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        if attention_bias is not None:
            raise NotImplementedError(f"{self.name}: attention_bias is not supported")
        if attn_mask_type not in (None, AttnMaskType.causal):
            raise ValueError(f"{self.name}: only causal attention is supported, got {attn_mask_type.name}")
        s, b, heads, _ = query.shape
        world, rank = self.cp_group.size(), self.cp_group.rank()
        if world > 1 and not packed.get("per_document") and s % len(self.layout.pieces(0, world)):
            raise ValueError(f"{self.name}: {s} local tokens do not split into the {self.layout.value} "
                             f"layout's pieces; --seq-length must be a multiple of 2 x --context-parallel-size")
        mask = self._mask(s, world, rank, query.device, **packed)
        if world > 1:
            kv = all_gather(torch.cat([key, value], dim=-1), 0, self.cp_group)  # rank order
            key, value = kv.split([key.shape[-1], value.shape[-1]], dim=-1)
        # [b, heads, seq, hn]; K and V heads repeated for their query groups, as Megatron's
        # DotProductAttention does (so CUDA can use its memory-efficient masked kernel).
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _mask(self, s, world, rank, device, cu_seqlens=None, per_document=False):
        """``[s, world * s]``: which of all ranks' keys (in rank order) each local query sees."""
        if cu_seqlens is None:
            positions = torch.arange(world * s, device=device)
            mine = [self.layout.shard(positions, r, world, dim=0) for r in range(world)] if world > 1 else [positions]
            return torch.cat(mine) <= mine[rank][:, None]
        try:
            packing = Packing.cached(cu_seqlens, self.layout, world, rank, s, per_document, device)
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        order, _, sizes = packing.gathered
        document = torch.searchsorted(packing.documents, order, right=True)
        me = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
        return (order <= order[me, None]) & (document == document[me, None])
