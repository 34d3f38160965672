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

from .comm import as_layout
from .comm.peer import TRANSPORTS, ScanTimeoutError, check_scans, claim_transport
from .cp import STRATEGIES, cp_plan, planned_gla
from .cp.checks import check_inputs
from .ops import require_backend

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
        cp_strategy: ``zeco``, ``lasp2``, ``lasp1`` or ``a2a`` (see :func:`megatron_zeco.zeco_gla`).
        cp_layout: ``zigzag`` (Megatron's CP batch split) or ``contiguous``.
        cp_num_blocks: All-Scan pipeline blocks (a divisor of ``kv_channels``).
        cp_overlap_scan: a side CUDA stream for (part of) the scan (``overlap`` of :func:`megatron_zeco.zeco_gla`;
            None: on for zeco over peer memory).
        cp_transport: how All-Scan moves states: ``auto`` (peer memory over NVLink when the CP group
            is on one node, else NCCL messages), ``peer_memory``, ``nvshmem`` (device-initiated puts,
            across nodes too) or ``send_recv`` (``transport`` of :func:`megatron_zeco.zeco_gla`).
        cp_piece_split: ``zeco`` and ``lasp2``, unpacked batches: run each of a rank's pieces as
            this many batched sub-pieces (``piece_split`` of :func:`megatron_zeco.zeco_gla`; exact,
            more parallel work for fla's state kernels; --seq-length must then divide into
            --context-parallel-size x pieces per rank x cp_piece_split). None: chosen by the op
            (2 for zeco with the contiguous layout, else 1).
        cp_packed_split: how packed sequences (THD) are split over CP ranks: ``document``
            (each document cut by ``cp_layout``: Megatron's THD split,
            ``get_thd_batch_on_this_cp_rank`` / ``--sft``), ``sequence`` (the whole packed
            sequence cut by ``cp_layout``: ``--dataloader-inter-document-masking`` without
            ``--sft``), or ``auto``: that rule applied to Megatron-LM's arguments when they
            are set (``pretrain_gpt.py``), else ``document``.
        cp_node_size: ranks of the CP group per node (``node_size`` of :func:`megatron_zeco.zeco_gla`;
            None: from the hosts, or ``$MEGATRON_ZECO_NODE_SIZE``).
        gate_low_rank_dim, gate_normalizer: GLA's forget-gate parameterisation.
        gate_timescales: ``(shortest, longest)`` memory in tokens: initialise the gate
            bias so that channel decays start at ``exp(-1/tau)``, tau log-uniform in
            that range (as Mamba's dt). None: zero bias, as fla (decay ~0.96 per token).
        pg_collection: Megatron's process groups (``tp``, ``cp``); taken from
            ``parallel_state`` when absent.
        **kwargs: anything else TransformerLayer passes (``cp_comm_type``,
            ``pp_layer_offset``, ``name``, ...) is accepted and unused.
    """

    def __init__(
        self,
        config,
        submodules: GatedLinearAttentionSubmodules,
        layer_number: int = 1,
        cp_strategy: str = "zeco",
        cp_layout: str = "zigzag",
        cp_num_blocks: int = 1,
        cp_overlap_scan: Optional[bool] = None,
        cp_transport: str = "auto",
        cp_piece_split: Optional[int] = None,
        cp_packed_split: str = "auto",
        cp_node_size: Optional[int] = None,
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
        tp, cp = self.tp_group.size(), self.cp_group.size()

        self.num_heads = config.num_attention_heads
        self.head_dim = config.kv_channels
        _check_config(config, submodules, cp_strategy, cp_layout, cp_num_blocks, cp_packed_split, cp_transport,
                      cp_piece_split, tp, cp, cp_node_size)
        if not config.use_cpu_initialization:  # parameters, so the layer, live on the GPU
            require_backend("cuda", config.params_dtype)
        self.heads_per_rank = self.num_heads // tp
        self.cp_strategy, self.cp_layout, self.cp_num_blocks = cp_strategy, cp_layout, cp_num_blocks
        self.cp_packed_split, self.cp_overlap_scan, self.cp_transport = cp_packed_split, cp_overlap_scan, cp_transport
        self.cp_piece_split, self.cp_node_size = cp_piece_split, cp_node_size
        claim_transport(self, cp_transport, f"GatedLinearAttention (layer {layer_number})")
        self._plan = None  # the CP plan, built at the first forward (it needs the device; collective)
        self.gate_normalizer = gate_normalizer
        self._validated = False
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
        packed = self._packed(packed_seq_params)
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

        cp = self.cp_group.size() > 1
        group, strategy = (self.cp_group, self.cp_strategy) if cp else (None, "none")
        name = f"GatedLinearAttention (layer {self.layer_number})"
        if not self._validated:
            self._validate(q, k, v, g, group, strategy, name, packed)
        if self._plan is None:
            self._plan = cp_plan(group, strategy=strategy, layout=self.cp_layout, num_blocks=self.cp_num_blocks,
                                 overlap=self.cp_overlap_scan, transport=self.cp_transport,
                                 node_size=self.cp_node_size, like=q, name=name)
            check_scans_when_gradients_finish(self.config)
        o, _ = planned_gla(self._plan, q, k, v, g, piece_split=self._piece_split(packed), **packed)

        weight = tensor_parallel.copy_to_tensor_model_parallel_region(self.out_norm_weight, group=self.tp_group) \
            if self.tp_group.size() > 1 else self.out_norm_weight
        o = F.rms_norm(o.to(fp), (self.head_dim,), weight.to(fp), self.config.layernorm_epsilon)
        o = (o * F.silu(r.to(fp))).to(r.dtype)
        o = o.transpose(0, 1).reshape(s, b, self.heads_per_rank * self.head_dim)
        return self.out_proj(o)

    def _validate(self, q, k, v, g, group, strategy, name, packed):
        """First call: the op's input checks (the same error on every CP rank, before any
        transfer), naming the Megatron flags that set what they check."""
        try:
            check_inputs(q, k, v, g, None, group=group, strategy=strategy, layout=self.cp_layout,
                         num_blocks=self.cp_num_blocks, output_final_state=False, transport=self.cp_transport,
                         piece_split=self._piece_split(packed), **packed)
        except ValueError as e:
            raise ValueError(
                f"{name}: {e}\n  (through Megatron, each context-parallel rank gets --seq-length / "
                "--context-parallel-size tokens: --seq-length must be a multiple of 2 x --context-parallel-size "
                "for the zigzag layout, of --context-parallel-size for the contiguous one, times cp_piece_split)") \
                from None
        self._validated = True

    def _piece_split(self, packed) -> int:
        """Sub-pieces per piece for this batch: packed batches already run as segments."""
        return 1 if packed else self.cp_piece_split

    def _packed(self, packed_seq_params):
        """``zeco_gla`` arguments for this batch's documents (none for an unpacked batch)."""
        if not self._validated:
            check_document_boundaries(packed_seq_params, "GatedLinearAttention")
        return packed_arguments(packed_seq_params, self.cp_packed_split, "GatedLinearAttention")


PACKED_SPLITS = ("auto", "document", "sequence")


class _ScansChecked:
    """Megatron's gradient finalisation (``config.finalize_model_grads_func``), then a check of this
    process's scans: a scan that gave up (its results NaN) raises ``ScanTimeoutError`` naming the
    layer and the peer, also where Megatron's own check for NaN gradients raises first."""

    def __init__(self, finalize):
        self.finalize = finalize

    def __call__(self, *args, **kwargs):
        try:
            result = self.finalize(*args, **kwargs)
        except ScanTimeoutError:
            raise
        except Exception as e:  # Megatron found NaN: name the scan that caused it, if one did
            check_scans_after(e)
            raise
        check_scans()
        return result


def check_scans_after(error: BaseException) -> None:
    """Raise ``ScanTimeoutError`` from ``error`` if a scan of this process gave up (its NaN explain it)."""
    try:
        check_scans()
    except ScanTimeoutError as timeout:
        raise timeout from error


def check_scans_when_gradients_finish(config) -> None:
    """Check this process's scans (:func:`megatron_zeco.check_scans`) where Megatron-LM's training loop
    finishes each step's gradients: it sets ``config.finalize_model_grads_func`` (``pretrain_gpt.py``,
    ``pretrain_hybrid.py``) before the first forward pass, which calls this. (Every optimizer step
    checks them too: ``comm.peer.install_step_check``.)"""
    finalize = getattr(config, "finalize_model_grads_func", None)
    if finalize is not None and not isinstance(finalize, _ScansChecked):
        config.finalize_model_grads_func = _ScansChecked(finalize)


def check_document_boundaries(packed_seq_params, who: str) -> None:
    """ValueError if Megatron-LM gives document boundaries only as a dense attention mask
    (``--reset-attention-mask`` without packed sequences), which a recurrent token mixer cannot use."""
    if packed_seq_params is None and _megatron_lm_arg("reset_attention_mask"):
        raise ValueError(f"{who}: --reset-attention-mask gives document boundaries only as a dense attention mask, "
                         f"which a recurrent token mixer cannot use; pass them as cu_seqlens with "
                         f"--dataloader-inter-document-masking (or --sft), or drop --reset-attention-mask")


def check_packed_split(split: str, who: str) -> None:
    """ValueError (naming ``who``) unless ``split`` is a ``cp_packed_split`` value."""
    if split not in PACKED_SPLITS:
        raise ValueError(f"{who}: cp_packed_split {split!r} is not one of {', '.join(PACKED_SPLITS)}")


def packed_arguments(packed_seq_params, split: str, who: str) -> dict:
    """``zeco_gla``'s ``cu_seqlens`` and ``per_document`` for Megatron's ``packed_seq_params`` (THD),
    ``{}`` for an unpacked batch. ``split``: ``document``, ``sequence`` or ``auto`` (from
    Megatron-LM's arguments: ``sequence`` with ``--dataloader-inter-document-masking`` unless
    ``--sft``, else ``document``). ``who`` names the caller in errors."""
    if packed_seq_params is None:
        return {}
    if packed_seq_params.qkv_format != "thd":
        raise NotImplementedError(f"{who}: packed_seq_params.qkv_format {packed_seq_params.qkv_format!r} is not "
                                  f"supported; only 'thd'")
    if packed_seq_params.cp_group is not None:
        raise NotImplementedError(f"{who}: hybrid context parallelism (a CP group per batch in packed_seq_params) "
                                  f"is not supported; train without --hybrid-context-parallel")
    padded = packed_seq_params.cu_seqlens_q_padded
    cu_seqlens = packed_seq_params.cu_seqlens_q if padded is None else padded
    if cu_seqlens is None:
        raise ValueError(f"{who}: packed_seq_params (THD) carries no document offsets "
                         f"(cu_seqlens_q / cu_seqlens_q_padded)")
    if split == "auto":
        split = "sequence" if _megatron_lm_arg("dataloader_inter_document_masking") and not _megatron_lm_arg("sft") \
            else "document"
    return dict(cu_seqlens=cu_seqlens, per_document=split == "document")


def _megatron_lm_arg(name):
    """A flag of Megatron-LM's parsed arguments (``pretrain_gpt.py``); False without them."""
    try:
        from megatron.training.global_vars import get_args
        return bool(getattr(get_args(), name, False))
    except (ImportError, AssertionError):  # megatron-core alone, or arguments not parsed
        return False


def _check_config(config, submodules, strategy, layout, num_blocks, packed_split, transport, piece_split, tp, cp,
                  node_size=None):
    """Start-up errors that name the flag to change."""
    as_layout(layout)
    if node_size is not None and (isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1):
        raise ValueError(f"GatedLinearAttention: cp_node_size {node_size!r} must be a positive integer (ranks of "
                         f"the CP group per node) or None")
    if piece_split is not None and (not isinstance(piece_split, int) or isinstance(piece_split, bool)
                                    or piece_split < 1):
        raise ValueError(f"GatedLinearAttention: cp_piece_split {piece_split!r} must be a positive integer or None")
    if transport not in TRANSPORTS:
        raise ValueError(f"GatedLinearAttention: cp_transport {transport!r} is not one of {', '.join(TRANSPORTS)}")
    check_packed_split(packed_split, "GatedLinearAttention")
    if strategy not in STRATEGIES or strategy == "none":
        raise ValueError(f"GatedLinearAttention: cp_strategy {strategy!r} is not one of "
                         f"{', '.join(s for s in STRATEGIES if s != 'none')}")
    H, D = config.num_attention_heads, config.kv_channels
    if H % tp:  # TransformerConfig checks its own tensor_model_parallel_size; this is the group's
        raise ValueError(f"GatedLinearAttention: --num-attention-heads ({H}) must be divisible by "
                         f"--tensor-model-parallel-size ({tp}): each TP rank holds whole heads")
    if strategy == "a2a" and cp > 1 and (H // tp) % cp:
        raise ValueError(f"GatedLinearAttention: the a2a strategy splits each TP rank's {H // tp} heads over "
                         f"--context-parallel-size ({cp}): make --num-attention-heads / "
                         f"--tensor-model-parallel-size a multiple of --context-parallel-size, or use the zeco "
                         f"strategy (--spec megatron_zeco.specs gla_local_spec)")
    if D % num_blocks:
        raise ValueError(f"GatedLinearAttention: cp_num_blocks ({num_blocks}) must divide --kv-channels ({D})")
    check_low_precision(config, submodules, ("in_proj", "gate_up", "out_proj"), "GatedLinearAttention", "gla_te_spec")


def check_low_precision(config, submodules, linears, who: str, te_spec: str) -> None:
    """ValueError if --fp8-format / --fp4-format is set but some of ``linears`` (names in ``submodules``)
    are Megatron-Core's own, which run their GEMMs in the parameters' dtype whatever the flag says."""
    fmt, flag = (config.fp8, "--fp8-format") if config.fp8 else (config.fp4, "--fp4-format")
    megatron_linears = (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear)
    local = [n for n in linears if _is_subclass(getattr(submodules, n), megatron_linears)]
    if fmt and local:
        raise ValueError(f"{who}: {flag} {fmt} runs GEMMs in low precision only in TransformerEngine "
                         f"linears; {', '.join(local)} here are Megatron-Core's, which would ignore it. "
                         f"Use --spec megatron_zeco.specs {te_spec}, or drop {flag}")


def _is_subclass(spec, classes) -> bool:
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    return isinstance(module, type) and issubclass(module, classes)
