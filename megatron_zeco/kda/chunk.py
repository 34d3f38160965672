"""Kimi Delta Attention, chunked, in plain PyTorch (the CPU path), and what a piece of it does to a state.

Per value head, with ``a_t = exp(g_t)`` a decay per key channel (a K-vector) and ``b_t = beta_t``
(fla's order, :mod:`.naive`: the decay first, then the delta update read from the decayed state),

    S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T,     o_t = scale * S_t^T q_t.

The sequence is cut into chunks of C tokens. With ``G_i`` the cumulative log decay inside the chunk
(a K-vector, token i included), ``S_0`` the state entering it and ``*`` the channel-wise product, the
state after token i is

    S_i = Diag(exp(G_i)) S_0 + sum_{j<=i} (exp(G_i - G_j) * k_j) nu_j^T,   nu_j = b_j (v_j - k_j^T Diag(a_j) S_{j-1})

and the corrections ``nu`` solve a unit lower-triangular system (the WY / UT transform) whose couplings
weigh every key channel by its own decay between the two tokens:

    (I + L) nu = b v - (b exp(G) * k) S_0,   L_jl = b_j sum_c k_jc k_lc exp(G_jc - G_lc)   (l < j)
    so nu = U - W S_0  with  U = (I + L)^-1 (b v),  W = (I + L)^-1 (b exp(G) * k).

Then, per chunk:

    o_i   = scale * ((exp(G_i) * q_i)^T S_0 + sum_{j<=i} P_ij nu_j),   P_ij = sum_c q_ic k_jc exp(G_ic - G_jc)
    S_out = M_c S_0 + E_c,   M_c = Diag(exp(G_C)) - Kd^T W,   E_c = Kd^T U,   Kd_j = exp(G_C - G_j) * k_j

(in fla's ``naive_chunk_kda``: ``A = (I + L)^-1 Diag(b)``, ``w = W``, ``u = U``, ``Aqk = scale P``).
A piece of sequence is the affine map ``S_out = M S_in + E`` (the chunks' maps composed): ZeCO's summary,
with ``M = prod_t (I - b_t k_t k_t^T) Diag(a_t)`` (latest token leftmost) a dense K x K matrix. The
gradient of the piece's outputs with respect to ``S_in`` (``A``) walks the chunks backwards through ``M_c^T``.
This module computes the chunks' terms; the passes over the chunks are ``common/delta.py``'s, shared
with the gated delta rule.

The pair decays ``exp(G_i - G_j)`` are formed per pair and channel (``[.., C, C, K]``, the upper triangle
masked to -inf before exp), never as ``exp(G_i) exp(-G_j)``, whose second factor overflows under strong
decay. Every exponent is <= 0, and no decay that is 1 by construction depends on ``g`` (the diagonal
``P_ii = q_i . k_i``, the last token's ``Kd_C = k_C``): with strong decay the gradient of ``g`` is tiny,
and two O(1) paths cancelling in it would leave rounding noise far above it. Computation runs in float64
for float64 inputs and in float32 otherwise; states are float32 or float64. Differentiable with
torch.autograd. Packed input (``cu_seqlens``) runs as a zero-padded batch of segments, as in
``gla/chunk.py`` (padding: ``beta = 0``, ``g = 0``, so the state passes unchanged).

Grouped value attention as fla's: ``HV`` value heads (``v``, ``g``, ``beta``, states), ``H`` query/key
heads, value head ``h`` reading query/key head ``h // (HV // H)``.
"""

from typing import Optional, Tuple

import torch

from ..common import delta
from ..common.chunked import Segments, chunked, state_dtype
from ..common.delta import DeltaChunks
from .naive import to_value_heads

Tensor = torch.Tensor
DEFAULT_CHUNK_SIZE = 16


def _chunk_terms(q, k, v, g, beta, chunk_size) -> DeltaChunks:
    """The terms of every chunk; ``q`` and ``k`` already per value head, ``q`` or ``v`` may be None."""
    dt = state_dtype(k.dtype)
    qc, kc, vc, gc = (None if x is None else chunked(x.to(dt), chunk_size) for x in (q, k, v, g))
    bc = chunked(beta.to(dt).unsqueeze(-1), chunk_size)  # [.., C, 1]
    C = kc.shape[-2]
    G = gc.cumsum(-2)
    below = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1).unsqueeze(-1)
    decay = torch.where(below, G.unsqueeze(-2) - G.unsqueeze(-3), float("-inf")).exp()  # [.., C_i, C_j, K]

    def pairs(x):  # sum_c x_ic k_jc exp(G_ic - G_jc) for j < i, zero elsewhere
        return torch.einsum("...ic,...jc,...ijc->...ij", x, kc, decay)

    lower = torch.eye(C, dtype=dt, device=k.device) + bc * pairs(kc)
    solve = lambda rhs: torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)  # noqa: E731
    U = None if vc is None else solve(bc * vc)
    W = solve(bc * G.exp() * kc)
    # the gates after token j, summed directly (the last token's is an exact 0, not G_C - G_C)
    after = torch.cat([gc[..., 1:, :].flip(-2).cumsum(-2).flip(-2), torch.zeros_like(gc[..., :1, :])], dim=-2)
    qg = attn = None
    if qc is not None:
        qg = qc * G.exp()
        attn = pairs(qc) + torch.diag_embed((qc * kc).sum(-1))
    return DeltaChunks(qg, attn, U, W, kc * after.exp(), gc.sum(-2).exp())


