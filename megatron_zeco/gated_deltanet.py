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
    o = planned_gated_delta_rule(q, k, v, g, beta)      over the CP group: ZeCO's All-Scan passes one
                                                        K x V state per piece and head (cp/delta.py)
    y = out_proj(out_norm(o) * silu(z))                 Megatron's (the gate in float32 at least)

Its parameters, their names, shapes, initialisation and ``sharded_state_dict`` are Megatron's (it
subclasses ``GatedDeltaNet``), so checkpoints load into either. Every CP rank keeps all of its TP
rank's heads, so CP is not capped by the head count. Hidden states arrive as ``[s, b, h]`` holding
this CP rank's tokens in Megatron's zigzag order (or contiguous, if configured); packed batches
(``packed_seq_params``, THD) restart the convolution and the recurrence at every document, under
either of Megatron's packed splits (``cp_packed_split``).

On GPUs the local work is flash-linear-attention's (``fla-core``: its causal_conv1d, l2norm and
gated-delta-rule kernels, as in Megatron's module); elsewhere the PyTorch forms of ``ops/``.
Needs megatron-core >= 0.19.
"""

import contextlib
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.jit import jit_fuser
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.ssm.gated_delta_net import common as _megatron_gdn
from megatron.core.utils import deprecate_inference_params

from .checkpoint import host_as_cuda
from .comm import as_layout
from .comm.peer import TRANSPORTS, claim_transport
from .cp import cp_plan, planned_gated_delta_rule
from .cp.checks import check_inputs
from .cp.conv import planned_causal_conv1d
from .cp.delta import delta_rule_transport
from .layer import (check_document_boundaries, check_low_precision, check_packed_split,
                    check_scans_when_gradients_finish, packed_arguments)
from .ops.conv import l2norm
from .ops.delta_backend import require_gdn_backend

__all__ = ["ZecoGatedDeltaNet", "GatedDeltaNetSubmodules", "CP_STRATEGIES"]

CP_STRATEGIES = ("zeco", "lasp2", "a2a")  # of the gated delta rule (megatron_zeco.zeco_gated_delta_rule)
WHO = "ZecoGatedDeltaNet"


class ZecoGatedDeltaNet(GatedDeltaNet):
    """Megatron-Core's GatedDeltaNet whose context parallelism splits the sequence, not the heads.

    Args:
        config, submodules, layer_number, bias, conv_bias, conv_init, use_qk_l2norm, A_init_range,
        pg_collection, name, cp_comm_type: as Megatron-Core's ``GatedDeltaNet`` (heads, head dims and
            the convolution's width from ``config.linear_*``: ``--linear-num-key-heads``,
            ``--linear-num-value-heads``, ``--linear-key-head-dim``, ``--linear-value-head-dim``,
            ``--linear-conv-kernel-dim``). ``pg_collection=None`` takes ``parallel_state``'s groups.
        cp_strategy: how the recurrent state crosses the CP ranks (:func:`megatron_zeco.zeco_gated_delta_rule`):
            ``zeco`` (All-Scan: one state per piece), ``lasp2`` (all-gather of every piece's state and
            transition) or ``a2a`` (head all-to-all around the recurrence: value heads per TP rank
            divisible by CP). The short convolution always exchanges halos.
        cp_layout: ``zigzag`` (Megatron's CP batch split) or ``contiguous``.
        cp_num_blocks: ``zeco``: blocks of value columns All-Scan pipelines (a divisor of
            ``--linear-value-head-dim``).
        cp_packed_split: how packed (THD) batches are split over CP: ``document``, ``sequence`` or
            ``auto`` (see :class:`megatron_zeco.layer.GatedLinearAttention`).
        cp_transport: ``zeco``: how All-Scan moves states: ``auto`` (= ``send_recv``, the CP group's
            point-to-point messages), ``peer_memory`` (one node) or ``nvshmem``: the dense hop kernel
            (``kernels/scan_hop.py``), exact on the CPU but not yet timed on GPUs, hence not the default.
        **kwargs: anything else TransformerLayer passes (``pp_layer_offset``, ...), unused.
    """

    def __init__(self, config, submodules: GatedDeltaNetSubmodules, layer_number: Optional[int] = None,
                 bias: bool = False, conv_bias: bool = False, conv_init: Optional[float] = None,
                 use_qk_l2norm: bool = True, A_init_range: Tuple[float, float] = (1, 16), pg_collection=None, *,
                 name: Optional[str] = None, cp_comm_type: Optional[str] = None, cp_strategy: str = "zeco",
                 cp_layout: str = "zigzag", cp_num_blocks: int = 1, cp_packed_split: str = "auto",
                 cp_transport: str = "auto", **kwargs):
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        _check_config(config, submodules, cp_strategy, cp_layout, cp_num_blocks, cp_packed_split, cp_transport,
                      pg_collection.tp.size(), pg_collection.cp.size())
        on_gpu = torch.cuda.is_available()
        if on_gpu:  # Megatron's module puts its own parameters on the GPU whatever the config says
            require_gdn_backend("cuda", config.params_dtype)
        with _megatron_constructible(on_gpu):
            super().__init__(config, submodules, layer_number=layer_number, bias=bias, conv_bias=conv_bias,
                             conv_init=conv_init, use_qk_l2norm=use_qk_l2norm, A_init_range=A_init_range,
                             pg_collection=pg_collection, name=name, cp_comm_type=cp_comm_type)
        self.cp_group = pg_collection.cp
        self.cp_strategy, self.cp_layout, self.cp_num_blocks = cp_strategy, cp_layout, cp_num_blocks
        self.cp_packed_split = cp_packed_split
        self.cp_transport = delta_rule_transport(cp_transport)
        claim_transport(self, self.cp_transport, f"{WHO} (layer {layer_number})")
        self._plan = None  # the CP plan, built at the first forward (it needs the device; collective)
        self._validated = False

    def _setup_variant_attrs(self):
        super()._setup_variant_attrs()
        # Megatron's per-rank widths divide the heads by the CP size (its CP is head-parallel); here
        # every CP rank keeps all of its TP rank's heads and holds part of the sequence.
        self.feat_dim_split = (2 * self.qk_dim_local_tp + self.v_dim_local_tp, self.v_dim_local_tp,
                               self.num_v_heads_local_tp, self.num_v_heads_local_tp)
        self.gated_delta_rule = self._context_parallel_gated_delta_rule

    def reset_parameters(self):
        """Megatron's initialisation: on the GPU its own (drawn under the model-parallel CUDA RNG);
        on a host without CUDA the same distributions drawn from torch's CPU generator (as Megatron-Core's
        linears draw theirs with ``use_cpu_initialization``)."""
        if self.A_log.is_cuda:
            return super().reset_parameters()
        if not self.config.perform_initialization:
            return
        with torch.no_grad():
            if self.conv_init is not None:
                nn.init.uniform_(self.conv1d.weight, -self.conv_init, self.conv_init)
            self.dt_bias.fill_(1.0)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(*self.A_init_range).log())

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                inference_context=None, packed_seq_params=None, sequence_len_offset: Optional[int] = None, *,
                inference_params=None, **kwargs):
        """``[s, b, h]`` -> (``[s, b, h]``, bias or None), as Megatron's GatedDeltaNet. The recurrence is
        causal by construction: ``attention_mask`` and rotary embeddings are not used (document
        boundaries come with ``packed_seq_params``)."""
        if deprecate_inference_params(inference_context, inference_params) is not None:
            raise NotImplementedError(f"{WHO}: inference is not supported yet (nor by Megatron's GatedDeltaNet)")
        if not self._validated:
            check_document_boundaries(packed_seq_params, WHO)
        packed = packed_arguments(packed_seq_params, self.cp_packed_split, WHO)

        qkvzba, _ = self.in_proj(hidden_states)  # [s, b, in_proj_dim / TP]: this CP rank's tokens
        s, b = qkvzba.shape[:2]
        qkv, gate, beta, alpha = torch.split(qkvzba.transpose(0, 1), self.feat_dim_split, dim=-1)
        gate = gate.reshape(b, s, -1, self.value_head_dim)
        if self._plan is None:
            self._first_call(qkv, beta, packed)

        conv_bias = self.conv1d.bias if self.conv_bias else None
        qkv = planned_causal_conv1d(self._plan, qkv, self.conv1d.weight.squeeze(1), conv_bias, self.activation,
                                    **packed)
        query, key, value, gate, beta, alpha = self._prepare_input_for_gated_delta_rule(qkv, gate, b, s, beta, alpha)
        g, beta = self._compute_g_and_beta(self.A_log, self.dt_bias, alpha, beta)
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

    def _gated_norm(self, core_attn_out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Megatron's gated output norm, back to ``[s, b, heads x V]`` (no all-to-all: the heads never left)."""
        b, s = core_attn_out.shape[:2]
        return self._apply_gated_norm(core_attn_out, gate).reshape(b, s, -1).transpose(0, 1).contiguous()

    def _prepare_input_for_gated_delta_rule(self, qkv, gate, batch, seq_len, *gate_feats):
        """Megatron's split of the convolved ``[q k v]`` into heads, the L2 norm of q and k and their
        repetition for grouped heads, with this rank's full head count (Megatron's divides it by CP)."""
        query_key, value = torch.split(qkv, [2 * self.qk_dim_local_tp, self.v_dim_local_tp], dim=-1)
        query_key = query_key.reshape(batch, seq_len, -1, self.key_head_dim)
        value = value.reshape(batch, seq_len, -1, self.value_head_dim)
        if self.use_qk_l2norm:
            query_key = l2norm(query_key)
        query, key = torch.split(query_key, [self.num_k_heads_local_tp] * 2, dim=2)
        if self.num_value_heads // self.num_key_heads > 1:
            repeat = self.num_value_heads // self.num_key_heads
            query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
        return (query.contiguous(), key.contiguous(), value.contiguous(), gate.contiguous(),
                *(t.contiguous() for t in gate_feats))

    @jit_fuser
    def _compute_g_and_beta(self, A_log: torch.Tensor, dt_bias: torch.Tensor, alpha: torch.Tensor,
                            beta: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Megatron's log decay ``g = -exp(A_log) softplus(alpha + dt_bias)`` and ``beta = sigmoid(b)``,
        the decay in float32 at least (Megatron's: exactly float32; a float64 model, the tests' reference,
        keeps float64)."""
        g = -A_log.exp() * F.softplus(alpha.to(torch.promote_types(alpha.dtype, torch.float32)) + dt_bias)
        return g, beta.sigmoid()

    @jit_fuser
    def _apply_gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Megatron's gated output norm ``out_norm(x) * silu(gate)``, the gate in float32 at least
        (Megatron's: exactly float32)."""
        y = self.out_norm(x.reshape(-1, x.shape[-1]))
        gate = gate.reshape(-1, gate.shape[-1])
        return (y * self.act_fn(gate.to(torch.promote_types(gate.dtype, torch.float32)))).to(x.dtype)

    def _context_parallel_gated_delta_rule(self, q, k, v, g, beta, initial_state=None, output_final_state=False,
                                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, per_document=False):
        """The recurrence over the CP group (``gated_delta_rule`` of Megatron's module: its arguments)."""
        if use_qk_l2norm_in_kernel:
            raise ValueError(f"{WHO}: q and k are normalised before the recurrence (use_qk_l2norm)")
        return planned_gated_delta_rule(self._plan, q, k, v, g, beta, initial_state=initial_state,
                                        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                        per_document=per_document)

    def _first_call(self, qkv, beta, packed):
        """The CP plan, after the operator's input checks (the same error on every CP rank, before any
        transfer, naming the Megatron flags that set what they check). The convolution runs before the
        recurrence's inputs exist, so the checks see tensors of their shapes (views, nothing copied)."""
        cp = self.cp_group.size() > 1
        group, strategy = (self.cp_group, self.cp_strategy) if cp else (None, "none")
        name = f"{WHO} (layer {self.layer_number})"
        b, s, H = beta.shape
        qk = beta.unsqueeze(-1).expand(b, s, H, self.key_head_dim)
        v = beta.unsqueeze(-1).expand(b, s, H, self.value_head_dim)
        try:
            check_inputs(qk, qk, v, beta, None, group=group, strategy=strategy, layout=self.cp_layout,
                         num_blocks=self.cp_num_blocks, output_final_state=False, transport=self.cp_transport,
                         beta=beta, op=name, **packed)
        except ValueError as e:
            raise ValueError(
                f"{e}\n  (through Megatron, each context-parallel rank gets --seq-length / --context-parallel-size "
                "tokens: --seq-length must be a multiple of 2 x --context-parallel-size for the zigzag layout, of "
                "--context-parallel-size for the contiguous one)") from None
        self._validated = True
        self._plan = cp_plan(group, strategy=strategy, layout=self.cp_layout, num_blocks=self.cp_num_blocks,
                             transport=self.cp_transport, like=qkv, name=name)
        check_scans_when_gradients_finish(self.config)


@contextlib.contextmanager
def _megatron_constructible(on_gpu: bool):
    """Let Megatron's constructor build the module where its forward would not run. It refuses
    without fla (its forward calls fla; ours only on CUDA, checked before), and it puts the
    convolution and gate parameters on ``torch.cuda.current_device()``: on a host without CUDA,
    the host stands in (``checkpoint.host_as_cuda``)."""
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


def _check_config(config, submodules, strategy, layout, num_blocks, packed_split, transport, tp, cp):
    """Start-up errors that name the flag to change."""
    as_layout(layout)
    check_packed_split(packed_split, WHO)
    if transport not in TRANSPORTS:
        raise ValueError(f"{WHO}: cp_transport {transport!r} is not one of {', '.join(TRANSPORTS)}")
    if strategy not in CP_STRATEGIES:
        raise ValueError(f"{WHO}: cp_strategy {strategy!r} is not one of {', '.join(CP_STRATEGIES)}")
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    if nk % tp or nv % tp:
        raise ValueError(f"{WHO}: --linear-num-key-heads ({nk}) and --linear-num-value-heads ({nv}) must be "
                         f"divisible by --tensor-model-parallel-size ({tp}): each TP rank holds whole heads")
    if nv % nk:
        raise ValueError(f"{WHO}: --linear-num-value-heads ({nv}) must be a multiple of --linear-num-key-heads ({nk})")
    if strategy == "a2a" and cp > 1 and (nv // tp) % cp:
        raise ValueError(f"{WHO}: the a2a strategy splits each TP rank's {nv // tp} value heads over "
                         f"--context-parallel-size ({cp}): make --linear-num-value-heads / "
                         f"--tensor-model-parallel-size a multiple of --context-parallel-size, or use the zeco "
                         f"strategy (--spec megatron_zeco.specs gdn_hybrid_stack_local_spec)")
    V = config.linear_value_head_dim
    if not isinstance(num_blocks, int) or num_blocks < 1 or V % num_blocks:
        raise ValueError(f"{WHO}: cp_num_blocks ({num_blocks!r}) must be a positive divisor of "
                         f"--linear-value-head-dim ({V})")
    if getattr(config.activation_func, "__name__", None) not in ("silu", "swish"):
        name = getattr(config.activation_func, "__name__", config.activation_func)
        raise ValueError(f"{WHO}: Gated DeltaNet applies config.activation_func after its short convolution "
                         f"and to its output gate, and fla's kernels (Megatron's too) compute it as SiLU only; "
                         f"got {name}: pass --swiglu (activation_func = torch.nn.functional.silu)")
    check_low_precision(config, submodules, ("in_proj", "out_proj"), WHO, "gdn_hybrid_stack_te_spec")
