"""The gated delta rule, chunked, in plain PyTorch (the CPU path), and what a piece of it does to a state.

Per head, ``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T`` and ``o_t = scale * S_t^T q_t``
with ``a_t = exp(g_t)`` (``g`` a scalar log decay per head and token) and ``b_t = beta_t``.

The sequence is cut into chunks of C tokens. With ``G_i`` the cumulative log decay inside the chunk
(token i included) and ``S_0`` the state entering it, the state after token i is

    S_i = exp(G_i) S_0 + sum_{j<=i} exp(G_i - G_j) k_j nu_j^T,    nu_j = b_j (v_j - a_j S_{j-1}^T k_j)

and the corrections ``nu`` solve a unit lower-triangular system (the WY / UT transform):

    (I + L) nu = b v - (b exp(G) k) S_0,   L_jl = b_j exp(G_j - G_l) k_j . k_l  (l < j)
    so nu = U - W S_0  with  U = (I + L)^-1 (b v),  W = (I + L)^-1 (b exp(G) k).

Then, per chunk:

    o_i   = scale * (exp(G_i) q_i^T S_0 + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) nu_j)
    S_out = M_c S_0 + E_c,   M_c = exp(G_C) I - Kd^T W,   E_c = Kd^T U,   Kd_j = exp(G_C - G_j) k_j

A piece of sequence is the affine map ``S_out = M S_in + E`` (the chunks' maps composed): ZeCO's
summary, with a K x K matrix ``M`` where gated linear attention has a diagonal. This module computes
the chunks' terms; the passes over the chunks are ``common/delta.py``'s, shared with KDA. The gradient of the
piece's outputs with respect to ``S_in`` (``A``) walks the chunks backwards through ``M_c^T``.

Every exponent is <= 0, and no decay that is 1 by construction depends on ``g`` (the diagonal of
``exp(G_i - G_j)``, the last token's ``exp(G_C - G_C)``): with strong decay the gradient of ``g`` is
tiny, and two O(1) paths cancelling in it would leave rounding noise far above it. Computation runs
in float64 for float64 inputs and in float32 otherwise; states are float32 or float64.
Differentiable with torch.autograd. Packed input (``cu_seqlens``) runs as a zero-padded batch of
segments, as in ``gla/chunk.py`` (padding: ``beta = 0``, ``g = 0``, so the state passes unchanged).
"""

from typing import Optional, Tuple

import torch

from ..common import delta
from ..common.chunked import Segments, chunked, state_dtype
from ..common.delta import DeltaChunks

Tensor = torch.Tensor
DEFAULT_CHUNK_SIZE = 16


