"""Gated linear attention as a Megatron-Core token mixer (``self_attention`` of a TransformerLayer).

    x -> in_proj -> per head [q | k | v | r]           (column parallel, heads split over TP)
    x -> gate_down (hidden -> r, replicated) -> gate_up (-> H*K, column parallel)
         g = logsigmoid(.) / gate_normalizer            (GLA's low-rank forget gate)
    o = zeco_gla(q, k, v, g) over the context-parallel group
    y = out_proj(RMSNorm_per_head(o) * swish(r))        (row parallel)

The same layer as fla's ``GatedLinearAttention`` (expand_k = expand_v = 1), with
the sequence split over Megatron's CP group: hidden states arrive as
``[s, b, h]`` holding this CP rank's tokens (``[s/tp, b, h]`` under sequence
parallelism) in Megatron's zigzag order, or contiguous order if configured.

Packed sequences (``packed_seq_params`` in the THD format: ``[t, 1, h]``, document
offsets in ``cu_seqlens_q_padded`` or ``cu_seqlens_q``) restart the state at every
document. Under CP the documents are split as Megatron splits them: per document
(its THD split, ``--sft``) or over the whole packed sequence (Megatron-LM's
``--dataloader-inter-document-masking``); see ``cp_packed_split``.
"""

import logging
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from ..cp.config import CPConfig, config_of, split_keywords
from ..cp.operator import Arguments, run_planned
from ..mcore.common import LayerCP, check_low_precision
from .local import require_backend
from .op import GLA

logger = logging.getLogger(__name__)


@dataclass
class GatedLinearAttentionSubmodules:
    """Linear layers of the GLA token mixer (Megatron's or TransformerEngine's)."""

    in_proj: Union[ModuleSpec, type] = IdentityOp
    gate_up: Union[ModuleSpec, type] = IdentityOp
    out_proj: Union[ModuleSpec, type] = IdentityOp


