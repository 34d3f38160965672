"""Triton kernels for the two per-piece reductions ZeCO adds to GLA.

* :func:`chunk_state`: what a piece does to a state passing through it,
  ``S_out = Diag(gamma) S_in + E`` (E = final state from zero, gamma = exp(sum g)).
* :func:`chunk_state_grad`: the piece's share of the gradient of the state entering it,
  ``A = scale * sum_t (q_t * exp(G_t)) do_t^T``.

Both stream the piece once, chunk by chunk, with the state in fp32 registers: one
program per (key block, value block, batch x head). Same contracts as
``megatron_zeco.ops.chunk.chunk_gla_state`` / ``chunk_gla_state_grad``, which are the
references in the tests (run on the CPU under ``TRITON_INTERPRET=1``).
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl


@triton.jit
def _program_tile(H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """This program's (batch x head, batch, head), key and value offsets, and their bounds masks."""
    i_v, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    return i_bh, i_bh // H, i_bh % H, o_k, o_v, o_k < K, o_v < V


@triton.jit
def _state_kernel(k, v, g, E, gamma, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    i_bh, i_b, i_h, o_k, o_v, m_k, m_v = _program_tile(H, K, V, BK, BV)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    g_sum = tl.zeros([BK], dtype=tl.float32)
    o_c = tl.arange(0, BT)
    after = (o_c[None, :] > o_c[:, None]).to(tl.float32)  # after[j, s] = 1 if s > j
    for t0 in range(0, T, BT):
        o_t = t0 + tl.arange(0, BT)
        m_t = o_t < T
        row = (i_b * T + o_t) * H + i_h  # [B, T, H, D] layout
        b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0).to(tl.float32)
        b_g = tl.load(g + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0).to(tl.float32)
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0).to(tl.float32)
        g_chunk = tl.sum(b_g, axis=0)
        # Decay from each token to the chunk's end: the sum of the gates after it, summed
        # directly (a difference of cumulative sums would cancel in fp32 for large gates).
        b_k = b_k * tl.exp(tl.dot(after, b_g, input_precision="ieee"))
        S = S * tl.exp(g_chunk)[:, None] + tl.dot(tl.trans(b_k), b_v, input_precision="ieee")
        g_sum += g_chunk
    base = i_bh * K * V
    tl.store(E + base + o_k[:, None] * V + o_v[None, :], S, mask=m_k[:, None] & m_v[None, :])
    if tl.program_id(0) == 0:  # one value block writes gamma
        tl.store(gamma + i_bh * K + o_k, tl.exp(g_sum), mask=m_k)


@triton.jit
def _state_grad_kernel(q, g, do, A, scale, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    i_bh, i_b, i_h, o_k, o_v, m_k, m_v = _program_tile(H, K, V, BK, BV)
    acc = tl.zeros([BK, BV], dtype=tl.float32)
    g_before = tl.zeros([BK], dtype=tl.float32)  # log-decay from the piece start to this chunk
    for t0 in range(0, T, BT):
        o_t = t0 + tl.arange(0, BT)
        m_t = o_t < T
        row = (i_b * T + o_t) * H + i_h
        b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0).to(tl.float32)
        b_g = tl.load(g + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0).to(tl.float32)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0).to(tl.float32)
        b_q = b_q * tl.exp(g_before[None, :] + tl.cumsum(b_g, axis=0))
        acc += tl.dot(tl.trans(b_q), b_do, input_precision="ieee")
        g_before += tl.sum(b_g, axis=0)
    tl.store(A + i_bh * K * V + o_k[:, None] * V + o_v[None, :], acc * scale, mask=m_k[:, None] & m_v[None, :])


def _blocks(K: int, V: int):
    return min(64, triton.next_power_of_2(K)), min(64, triton.next_power_of_2(V))


def chunk_state(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, chunk_size: int = 64
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Piece summary ``(E [B, H, K, V], gamma [B, H, K])`` in float32.

    Args:
        k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; float32, bfloat16 or float16, contiguous.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    E = torch.empty(B, H, K, V, dtype=torch.float32, device=k.device)
    gamma = torch.empty(B, H, K, dtype=torch.float32, device=k.device)
    BK, BV = _blocks(K, V)
    grid = (triton.cdiv(V, BV), triton.cdiv(K, BK), B * H)
    _state_kernel[grid](k, v, g, E, gamma, T, H, K, V, BT=chunk_size, BK=BK, BV=BV)
    return E, gamma


def chunk_state_grad(q: torch.Tensor, g: torch.Tensor, do: torch.Tensor, scale: Optional[float] = None,
                     chunk_size: int = 64) -> torch.Tensor:
    """``A = scale * sum_t (q_t * exp(G_t)) do_t^T``: ``[B, H, K, V]`` float32.

    Args:
        q, g: ``[B, T, H, K]``; do: ``[B, T, H, V]``; float32, bfloat16 or float16, contiguous.
    """
    B, T, H, K = q.shape
    V = do.shape[-1]
    if scale is None:
        scale = K ** -0.5
    A = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device)
    BK, BV = _blocks(K, V)
    grid = (triton.cdiv(V, BV), triton.cdiv(K, BK), B * H)
    _state_grad_kernel[grid](q, g, do, A, float(scale), T, H, K, V, BT=chunk_size, BK=BK, BV=BV)
    return A
