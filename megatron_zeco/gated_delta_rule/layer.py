"""Megatron-Core's Gated DeltaNet with ZeCO context parallelism (the ``G`` layers of a HybridModel).

megatron-core 0.19's ``GatedDeltaNet`` runs context parallelism (CP) by head all-to-all: before the
short convolution every rank trades its tokens of all heads for all tokens of H / CP heads, and
back after the recurrence (O(L x d) activations per layer; heads divisible by TP x CP).
:class:`ZecoGatedDeltaNet` is that module with the CP path replaced and nothing else:

    x -> in_proj -> [q k v | z | b | a]                 Megatron's projection (heads split over TP)
    [q k v] -> short causal conv + SiLU                 each rank its own tokens; the W - 1 tokens
                                                        before each piece by a halo exchange (cp/conv.py)
    q, k -> L2 norm (and repeated for grouped heads)
    g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)            Megatron's (g in float32 at least)
    o = the gated delta rule (q, k, v, g, beta)         over the CP group: ZeCO's All-Scan passes one
                                                        K x V state per piece and head (op.py)
    y = out_proj(out_norm(o) * silu(z))                 Megatron's (the gate in float32 at least; a plain
                                                        RMSNorm out_norm and the gate as one fused kernel)

Its parameters, their names, shapes, initialisation and ``sharded_state_dict`` are Megatron's (it
subclasses ``GatedDeltaNet``), so checkpoints load into either. Every CP rank keeps all of its TP
rank's heads, so CP is not capped by the head count. Hidden states arrive as ``[s, b, h]`` holding
this CP rank's tokens in Megatron's zigzag order (or contiguous, if configured); packed batches
(``packed_seq_params``, THD) restart the convolution and the recurrence at every document, under
either of Megatron's packed splits (``cp_packed_split``).

On GPUs the local work is flash-linear-attention's (``fla-core``: its causal_conv1d, l2norm and
gated-delta-rule kernels, as in Megatron's module); elsewhere the PyTorch forms (``chunk.py``, ``common/conv.py``).
Needs megatron-core >= 0.19.
"""

import contextlib
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.ssm.gated_delta_net import common as _megatron_gdn
from megatron.core.utils import deprecate_inference_params

from ..common.conv import l2norm
from ..common.norm import gated_rms_norm
from ..cp.config import CPConfig, config_of, split_keywords
from ..cp.conv import planned_causal_conv1d
from ..cp.operator import Arguments, run_planned
from ..mcore.common import (LayerCP, check_conv_init, check_gate_timescales, check_low_precision,
                            dt_bias_for_timescales, init_conv_taps, log_spaced)
from ..mcore.host import host_as_cuda
from .local import require_backend
from .op import GATED_DELTA_RULE

__all__ = ["ZecoGatedDeltaNet", "GatedDeltaNetSubmodules"]

WHO = "ZecoGatedDeltaNet"