def _chunk_terms(q, k, v, g, beta, chunk_size) -> DeltaChunks:
    """The terms of every chunk (``common.delta``); ``q`` or ``v`` may be None."""
    dt = state_dtype(k.dtype)
    kc = chunked(k.to(dt), chunk_size)
    qc, vc = (None if x is None else chunked(x.to(dt), chunk_size) for x in (q, v))
    gc, bc = (chunked(x.to(dt).unsqueeze(-1), chunk_size).squeeze(-1) for x in (g, beta))
    C = kc.shape[-2]
    G = gc.cumsum(-1)
    below = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
    decay = torch.where(below, G.unsqueeze(-1) - G.unsqueeze(-2), float("-inf")).exp()
    # the gates after token j, summed directly (the last token's is an exact 0, not G_C - G_C)
    after = torch.cat([gc[..., 1:].flip(-1).cumsum(-1).flip(-1), torch.zeros_like(gc[..., :1])], dim=-1)
    eye = torch.eye(C, dtype=dt, device=k.device)
    lower = eye + bc.unsqueeze(-1) * decay * (kc @ kc.transpose(-1, -2))
    solve = lambda rhs: torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)  # noqa: E731
    U = None if vc is None else solve(bc.unsqueeze(-1) * vc)
    W = solve((bc * G.exp()).unsqueeze(-1) * kc)
    qg = attn = None
    if qc is not None:
        qg = qc * G.exp().unsqueeze(-1)
        attn = (qc @ kc.transpose(-1, -2)) * (decay + eye)
    last = gc.sum(-1).exp().unsqueeze(-1).expand(*gc.shape[:-1], kc.shape[-1])  # one decay for every key channel
    return DeltaChunks(qg, attn, U, W, kc * after.exp().unsqueeze(-1), last)


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None, output_final_state: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE, cu_seqlens: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """The gated delta rule over a whole sequence, chunk by chunk; fla's ``chunk_gated_delta_rule`` call.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log decay (<= 0);
            beta: ``[B, T, H]`` in ``[0, 1]``; one floating dtype. T need not be a multiple of ``chunk_size``.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` (``[N, H, K, V]`` with ``cu_seqlens``) or None for zeros.
        output_final_state: also return the state after the last token (of each segment).
        cu_seqlens: ``[N+1]`` offsets of N independent segments packed in one sequence (B = 1).

    Returns:
        ``o [B, T, H, V]`` in the dtype of ``v`` and the final state ``[B, H, K, V]``
        (``[N, H, K, V]``) in :func:`state_dtype`, or None.
    """
    if cu_seqlens is not None:
        segments = Segments(cu_seqlens, q.shape[1], q.shape[0])
        o, ht = chunk_gated_delta_rule(*(segments.split(x) for x in (q, k, v, g, beta)), scale, initial_state,
                                       output_final_state, chunk_size)
        return segments.merge(o), ht
    if scale is None:
        scale = q.shape[-1] ** -0.5
    o, S = delta.outputs(_chunk_terms(q, k, v, g, beta, chunk_size), scale, initial_state, q.shape[1])
    return o.to(v.dtype), (S if output_final_state else None)


def chunk_gated_delta_rule_state(
    k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE,
    cu_seqlens: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """What a piece of sequence does to a state passing through it: ``S_out = M S_in + E``.

    Args:
        k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g, beta: ``[B, T, H]``.
        cu_seqlens: ``[N+1]`` offsets of N segments (B = 1): one summary per segment.

    Returns:
        ``E [B, H, K, V]`` (the final state from a zero state) and ``M [B, H, K, K]``
        (``prod_t exp(g_t) (I - beta_t k_t k_t^T)``, latest token leftmost), in :func:`state_dtype`
        (``[N, ...]`` with ``cu_seqlens``).
    """
    if cu_seqlens is not None:
        segments = Segments(cu_seqlens, k.shape[1], k.shape[0])
        return chunk_gated_delta_rule_state(*(segments.split(x) for x in (k, v, g, beta)), chunk_size)
    return delta.summary(_chunk_terms(None, k, v, g, beta, chunk_size))


def chunk_gated_delta_rule_state_grad(
    q: Tensor, k: Tensor, g: Tensor, beta: Tensor, do: Tensor, scale: Optional[float] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE, cu_seqlens: Optional[Tensor] = None,
) -> Tensor:
    """Gradient ``A`` of a piece's outputs (``<do, o>``) with respect to the state entering it.

    The gradient of the entering state is ``A + M^T D``, D being that of the state leaving the
    piece (the backward scan adds the second term). Per chunk the outputs read
    ``S_0`` through ``scale * (exp(G) q - attn W) S_0``; the chunks are walked backwards through ``M_c^T``.

    Args:
        q, k: ``[B, T, H, K]``; g, beta: ``[B, T, H]``; do: ``[B, T, H, V]``.
        cu_seqlens: ``[N+1]`` offsets of N segments (B = 1): one result per segment.

    Returns:
        ``[B, H, K, V]`` (``[N, H, K, V]``) in :func:`state_dtype`.
    """
    if cu_seqlens is not None:
        segments = Segments(cu_seqlens, q.shape[1], q.shape[0])
        return chunk_gated_delta_rule_state_grad(*(segments.split(x) for x in (q, k, g, beta, do)), scale,
                                                 chunk_size)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return delta.entering_grad(_chunk_terms(q, k, None, g, beta, chunk_size), do, scale, chunk_size)