def chunk_kda(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None, output_final_state: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE, cu_seqlens: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """KDA over a whole sequence, chunk by chunk; fla's ``chunk_kda`` call (with a precomputed ``g``).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (``HV`` a multiple of ``H``); g: ``[B, T, HV, K]``
            log decay per key channel (<= 0); beta: ``[B, T, HV]`` in ``[0, 1]``; one floating dtype.
            T need not be a multiple of ``chunk_size``.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[B, HV, K, V]`` (``[N, HV, K, V]`` with ``cu_seqlens``) or None for zeros.
        output_final_state: also return the state after the last token (of each segment).
        cu_seqlens: ``[N+1]`` offsets of N independent segments packed in one sequence (B = 1).

    Returns:
        ``o [B, T, HV, V]`` in the dtype of ``v`` and the final state ``[B, HV, K, V]``
        (``[N, HV, K, V]``) in :func:`state_dtype`, or None.
    """
    if cu_seqlens is not None:
        segments = Segments(cu_seqlens, q.shape[1], q.shape[0])
        o, ht = chunk_kda(*(segments.split(x) for x in (q, k, v, g, beta)), scale, initial_state,
                          output_final_state, chunk_size)
        return segments.merge(o), ht
    HV = v.shape[2]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    c = _chunk_terms(to_value_heads(q, HV), to_value_heads(k, HV), v, g, beta, chunk_size)
    o, S = delta.outputs(c, scale, initial_state, q.shape[1])
    return o.to(v.dtype), (S if output_final_state else None)


def chunk_kda_state(
    k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE,
    cu_seqlens: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """What a piece of sequence does to a state passing through it: ``S_out = M S_in + E``.

    Args:
        k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]``; beta: ``[B, T, HV]``.
        cu_seqlens: ``[N+1]`` offsets of N segments (B = 1): one summary per segment.

    Returns:
        ``E [B, HV, K, V]`` (the final state from a zero state) and ``M [B, HV, K, K]``
        (``prod_t (I - beta_t k_t k_t^T) Diag(exp(g_t))``, latest token leftmost), in :func:`state_dtype`
        (``[N, ...]`` with ``cu_seqlens``).
    """
    if cu_seqlens is not None:
        segments = Segments(cu_seqlens, k.shape[1], k.shape[0])
        return chunk_kda_state(*(segments.split(x) for x in (k, v, g, beta)), chunk_size)
    return delta.summary(_chunk_terms(None, to_value_heads(k, v.shape[2]), v, g, beta, chunk_size))


def chunk_kda_state_grad(
    q: Tensor, k: Tensor, g: Tensor, beta: Tensor, do: Tensor, scale: Optional[float] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE, cu_seqlens: Optional[Tensor] = None,
) -> Tensor:
    """Gradient ``A`` of a piece's outputs (``<do, o>``) with respect to the state entering it.

    The gradient of the entering state is ``A + M^T D``, D being that of the state leaving the piece
    (the backward scan adds the second term). Per chunk the outputs read ``S_0`` through
    ``scale * (exp(G) * q - P W) S_0``; the chunks are walked backwards through ``M_c^T``.

    Args:
        q, k: ``[B, T, H, K]``; g: ``[B, T, HV, K]``; beta: ``[B, T, HV]``; do: ``[B, T, HV, V]``.
        cu_seqlens: ``[N+1]`` offsets of N segments (B = 1): one result per segment.

    Returns:
        ``[B, HV, K, V]`` (``[N, HV, K, V]``) in :func:`state_dtype`.
    """
    if cu_seqlens is not None:
        segments = Segments(cu_seqlens, q.shape[1], q.shape[0])
        return chunk_kda_state_grad(*(segments.split(x) for x in (q, k, g, beta, do)), scale, chunk_size)
    HV = g.shape[2]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    c = _chunk_terms(to_value_heads(q, HV), to_value_heads(k, HV), None, g, beta, chunk_size)
    return delta.entering_grad(c, do, scale, chunk_size)
