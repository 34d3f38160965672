"""Kimi Delta Attention as a Megatron-Core token mixer (``self_attention`` of a TransformerLayer, or the
``G`` slot of a HybridModel), with ZeCO context parallelism.

Kimi Linear's KDA layer (fla's ``KimiDeltaAttention``, one value head per key head, K = V), its heads split
over tensor parallelism as Megatron's GatedDeltaNet splits them:

    x -> in_proj -> per head [q | k | v | b]            (column parallel)
    [q k v] -> short causal conv + SiLU                 each rank its own tokens; the W - 1 tokens before
                                                        each piece by a halo exchange (cp/conv.py)
    q, k -> L2 norm
    x -> gate_down (hidden -> K, replicated) -> gate_up (-> H*K, column parallel)
         g = -exp(A_log) softplus(. + dt_bias)           a log decay per head and key channel (float32)
    beta = sigmoid(b)
    o = KDA (q, k, v, g, beta)                          over the CP group: ZeCO's All-Scan passes one
                                                        K x V state per piece and head (op.py)
    x -> out_gate_down (hidden -> V, replicated) -> out_gate_up (-> H*V, column parallel, bias)
    y = out_proj(RMSNorm_per_head(o) * sigmoid(out gate))           (row parallel)

Parameters (checkpoint names under ``self_attention.``): ``in_proj.weight [H*(2K+V+1), hidden]`` (per head
q, k, v rows then one beta row), ``conv_weight [H*(2K+V), W]`` (per head q, k, v channels), ``gate_down
[K, hidden]``, ``gate_up.weight [H*K, K]``, ``A_log [H]``, ``dt_bias [H*K]``, ``out_gate_down [V, hidden]``,
``out_gate_up.weight [H*V, V]``, ``out_gate_up.bias [H*V]``, ``out_norm_weight [V]``, ``out_proj.weight
[hidden, H*V]``; ``conv_weight``, ``A_log`` and ``dt_bias`` are split over tensor parallelism by heads
(dist-checkpointing keeps the whole tensors, so a checkpoint loads under any TP and CP size).

Hidden states arrive as ``[s, b, h]`` holding this CP rank's tokens (``[s/tp, b, h]`` under sequence
parallelism) in Megatron's zigzag order, or contiguous if configured; packed batches (``packed_seq_params``,
THD) restart the convolution and the recurrence at every document, under either of Megatron's packed splits
(``cp_packed_split``). Heads: ``--num-attention-heads``; K = V = ``--kv-channels``.
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
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

from ..common.conv import l2norm
from ..common.norm import gated_rms_norm
from ..cp.config import CPConfig, config_of, split_keywords
from ..cp.conv import planned_causal_conv1d
from ..cp.operator import Arguments, run_planned
from ..mcore.common import (LayerCP, check_conv_init, check_gate_timescales, check_low_precision,
                            dt_bias_for_timescales, init_conv_taps, log_uniform)
from .local import require_backend
from .op import KDA

logger = logging.getLogger(__name__)
WHO = "KimiDeltaAttention"
# Parameters of this module (not of its linears) split over tensor parallelism by heads, on dim 0.
TP_SPLIT = ("conv_weight", "A_log", "dt_bias")


@dataclass
class KimiDeltaAttentionSubmodules:
    """Linear layers of the KDA token mixer (Megatron's or TransformerEngine's)."""

    in_proj: Union[ModuleSpec, type] = IdentityOp
    gate_up: Union[ModuleSpec, type] = IdentityOp
    out_gate_up: Union[ModuleSpec, type] = IdentityOp
    out_proj: Union[ModuleSpec, type] = IdentityOp


class KimiDeltaAttention(MegatronModule):
    """KDA token mixer with context parallelism by ZeCO (or a baseline strategy).

    Args:
        config: the model's TransformerConfig; heads = ``num_attention_heads``, key and value head
            dim = ``kv_channels``.
        submodules: the linear layers.
        layer_number: passed by TransformerLayer.
        cp_config: the layer's context parallelism (:class:`~megatron_zeco.cp.CPConfig`, operator
            ``kda``), or None to make it from the ``cp_*`` keywords (not both): ``cp_strategy``
            (``zeco``, ``lasp2`` or ``a2a``), ``cp_layout``, ``cp_num_blocks`` (blocks of value columns,
            a divisor of ``--kv-channels``), ``cp_transport``, ``cp_overlap_scan``, ``cp_packed_split``
            (as :class:`megatron_zeco.gla.layer.GatedLinearAttention`'s). The short convolution always
            exchanges halos.
        conv_kernel_size: the short convolution's width W (Kimi Linear's: 4).
        conv_init: the short convolution's initial taps: None, ``nn.Conv1d``'s (uniform in ``+-W ** -0.5``,
            as fla's layer draws them); a float, uniform in ``+-conv_init`` (Megatron's GatedDeltaNet's
            knob); ``"identity"``, the current token's tap 1 and the others 0: the layer starts as fla's
            without a short convolution and learns the taps (``mcore.common.init_conv_taps``).
        gate_timescales: ``(shortest, longest)`` memory in tokens: initialise ``A_log = 0`` and
            ``dt_bias`` so that channel decays start at ``exp(-1/tau)``, tau log-uniform in that range
            per head and channel (as Mamba's dt). None: fla's KDA models' (``A`` uniform in [1, 16],
            ``dt_bias = softplus^-1(dt)``, dt log-uniform in [0.001, 0.1] per channel, as Mamba's: decays
            of ``exp(-A dt)`` per token, from 0.2 to 0.999 at the start).
        pg_collection: Megatron's process groups (``tp``, ``cp``); taken from ``parallel_state`` when
            absent.
        **kwargs: the ``cp_*`` keywords, and anything else TransformerLayer passes (``cp_comm_type``,
            ``pp_layer_offset``, ``name``, ...), accepted and unused.
    """

    def __init__(self, config, submodules: KimiDeltaAttentionSubmodules, layer_number: int = 1,
                 cp_config: Optional[CPConfig] = None, conv_kernel_size: int = 4,
                 conv_init: Union[None, float, str] = None, gate_timescales: Optional[Tuple[float, float]] = None,
                 pg_collection=None, **kwargs):
        super().__init__(config=config)
        self.layer_number = layer_number
        if pg_collection is not None:
            self.tp_group, self.cp_group = pg_collection.tp, pg_collection.cp
        else:
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
            self.cp_group = parallel_state.get_context_parallel_group()
        H, D = config.num_attention_heads, config.kv_channels
        if not isinstance(conv_kernel_size, int) or conv_kernel_size < 1:
            raise ValueError(f"{WHO}: conv_kernel_size must be a positive int, got {conv_kernel_size!r}")
        check_conv_init(conv_init, WHO)
        check_gate_timescales(gate_timescales, WHO)
        cp_config = config_of("kda", cp_config, split_keywords(kwargs)[0], WHO)
        self.cp = LayerCP(KDA, cp_config, (self.tp_group, self.cp_group), (H, "--num-attention-heads"),
                          ((D, "--kv-channels"),) * 2,
                          f"{WHO} (layer {layer_number})", "kda_hybrid_stack_local_spec")
        check_low_precision(config, submodules, ("in_proj", "gate_up", "out_gate_up", "out_proj"), WHO,
                            "kda_hybrid_stack_te_spec")
        if not config.use_cpu_initialization:  # parameters, so the layer, live on the GPU
            require_backend("cuda", config.params_dtype)
        self.num_heads, self.head_dim, self.conv_kernel_size = H, D, conv_kernel_size
        self.heads_per_rank = H // self.tp_group.size()
        self._warned_rotary = False

        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        linear = dict(config=config, is_expert=False, tp_group=self.tp_group)
        self.in_proj = build_module(
            submodules.in_proj, config.hidden_size, H * (3 * D + 1), init_method=config.init_method,
            gather_output=False, bias=False, skip_bias_add=False, tp_comm_buffer_name="qkv", **linear)
        # Replicated down projections of the low-rank gates. Under sequence parallelism each sees only this
        # rank's tokens, so Megatron sums their gradients over TP.
        self.gate_down = self._replicated(D, config.hidden_size, device)
        self.gate_up = build_module(
            submodules.gate_up, D, H * D, init_method=config.init_method, gather_output=False, bias=False,
            skip_bias_add=False, tp_comm_buffer_name="gate", **linear)
        self.out_gate_down = self._replicated(D, config.hidden_size, device)
        self.out_gate_up = build_module(
            submodules.out_gate_up, D, H * D, init_method=config.init_method, gather_output=False, bias=True,
            skip_bias_add=False, tp_comm_buffer_name="out_gate", **linear)
        # Per-head parameters, drawn whole (the same on every TP rank) and sliced to this rank's heads.
        self.conv_weight = self._per_head(init_conv_taps(torch.empty(H * 3 * D, conv_kernel_size), conv_init), device)
        if gate_timescales is None:  # fla's KDA models' (KDAPreTrainedModel._init_weights): dt in [0.001, 0.1]
            A_log, dt_bias = torch.empty(H).uniform_(1, 16).log(), dt_bias_for_timescales(log_uniform(H * D, 10, 1000))
        else:
            A_log, dt_bias = torch.zeros(H), dt_bias_for_timescales(log_uniform(H * D, *gate_timescales))
        self.A_log, self.dt_bias = self._per_head(A_log, device), self._per_head(dt_bias, device)
        for p in (self.A_log, self.dt_bias):
            p._no_weight_decay = True
        # Per-head RMSNorm weight, shared by all heads as in fla; it enters through
        # copy_to_tensor_model_parallel_region under TP (whose backward sums its gradient over TP).
        self.out_norm_weight = torch.nn.Parameter(torch.ones(D, dtype=config.params_dtype, device=device))
        self.out_proj = build_module(
            submodules.out_proj, H * D, config.hidden_size, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True, tp_comm_buffer_name="proj", **linear)

    def _replicated(self, rows: int, columns: int, device) -> torch.nn.Parameter:
        weight = torch.nn.Parameter(torch.empty(rows, columns, dtype=self.config.params_dtype, device=device))
        weight.sequence_parallel = self.config.sequence_parallel
        if self.config.perform_initialization:
            self.config.init_method(weight)
        return weight

    def _per_head(self, whole: torch.Tensor, device) -> torch.nn.Parameter:
        """This TP rank's heads of ``whole`` (its first dim, heads major) as a TP-split parameter."""
        mine = whole.view(self.num_heads, -1)[self.tp_group.rank() * self.heads_per_rank:][:self.heads_per_rank]
        param = torch.nn.Parameter(mine.reshape(-1, *whole.shape[1:]).to(device, self.config.params_dtype))
        tensor_parallel.set_tensor_model_parallel_attributes(param, True, 0, 1)
        return param

    def forward(self, hidden_states, attention_mask=None, *, rotary_pos_emb=None, packed_seq_params=None,
                inference_context=None, inference_params=None, **kwargs):
        """``[s, b, h]`` -> (``[s, b, h]``, bias or None), as Megatron's attention modules. KDA is causal
        by construction: ``attention_mask`` is not used (document boundaries come with
        ``packed_seq_params``); rotary embeddings are ignored."""
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError(f"{WHO}: inference with a KV cache is not supported yet")
        if rotary_pos_emb is not None and not self._warned_rotary:
            logger.warning(f"{WHO} ignores rotary position embeddings; pass --position-embedding-type none "
                           f"(or rope only for the softmax layers of a hybrid)")
            self._warned_rotary = True
        packed = self.cp.packed(packed_seq_params)
        H, D = self.heads_per_rank, self.head_dim

        proj, _ = self.in_proj(hidden_states)  # [s, b, H_tp * (3D + 1)]: this CP rank's tokens
        s, b = proj.shape[:2]
        proj = proj.transpose(0, 1).reshape(b, s, H, 3 * D + 1)
        qkv, beta = proj[..., :3 * D].reshape(b, s, H * 3 * D), proj[..., 3 * D]
        fp = torch.promote_types(proj.dtype, torch.float32)  # gates and norms in at least float32
        gate = self._low_rank(self.gate_down, self.gate_up, hidden_states).view(b, s, H, D)
        g = -self.A_log.to(fp).exp().unsqueeze(-1) * F.softplus(gate.to(fp) + self.dt_bias.to(fp).view(H, D))
        beta = beta.to(fp).sigmoid().to(proj.dtype)
        plan = self.cp.planned(Arguments(self._recurrence_shaped(beta), **packed), self.config)

        qkv = planned_causal_conv1d(plan, qkv, self.conv_weight, None, "silu", **packed).view(b, s, H, 3 * D)
        q, k, v = qkv.split(D, dim=-1)
        q, k = l2norm(q), l2norm(k)
        o, _ = run_planned(KDA, plan, Arguments((q.contiguous(), k.contiguous(), v.contiguous(), g, beta), **packed))

        out_gate = self._low_rank(self.out_gate_down, self.out_gate_up, hidden_states).view(b, s, H, D)
        weight = tensor_parallel.copy_to_tensor_model_parallel_region(self.out_norm_weight, group=self.tp_group) \
            if self.tp_group.size() > 1 else self.out_norm_weight
        o = gated_rms_norm(o, out_gate, weight, self.config.layernorm_epsilon, "sigmoid")
        return self.out_proj(o.reshape(b, s, H * D).transpose(0, 1))

    def _low_rank(self, down: torch.Tensor, up, hidden_states: torch.Tensor) -> torch.Tensor:
        """``up(down x)`` as ``[b, s, ...]``: the replicated down projection on this rank's tokens, the
        column-parallel up projection (which gathers them under sequence parallelism)."""
        out, _ = up(F.linear(hidden_states, down))
        return out.transpose(0, 1)

    def _recurrence_shaped(self, beta: torch.Tensor):
        """Views of the recurrence's inputs' shapes (q, k, v, g, beta), nothing copied: its input checks
        run before the convolution that makes them."""
        b, s, H = beta.shape
        x = beta.unsqueeze(-1).expand(b, s, H, self.head_dim)
        return x, x, x, x, beta

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Megatron's, with the per-head parameters (``TP_SPLIT``) sharded over tensor parallelism on dim 0."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        own = {name: getattr(self, name) for name in TP_SPLIT}
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state.update(make_sharded_tensors_for_checkpoint(own, prefix, {name: 0 for name in TP_SPLIT}, sharded_offsets,
                                                         tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]))
        return state