class GatedLinearAttention(MegatronModule):
    """GLA token mixer with context parallelism by ZeCO (or a baseline strategy).

    Args:
        config: the model's TransformerConfig; heads = ``num_attention_heads``,
            key and value head dim = ``kv_channels``.
        submodules: the linear layers.
        layer_number: passed by TransformerLayer.
        cp_config: the layer's context parallelism (:class:`~megatron_zeco.cp.CPConfig`, operator
            ``gla``), or None to make it from the ``cp_*`` keywords below (not both).
        cp_strategy, cp_layout, cp_num_blocks, cp_overlap_scan, cp_transport, cp_piece_split,
            cp_packed_split, cp_node_size: the knobs of :class:`~megatron_zeco.cp.CPConfig` (``cp_*``:
            its ``strategy``, ``layout``, ...; as :func:`megatron_zeco.zeco_gla` takes them). Defaults:
            zeco, zigzag (Megatron's CP batch split), 1 block, overlap and transport chosen per group
            (peer memory over NVLink on one node, else the group's messages), sub-pieces chosen per
            call, the packed split from Megatron-LM's arguments (``--sft``: per document;
            ``--dataloader-inter-document-masking``: the whole sequence), the node size from the hosts.
        gate_low_rank_dim, gate_normalizer: GLA's forget-gate parameterisation.
        gate_timescales: ``(shortest, longest)`` memory in tokens: initialise the gate
            bias so that channel decays start at ``exp(-1/tau)``, tau log-uniform in
            that range (as Mamba's dt). None: zero bias, as fla (decay ~0.96 per token).
        pg_collection: Megatron's process groups (``tp``, ``cp``); taken from
            ``parallel_state`` when absent.
        **kwargs: the ``cp_*`` knobs, and anything else TransformerLayer passes (``cp_comm_type``,
            ``pp_layer_offset``, ``name``, ...), accepted and unused.
    """

    def __init__(
        self,
        config,
        submodules: GatedLinearAttentionSubmodules,
        layer_number: int = 1,
        cp_config: Optional[CPConfig] = None,
        gate_low_rank_dim: int = 16,
        gate_normalizer: float = 16.0,
        gate_timescales: Optional[Tuple[float, float]] = None,
        pg_collection=None,
        **kwargs,
    ):
        super().__init__(config=config)
        self.layer_number = layer_number
        if pg_collection is not None:
            self.tp_group, self.cp_group = pg_collection.tp, pg_collection.cp
        else:
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
            self.cp_group = parallel_state.get_context_parallel_group()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.kv_channels
        who = f"GatedLinearAttention (layer {layer_number})"
        cp_config = config_of("gla", cp_config, split_keywords(kwargs)[0], "GatedLinearAttention")
        self.cp = LayerCP(GLA, cp_config, (self.tp_group, self.cp_group),
                          (self.num_heads, "--num-attention-heads"), ((self.head_dim, "--kv-channels"),) * 2, who,
                          "gla_local_spec")
        check_low_precision(config, submodules, ("in_proj", "gate_up", "out_proj"), "GatedLinearAttention",
                            "gla_te_spec")
        if not config.use_cpu_initialization:  # parameters, so the layer, live on the GPU
            require_backend("cuda", config.params_dtype)
        self.heads_per_rank = self.num_heads // self.tp_group.size()
        self.gate_normalizer = gate_normalizer
        self._warned_rotary = False

        D, H = self.head_dim, self.num_heads
        linear_kwargs = dict(config=config, is_expert=False, tp_group=self.tp_group)
        self.in_proj = build_module(
            submodules.in_proj, config.hidden_size, H * 4 * D, init_method=config.init_method,
            gather_output=False, bias=False, skip_bias_add=False, tp_comm_buffer_name="qkv",
            **linear_kwargs)
        # Low-rank forget gate. The down projection is replicated over TP; under sequence
        # parallelism it sees only this rank's tokens, so Megatron sums its gradient over TP.
        self.gate_down = torch.nn.Parameter(torch.empty(
            gate_low_rank_dim, config.hidden_size, dtype=config.params_dtype,
            device="cpu" if config.use_cpu_initialization else torch.cuda.current_device()))
        self.gate_down.sequence_parallel = config.sequence_parallel
        if config.perform_initialization:
            config.init_method(self.gate_down)
        self.gate_up = build_module(
            submodules.gate_up, gate_low_rank_dim, H * D, init_method=config.init_method,
            gather_output=False, bias=True, skip_bias_add=False, tp_comm_buffer_name="gate",
            **linear_kwargs)
        if gate_timescales is not None and config.perform_initialization:
            self._init_gate_timescales(*gate_timescales, tp_rank=self.tp_group.rank())
        # Per-head RMSNorm weight, shared by all heads as in fla. Each TP rank sees only its
        # heads, so the weight enters through copy_to_tensor_model_parallel_region (its
        # backward sums the gradient over TP).
        self.out_norm_weight = torch.nn.Parameter(torch.ones(
            D, dtype=config.params_dtype,
            device="cpu" if config.use_cpu_initialization else torch.cuda.current_device()))
        self.out_proj = build_module(
            submodules.out_proj, H * D, config.hidden_size, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True, tp_comm_buffer_name="proj",
            **linear_kwargs)

    @torch.no_grad()
    def _init_gate_timescales(self, shortest: float, longest: float, tp_rank: int):
        """Gate bias b with logsigmoid(b) / normalizer = -1 / tau, tau log-uniform per channel."""
        full = self.num_heads * self.head_dim  # the same draw on every TP rank, then this rank's slice
        u = torch.rand(full, generator=torch.Generator().manual_seed(self.layer_number), dtype=torch.float64)
        tau = shortest * (longest / shortest) ** u
        keep = torch.exp(-self.gate_normalizer / tau).clamp(1e-6, 1 - 1e-12)  # sigmoid(b)
        bias = torch.log(keep) - torch.log1p(-keep)
        local = bias.view(self.num_heads, -1)[tp_rank * self.heads_per_rank:(tp_rank + 1) * self.heads_per_rank]
        self.gate_up.bias.copy_(local.reshape(-1).to(self.gate_up.bias))

    def forward(self, hidden_states, attention_mask=None, *, rotary_pos_emb=None,
                packed_seq_params=None, inference_context=None, inference_params=None, **kwargs):
        """``[s, b, h]`` -> (``[s, b, h]``, bias or None), as Megatron's attention modules.

        GLA is causal by construction: ``attention_mask`` is not used (document
        boundaries come with ``packed_seq_params``; Megatron-LM's ``--reset-attention-mask``
        alone, which only builds a dense mask, is refused). Rotary embeddings are ignored
        (GLA layers carry no positions; use ``--position-embedding-type none``).
        """
        packed = self.cp.packed(packed_seq_params)
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("GatedLinearAttention: inference with a KV cache is not supported yet")
        if rotary_pos_emb is not None and not self._warned_rotary:
            logger.warning("GatedLinearAttention ignores rotary position embeddings; "
                           "pass --position-embedding-type none to skip computing them")
            self._warned_rotary = True

        qkvr, _ = self.in_proj(hidden_states)  # [s, b, H_tp * 4D]
        s, b = qkvr.shape[:2]
        qkvr = qkvr.view(s, b, self.heads_per_rank, 4, self.head_dim).transpose(0, 1)  # [b, s, H, 4, D]
        q, k, v, r = qkvr.unbind(dim=3)
        fp = torch.promote_types(q.dtype, torch.float32)  # norms and gates in at least fp32
        low = F.linear(hidden_states, self.gate_down)
        g, _ = self.gate_up(low)
        g = F.logsigmoid(g.to(fp)) / self.gate_normalizer
        g = g.view(s, b, self.heads_per_rank, self.head_dim).transpose(0, 1).to(q.dtype)

        args = Arguments((q, k, v, g), **packed)
        o, _ = run_planned(GLA, self.cp.planned(args, self.config), args)

        weight = tensor_parallel.copy_to_tensor_model_parallel_region(self.out_norm_weight, group=self.tp_group) \
            if self.tp_group.size() > 1 else self.out_norm_weight
        o = F.rms_norm(o.to(fp), (self.head_dim,), weight.to(fp), self.config.layernorm_epsilon)
        o = (o * F.silu(r.to(fp))).to(r.dtype)
        o = o.transpose(0, 1).reshape(s, b, self.heads_per_rank * self.head_dim)
        return self.out_proj(o)
