"""Layer specs: Megatron's GPT layer with its self-attention replaced by a ZeCO token mixer (GLA or
KDA), and HybridModel stacks whose ``G`` layers are GLA, Megatron-Core's Gated DeltaNet or KDA under ZeCO.

For ``pretrain_gpt.py --spec megatron_zeco.specs NAME`` (used as is, not called):

=========================  ================================================
NAME                       layer
=========================  ================================================
``gla_local_spec``         Megatron-Core linears, ZeCO CP (zigzag layout)
``gla_te_spec``            TransformerEngine linears and norms, ZeCO CP
``gla_local_<s>_spec``     local, CP strategy ``<s>`` in lasp1, lasp2, a2a
``gla_te_<s>_spec``        TE, CP strategy ``<s>``
``hybrid_local_spec``      GLA with softmax attention every 4th layer
                           (pattern ``GGG*``), Megatron-Core linears; the
                           softmax layers all-gather K/V over CP
``hybrid_te_spec``         the same with TE: the softmax layers are
                           Megatron's TE attention with its own CP
``gdn_local_spec``         Megatron-Core's Gated DeltaNet (megatron-core
                           >= 0.19) with ZeCO CP in every layer, local
``gdn_te_spec``            the same with TE
``gdn_hybrid_local_spec``  ``hybrid_local_spec`` with Gated DeltaNet for GLA
``kda_local_spec``         Kimi Delta Attention (KimiDeltaAttention) in
                           every layer, Megatron-Core linears, ZeCO CP
``kda_te_spec``            the same with TE
``kda_hybrid_local_spec``  ``hybrid_local_spec`` with KDA for GLA
``kda_hybrid_te_spec``     ``hybrid_te_spec`` with KDA for GLA
=========================  ================================================

For ``pretrain_hybrid.py --spec megatron_zeco.specs NAME --hybrid-layer-pattern ...``
(Megatron's ``HybridModel``, megatron-core >= 0.19; symbols ``G`` GLA, Gated DeltaNet or KDA,
``*`` softmax attention, ``-`` MLP, ``E`` MoE, ``|`` pipeline boundary; see
megatron_zeco.mcore.hybrid_stack):

======================================  =====================================
NAME                                    stack
======================================  =====================================
``hybrid_stack_local_spec``             ``G`` GLA; Megatron-Core linears and
                                        norms, ZeCO CP; ``*`` all-gathers K/V
                                        over CP
``hybrid_stack_local_<s>_spec``         the same, CP strategy ``<s>`` in
                                        lasp1, lasp2, a2a
``hybrid_stack_te_spec``                TE linears and norms, ZeCO CP; ``*``
                                        is TE's attention with its own CP
``gdn_hybrid_stack_local_spec``         ``G`` Megatron-Core's Gated DeltaNet
                                        with ZeCO CP (ZecoGatedDeltaNet);
                                        otherwise ``hybrid_stack_local_spec``
``gdn_hybrid_stack_local_<s>_spec``     the same, CP strategy ``<s>`` in
                                        lasp2, a2a
``gdn_hybrid_stack_te_spec``            ``G`` Gated DeltaNet, otherwise
                                        ``hybrid_stack_te_spec``
``kda_hybrid_stack_local_spec``         ``G`` Kimi Delta Attention with ZeCO
                                        CP; otherwise
                                        ``hybrid_stack_local_spec``
``kda_hybrid_stack_local_<s>_spec``     the same, CP strategy ``<s>`` in
                                        lasp2, a2a
``kda_hybrid_stack_te_spec``            ``G`` KDA, otherwise
                                        ``hybrid_stack_te_spec``
======================================  =====================================

In your own model code, call :func:`gla_layer_spec`, :func:`gdn_layer_spec`, :func:`kda_layer_spec`,
:func:`hybrid_layer_spec` or :func:`hybrid_stack_spec` (``mixer="gdn"`` for Gated DeltaNet, ``mixer="kda"``
for KDA) instead, and
``megatron_zeco.models.build_hybrid_model``. Everything but the token mixer (norms, MLP,
bias-dropout-add) is whatever Megatron's own GPT (or hybrid) spec of the installed version builds,
so the specs follow Megatron-Core releases.
"""

import functools
import importlib.util
from dataclasses import replace
from typing import Optional

