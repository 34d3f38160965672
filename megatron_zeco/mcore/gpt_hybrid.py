"""Hybrid models: GLA layers and softmax-attention layers in one stack, chosen by a layer pattern.

A pattern is a string of Megatron's hybrid-model layer symbols, ``G`` for a GLA layer
and ``*`` for a softmax-attention layer, repeated over the depth: layer n (1-based,
counted over the whole model, all pipeline stages) is ``pattern[(n - 1) % len(pattern)]``.
``GGG*`` makes layers 4, 8, 12, ... softmax attention and the rest GLA.

:class:`HybridTransformerLayer` is one ``ModuleSpec`` for every layer (so it passes
through ``pretrain_gpt.py --spec`` and Megatron's per-stage fan-out unchanged); each
layer builds the GLA or the softmax TransformerLayer by its global layer number.

Megatron-Core's own ``HybridModel`` (megatron-core >= 0.19) takes the pattern itself
(``--hybrid-layer-pattern``, one layer per symbol, MLPs as layers of their own):
see megatron_zeco.mcore.hybrid_stack. Its GLA and softmax layers are :class:`HybridMixerLayer`.
"""

from dataclasses import dataclass

from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)
from megatron.core.utils import get_pg_rank

from ..comm import Layout, as_layout
from .attention import AllGatherDotProductAttention
from .common import check_packed_split, packed_arguments

GLA, ATTENTION = "G", "*"


def check_pattern(pattern: str):
    """ValueError unless ``pattern`` is a non-empty string of layer symbols."""
    if not isinstance(pattern, str) or not pattern or set(pattern) - {GLA, ATTENTION}:
        raise ValueError(f"hybrid layer pattern {pattern!r}: use the symbols {GLA!r} (GLA) and {ATTENTION!r} "
                         f"(softmax attention), e.g. 'GGG*'")


def layer_kinds(pattern: str, num_layers: int) -> str:
    """The symbol of each of ``num_layers`` layers: ``pattern`` repeated."""
    check_pattern(pattern)
    if len(pattern) > num_layers:
        raise ValueError(f"hybrid layer pattern {pattern!r} is longer than --num-layers ({num_layers})")
    return (pattern * num_layers)[:num_layers]


@dataclass
class HybridLayerSubmodules:
    """The two layer kinds of a hybrid model."""

    gla: TransformerLayerSubmodules
    attention: TransformerLayerSubmodules


class HybridMixerLayer(TransformerLayer):
    """A TransformerLayer of a model that mixes GLA and softmax-attention layers under one CP split.

    Args:
        config, submodules, layer_number, pg_collection, **kwargs: as TransformerLayer.
        kind: ``G`` (the token mixer is GLA) or ``*`` (causal softmax self-attention).
        cp_layout: the CP layout of the hidden states (``zigzag`` or ``contiguous``).
        cp_packed_split: how packed batches are split over CP (as the GLA layers').

    Rotary embeddings reach only the softmax layers (GLA layers carry no positions).
    Megatron-Core splits them over CP in its zigzag order, and those of packed batches
    document by document, so under a contiguous layout, or for packed batches split as a
    whole sequence, with CP > 1 they are refused rather than applied at the wrong positions.
    The layers of Megatron's ``HybridModel`` stack (``megatron_zeco.mcore.hybrid_stack``) are of this
    class, their kind fixed by the stack's slot.
    """

    def __init__(self, config, submodules: TransformerLayerSubmodules, layer_number: int = 1, kind: str = GLA,
                 cp_layout: str = "zigzag", cp_packed_split: str = "auto", **kwargs):
        if kind not in (GLA, ATTENTION):
            raise ValueError(f"{type(self).__name__}: kind {kind!r} is not {GLA!r} (GLA) or {ATTENTION!r} "
                             f"(softmax attention)")
        super().__init__(config, submodules, layer_number=layer_number, **kwargs)
        self.kind = kind
        self.cp_layout = as_layout(cp_layout)
        check_packed_split(cp_packed_split, type(self).__name__)
        self.cp_packed_split = cp_packed_split

    def forward(self, *args, **kwargs):
        if self.kind == GLA:
            kwargs["rotary_pos_emb"] = None
        elif self.pg_collection.cp.size() > 1:
            self._check_softmax_inputs(kwargs.get("rotary_pos_emb") is not None, kwargs.get("packed_seq_params"))
        return super().forward(*args, **kwargs)

    def _check_softmax_inputs(self, rotary: bool, packed_seq_params):
        """Under CP: refuse what Megatron's softmax layer would compute at the wrong positions."""
        if rotary and self.cp_layout is Layout.CONTIGUOUS:
            raise ValueError("hybrid model: rotary embeddings under context parallelism need the zigzag layout "
                             "(Megatron-Core splits them zigzag); use cp_layout='zigzag' or "
                             "--position-embedding-type none")
        packed = packed_arguments(packed_seq_params, self.cp_packed_split, "hybrid model")
        if not packed or packed["per_document"]:
            return
        if rotary:
            raise ValueError("hybrid model: rotary embeddings of packed batches under context parallelism follow "
                             "Megatron's per-document split, not this whole-sequence split (cp_packed_split "
                             "'sequence', or --dataloader-inter-document-masking); use --position-embedding-type "
                             "none, or split per document (cp_packed_split='document', --sft)")
        if not isinstance(self.self_attention.core_attention, AllGatherDotProductAttention):
            raise ValueError("hybrid model: TransformerEngine's attention takes packed batches under context "
                             "parallelism in Megatron's per-document split only; use cp_packed_split='document' "
                             "(--sft), or a spec without TransformerEngine (hybrid_local_spec, "
                             "hybrid_stack_local_spec)")


class HybridTransformerLayer(HybridMixerLayer):
    """A :class:`HybridMixerLayer` built as GLA or softmax attention by its global layer number
    (the layer spec of a hybrid ``GPTModel``).

    Args:
        config, layer_number, pg_collection, vp_stage, **kwargs: as TransformerLayer.
        submodules: the GLA layer's and the softmax layer's submodules.
        pattern: layer symbols (see the module docstring).
        cp_layout, cp_packed_split: as :class:`HybridMixerLayer`.
    """

    def __init__(self, config, submodules: HybridLayerSubmodules, layer_number: int = 1, pattern: str = "GGG*",
                 cp_layout: str = "zigzag", cp_packed_split: str = "auto", pg_collection=None, vp_stage=None,
                 **kwargs):
        kinds = layer_kinds(pattern, config.num_layers)
        # TransformerLayer's own rule for the global number (it adds the stage offset unless told not to).
        offset = 0 if kwargs.get("is_mtp_layer") or not kwargs.get("add_layer_offset", True) else \
            get_transformer_layer_offset(config, vp_stage, get_pg_rank(pg_collection.pp) if pg_collection else None)
        kind = kinds[layer_number + offset - 1]
        super().__init__(config, submodules.gla if kind == GLA else submodules.attention, layer_number=layer_number,
                         kind=kind, cp_layout=cp_layout, cp_packed_split=cp_packed_split,
                         pg_collection=pg_collection, vp_stage=vp_stage, **kwargs)
        if self.layer_number != layer_number + offset:  # a future Megatron-Core numbering layers otherwise
            raise RuntimeError(f"HybridTransformerLayer: layer {self.layer_number} was built as layer "
                               f"{layer_number + offset} of pattern {pattern!r}")
