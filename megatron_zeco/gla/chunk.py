"""Chunked gated linear attention in plain PyTorch (the CPU path).

The sequence is cut into chunks of C tokens. Inside a chunk the output is a
masked attention with per-channel decays; across chunks a state is carried:

    o_i = scale * (sum_{j<=i in chunk} (q_i . (k_j * exp(G_i - G_j))) v_j  +  (q_i * exp(G_i))^T S_in)
    S_out = Diag(exp(G_C)) S_in + sum_j (k_j * exp(G_C - G_j)) v_j^T

with G the cumulative log-gate inside the chunk. Every exponent is <= 0 (the
upper triangle is masked to -inf before exp), so the form is stable for any
gate, including decays that underflow to 0. The same three quantities are what
ZeCO needs per rank: the local output, the local state E and the decay gamma.

Computation runs in float64 for float64 inputs and in float32 otherwise; states
are always float32 or float64. Differentiable with torch.autograd.

Variable-length (packed) input, as fla's ``cu_seqlens``: ``[1, T, ...]`` holding N
segments one after another, each with its own initial and final state. The segments
run as a zero-padded batch ``[N, L, ...]``: padding after a segment's end (k = v = g = 0)
leaves its state unchanged, so every result is exact (memory grows with N times the
longest segment: this is the CPU and reference path).
"""

from typing import Optional, Tuple

import torch

from ..common.chunked import Segments, chunked, state_dtype

DEFAULT_CHUNK_SIZE = 32


def _chunk_summaries(kc, vc, graw):
    """Per chunk: the state it adds from zero (``[B, H, N, K, V]``) and its total log-decay ``[B, H, N, K]``.

    The decay after token j is the sum of the gates *after* j, summed directly
    rather than as a difference of cumulative sums: with decay ~ 0 the
    difference would cancel two O(1) gradient paths and leave rounding noise
    far larger than the true (tiny) gradient of g.
    """
    after = torch.cat([graw[..., 1:, :].flip(-2).cumsum(-2).flip(-2), torch.zeros_like(graw[..., :1, :])], dim=-2)
    E = torch.einsum("bhnck,bhncv->bhnkv", kc * after.exp(), vc)
    return E, graw.sum(-2)


def _carry(E, g_last, S):
    """Carry state S across the chunks: returns the states entering each chunk ``[B, H, N, K, V]`` and the last."""
    S_in = []
    for n in range(E.shape[2]):
        S_in.append(S)
        S = g_last[:, :, n].exp().unsqueeze(-1) * S + E[:, :, n]
    return torch.stack(S_in, dim=2), S


def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """GLA over a whole sequence, chunk by chunk; same call as fla's ``chunk_gla``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log-gates (<= 0),
            all of one floating dtype. T need not be a multiple of ``chunk_size``.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` (float32/float64) or None for zeros
            (``[N, H, K, V]``, one per segment, with ``cu_seqlens``).
        output_final_state: also return the state after the last token (of each segment).
        cu_seqlens: ``[N+1]`` integer offsets of N independent segments packed in one
            sequence (B = 1), from 0 to T; None: B independent sequences of length T.

    Returns:
        ``o`` ``[B, T, H, V]`` in the dtype of ``v``, and the final state
        ``[B, H, K, V]`` (``[N, H, K, V]``) in :func:`state_dtype` (or None).
    """
    if cu_seqlens is not None:
        segments = Segments(cu_seqlens, q.shape[1], q.shape[0])
        o, ht = chunk_gla(*(segments.split(x) for x in (q, k, v, g)), scale, initial_state,
                          output_final_state, chunk_size)
        return segments.merge(o), ht
    B, T, H, K = q.shape
    if scale is None:
        scale = K ** -0.5
    dt = state_dtype(q.dtype)
    qc, kc, vc, graw = (chunked(x.to(dt), chunk_size) for x in (q, k, v, g))
    gc = graw.cumsum(-2)
    C = chunk_size

    # Strictly causal part with decays exp(G_i - G_j) (upper triangle masked before exp),
    # plus the diagonal, whose decay is exactly 1 (kept out of the gradient of g).
    below = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    rel = gc.unsqueeze(-2) - gc.unsqueeze(-3)  # [B, H, N, C_i, C_j, K]: G_i - G_j
    decay = torch.where(below.unsqueeze(-1), rel, float("-inf")).exp()
    attn = torch.einsum("bhnik,bhnjk,bhnijk->bhnij", qc, kc, decay) + torch.diag_embed((qc * kc).sum(-1))
    o = attn @ vc

    E, g_last = _chunk_summaries(kc, vc, graw)
    S = vc.new_zeros(B, H, K, vc.shape[-1]) if initial_state is None else initial_state.to(dt)
    S_in, S = _carry(E, g_last, S)
    o = o + (qc * gc.exp()) @ S_in

    o = (scale * o).permute(0, 2, 3, 1, 4).reshape(B, -1, H, vc.shape[-1])[:, :T]
    return o.to(v.dtype), (S if output_final_state else None)


def chunk_gla_state(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """What a piece of sequence does to a state passing through it.

    ``S_out = Diag(gamma) S_in + E``. This is ZeCO's per-rank summary.

    Args:
        k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]``.
        cu_seqlens: ``[N+1]`` offsets of N segments (B = 1): one summary per segment.

    Returns:
        ``E`` ``[B, H, K, V]`` (the final state from a zero initial state) and
        ``gamma`` ``[B, H, K]`` (``exp(sum_t g_t)``), both in :func:`state_dtype`
        (``[N, ...]`` with ``cu_seqlens``).
    """
    if cu_seqlens is not None:
        segments = Segments(cu_seqlens, k.shape[1], k.shape[0])
        return chunk_gla_state(*(segments.split(x) for x in (k, v, g)), chunk_size)
    dt = state_dtype(k.dtype)
    kc, vc, graw = (chunked(x.to(dt), chunk_size) for x in (k, v, g))
    E, g_last = _chunk_summaries(kc, vc, graw)
    _, S = _carry(E, g_last, torch.zeros_like(E[:, :, 0]))
    return S, g.to(dt).sum(1).exp()


def chunk_gla_state_grad(
    q: torch.Tensor, g: torch.Tensor, do: torch.Tensor, scale: Optional[float] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gradient of a piece's outputs with respect to the state entering it.

    ``dS_in = scale * sum_t (exp(G_t) * q_t) do_t^T`` with ``G_t`` the cumulative
    log-gate from the start of the piece (token t included). The backward scan
    adds ``Diag(gamma) D`` to this, D being the gradient of the state leaving it.

    Args:
        q, g: ``[B, T, H, K]``; do: ``[B, T, H, V]``.
        cu_seqlens: ``[N+1]`` offsets of N segments (B = 1): one result per segment.

    Returns:
        ``[B, H, K, V]`` (``[N, H, K, V]``) in :func:`state_dtype`.
    """
    if cu_seqlens is not None:
        segments = Segments(cu_seqlens, q.shape[1], q.shape[0])
        return chunk_gla_state_grad(*(segments.split(x) for x in (q, g, do)), scale)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    dt = state_dtype(q.dtype)
    decayed_q = q.to(dt) * g.to(dt).cumsum(1).exp()
    return scale * torch.einsum("bthk,bthv->bhkv", decayed_q, do.to(dt))
