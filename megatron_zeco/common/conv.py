"""The short causal convolution of Gated DeltaNet and KDA (and Mamba) on one device, started from given inputs.

Depthwise, per channel c with a kernel of W taps:

    y_t = act(b_c + sum_{j=0}^{W-1} w[c, j] * x_{t - (W-1) + j})

over a sequence whose W - 1 inputs before its first token are given (``initial_state``; zeros
where there are none: a sequence start or a document start). Under context parallelism they are
the last tokens of the piece before, held by another rank (``comm/halo.py`` fetches them); a
whole unsplit sequence has zeros there, which is ``torch.nn.Conv1d`` with left padding W - 1.

On CUDA flash-linear-attention's ``causal_conv1d`` runs it (the kernel Megatron-Core's
GatedDeltaNet calls), whose ``initial_state`` ``[N, C, W]`` holds the same W - 1 inputs in its last
W - 1 slots; elsewhere, and for float64, :func:`causal_conv1d` below in PyTorch. Differentiable in
x, the weight, the bias and the initial state. ``MEGATRON_ZECO_BACKEND=torch`` forces the
PyTorch form.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from .backend import fla, uses_kernels

Tensor = torch.Tensor
ACTIVATIONS = (None, "silu", "swish")


def causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None,
                  initial_state: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """Depthwise causal convolution of ``x`` started from ``initial_state``.

    Args:
        x: ``[B, T, C]`` (B = 1 with ``cu_seqlens``).
        weight: ``[C, W]``; bias: ``[C]`` or None.
        activation: None, ``silu`` or ``swish`` (the same).
        initial_state: ``[N, W-1, C]``: the W - 1 inputs before each of the N sequences (N = B, or
            the segments of ``cu_seqlens``), oldest first; None for zeros.
        cu_seqlens: ``[N+1]`` int64 offsets of N segments of the one row of ``x``, each convolved
            on its own (host values are read).

    Returns:
        ``[B, T, C]`` in the dtype of ``x``.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation {activation!r} is not one of {ACTIVATIONS}")
    if uses_kernels(x.device, x.dtype):
        return _fla_conv1d(x, weight, bias, activation, initial_state, cu_seqlens)
    if cu_seqlens is None:
        return _dense(x, weight, bias, activation, initial_state)
    bounds = cu_seqlens.tolist()
    parts = [_dense(x[:, a:b], weight, bias, activation, None if initial_state is None else initial_state[n:n + 1])
             for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
    return torch.cat(parts, dim=1)


def _dense(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str],
           initial_state: Optional[Tensor]) -> Tensor:
    """B sequences: the inputs before each (zeros if None), then ``torch.nn.functional.conv1d``."""
    B, _, C = x.shape
    W = weight.shape[-1]
    before = x.new_zeros(B, W - 1, C) if initial_state is None else initial_state.to(x.dtype)
    y = F.conv1d(torch.cat([before, x], dim=1).transpose(1, 2), weight.to(x.dtype).unsqueeze(1),
                 None if bias is None else bias.to(x.dtype), groups=C).transpose(1, 2)
    return y if activation is None else F.silu(y)


def _fla_conv1d(x, weight, bias, activation, initial_state, cu_seqlens):
    """fla's kernel; its initial state is ``[N, C, W]`` with the W - 1 inputs in the last slots."""
    if initial_state is not None:
        initial_state = F.pad(initial_state, (0, 0, 1, 0)).transpose(1, 2).contiguous().to(x.dtype)
    # fla's kernels take any token and channel strides (x is often a slice of a projection's output)
    y, _ = _fla_causal_conv1d()(x=x, weight=weight, bias=bias, activation=activation,
                                initial_state=initial_state, output_final_state=False, cu_seqlens=cu_seqlens)
    return y


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in float32 at least, returned in x's dtype: fla's
    ``l2norm`` (Megatron-Core's GatedDeltaNet normalises q and k with it), which runs it on CUDA."""
    if uses_kernels(x.device, x.dtype):
        return _fla_l2norm()(x.contiguous(), eps=eps)
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def _fla_causal_conv1d():
    return fla("the short convolution on CUDA", "fla.modules.convolution.causal_conv1d")


def _fla_l2norm():
    return fla("the L2 norm on CUDA", "fla.modules.l2norm.l2norm")