class ZecoGatedDeltaNet(GatedDeltaNet):
    """Megatron-Core's GatedDeltaNet whose context parallelism splits the sequence, not the heads.

    Args:
        config, submodules, *args (layer_number, bias, conv_bias, conv_init, use_qk_l2norm, A_init_range,
        pg_collection), name, cp_comm_type: as Megatron-Core's ``GatedDeltaNet`` (``conv_init`` may also be
            ``"identity"``: the convolution starts passing each token through, ``mcore.common.init_conv_taps``;
            heads, head dims and
            the convolution's width from ``config.linear_*``: ``--linear-num-key-heads``,
            ``--linear-num-value-heads``, ``--linear-key-head-dim``, ``--linear-value-head-dim``,
            ``--linear-conv-kernel-dim``). ``pg_collection=None`` takes ``parallel_state``'s groups.
        cp_config: the layer's context parallelism (:class:`~megatron_zeco.cp.CPConfig`, operator
            ``gated_delta_rule``), or None to make it from the ``cp_*`` keywords (not both):
            ``cp_strategy`` (``zeco``: All-Scan, one state per piece; ``lasp2``: all-gather of every
            piece's state and transition; ``a2a``: head all-to-all around the recurrence, value heads
            per TP rank divisible by CP), ``cp_layout`` (``zigzag``, Megatron's CP batch split, or
            ``contiguous``), ``cp_num_blocks`` (blocks of value columns All-Scan pipelines, a divisor of
            ``--linear-value-head-dim``), ``cp_transport``, ``cp_overlap_scan``, ``cp_packed_split``
            (as :class:`megatron_zeco.gla.layer.GatedLinearAttention`'s). The short convolution always
            exchanges halos.
        gate_timescales: ``(shortest, longest)`` memory in tokens: the decays start at ``exp(-1 / tau)``,
            ``tau`` evenly spaced in log over that range across the value heads (see :meth:`reset_parameters`);
            None: Megatron's initialisation (``A`` uniform in ``A_init_range``, ``dt_bias = 1``: decays of 0.27
            or less per token).
        **kwargs: the ``cp_*`` keywords, Megatron's keyword arguments above, and anything else
            TransformerLayer passes (``pp_layer_offset``, ...), unused.
    """

    def __init__(self, config, submodules: GatedDeltaNetSubmodules, *args, cp_config: Optional[CPConfig] = None,
                 gate_timescales: Optional[Tuple[float, float]] = None, **kwargs):
        knobs, kwargs = split_keywords(kwargs)
        megatron = _megatron_arguments(args, kwargs)
        check_conv_init(megatron.get("conv_init"), WHO)
        check_gate_timescales(gate_timescales, WHO)
        # Set before Megatron's constructor, which calls reset_parameters. "identity" is this layer's own;
        # Megatron's module takes a float or None.
        self.conv_identity, self.gate_timescales = megatron.get("conv_init") == "identity", gate_timescales
        if self.conv_identity:
            megatron["conv_init"] = None
        pg_collection = megatron.get("pg_collection")
        if pg_collection is None:
            megatron["pg_collection"] = pg_collection = ProcessGroupCollection.use_mpu_process_groups(
                required_pgs=["tp", "cp"])
        cp_config = config_of("gated_delta_rule", cp_config, knobs, WHO)
        _check_config(config, submodules, pg_collection.tp.size())
        on_gpu = torch.cuda.is_available()
        if on_gpu:  # Megatron's module puts its own parameters on the GPU whatever the config says
            require_backend("cuda", config.params_dtype)
        with _megatron_constructible(on_gpu):
            super().__init__(config, submodules, **megatron)
        self.cp = LayerCP(GATED_DELTA_RULE, cp_config, (pg_collection.tp, pg_collection.cp),
                          (config.linear_num_value_heads, "--linear-num-value-heads"),
                          ((config.linear_key_head_dim, "--linear-key-head-dim"),
                           (config.linear_value_head_dim, "--linear-value-head-dim")),
                          f"{WHO} (layer {self.layer_number})", "gdn_hybrid_stack_local_spec")
        # the output norm as one fused kernel (common.norm) where it is a plain RMSNorm; else Megatron's module
        self.fused_out_norm = _plain_rms_norm(self.out_norm, config, self.value_head_dim)

    def _setup_variant_attrs(self, *args, **kwargs):
        """Megatron's variant hook: its GDN's sizes, the per-rank widths of the full head count (Megatron's
        divide the heads by the CP size, its CP being head-parallel; here every CP rank keeps all of its TP
        rank's heads and holds part of the sequence), and the recurrence over the CP group."""
        super()._setup_variant_attrs(*args, **kwargs)
        self.feat_dim_split = (2 * self.qk_dim_local_tp + self.v_dim_local_tp, self.v_dim_local_tp,
                               self.num_v_heads_local_tp, self.num_v_heads_local_tp)
        self.gated_delta_rule = self._context_parallel_gated_delta_rule

    def reset_parameters(self):
        """Megatron's initialisation: on the GPU its own (drawn under the model-parallel CUDA RNG);
        on a host without CUDA the same distributions drawn from torch's CPU generator (as Megatron-Core's
        linears draw theirs with ``use_cpu_initialization``). Then, with ``conv_init="identity"``, the
        convolution starts as the identity (``mcore.common.init_conv_taps``), and with ``gate_timescales``
        the decays start at ``exp(-1 / tau)`` per token, ``tau`` evenly spaced in log over that range across the
        value heads (``A_log = 0``, ``dt_bias`` of ``mcore.common.dt_bias_for_timescales``; each TP rank takes
        its heads' share, so that any TP size starts alike). A head's decay is one number and a small model
        has few heads: spaced evenly, some head always starts with a long memory, which a random draw over
        a few heads can miss."""
        if self.A_log.is_cuda:
            super().reset_parameters()
        elif self.config.perform_initialization:
            with torch.no_grad():
                if self.conv_init is not None:
                    nn.init.uniform_(self.conv1d.weight, -self.conv_init, self.conv_init)
                self.dt_bias.fill_(1.0)
                self.A_log.copy_(torch.empty_like(self.A_log).uniform_(*self.A_init_range).log())
        if not self.config.perform_initialization:
            return
        if self.conv_identity:
            init_conv_taps(self.conv1d.weight, "identity")
        if self.gate_timescales is not None:
            heads = self.num_value_heads // self.tp_size
            whole = dt_bias_for_timescales(log_spaced(self.num_value_heads, *self.gate_timescales))
            with torch.no_grad():
                self.A_log.zero_()
                self.dt_bias.copy_(whole[self.pg_collection.tp.rank() * heads:][:heads])

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                inference_context=None, packed_seq_params=None, sequence_len_offset: Optional[int] = None, *,
                inference_params=None, **kwargs):
        """``[s, b, h]`` -> (``[s, b, h]``, bias or None), as Megatron's GatedDeltaNet. The recurrence is
        causal by construction: ``attention_mask`` and rotary embeddings are not used (document
        boundaries come with ``packed_seq_params``)."""
        if deprecate_inference_params(inference_context, inference_params) is not None:
            raise NotImplementedError(f"{WHO}: inference is not supported yet (nor by Megatron's GatedDeltaNet)")
        packed = self.cp.packed(packed_seq_params)

        qkvzba, _ = self.in_proj(hidden_states)  # [s, b, in_proj_dim / TP]: this CP rank's tokens
        s, b = qkvzba.shape[:2]
        qkv, gate, beta, alpha = torch.split(qkvzba.transpose(0, 1), self.feat_dim_split, dim=-1)
        gate = gate.reshape(b, s, -1, self.value_head_dim)
        plan = self.cp.planned(Arguments(self._recurrence_shaped(beta), **packed), self.config)

        conv_bias = self.conv1d.bias if self.conv_bias else None
        qkv = planned_causal_conv1d(plan, qkv, self.conv1d.weight.squeeze(1), conv_bias, self.activation, **packed)
        query, key, value = self._heads(qkv, b, s)
        g, beta = _g_and_beta(self.A_log, self.dt_bias, alpha.contiguous(), beta.contiguous())
        core_attn_out, _ = self.gated_delta_rule(query, key, value, g=g, beta=beta, **packed)

        if self.recompute_norm_out:  # Megatron's selective recompute of the gated norm ('gdn_norm_out')
            self.norm_out_checkpoint = tensor_parallel.CheckpointWithoutOutput()
            norm_out = self.norm_out_checkpoint.checkpoint(self._gated_norm, core_attn_out, gate)
        else:
            norm_out = self._gated_norm(core_attn_out, gate)
        out, out_bias = self.out_proj(norm_out)
        if self.recompute_norm_out:
            self.norm_out_checkpoint.discard_output_and_register_recompute(out)
        return out, out_bias

    def _recurrence_shaped(self, beta: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Views of the recurrence's inputs' shapes (q, k, v, g, beta), nothing copied: its input checks run
        before the convolution that makes them."""
        b, s, H = beta.shape
        qk = beta.unsqueeze(-1).expand(b, s, H, self.key_head_dim)
        return qk, qk, beta.unsqueeze(-1).expand(b, s, H, self.value_head_dim), beta, beta

    def _gated_norm(self, core_attn_out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Megatron's gated output norm ``out_norm(x) * silu(gate)`` (the gate in float32 at least; a float64
        model, the tests' reference, keeps float64), back to ``[s, b, heads x V]`` (no all-to-all: the heads
        never left). A plain RMSNorm ``out_norm`` runs as one fused kernel (``common.norm.gated_rms_norm``:
        the normalised value stays in float32 up to the gate)."""
        b, s = core_attn_out.shape[:2]
        if self.fused_out_norm:
            y = gated_rms_norm(core_attn_out, gate, self.out_norm.weight, self.config.layernorm_epsilon)
        else:
            y = self.out_norm(core_attn_out.reshape(-1, core_attn_out.shape[-1]))
            gate = gate.reshape(-1, gate.shape[-1])
            y = (y * self.act_fn(gate.to(torch.promote_types(gate.dtype, torch.float32)))).to(core_attn_out.dtype)
        return y.reshape(b, s, -1).transpose(0, 1).contiguous()

    def _heads(self, qkv: torch.Tensor, batch: int, seq_len: int) -> Tuple[torch.Tensor, ...]:
        """Megatron's split of the convolved ``[q k v]`` into heads, the L2 norm of q and k and their
        repetition for grouped heads, with this rank's full head count (Megatron's divides it by CP).
        q and k are normalised apart: each comes out of the norm in the layout the recurrence takes."""
        query, key, value = torch.split(qkv, [self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp], dim=-1)
        query, key = (x.reshape(batch, seq_len, -1, self.key_head_dim) for x in (query, key))
        value = value.reshape(batch, seq_len, -1, self.value_head_dim)
        if self.use_qk_l2norm:
            query, key = l2norm(query), l2norm(key)
        if self.num_value_heads // self.num_key_heads > 1:
            repeat = self.num_value_heads // self.num_key_heads
            query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
        return query.contiguous(), key.contiguous(), value.contiguous()

    def _context_parallel_gated_delta_rule(self, q, k, v, g, beta, use_qk_l2norm_in_kernel=False, **kwargs):
        """The recurrence over the CP group (Megatron's ``GatedDeltaRuleInterface``: its arguments,
        ``initial_state``, ``output_final_state``, ``cu_seqlens``, and ``per_document``)."""
        if use_qk_l2norm_in_kernel:
            raise ValueError(f"{WHO}: q and k are normalised before the recurrence (use_qk_l2norm)")
        return run_planned(GATED_DELTA_RULE, self.cp.plan, Arguments((q, k, v, g, beta), **kwargs))


def _g_and_beta(A_log: torch.Tensor, dt_bias: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor):
    """Megatron's log decay ``g = -exp(A_log) softplus(alpha + dt_bias)`` and ``beta = sigmoid(b)``, the decay
    in float32 at least (Megatron's: exactly float32; a float64 model, the tests' reference, keeps float64)."""
    g = -A_log.exp() * F.softplus(alpha.to(torch.promote_types(alpha.dtype, torch.float32)) + dt_bias)
    return g, beta.sigmoid()


def _plain_rms_norm(norm: nn.Module, config, width: int) -> bool:
    """Whether Megatron's ``out_norm`` is ``x / rms(x) * weight`` over ``width`` channels with eps
    ``config.layernorm_epsilon`` (what ``gated_rms_norm`` computes): ``--normalization RMSNorm``, without
    ``--apply-layernorm-1p`` (zero-centred gamma), a ``weight`` of ``[width]`` and no bias."""
    weight = getattr(norm, "weight", None)
    return (config.normalization == "RMSNorm" and not config.layernorm_zero_centered_gamma
            and isinstance(weight, torch.Tensor) and tuple(weight.shape) == (width,)
            and getattr(norm, "bias", None) is None)


def _megatron_arguments(args: tuple, kwargs: dict) -> dict:
    """Megatron's GatedDeltaNet arguments among ``args`` (positional, after config and submodules) and
    ``kwargs`` (keywords its constructor takes; TransformerLayer's others dropped), by name."""
    import inspect

    names = list(inspect.signature(GatedDeltaNet.__init__).parameters)[3:]  # after self, config, submodules
    out = dict(zip(names, args))
    out.update({k: v for k, v in kwargs.items() if k in names})
    return out


@contextlib.contextmanager
def _megatron_constructible(on_gpu: bool):
    """Let Megatron's constructor build the module where its forward would not run. It refuses
    without fla (its forward calls fla; ours only on CUDA, checked before), and it puts the
    convolution and gate parameters on ``torch.cuda.current_device()``: on a host without CUDA,
    the host stands in (``mcore.host.host_as_cuda``)."""
    with contextlib.ExitStack() as stack:
        if not _megatron_gdn.HAVE_FLA:
            stack.enter_context(_patched(_megatron_gdn, "HAVE_FLA", True))
        if not on_gpu:
            stack.enter_context(host_as_cuda())
        yield


@contextlib.contextmanager
def _patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _check_config(config, submodules, tp: int):
    """Start-up errors of Megatron's own knobs that name the flag to change (the CP knobs: ``LayerCP``)."""
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    if nk % tp or nv % tp:
        raise ValueError(f"{WHO}: --linear-num-key-heads ({nk}) and --linear-num-value-heads ({nv}) must be "
                         f"divisible by --tensor-model-parallel-size ({tp}): each TP rank holds whole heads")
    if nv % nk:
        raise ValueError(f"{WHO}: --linear-num-value-heads ({nv}) must be a multiple of --linear-num-key-heads ({nk})")
    if getattr(config.activation_func, "__name__", None) not in ("silu", "swish"):
        name = getattr(config.activation_func, "__name__", config.activation_func)
        raise ValueError(f"{WHO}: Gated DeltaNet applies config.activation_func after its short convolution "
                         f"and to its output gate, and fla's kernels (Megatron's too) compute it as SiLU only; "
                         f"got {name}: pass --swiglu (activation_func = torch.nn.functional.silu)")
    check_low_precision(config, submodules, ("in_proj", "out_proj"), WHO, "gdn_hybrid_stack_te_spec")


def transformer_config_fields(hidden: int, heads: int) -> dict:
    """The ``TransformerConfig`` fields a model of ``hidden`` channels in ``heads`` heads sets for these layers
    (the main job's; Megatron-LM's ``--linear-num-key-heads``, ...): ``heads`` query/key and value heads of
    ``hidden / heads`` channels, a convolution of 4 taps; the kernels apply SiLU, which the layer takes from
    ``activation_func`` (Megatron-LM's ``--swiglu``, SiLU-gated MLPs, sets it)."""
    return dict(linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=hidden // heads,
                linear_value_head_dim=hidden // heads, linear_conv_kernel_dim=4, activation_func=F.silu,
                gated_linear_unit=True)
