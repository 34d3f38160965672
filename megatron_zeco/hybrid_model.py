"""Megatron-Core's ``HybridModel`` (megatron-core >= 0.19) with this package's GLA or Gated DeltaNet layers.

``HybridModel`` builds its decoder from a ``HybridStack`` spec and ``--hybrid-layer-pattern``:
one layer per symbol, ``|`` between pipeline segments. ``megatron_zeco.specs.hybrid_stack_spec``
fills the slots this package provides, under one context-parallel (CP) split:

======  =================  ==================================================================
symbol  slot               layer
======  =================  ==================================================================
``G``   ``gdn_layer``      norm + the ZeCO GLA token mixer (Megatron's slot for the gated
                           linear-recurrent family), or with ``hybrid_stack_spec(mixer="gdn")``
                           Megatron's own Gated DeltaNet layer with ZeCO's CP
                           (:class:`~megatron_zeco.gated_deltanet.ZecoGatedDeltaNet`)
``*``   ``attention_layer`` norm + causal softmax self-attention: TransformerEngine's with its
                           own CP, or without TE this package's ``AllGatherDotProductAttention``
``-``   ``mlp_layer``      norm + MLP (Megatron's)
``E``   ``moe_layer``      norm + mixture of experts (Megatron's)
======  =================  ==================================================================

With TransformerEngine the other slots (``M`` Mamba, ``D`` DSA, ``+`` MLA) are Megatron's own;
without it they are empty and :class:`GLAHybridStack` refuses their symbols.

Megatron's ``HybridStack`` builds its final norm as ``TENorm`` whatever the spec says, so
without TransformerEngine no ``HybridModel`` can be built. :class:`GLAHybridStack` builds it
from the spec instead (``GLAHybridStackSubmodules.final_norm``): ``TENorm`` in the TE spec,
Megatron-Core's own norm in the local one. Everything else is ``HybridStack``'s.
"""

from dataclasses import dataclass
from typing import Optional, Union

from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

# The slot of each layer symbol, as HybridStack reads them.
SLOTS = {Symbols.MAMBA: ("mamba_layer", "Mamba"), Symbols.GDN: ("gdn_layer", "GLA"),
         Symbols.ATTENTION: ("attention_layer", "softmax attention"), Symbols.DS_ATTENTION: ("dsa_layer", "DSA"),
         Symbols.MLA: ("mla_layer", "MLA"), Symbols.MLP: ("mlp_layer", "MLP"), Symbols.MOE: ("moe_layer", "MoE")}


@dataclass
class GLAHybridStackSubmodules(HybridStackSubmodules):
    """``HybridStackSubmodules`` and the final norm (``TENorm`` in Megatron's stack, unconditionally)."""

    final_norm: Optional[Union[ModuleSpec, type]] = None


class GLAHybridStack(HybridStack):
    """``HybridStack`` with its final norm built from ``submodules.final_norm``, so that it builds
    without TransformerEngine; a pattern symbol whose slot the spec leaves empty is refused.

    Args: as ``HybridStack`` (``submodules``: :class:`GLAHybridStackSubmodules`).
    """

    def __init__(self, config, submodules: GLAHybridStackSubmodules, *args, layer_type_list=None,
                 post_layer_norm: bool = True, **kwargs):
        for symbol in dict.fromkeys(layer_type_list or ()):
            slot, name = SLOTS.get(symbol, (None, None))
            if slot is not None and getattr(submodules, slot) is IdentityOp:
                provided = ", ".join(f"{s!r} ({_layer_name(submodules, sl, n)})" for s, (sl, n) in SLOTS.items()
                                     if getattr(submodules, sl) is not IdentityOp)
                raise ValueError(f"--hybrid-layer-pattern: this stack spec has no {name} layer for {symbol!r}; "
                                 f"its symbols are {provided}")
        # HybridStack would build TENorm; it builds no final norm when told not to, and its forward
        # applies self.final_norm whenever post_process and post_layer_norm are set.
        super().__init__(config, submodules, *args, layer_type_list=layer_type_list, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and self.post_layer_norm:
            if submodules.final_norm is None:
                raise ValueError("GLAHybridStack: its submodules give no final_norm (TENorm with TransformerEngine, "
                                 "else megatron.core.transformer.torch_norm.WrappedTorchNorm)")
            self.final_norm = build_module(submodules.final_norm, config=self.config,
                                           hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)


def _layer_name(submodules, slot: str, name: str) -> str:
    """What a slot's layer is, for messages: ``G`` is GLA or Gated DeltaNet by its token mixer."""
    mixer = getattr(getattr(getattr(submodules, slot), "submodules", None), "self_attention", None)
    return "Gated DeltaNet" if "DeltaNet" in getattr(getattr(mixer, "module", None), "__name__", "") else name


def build_hybrid_model(config, hybrid_layer_pattern: str, vocab_size: int, max_sequence_length: int,
                       stack_spec: Optional[ModuleSpec] = None, pg_collection=None, vp_stage: Optional[int] = None,
                       **kwargs) -> HybridModel:
    """A ``HybridModel`` of this package's layers, for this rank's pipeline stage.

    Args:
        config: the model's TransformerConfig; ``num_layers`` must be the pattern's layer count
            (Megatron-LM sets it so from ``--hybrid-layer-pattern``).
        hybrid_layer_pattern: ``G`` GLA (or Gated DeltaNet, by the stack spec), ``*`` softmax attention,
            ``-`` MLP, ``E`` MoE, ``|`` between pipeline segments (their number a multiple of the
            pipeline size); e.g. ``G-G*-``.
        vocab_size, max_sequence_length: as HybridModel.
        stack_spec: a ``megatron_zeco.specs.hybrid_stack_spec(...)``; None for its defaults
            (GLA, Megatron-Core linears, ZeCO, zigzag layout).
        pg_collection: Megatron's process groups; None for ``parallel_state``'s.
        vp_stage: the virtual pipeline stage this model chunk is.
        **kwargs: HybridModel's other arguments (``position_embedding_type``, default ``none``;
            ``pre_process`` and ``post_process`` default to whether this is the first and the
            last pipeline stage).
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    from .specs import hybrid_stack_spec

    main = parse_hybrid_pattern(hybrid_layer_pattern).main_pattern or ""
    layers = len(main.replace(Symbols.PIPE, ""))
    if config.num_layers != layers:
        raise ValueError(f"hybrid layer pattern {hybrid_layer_pattern!r} has {layers} layers but the config's "
                         f"num_layers (--num-layers) is {config.num_layers}; make them equal")
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    # The segment this chunk builds, as HybridModel picks it (select_pipeline_segment): segment
    # vp_stage x PP + pp_rank of the '|'-separated ones; without '|', this rank's share of the layers.
    pp_rank, pp_size = pg_collection.pp.rank(), pg_collection.pp.size()
    segments = main.count(Symbols.PIPE) + 1
    index, last = ((vp_stage or 0) * pp_size + pp_rank, segments - 1) if segments > 1 else (pp_rank, pp_size - 1)
    kwargs.setdefault("pre_process", index == 0)
    kwargs.setdefault("post_process", index == last)
    kwargs.setdefault("position_embedding_type", "none")
    return HybridModel(config=config, hybrid_stack_spec=stack_spec or hybrid_stack_spec(), vocab_size=vocab_size,
                       max_sequence_length=max_sequence_length, hybrid_layer_pattern=hybrid_layer_pattern,
                       pg_collection=pg_collection, vp_stage=vp_stage, **kwargs)