from . import mixers
from .comm import Layout, as_layout
from .cp import registry
from .cp.config import CPConfig, config_of, split_keywords
from .mcore import optional_packages_unmentioned

with optional_packages_unmentioned():  # megatron-core's first import: no notices about Apex or TE
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .gla.layer import GatedLinearAttention, GatedLinearAttentionSubmodules
    from .kda.layer import KimiDeltaAttention, KimiDeltaAttentionSubmodules
    from .mcore.attention import AllGatherDotProductAttention
    from .mcore.common import check_conv_init, check_gate_timescales
    from .mcore.gpt_hybrid import (ATTENTION, GLA, HybridLayerSubmodules, HybridMixerLayer, HybridTransformerLayer,
                                   check_pattern)

    try:
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelLinear,
            TENorm,
            TERowParallelLinear,
        )
        import transformer_engine  # noqa: F401  (the extension module imports without TE)

        HAVE_TE = True
    except ImportError:
        HAVE_TE = False

# Megatron-Core's HybridModel (megatron/core/models/hybrid/) arrived in 0.19.
HAVE_HYBRID_MODEL = importlib.util.find_spec("megatron.core.models.hybrid") is not None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent is a module, not a package (megatron-core 0.16's gated_delta_net.py)
        return False


# The GatedDeltaNet that ZecoGatedDeltaNet subclasses (megatron/core/ssm/gated_delta_net/, 0.19).
HAVE_GDN_LAYER = _has_module("megatron.core.ssm.gated_delta_net.common")


class _TransformerEngineMissing:
    """Stands in for TE modules when TransformerEngine is not installed: fails at model build."""

    def __init__(self, *args, local_spec: str = "gla_local_spec", **kwargs):
        raise ImportError(
            "megatron_zeco: this layer spec uses TransformerEngine, which is not installed. "
            f"Install transformer-engine, or use --spec megatron_zeco.specs {local_spec} (or use_te=False)."
        )


class _GatedDeltaNetMissing:
    """Stands in for the Gated DeltaNet layer on megatron-core < 0.19: fails at model build."""

    def __init__(self, *args, **kwargs):
        raise ImportError("megatron_zeco: the Gated DeltaNet layer (ZecoGatedDeltaNet) subclasses megatron-core "
                          "0.19's GatedDeltaNet (megatron.core.ssm.gated_delta_net, Python >= 3.12 wheels); this "
                          "megatron-core has none. Upgrade megatron-core, or use the GLA specs (gla_local_spec, "
                          "hybrid_stack_local_spec).")


class _HybridModelMissing:
    """Stands in for the hybrid stack on megatron-core < 0.19 (no HybridModel): fails at model build."""

    def __init__(self, *args, **kwargs):
        raise ImportError("megatron_zeco: HybridModel stacks need megatron-core >= 0.19 (Python >= 3.12); this "
                          "megatron-core has no megatron.core.models.hybrid. Upgrade megatron-core, or build a "
                          "GPTModel with --spec megatron_zeco.specs hybrid_local_spec (pretrain_gpt.py).")


def gla_layer_spec(
    use_te: bool = False,
    cp_config: Optional[CPConfig] = None,
    gate_low_rank_dim: int = 16,
    gate_timescales=None,
    normalization: Optional[str] = None,
    **cp_knobs,
) -> ModuleSpec:
    """TransformerLayer spec with the GLA token mixer.

    Args:
        use_te: TransformerEngine linears and norms (needs TE) or Megatron-Core's.
        cp_config: the layers' context parallelism (:class:`~megatron_zeco.cp.CPConfig`, operator ``gla``;
            used when ``--context-parallel-size`` > 1), or None to make it from ``cp_knobs``.
        gate_low_rank_dim: rank of GLA's forget-gate projection.
        gate_timescales: ``(shortest, longest)`` initial memory of the gate channels in
            tokens, or None for fla's zero gate bias (see GatedLinearAttention).
        normalization: passed to Megatron's local spec (``LayerNorm``/``RMSNorm``);
            TE norms follow ``--normalization`` by themselves.
        **cp_knobs: the CP knobs as keywords, when no ``cp_config`` is given: ``cp_strategy``
            (``zeco`` All-Scan, ``lasp2``, ``lasp1`` or ``a2a``), ``cp_layout`` (``zigzag``, Megatron's
            ``get_batch_on_this_cp_rank`` split, or ``contiguous``), ``cp_num_blocks``,
            ``cp_overlap_scan``, ``cp_transport`` (``auto``, ``peer_memory``, ``nvshmem``,
            ``send_recv``), ``cp_piece_split``, ``cp_packed_split`` (``document``: Megatron's THD
            split; ``sequence``: ``--dataloader-inter-document-masking``; ``auto``: from Megatron-LM's
            arguments), ``cp_node_size`` (see :class:`~megatron_zeco.gla.layer.GatedLinearAttention`).
    """
    params = dict(cp_config=_cp_config("gla", cp_config, cp_knobs, "gla_layer_spec"),
                  gate_low_rank_dim=gate_low_rank_dim, gate_timescales=gate_timescales)
    if use_te and not HAVE_TE:
        return ModuleSpec(module=_TransformerEngineMissing)
    if use_te:
        base = get_gpt_layer_with_transformer_engine_spec()
        column, row = TEColumnParallelLinear, TERowParallelLinear
        # TE's GPT spec fuses the input norm into linear_qkv; the GLA gate needs the normed
        # input too, so the norm stays a module of its own.
        extra = dict(input_layernorm=TENorm)
    else:
        base = get_gpt_layer_local_spec(normalization=normalization)
        column, row = ColumnParallelLinear, RowParallelLinear
        extra = {}
    mixer = ModuleSpec(
        module=GatedLinearAttention,
        params=params,
        submodules=GatedLinearAttentionSubmodules(in_proj=column, gate_up=column, out_proj=row),
    )
    # Checkpoint keys: the input norm is not fused into a linear_qkv here, so keep its own name.
    keys_map = {k: v for k, v in base.submodules.sharded_state_dict_keys_map.items() if k != "input_layernorm."}
    return replace(base, submodules=replace(base.submodules, self_attention=mixer,
                                            sharded_state_dict_keys_map=keys_map, **extra))


def gdn_layer_spec(
    use_te: bool = False,
    cp_config: Optional[CPConfig] = None,
    conv_init=None,
    gate_timescales=None,
    normalization: Optional[str] = None,
    **cp_knobs,
) -> ModuleSpec:
    """TransformerLayer spec (``GPTModel``) with Megatron-Core's Gated DeltaNet as token mixer, its
    context parallelism ZeCO's (:class:`~megatron_zeco.gated_delta_rule.layer.ZecoGatedDeltaNet`;
    megatron-core >= 0.19).

    Args:
        use_te: TransformerEngine linears and norms (the input norm fused into ``in_proj``, as in
            Megatron's spec) or Megatron-Core's (the input norm a module of its own, checkpointed
            under the fused name).
        cp_config: the layers' context parallelism (:class:`~megatron_zeco.cp.CPConfig`, operator
            ``gated_delta_rule``; used when ``--context-parallel-size`` > 1), or None to make it from
            ``cp_knobs``.
        conv_init: the short convolution's initial taps: None (Megatron's: ``nn.Conv1d``'s), a float
            (Megatron's ``conv_init``: uniform in ``+-conv_init``) or ``"identity"`` (see
            :func:`megatron_zeco.mcore.common.init_conv_taps`).
        gate_timescales: ``(shortest, longest)`` initial memory of the value heads' decays in tokens, or
            None for Megatron's initialisation (see ZecoGatedDeltaNet).
        normalization: passed to Megatron's local spec (``LayerNorm``/``RMSNorm``); TE norms follow
            ``--normalization`` by themselves.
        **cp_knobs: the CP knobs as keywords (``cp_strategy``: ``zeco``, ``lasp2`` or ``a2a``;
            ``cp_layout``, ``cp_num_blocks``, ``cp_transport``, ``cp_overlap_scan``,
            ``cp_packed_split``; see ZecoGatedDeltaNet).
    """
    config = _cp_config("gated_delta_rule", cp_config, cp_knobs, "gdn_layer_spec")
    check_conv_init(conv_init, "megatron_zeco.specs.gdn_layer_spec")
    check_gate_timescales(gate_timescales, "megatron_zeco.specs.gdn_layer_spec")
    if not HAVE_GDN_LAYER:
        return ModuleSpec(module=_GatedDeltaNetMissing)
    if use_te and not HAVE_TE:
        return ModuleSpec(module=_TransformerEngineMissing, params={"local_spec": "gdn_local_spec"})
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules

    from .gated_delta_rule.layer import ZecoGatedDeltaNet

    # Megatron's own initialisation unless a knob is given (Megatron's constructor takes conv_init too)
    knobs = dict(conv_init=conv_init, gate_timescales=gate_timescales)
    params = dict(cp_config=config, **{k: v for k, v in knobs.items() if v is not None})
    if use_te:  # Megatron's own submodules: the input norm fused into in_proj
        from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear

        base = get_gpt_layer_with_transformer_engine_spec()
        submodules = GatedDeltaNetSubmodules(in_proj=TELayerNormColumnParallelLinear, out_norm=TENorm,
                                             out_proj=TERowParallelLinear)
        layer = dict(input_layernorm=IdentityOp)
    else:  # the input norm a module of its own, checkpointed under the fused norm's key (as Megatron's
        # local GPT spec maps input_layernorm to linear_qkv's), so checkpoints load into either
        base = get_gpt_layer_local_spec(normalization=normalization)
        submodules = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=base.submodules.input_layernorm,
                                             out_proj=RowParallelLinear)
        layer = dict(sharded_state_dict_keys_map={**base.submodules.sharded_state_dict_keys_map,
                                                  "input_layernorm.": "self_attention.in_proj.layer_norm_"})
    mixer = ModuleSpec(module=ZecoGatedDeltaNet, params=params, submodules=submodules)
    return replace(base, submodules=replace(base.submodules, self_attention=mixer, **layer))


