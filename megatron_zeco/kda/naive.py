"""Kimi Delta Attention (KDA), one token at a time: the obviously-right reference.

fla's ``chunk_kda`` (fla-core 0.6.0, ``fla/ops/kda/naive.py``, ``naive_recurrent_kda``) runs, per value
head, with the state ``S`` of shape ``[K, V]``::

    S = S * exp(g_t)[:, None]                      # decay first, one rate per key channel
    S = S + (beta_t k_t) (v_t - k_t^T S)^T         # then the delta update, its residual read from the decayed S
    o_t = (scale q_t)^T S

that is, with ``a_t = exp(g_t)`` (a vector over the K key channels) and ``b_t = beta_t``,

    S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T,     o_t = scale * S_t^T q_t

(the gated delta rule is the special case of a decay equal over the channels: there ``Diag(a_t)`` is a
scalar and commutes with the update). Grouped value attention as fla's: with ``HV`` value heads and ``H``
query/key heads (``HV`` a multiple of ``H``), value head ``h`` reads query/key head ``h // (HV // H)``.
"""

from typing import Optional, Tuple

import torch

Tensor = torch.Tensor


def to_value_heads(x: Tensor, value_heads: int) -> Tensor:
    """``[B, T, H, K]`` queries or keys -> ``[B, T, HV, K]``: value head ``h`` reads head ``h // (HV // H)``."""
    H = x.shape[2]
    if value_heads % H:
        raise ValueError(f"the number of value heads ({value_heads}) must be a multiple of that of query/key "
                         f"heads ({H})")
    return x if value_heads == H else x.repeat_interleave(value_heads // H, dim=2)


def naive_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Step-by-step KDA (differentiable; slow; for tests), fla's ``chunk_kda`` call:

        S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,     o_t = scale * S_t^T q_t

    Args:
        q, k: ``[B, T, H, K]`` (k usually L2-normalised: the recurrence is contractive then).
        v: ``[B, T, HV, V]``, ``HV`` a multiple of ``H``.
        g: ``[B, T, HV, K]`` log decay per key channel, head and token (``g <= 0``).
        beta: ``[B, T, HV]`` write strength, in ``[0, 1]``.
        scale: multiplies the output; defaults to ``K ** -0.5``.
        initial_state: ``[B, HV, K, V]`` state before the first token, or None for zeros.
        output_final_state: also return the state after the last token.

    Returns:
        ``o [B, T, HV, V]`` and the final state ``[B, HV, K, V]`` (or None), computed in the dtype of the
        inputs: pass float64 tensors to get the reference.
    """
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if scale is None:
        scale = K ** -0.5
    q, k = to_value_heads(q, HV), to_value_heads(k, HV)
    S = q.new_zeros(B, HV, K, V)
    if initial_state is not None:
        S = S + initial_state.to(q.dtype)
    outputs = []
    for t in range(T):
        S = g[:, t].exp().unsqueeze(-1) * S
        k_t = k[:, t]
        residual = v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S)  # what the decayed state predicts for k_t, corrected
        S = S + (beta[:, t, :, None] * k_t).unsqueeze(-1) * residual.unsqueeze(-2)
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, HV, V)
    return o, (S if output_final_state else None)
