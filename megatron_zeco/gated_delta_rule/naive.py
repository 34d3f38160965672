"""The gated delta rule one token at a time: the obviously-right reference.

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t

Every faster path of the gated delta rule (chunked PyTorch, fla, and all the context-parallel
strategies) is tested against this loop run in float64.
"""

from typing import Optional, Tuple

import torch


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Step-by-step gated delta rule (differentiable; slow; for tests), fla's ``chunk_gated_delta_rule``:

        S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,     o_t = scale * S_t^T q_t

    Args:
        q, k: ``[B, T, H, K]`` (k usually L2-normalised: the recurrence is contractive then).
        v: ``[B, T, H, V]``.
        g: ``[B, T, H]`` log decay per head and token (``g <= 0``).
        beta: ``[B, T, H]`` write strength, in ``[0, 1]``.
        scale: multiplies the output; defaults to ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` state before the first token, or None for zeros.
        output_final_state: also return the state after the last token.

    Returns:
        ``o [B, T, H, V]`` in the dtype of ``q`` and the final state ``[B, H, K, V]`` (or None),
        computed in the dtype of the inputs: pass float64 tensors to get the reference.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K ** -0.5
    S = q.new_zeros(B, H, K, V)
    if initial_state is not None:
        S = S + initial_state.to(q.dtype)
    outputs = []
    for t in range(T):
        S = g[:, t].exp()[..., None, None] * S
        k_t = k[:, t]
        residual = v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S)  # what the state predicts for k_t, corrected
        S = S + (beta[:, t, :, None] * k_t).unsqueeze(-1) * residual.unsqueeze(-2)
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, H, V)
    return o, (S if output_final_state else None)