def kda_layer_spec(
    use_te: bool = False,
    cp_config: Optional[CPConfig] = None,
    conv_kernel_size: int = 4,
    conv_init=None,
    gate_timescales=None,
    normalization: Optional[str] = None,
    **cp_knobs,
) -> ModuleSpec:
    """TransformerLayer spec with Kimi Delta Attention as token mixer
    (:class:`~megatron_zeco.kda.layer.KimiDeltaAttention`).

    Args:
        use_te: TransformerEngine linears and norms (needs TE) or Megatron-Core's.
        cp_config: the layers' context parallelism (:class:`~megatron_zeco.cp.CPConfig`, operator ``kda``;
            used when ``--context-parallel-size`` > 1), or None to make it from ``cp_knobs``.
        conv_kernel_size: the short convolution's width.
        conv_init: the short convolution's initial taps: None (``nn.Conv1d``'s, as fla's layer), a float
            (uniform in ``+-conv_init``) or ``"identity"`` (see KimiDeltaAttention).
        gate_timescales: ``(shortest, longest)`` initial memory of the forget-gate channels in tokens,
            or None for fla's KDA models' initialisation (see KimiDeltaAttention).
        normalization: passed to Megatron's local spec (``LayerNorm``/``RMSNorm``); TE norms follow
            ``--normalization`` by themselves.
        **cp_knobs: the CP knobs as keywords (``cp_strategy``: ``zeco``, ``lasp2`` or ``a2a``;
            ``cp_layout``, ``cp_num_blocks``, ``cp_transport``, ``cp_overlap_scan``, ``cp_packed_split``).
    """
    check_conv_init(conv_init, "megatron_zeco.specs.kda_layer_spec")
    check_gate_timescales(gate_timescales, "megatron_zeco.specs.kda_layer_spec")
    params = dict(cp_config=_cp_config("kda", cp_config, cp_knobs, "kda_layer_spec"),
                  conv_kernel_size=conv_kernel_size, conv_init=conv_init, gate_timescales=gate_timescales)
    if use_te and not HAVE_TE:
        return ModuleSpec(module=_TransformerEngineMissing, params={"local_spec": "kda_local_spec"})
    if use_te:
        base = get_gpt_layer_with_transformer_engine_spec()
        column, row = TEColumnParallelLinear, TERowParallelLinear
        extra = dict(input_layernorm=TENorm)  # the gates read the normed input too: a norm of its own
    else:
        base = get_gpt_layer_local_spec(normalization=normalization)
        column, row = ColumnParallelLinear, RowParallelLinear
        extra = {}
    mixer = ModuleSpec(module=KimiDeltaAttention, params=params, submodules=KimiDeltaAttentionSubmodules(
        in_proj=column, gate_up=column, out_gate_up=column, out_proj=row))
    keys_map = {k: v for k, v in base.submodules.sharded_state_dict_keys_map.items() if k != "input_layernorm."}
    return replace(base, submodules=replace(base.submodules, self_attention=mixer,
                                            sharded_state_dict_keys_map=keys_map, **extra))


