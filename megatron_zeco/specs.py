"""Layer specs: Megatron's GPT layer with its self-attention replaced by the ZeCO GLA mixer.

For ``pretrain_gpt.py --spec megatron_zeco.specs NAME`` (used as is, not called):

=========================  ================================================
NAME                       layer
=========================  ================================================
``gla_local_spec``         Megatron-Core linears, ZeCO CP (zigzag layout)
``gla_te_spec``            TransformerEngine linears and norms, ZeCO CP
``gla_local_<s>_spec``     local, CP strategy ``<s>`` in lasp1, lasp2, a2a
``gla_te_<s>_spec``        TE, CP strategy ``<s>``
=========================  ================================================

In your own model code, call :func:`gla_layer_spec` instead. Everything but the
token mixer (norms, MLP, bias-dropout-add) is whatever Megatron's own GPT spec
of the installed version builds, so the specs follow Megatron-Core releases.
"""

from dataclasses import replace
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from .layer import GatedLinearAttention, GatedLinearAttentionSubmodules

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


class _TransformerEngineMissing:
    """Stands in for TE modules when TransformerEngine is not installed: fails at model build."""

    def __init__(self, *args, **kwargs):
        raise ImportError(
            "megatron_zeco: this layer spec uses TransformerEngine, which is not installed. "
            "Install transformer-engine, or use --spec megatron_zeco.specs gla_local_spec "
            "(or gla_layer_spec(use_te=False))."
        )


def gla_layer_spec(
    use_te: bool = False,
    cp_strategy: str = "zeco",
    cp_layout: str = "zigzag",
    cp_num_blocks: int = 1,
    cp_packed_split: str = "auto",
    gate_low_rank_dim: int = 16,
    gate_timescales=None,
    normalization: Optional[str] = None,
) -> ModuleSpec:
    """TransformerLayer spec with the GLA token mixer.

    Args:
        use_te: TransformerEngine linears and norms (needs TE) or Megatron-Core's.
        cp_strategy: ``zeco`` (All-Scan), ``lasp2``, ``lasp1`` or ``a2a``; used when
            ``--context-parallel-size`` > 1.
        cp_layout: ``zigzag`` (Megatron's ``get_batch_on_this_cp_rank`` split) or
            ``contiguous`` (rank r holds the r-th block of tokens).
        cp_num_blocks: blocks the state is pipelined in by All-Scan.
        cp_packed_split: how packed (THD) batches are split over CP: ``document``
            (Megatron's THD split), ``sequence`` (``--dataloader-inter-document-masking``)
            or ``auto`` (from Megatron-LM's arguments; see GatedLinearAttention).
        gate_low_rank_dim: rank of GLA's forget-gate projection.
        gate_timescales: ``(shortest, longest)`` initial memory of the gate channels in
            tokens, or None for fla's zero gate bias (see GatedLinearAttention).
        normalization: passed to Megatron's local spec (``LayerNorm``/``RMSNorm``);
            TE norms follow ``--normalization`` by themselves.
    """
    params = dict(cp_strategy=cp_strategy, cp_layout=cp_layout, cp_num_blocks=cp_num_blocks,
                  cp_packed_split=cp_packed_split, gate_low_rank_dim=gate_low_rank_dim, gate_timescales=gate_timescales)
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


gla_local_spec = gla_layer_spec(use_te=False)
gla_te_spec = gla_layer_spec(use_te=True)
gla_local_lasp1_spec = gla_layer_spec(use_te=False, cp_strategy="lasp1")
gla_local_lasp2_spec = gla_layer_spec(use_te=False, cp_strategy="lasp2")
gla_local_a2a_spec = gla_layer_spec(use_te=False, cp_strategy="a2a")
gla_te_lasp1_spec = gla_layer_spec(use_te=True, cp_strategy="lasp1")
gla_te_lasp2_spec = gla_layer_spec(use_te=True, cp_strategy="lasp2")
gla_te_a2a_spec = gla_layer_spec(use_te=True, cp_strategy="a2a")
