"""The gated output norm of Gated DeltaNet and KDA on one device: ``rms_norm(x) * weight * act(gate)``.

Per row of the last dim (a head's ``V`` channels):

    y = x / sqrt(mean(x^2) + eps) * weight * act(gate),    act = SiLU (Gated DeltaNet) or sigmoid (KDA)

computed in float32 at least and returned in the dtype of ``x``. On CUDA flash-linear-attention's
fused kernel runs it (``fla.modules.norm.rms_norm_gated``: one kernel forward, one backward, no
intermediate rounding); elsewhere, and for float64, the PyTorch form below, which computes the same
in float32 (float64 for float64 inputs). ``MEGATRON_ZECO_BACKEND=torch`` forces the PyTorch form.
Differentiable in ``x``, ``gate`` and ``weight``.
"""

import torch
import torch.nn.functional as F

from .backend import fla, uses_kernels

Tensor = torch.Tensor
ACTIVATIONS = {"silu": "swish", "sigmoid": "sigmoid"}  # this package's names -> fla's


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float, activation: str = "silu") -> Tensor:
    """``rms_norm(x) * weight * act(gate)`` over the last dim.

    Args:
        x: ``[..., D]``; gate: the same shape (any dtype; read in float32 at least).
        weight: ``[D]``.
        eps: added to the mean square.
        activation: ``silu`` or ``sigmoid``, applied to the gate.

    Returns:
        ``[..., D]`` in the dtype of ``x``.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated_rms_norm: activation {activation!r} is not one of {tuple(ACTIVATIONS)}")
    if gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: gate {tuple(gate.shape)} and x {tuple(x.shape)} differ in shape")
    if uses_kernels(x.device, x.dtype):
        return _fla_rms_norm_gated()(x, gate.to(x.dtype), weight, None, activation=ACTIVATIONS[activation], eps=eps)
    fp = torch.promote_types(x.dtype, torch.float32)
    y = F.rms_norm(x.to(fp), (x.shape[-1],), weight.to(fp), eps)
    gate = gate.to(fp)
    return (y * (F.silu(gate) if activation == "silu" else gate.sigmoid())).to(x.dtype)


def _fla_rms_norm_gated():
    return fla("the gated output norm on CUDA", "fla.modules.norm.fused_norm_gate.rms_norm_gated")