def softmax_layer_spec(use_te: bool = False, cp_layout: str = "zigzag", cp_packed_split: str = "auto",
                       normalization: Optional[str] = None) -> ModuleSpec:
    """Megatron's GPT TransformerLayer spec (causal softmax self-attention) that runs under CP.

    With TE it is Megatron's own TE spec: TEDotProductAttention does context parallelism
    itself (``--cp-comm-type``), on Megatron's zigzag split only. Without TE, Megatron's local
    spec with :class:`~megatron_zeco.mcore.attention.AllGatherDotProductAttention` as core attention
    (Megatron's DotProductAttention refuses CP), for either layout and, for packed batches,
    either packed split (``cp_packed_split``, as the GLA layers').
    """
    layout = as_layout(cp_layout)
    if use_te:
        if layout is not Layout.ZIGZAG:
            raise ValueError("softmax layers with TransformerEngine: TE's context parallelism takes Megatron's "
                             "zigzag split only; use cp_layout='zigzag' or use_te=False")
        if not HAVE_TE:
            return ModuleSpec(module=_TransformerEngineMissing, params={"local_spec": "hybrid_local_spec"})
        return get_gpt_layer_with_transformer_engine_spec()
    base = get_gpt_layer_local_spec(normalization=normalization)
    attention = base.submodules.self_attention
    core = functools.partial(AllGatherDotProductAttention, cp_layout=layout.value, cp_packed_split=cp_packed_split)
    attention = replace(attention, submodules=replace(attention.submodules, core_attention=core))
    return replace(base, submodules=replace(base.submodules, self_attention=attention))


