"""Megatron-Core's ``HybridModel`` (megatron-core >= 0.19) with this package's GLA, Gated DeltaNet or KDA layers.

``HybridModel`` builds its decoder from a ``HybridStack`` spec and ``--hybrid-layer-pattern``:
one layer per symbol, ``|`` between pipeline segments. ``megatron_zeco.specs.hybrid_stack_spec``
fills the slots this package provides, under one context-parallel (CP) split:

======  =================  ==================================================================
symbol  slot               layer
======  =================  ==================================================================
``G``   ``gdn_layer``      norm + the ZeCO GLA token mixer (Megatron's slot for the gated
                           linear-recurrent family), or with ``hybrid_stack_spec(mixer="gdn")``
                           Megatron's own Gated DeltaNet layer with ZeCO's CP
                           (:class:`~megatron_zeco.gated_delta_rule.layer.ZecoGatedDeltaNet`), or with
                           ``mixer="kda"`` Kimi Delta Attention
                           (:class:`~megatron_zeco.kda.layer.KimiDeltaAttention`)
``*``   ``attention_layer`` norm + causal softmax self-attention: TransformerEngine's with its
                           own CP, or without TE this package's ``AllGatherDotProductAttention``
``-``   ``mlp_layer``      norm + MLP (Megatron's)
``E``   ``moe_layer``      norm + mixture of experts (Megatron's)
======  =================  ==================================================================

With TransformerEngine the other slots (``M`` Mamba, ``D`` DSA, ``+`` MLA) are Megatron's own;
without it they are empty and :class:`ZecoHybridStack` refuses their symbols.

Megatron's ``HybridStack`` builds its final norm as ``TENorm`` whatever the spec says, so
without TransformerEngine no ``HybridModel`` can be built. :class:`ZecoHybridStack` builds it
from the spec instead (``ZecoHybridStackSubmodules.final_norm``): ``TENorm`` in the TE spec,
Megatron-Core's own norm in the local one. Everything else is ``HybridStack``'s.
"""

from dataclasses import dataclass
from typing import Optional, Union

from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

# The slot of each layer symbol, as HybridStack reads them.
SLOTS = {Symbols.MAMBA: ("mamba_layer", "Mamba"), Symbols.GDN: ("gdn_layer", "GLA"),
         Symbols.ATTENTION: ("attention_layer", "softmax attention"), Symbols.DS_ATTENTION: ("dsa_layer", "DSA"),
         Symbols.MLA: ("mla_layer", "MLA"), Symbols.MLP: ("mlp_layer", "MLP"), Symbols.MOE: ("moe_layer", "MoE")}


@dataclass
class ZecoHybridStackSubmodules(HybridStackSubmodules):
    """``HybridStackSubmodules`` and the final norm (``TENorm`` in Megatron's stack, unconditionally)."""

    final_norm: Optional[Union[ModuleSpec, type]] = None


class ZecoHybridStack(HybridStack):
    """``HybridStack`` with its final norm built from ``submodules.final_norm``, so that it builds
    without TransformerEngine; a pattern symbol whose slot the spec leaves empty is refused.

    Args: as ``HybridStack`` (``submodules``: :class:`ZecoHybridStackSubmodules`).
    """

    def __init__(self, config, submodules: ZecoHybridStackSubmodules, *args, layer_type_list=None,
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
                raise ValueError("ZecoHybridStack: its submodules give no final_norm (TENorm with TransformerEngine, "
                                 "else megatron.core.transformer.torch_norm.WrappedTorchNorm)")
            self.final_norm = build_module(submodules.final_norm, config=self.config,
                                           hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)


def _layer_name(submodules, slot: str, name: str) -> str:
    """What a slot's layer is, for messages: ``G`` is GLA, Gated DeltaNet or KDA by its token mixer."""
    mixer = getattr(getattr(getattr(submodules, slot), "submodules", None), "self_attention", None)
    module = getattr(getattr(mixer, "module", None), "__name__", "")
    return {"ZecoGatedDeltaNet": "Gated DeltaNet", "KimiDeltaAttention": "KDA"}.get(module, name)

