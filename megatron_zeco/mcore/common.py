"""Megatron-Core glue every layer of this package shares.

Packed batches (Megatron's THD ``packed_seq_params``) as the operators take them; the start-up
checks a token mixer runs against Megatron's flags; a layer's context parallelism (``LayerCP``);
the step check that hooks Megatron's gradient finalisation.
"""

from typing import Tuple, Union

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.spec_utils import ModuleSpec

from ..comm.transport import claim_transport
from ..comm.watch import ScanTimeoutError, check_scans
from ..cp.checks import check_inputs
from ..cp.config import PACKED_SPLITS, CPConfig
from ..cp.operator import Arguments, refuse_capture, refuse_packed_capture
from ..cp.plan import CPPlan, make_plan
from ..cp.strategies import BY_NAME


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
    checks them too: ``comm.watch.install_step_check``.)"""
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


# How a layer's short convolution starts (``conv_init``): the values a layer takes besides a float.
CONV_INITS = ("identity",)


def check_conv_init(conv_init: Union[None, float, str], who: str) -> None:
    """ValueError (naming ``who``) unless ``conv_init`` is None, a positive float or ``"identity"``."""
    if conv_init is None or conv_init in CONV_INITS:
        return
    if isinstance(conv_init, bool) or not isinstance(conv_init, (int, float)) or not conv_init > 0:
        raise ValueError(f"{who}: conv_init must be None (nn.Conv1d's initialisation), a positive float (taps "
                         f"uniform in [-conv_init, conv_init], as Megatron's GatedDeltaNet) or 'identity', got "
                         f"{conv_init!r}")


@torch.no_grad()
def init_conv_taps(weight: torch.Tensor, conv_init: Union[None, float, str]) -> torch.Tensor:
    """Draw a depthwise short convolution's taps ``weight [channels, ..., W]`` (the last tap weighs the
    current token) in place: ``None`` as ``nn.Conv1d`` (uniform in ``+-W ** -0.5``, its fan-in being W),
    a float ``c`` uniform in ``+-c`` (Megatron's GatedDeltaNet's ``conv_init``), ``"identity"`` the current
    token's tap 1 and the others 0, so that the layer starts as it would without the convolution (fla's
    ``use_short_conv=False``: ``SiLU(projection)``) and learns the taps."""
    if conv_init == "identity":
        weight.zero_()
        weight[..., -1] = 1.0
        return weight
    bound = weight.shape[-1] ** -0.5 if conv_init is None else float(conv_init)
    return weight.uniform_(-bound, bound)


def check_gate_timescales(timescales, who: str) -> None:
    """ValueError (naming ``who``) unless ``timescales`` is None or ``(shortest, longest)`` with
    ``0 < shortest <= longest``."""
    if timescales is None:
        return
    try:
        shortest, longest = (float(t) for t in timescales)
    except (TypeError, ValueError):
        shortest = longest = float("nan")
    if not 0 < shortest <= longest:
        raise ValueError(f"{who}: gate_timescales must be (shortest, longest) in tokens with 0 < shortest <= "
                         f"longest, got {timescales!r}")


def log_uniform(n: int, low: float, high: float) -> torch.Tensor:
    """``n`` values log-uniform in ``[low, high]`` (float64, from torch's generator)."""
    return low * (high / low) ** torch.rand(n, dtype=torch.float64)


def log_spaced(n: int, low: float, high: float) -> torch.Tensor:
    """``n`` values evenly spaced in log over ``[low, high]``, the midpoints of n equal steps (float64)."""
    return low * (high / low) ** ((torch.arange(n, dtype=torch.float64) + 0.5) / n)


def dt_bias_for_timescales(tau: torch.Tensor) -> torch.Tensor:
    """A Mamba-style gate bias for memories of ``tau`` tokens: ``softplus(dt_bias) = 1 / tau``, so that with
    ``A = 1`` (``A_log = 0``) a decay ``exp(-A softplus(x + dt_bias))`` starts at ``exp(-1 / tau)`` per token
    (for ``x = 0``)."""
    return softplus_inverse(1 / tau)


def softplus_inverse(y: torch.Tensor) -> torch.Tensor:
    """``x`` with ``softplus(x) = y`` (y > 0), stable for small and large y."""
    return y + torch.log(-torch.expm1(-y))


# Through Megatron each CP rank gets --seq-length / --context-parallel-size tokens: what an input error at
# a layer's first step usually means.
SEQUENCE_HINT = ("(through Megatron, each context-parallel rank gets --seq-length / --context-parallel-size "
                 "tokens: --seq-length must be a multiple of 2 x --context-parallel-size for the zigzag layout, of "
                 "--context-parallel-size for the contiguous one, times cp_piece_split)")


class LayerCP:
    """A layer's context parallelism: its :class:`~megatron_zeco.cp.CPConfig`, checked when the layer is
    built against the layer's heads and group sizes; its plan, made at the first forward pass (it
    needs the device; collective), after the operator's input checks have run on every CP rank alike.

    Args:
        op: the operator (:class:`~megatron_zeco.cp.operator.Operator`).
        config: the layer's CPConfig.
        groups: ``(tp, cp)`` process groups.
        heads: the layer's heads (all TP ranks') and the flag that sets them.
        dims: ``((key dim, its flag), (value dim, its flag))`` of a head.
        who: names the layer in errors (``ZecoGatedDeltaNet (layer 3)``).
        local_spec: the spec to suggest where a2a cannot split the heads.
    """

    def __init__(self, op, config: CPConfig, groups, heads: Tuple[int, str], dims, who: str, local_spec: str):
        tp, cp = (g.size() for g in groups)
        heads, flag = heads
        self.op, self.config, self.group, self.who = op, config, groups[1], who
        self.plan = None
        if heads % tp:  # TransformerConfig checks its own tensor_model_parallel_size; this is the group's
            raise ValueError(f"{who}: {flag} ({heads}) must be divisible by "
                             f"--tensor-model-parallel-size ({tp}): each TP rank holds whole heads")
        if BY_NAME[config.strategy].splits_heads and cp > 1 and (heads // tp) % cp:
            raise ValueError(f"{who}: the a2a strategy splits each TP rank's {heads // tp} heads over "
                             f"--context-parallel-size ({cp}): make {flag} / --tensor-model-parallel-size a "
                             f"multiple of --context-parallel-size, or use the zeco strategy "
                             f"(--spec megatron_zeco.specs {local_spec})")
        try:
            config.check_dims(dims[0][0], dims[1][0])
        except ValueError as e:
            (_, key_flag), (_, value_flag) = dims
            flags = f"the head dim is {key_flag}" if key_flag == value_flag else \
                f"the key head dim is {key_flag}, the value head dim {value_flag}"
            raise ValueError(f"{who}: {e} ({flags})") from None
        claim_transport(self, config.transport, who)

    def packed(self, packed_seq_params) -> dict:
        """The operator's ``cu_seqlens`` and ``per_document`` for Megatron's ``packed_seq_params``
        (:func:`packed_arguments`, split by the config's ``packed_split``; ``{}`` for an unpacked batch),
        after, before the first plan, the check that document boundaries are offsets
        (:func:`check_document_boundaries`)."""
        if self.plan is None:
            check_document_boundaries(packed_seq_params, self.who)
        packed = packed_arguments(packed_seq_params, self.config.packed_split, self.who)
        refuse_packed_capture(self.who, bool(packed))
        return packed

    def planned(self, args: Arguments, megatron_config) -> CPPlan:
        """The plan, made at the first call after the operator's cross-rank input checks (an error
        names the Megatron flags behind it); the gradient finalisation of Megatron's training loop
        then checks the scans (:func:`check_scans_when_gradients_finish`)."""
        if self.plan is None:
            refuse_capture(self.who, "its first call checks the inputs across ranks and makes its plan (collectives, "
                                     "host reads): run one step before capturing")
            group = self.group if self.group.size() > 1 else None
            try:
                check_inputs(self.op, self.config, [], args, group, self.who)
            except ValueError as e:
                raise ValueError(f"{e}\n  {SEQUENCE_HINT}") from None
            self.plan = make_plan(self.config, group, like=args.tensors[0], name=self.who)
            check_scans_when_gradients_finish(megatron_config)
        return self.plan