def hybrid_layer_spec(
    pattern: str = "GGG*",
    use_te: bool = False,
    mixer: str = "gla",
    cp_config: Optional[CPConfig] = None,
    gate_low_rank_dim: int = 16,
    gate_timescales=None,
    conv_init=None,
    normalization: Optional[str] = None,
    **cp_knobs,
) -> ModuleSpec:
    """Layer spec of a hybrid model: linear-attention layers (``mixer``) and causal softmax-attention layers
    by ``pattern``.

    Args:
        pattern: ``G`` (the mixer) and ``*`` (softmax attention), repeated over the layers: layer n
            (1-based, over all pipeline stages) is ``pattern[(n - 1) % len(pattern)]``, so
            ``GGG*`` puts softmax attention at layers 4, 8, ... (see megatron_zeco.mcore.gpt_hybrid).
        use_te: TransformerEngine linears, norms and attention (:func:`softmax_layer_spec`).
        mixer: ``gla``, ``gdn`` or ``kda``: the ``G`` layers are GLA (:func:`gla_layer_spec`), Megatron-Core's
            Gated DeltaNet under ZeCO (:func:`gdn_layer_spec`) or KDA (:func:`kda_layer_spec`).
        cp_config, **cp_knobs: the ``G`` layers' context parallelism (as :func:`gla_layer_spec`,
            :func:`gdn_layer_spec` or :func:`kda_layer_spec` take it); its layout and packed split are the softmax layers' too
            (TE's attention takes ``zigzag`` only).
        gate_low_rank_dim, gate_timescales, conv_init: the mixer's initialisation knobs, each given only
            where the mixer has it (``megatron_zeco.mixers.KNOBS``): ``gate_timescales`` every mixer's,
            ``gate_low_rank_dim`` GLA's, ``conv_init`` Gated DeltaNet's and KDA's.
        normalization: as in :func:`gla_layer_spec`.

    Softmax layers take Megatron's rotary embeddings (``--position-embedding-type rope``,
    zigzag layout under CP; for packed batches under CP the per-document split) or none;
    the ``G`` layers ignore them. Packed batches attend within each document.
    """
    check_pattern(pattern)  # its length is checked against --num-layers when the layers are built
    _check_mixer(mixer)
    config = _cp_config(mixers.OPERATORS[mixer], cp_config, cp_knobs, "hybrid_layer_spec")
    cp_layout, cp_packed_split = config.layout.value, config.packed_split
    attention = softmax_layer_spec(use_te=use_te, cp_layout=cp_layout, cp_packed_split=cp_packed_split,
                                   normalization=normalization)
    if use_te and not HAVE_TE:
        return attention  # fails at build, naming hybrid_local_spec
    mixer_layer = _g_layer_spec(mixer, config, use_te=use_te, gate_low_rank_dim=gate_low_rank_dim,
                                gate_timescales=gate_timescales, conv_init=conv_init, normalization=normalization)
    if mixer_layer.submodules is None:
        return mixer_layer  # a stand-in that fails at build, naming the megatron-core to install
    return ModuleSpec(module=HybridTransformerLayer,
                      params={"pattern": pattern, "cp_layout": cp_layout, "cp_packed_split": cp_packed_split},
                      submodules=HybridLayerSubmodules(gla=mixer_layer.submodules, attention=attention.submodules))


