"""The main job's model: its TransformerConfig, its G layers' CP configuration and knobs, and the
GPTModel or HybridModel over this package's specs."""

from dataclasses import fields

import torch

from .. import mixers
from ..cp import registry
from .arguments import TrainConfig, cp_config

def transformer_config(cfg: TrainConfig):
    """The model's TransformerConfig (Megatron's own checks of the sizes run here)."""
    from megatron.core.transformer import TransformerConfig

    # CUDA graphs are off; say so in the form this megatron-core takes (its default, "full", is deprecated).
    names = {f.name for f in fields(TransformerConfig)}
    graphs = dict(cuda_graph_modules=[]) if "cuda_graph_modules" in names else dict(cuda_graph_scope=[])
    # HybridModel's E layers: Megatron's router defaults (top-2, no auxiliary loss), experts the size
    # of the MLP layers (said, or megatron-core warns). Linears without biases, as Megatron's MoE models
    # train (--disable-bias-linear): its local experts' forward adds an expert's bias in place to a
    # view of autograd's and fails.
    moe = {}
    if cfg.model == "hybrid" and "E" in cfg.hybrid_layer_pattern:
        moe = dict(num_moe_experts=cfg.experts, moe_ffn_hidden_size=4 * cfg.hidden, add_bias_linear=False)
    # What the mixer's layers need of the config beyond the model's size (Gated DeltaNet: its heads, its SiLU).
    mixer_fields = registry.mixer(cfg.mixer).transformer_config_fields(cfg.hidden, cfg.heads)
    # A GPTModel's checkpoint stacks each layer tensor of its block along a layer axis, which needs every
    # layer to hold the same tensors; GLA and softmax layers (--pattern 'G*') do not (without this the
    # save fails megatron-core's sharding check), so they are saved per layer, as HybridModel's always
    # are. ('hetereogenous' is megatron-core's spelling, in 0.16 and 0.19 alike.)
    mixed = cfg.model == "gpt" and len(set(cfg.pattern)) > 1
    return TransformerConfig(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
        tensor_model_parallel_size=cfg.tp, context_parallel_size=cfg.cp,
        use_cpu_initialization=True, params_dtype=getattr(torch, cfg.dtype),
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=cfg.init_std,
        deterministic_mode=cfg.deterministic, hetereogenous_dist_checkpoint=mixed, **graphs, **moe, **mixer_fields,
    )


def _mixer_knobs(cfg: TrainConfig) -> dict:
    """The G layers' arguments (megatron_zeco.specs) from the job's flags, for either model: the CP knobs and
    the initialisation knobs the mixer has (mixers.KNOBS): the gates' memories (--gate-init: from one token to
    four sequence lengths, or the layer's own), the convolution's taps (--conv-init; uniform is the layers' own
    default)."""
    init = dict(gate_timescales=(1.0, 4.0 * cfg.seq_len) if cfg.gate_init == "timescales" else None,
                conv_init=None if cfg.conv_init == "uniform" else cfg.conv_init)
    mine = {k: v for k, v in init.items() if k in mixers.KNOBS[cfg.mixer]}
    return dict(mixer=cfg.mixer, cp_config=cp_config(cfg), **mine)


def layer_spec(cfg: TrainConfig):
    """This package's layer spec for ``--pattern``: G layers alone, or G and softmax layers."""
    from .. import specs

    knobs = _mixer_knobs(cfg)
    if cfg.pattern == "G":
        return registry.mixer(knobs.pop("mixer")).build_layer_spec(**knobs)
    return specs.hybrid_layer_spec(cfg.pattern, **knobs)


def gpt_model(cfg: TrainConfig, config, vocab_size: int):
    """megatron-core's GPTModel over :func:`layer_spec`."""
    from megatron.core.models.gpt import GPTModel

    if cfg.position_embedding not in ("none", "rope"):
        raise ValueError(f"--position-embedding must be none or rope, got {cfg.position_embedding!r}")
    return GPTModel(config=config, transformer_layer_spec=layer_spec(cfg), vocab_size=vocab_size,
                    max_sequence_length=cfg.seq_len, position_embedding_type=cfg.position_embedding)


def hybrid_model(cfg: TrainConfig, config, vocab_size: int):
    """megatron-core's HybridModel (>= 0.19) of ``--hybrid-layer-pattern`` over this package's
    hybrid stack spec (Megatron-Core linears and norms; the G layers as ``--pattern``'s)."""
    from ..models import build_hybrid_model
    from ..specs import hybrid_stack_spec

    return build_hybrid_model(config, cfg.hybrid_layer_pattern, vocab_size, cfg.seq_len,
                              hybrid_stack_spec(**_mixer_knobs(cfg)), position_embedding_type=cfg.position_embedding)


# Model kinds (--model): name -> builder(cfg, TransformerConfig, vocab_size).
MODEL_KINDS = {"gpt": gpt_model, "hybrid": hybrid_model}


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device):
    """The model ``--model`` names; identical initial weights for any TP/CP layout."""
    torch.manual_seed(cfg.seed)
    model = MODEL_KINDS[cfg.model](cfg, transformer_config(cfg), vocab_size)
    return model.to(device=device, dtype=getattr(torch, cfg.dtype))  # some norms ignore params_dtype