def _mixer_only(submodules, keys_map: dict):
    """A TransformerLayer's norm, token mixer and bias-dropout-add without its MLP: HybridModel's
    ``G`` and ``*`` layers (the MLP is a layer of its own, ``-``)."""
    return replace(submodules, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp,
                   sharded_state_dict_keys_map=keys_map)


def hybrid_stack_spec(
    use_te: bool = False,
    mixer: str = "gla",
    cp_config: Optional[CPConfig] = None,
    gate_low_rank_dim: int = 16,
    gate_timescales=None,
    conv_init=None,
    normalization: Optional[str] = None,
    **cp_knobs,
) -> ModuleSpec:
    """``HybridStack`` spec of Megatron-Core's ``HybridModel`` (megatron-core >= 0.19) with GLA, Gated
    DeltaNet or KDA layers.

    The layers are ``--hybrid-layer-pattern``'s symbols: ``G`` the GLA token mixer, Gated DeltaNet or KDA
    (``mixer``; Megatron's ``gdn_layer`` slot), ``*`` causal softmax self-attention, ``-`` MLP, ``E`` MoE; each a norm,
    the module and the residual, as in Megatron's ``hybrid_stack_spec``. All layers share the CP
    split. See megatron_zeco.mcore.hybrid_stack.

    Args:
        use_te: TransformerEngine linears and norms, ``*`` TE's attention with its own CP, and
            Megatron's own other slots (``M``, ``D``, ``+``); or Megatron-Core's linears and norms,
            ``*`` :class:`~megatron_zeco.mcore.attention.AllGatherDotProductAttention` (any device).
        mixer: ``gla``; ``gdn``: the ``G`` layers are Megatron-Core's Gated DeltaNet
            (``gdn_layer``, Megatron's own layer and parameters) with ZeCO's context parallelism
            (:class:`~megatron_zeco.gated_delta_rule.layer.ZecoGatedDeltaNet`); ``kda``: Kimi Delta Attention
            (:class:`~megatron_zeco.kda.layer.KimiDeltaAttention`).
        cp_config, **cp_knobs: the ``G`` layers' context parallelism (as :func:`gla_layer_spec`,
            :func:`gdn_layer_spec` or :func:`kda_layer_spec` take it); its layout and packed split are every layer's (TE's
            attention takes ``zigzag``, Megatron's ``get_batch_on_this_cp_rank`` split, only).
        gate_low_rank_dim, gate_timescales, conv_init: the mixer's initialisation knobs, each given only
            where the mixer has it (``megatron_zeco.mixers.KNOBS``): ``gate_timescales`` every mixer's,
            ``gate_low_rank_dim`` GLA's, ``conv_init`` Gated DeltaNet's and KDA's.
        normalization: passed to Megatron's local spec (``LayerNorm``/``RMSNorm``);
            TE norms follow ``--normalization`` by themselves.

    Softmax layers take Megatron's rotary embeddings (``--position-embedding-type rope``: under
    CP the zigzag layout, and for packed batches the per-document split) or none; GLA and Gated
    DeltaNet layers ignore them.
    """
    _check_mixer(mixer)
    config = _cp_config(mixers.OPERATORS[mixer], cp_config, cp_knobs, "hybrid_stack_spec")
    if not HAVE_HYBRID_MODEL:
        return ModuleSpec(module=_HybridModelMissing)
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayerSubmodules

    from .mcore.hybrid_stack import ZecoHybridStack, ZecoHybridStackSubmodules

    cp_layout, cp_packed_split = config.layout.value, config.packed_split
    attention = softmax_layer_spec(use_te=use_te, cp_layout=cp_layout, cp_packed_split=cp_packed_split,
                                   normalization=normalization)  # checks TE against the layout
    if use_te and not HAVE_TE:
        local_spec = {"gla": "hybrid_stack_local_spec"}.get(mixer, f"{mixer}_hybrid_stack_local_spec")
        return ModuleSpec(module=_TransformerEngineMissing, params={"local_spec": local_spec})
    layer_params = dict(cp_layout=cp_layout, cp_packed_split=cp_packed_split)
    mixer_layer = _g_layer_spec(mixer, config, use_te=use_te, gate_low_rank_dim=gate_low_rank_dim,
                                gate_timescales=gate_timescales, conv_init=conv_init, normalization=normalization)
    if mixer_layer.submodules is None:
        return mixer_layer  # a stand-in that fails at build, naming the megatron-core to install
    # The G layer without its MLP. Its input norm keeps the checkpoint key of the GPT layer it comes
    # from: GLA's is a module of its own with and without TE (its gate reads the normed input too);
    # Gated DeltaNet's is fused into in_proj with TE, and stored under the fused name without.
    keys = {k: v for k, v in mixer_layer.submodules.sharded_state_dict_keys_map.items() if k == "input_layernorm."}
    g_layer = ModuleSpec(module=HybridMixerLayer, params={"kind": GLA, **layer_params},
                         submodules=_mixer_only(mixer_layer.submodules, keys))
    if use_te:
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as megatron_stack

        theirs = megatron_stack.submodules
        attention_layer = replace(theirs.attention_layer, module=HybridMixerLayer,
                                  params={**theirs.attention_layer.params, "kind": ATTENTION, **layer_params})
        slots = {name: getattr(theirs, name) for name in theirs.__dataclass_fields__}
        return ModuleSpec(module=ZecoHybridStack, submodules=ZecoHybridStackSubmodules(
            **{**slots, "gdn_layer": g_layer, "attention_layer": attention_layer, "final_norm": TENorm}))
    # Megatron-Core's local layer: its norm, MLP, MoE; checkpoint keys mapped to the TE stack's
    # fused norms (linear_qkv's, linear_fc1's), as Megatron's local GPT spec does.
    local = get_gpt_layer_local_spec(normalization=normalization).submodules
    keys = local.sharded_state_dict_keys_map
    attention_layer = ModuleSpec(module=HybridMixerLayer, params={"kind": ATTENTION, **layer_params},
                                 submodules=_mixer_only(attention.submodules, {
                                     k: v for k, v in keys.items() if k == "input_layernorm."}))
    mlp_keys = {k: v for k, v in keys.items() if k == "pre_mlp_layernorm."}
    mlp_layer = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=local.pre_mlp_layernorm, mlp=local.mlp, mlp_bda=local.mlp_bda,
        sharded_state_dict_keys_map=mlp_keys))
    # The expert count comes from --num-experts; the spec only needs it to pick the MoE module.
    moe = get_gpt_layer_local_spec(num_experts=8, normalization=normalization).submodules
    moe_layer = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=moe.mlp_bda))
    return ModuleSpec(module=ZecoHybridStack, submodules=ZecoHybridStackSubmodules(
        gdn_layer=g_layer, attention_layer=attention_layer, mlp_layer=mlp_layer, moe_layer=moe_layer,
        final_norm=local.input_layernorm))


def _cp_config(operator: str, config: Optional[CPConfig], knobs: dict, who: str) -> CPConfig:
    """The CPConfig a spec function gives its layers: ``config``, or one from its ``cp_*`` keywords."""
    cp_knobs, rest = split_keywords(knobs)
    if rest:
        raise TypeError(f"{who}() got unexpected keyword arguments {', '.join(map(repr, rest))}")
    return config_of(operator, config, cp_knobs, f"megatron_zeco.specs.{who}")


def _g_layer_spec(mixer: str, config: CPConfig, use_te: bool, normalization: Optional[str], **knobs) -> ModuleSpec:
    """The GPT layer spec whose norm and token mixer the ``G`` layers take: the registered mixer's layer spec
    builder's (``cp.registry.Mixer.layer_spec``: :func:`gla_layer_spec`, :func:`gdn_layer_spec`,
    :func:`kda_layer_spec`, ...), given the mixer's knobs (``mixers.KNOBS``). A knob of another mixer set
    away from its default is an error, not ignored."""
    mine = {name: knobs.pop(name) for name in mixers.KNOBS[mixer]}
    changed = [name for name, value in knobs.items() if value != mixers.KNOB_DEFAULTS[name]]
    if changed:
        owners = ", ".join(f"{n} applies to {mixers.owners(n)} layers only" for n in changed)
        defaults = ", ".join(f"{n}={mixers.KNOB_DEFAULTS[n]!r}" for n in changed)
        raise ValueError(f"megatron_zeco.specs: {owners}; for {mixers.NAMES[mixer]} (mixer={mixer!r}) keep the "
                         f"default{'s' if len(changed) > 1 else ''} ({defaults})")
    return registry.mixer(mixer).build_layer_spec(use_te=use_te, cp_config=config, normalization=normalization,
                                                  **mine)


def _check_mixer(mixer: str) -> None:
    if mixer not in mixers.OPERATORS:
        raise ValueError(f"megatron_zeco.specs: mixer {mixer!r} is not one of {', '.join(mixers.OPERATORS)} "
                         "(the mixers megatron_zeco.cp.registry holds)")


gla_local_spec = gla_layer_spec(use_te=False)
gla_te_spec = gla_layer_spec(use_te=True)
gla_local_lasp1_spec = gla_layer_spec(use_te=False, cp_strategy="lasp1")
gla_local_lasp2_spec = gla_layer_spec(use_te=False, cp_strategy="lasp2")
gla_local_a2a_spec = gla_layer_spec(use_te=False, cp_strategy="a2a")
gla_te_lasp1_spec = gla_layer_spec(use_te=True, cp_strategy="lasp1")
gla_te_lasp2_spec = gla_layer_spec(use_te=True, cp_strategy="lasp2")
gla_te_a2a_spec = gla_layer_spec(use_te=True, cp_strategy="a2a")
hybrid_local_spec = hybrid_layer_spec(use_te=False)
hybrid_te_spec = hybrid_layer_spec(use_te=True)
hybrid_stack_local_spec = hybrid_stack_spec(use_te=False)
hybrid_stack_local_lasp1_spec = hybrid_stack_spec(use_te=False, cp_strategy="lasp1")
hybrid_stack_local_lasp2_spec = hybrid_stack_spec(use_te=False, cp_strategy="lasp2")
hybrid_stack_local_a2a_spec = hybrid_stack_spec(use_te=False, cp_strategy="a2a")
hybrid_stack_te_spec = hybrid_stack_spec(use_te=True)
gdn_local_spec = gdn_layer_spec(use_te=False)
gdn_te_spec = gdn_layer_spec(use_te=True)
gdn_hybrid_local_spec = hybrid_layer_spec(use_te=False, mixer="gdn")
gdn_hybrid_stack_local_spec = hybrid_stack_spec(use_te=False, mixer="gdn")
gdn_hybrid_stack_local_lasp2_spec = hybrid_stack_spec(use_te=False, mixer="gdn", cp_strategy="lasp2")
gdn_hybrid_stack_local_a2a_spec = hybrid_stack_spec(use_te=False, mixer="gdn", cp_strategy="a2a")
gdn_hybrid_stack_te_spec = hybrid_stack_spec(use_te=True, mixer="gdn")
kda_local_spec = kda_layer_spec(use_te=False)
kda_te_spec = kda_layer_spec(use_te=True)
kda_hybrid_local_spec = hybrid_layer_spec(use_te=False, mixer="kda")
kda_hybrid_te_spec = hybrid_layer_spec(use_te=True, mixer="kda")
kda_hybrid_stack_local_spec = hybrid_stack_spec(use_te=False, mixer="kda")
kda_hybrid_stack_local_lasp2_spec = hybrid_stack_spec(use_te=False, mixer="kda", cp_strategy="lasp2")
kda_hybrid_stack_local_a2a_spec = hybrid_stack_spec(use_te=False, mixer="kda", cp_strategy="a2a")
kda_hybrid_stack_te_spec = hybrid_stack_spec(use_te=True, mixer="kda")
