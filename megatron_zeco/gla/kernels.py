"""Triton kernels: GLA's chunk output and gradient kernels with ZeCO's state term fused in.

fla's ``chunk_gla`` keeps one state per chunk of BT tokens (``h[c]``: the state entering
chunk c; ``dh[c]``: the gradient of the state leaving it) and reads them in three
kernels: the output (``o``), the value gradient (``dv``) and the query/key/gate
gradients (``dq, dk, dg``). In a ZeCO piece these states are computed without the
state entering the piece (``S``, forward) or the gradient of the state leaving it
(``D``, backward), because the scan delivers those only after the piece's summary
is known. The kernels here are those three with the missing term added where the
chunk states are read, so no pass over ``h`` or ``dh`` is needed:

    o  = scale (q * exp2(g)) (h[c] + Diag(exp2(w[c])) S[n]) + A v         (w: into chunk c)
    dv = A^T do + (k * exp2(g_last - g)) (dh[c] + Diag(exp2(w[c])) D[n])  (w: out of chunk c)
    dq, dk, dg: fla's inter-chunk gradients with dh[c] + Diag(exp2(w[c])) D[n]

``n`` is the sequence (batch entry, or document with ``cu_seqlens``) chunk c belongs to;
``w[c]`` the log2-decay from the sequence's start to chunk c's start (forward) or from
chunk c's end to the sequence's end (backward). ``g`` is the in-chunk cumulative log2
gate (fla's ``chunk_local_cumsum(g, scale=1/ln 2)``), ``A`` the in-chunk attention
(fla's ``chunk_gla_fwd_intra_gk``); token layout ``[B, T, H, *]``, chunk states
``[B * NT, H, K, V]`` (all chunks of all sequences, in order), as in fla.

The decays ``w`` (and each sequence's decay ``gamma``) come from ``chunk_decays``: prefix sums
of the chunks' total gates in float64, one launch.

Roundings: the forward multiplies ``q * exp2(g)`` (rounded to the input dtype, as fla
does) by the local ``h[c]`` and by the decayed ``S`` split into a high and a low part of
the input dtype, so ``S`` loses nothing to rounding (three bf16 products cost less than
one tf32 product); the backward adds ``D`` to the float32 ``dh`` tile before the one
rounding fla applies.
The decomposition follows fla's kernels (``fla/ops/gla/chunk.py``, MIT).

Reference in the tests: the same formulas in float64 PyTorch (CPU, ``TRITON_INTERPRET=1``).
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..kernels import interpreted

Tensor = torch.Tensor

# Under the interpreter (CI) one configuration; on the GPU a few, tuned per shape.
_CONFIGS = [triton.Config({"BK": 64, "BV": 64}, num_warps=4, num_stages=2)] if interpreted() \
    else [triton.Config({"BK": BK, "BV": BV}, num_warps=w, num_stages=s)
          for BK in (32, 64) for BV in (64, 128) for w in (4, 8) for s in (2, 3)]


@triton.jit
def _locate(i_b, i_t, T, cu_seqlens, chunk_indices, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(index of the chunk's state, its sequence, the chunk within the sequence, the
    sequence's first token, its length) of program chunk ``i_t`` of batch entry ``i_b``."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        return i_t.to(tl.int64), i_n, i_c, bos, tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        return (i_b * tl.cdiv(T, BT) + i_t).to(tl.int64), i_b.to(tl.int64), i_t.to(tl.int64), \
            (i_b * T).to(tl.int64), T


@triton.jit
def _program(T, cu_seqlens, chunk_indices, H: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
             IS_VARLEN: tl.constexpr):
    """What a chunk program of grid ``(cdiv(N, BN) * chunks, B * H)`` works on: (its block along
    the N-wide dim, head, chunk state index, sequence, the chunk's tokens, their mask, their rows
    of ``[B*T*H, *]`` tensors, the row of the chunk's last token)."""
    NB = tl.cdiv(N, BN)
    i_x, i_t = tl.program_id(0) % NB, tl.program_id(0) // NB
    i_b, i_h = tl.program_id(1) // H, tl.program_id(1) % H
    i_s, i_n, i_c, bos, T = _locate(i_b, i_t, T, cu_seqlens, chunk_indices, BT, IS_VARLEN)
    o_t = i_c * BT + tl.arange(0, BT)
    row = (bos + o_t) * H + i_h
    last = (bos + tl.minimum(i_c * BT + BT, T) - 1) * H + i_h
    return i_x, i_h, i_s, i_n, o_t, o_t < T, row, last


@triton.jit(do_not_specialize=["T"])
def _decays_kernel(g, into, out_of, gamma, cu_seqlens, chunk_offsets, T, HK, BT: tl.constexpr, BC: tl.constexpr,
                   BHK: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_hk, i_n = tl.program_id(0), tl.program_id(1)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        first = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos, L, first = i_n.to(tl.int64) * T, T, i_n.to(tl.int64) * tl.cdiv(T, BT)
    NT = tl.cdiv(L, BT)
    o_hk = i_hk * BHK + tl.arange(0, BHK)
    m_hk = o_hk < HK
    total = tl.zeros([BHK], dtype=tl.float64)
    for i in range(0, tl.cdiv(NT, BC)):  # the sequence's total log2-decay
        o_c = i * BC + tl.arange(0, BC)
        m = (o_c < NT)[:, None] & m_hk[None, :]
        last = bos + tl.minimum((o_c + 1) * BT, L) - 1  # each chunk's last token holds its total
        total += tl.sum(tl.load(g + last[:, None] * HK + o_hk[None, :], mask=m, other=0.).to(tl.float64), axis=0)
    before = tl.zeros([BHK], dtype=tl.float64)
    for i in range(0, tl.cdiv(NT, BC)):
        o_c = i * BC + tl.arange(0, BC)
        m = (o_c < NT)[:, None] & m_hk[None, :]
        last = bos + tl.minimum((o_c + 1) * BT, L) - 1
        x = tl.load(g + last[:, None] * HK + o_hk[None, :], mask=m, other=0.).to(tl.float64)
        through = tl.cumsum(x, axis=0) + before[None, :]  # from the start to each chunk's end
        p = (first + o_c)[:, None] * HK + o_hk[None, :]
        tl.store(into + p, (through - x).to(tl.float32), mask=m)
        tl.store(out_of + p, (total[None, :] - through).to(tl.float32), mask=m)
        before += tl.sum(x, axis=0)
    tl.store(gamma + i_n * HK + o_hk, tl.exp2(total.to(tl.float32)), mask=m_hk)


@triton.autotune(configs=_CONFIGS, key=["BT", "K", "V"])
@triton.jit(do_not_specialize=["T"])
def _o_kernel(q, v, g, h, A, S, w, o, cu_seqlens, chunk_indices, scale, T,
              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_v, i_h, i_s, i_n, _, m_t, row, _ = _program(T, cu_seqlens, chunk_indices, H, V, BT, BV, IS_VARLEN)
    o_i = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V

    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk, m_kv = m_t[:, None] & m_k[None, :], m_k[:, None] & m_v[None, :]
        b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_g = tl.load(g + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_h = tl.load(h + ((i_s * H + i_h) * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv, other=0.0)
        b_qg = (b_q * tl.exp2(b_g)).to(b_q.dtype)
        b_o = tl.dot(b_qg, b_h.to(b_q.dtype), b_o)
        # the incoming state decayed to the chunk's start, in two parts of the input dtype
        # (high, low) so that it is not rounded: about 16 bits of mantissa with bf16
        b_w = tl.load(w + (i_s * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_S = tl.exp2(b_w)[:, None] * tl.load(S + ((i_n * H + i_h) * K + o_k[:, None]) * V + o_v[None, :],
                                               mask=m_kv, other=0.0)
        b_hi = b_S.to(b_q.dtype)
        b_o = tl.dot(b_qg, b_hi, b_o)
        b_o = tl.dot(b_qg, (b_S - b_hi.to(tl.float32)).to(b_q.dtype), b_o)
    b_o *= scale
    m_tv = m_t[:, None] & m_v[None, :]
    b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
    b_A = tl.load(A + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
    b_A = tl.where(o_i[:, None] >= o_i[None, :], b_A, 0.0).to(b_v.dtype)
    b_o = tl.dot(b_A, b_v, b_o)
    tl.store(o + row[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)


@triton.autotune(configs=_CONFIGS, key=["BT", "K", "V"])
@triton.jit(do_not_specialize=["T"])
def _dv_kernel(k, g, A, do, dh, D, w, dv, cu_seqlens, chunk_indices, T,
               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_v, i_h, i_s, i_n, _, m_t, row, last = _program(T, cu_seqlens, chunk_indices, H, V, BT, BV, IS_VARLEN)
    o_i = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_tv = m_t[:, None] & m_v[None, :]

    b_At = tl.load(A + row[None, :] * BT + o_i[:, None], mask=m_t[None, :], other=0.0)  # A^T
    b_At = tl.where(o_i[:, None] <= o_i[None, :], b_At, 0.0)
    b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
    b_dv = tl.dot(b_At, b_do.to(b_At.dtype), input_precision="ieee")
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk, m_kv = m_t[:, None] & m_k[None, :], m_k[:, None] & m_v[None, :]
        b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_g = tl.load(g + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_gl = tl.load(g + last * K + o_k, mask=m_k, other=0.0)
        b_k = (b_k * tl.exp2(b_gl[None, :] - b_g)).to(b_k.dtype)
        b_dh = tl.load(dh + ((i_s * H + i_h) * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv, other=0.0)
        b_w = tl.load(w + (i_s * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_D = tl.load(D + ((i_n * H + i_h) * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv, other=0.0)
        b_dh = b_dh.to(tl.float32) + tl.exp2(b_w)[:, None] * b_D
        b_dv = tl.dot(b_k, b_dh.to(b_k.dtype), b_dv)
    tl.store(dv + row[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)


@triton.autotune(configs=_CONFIGS, key=["BT", "K", "V"])
@triton.jit(do_not_specialize=["T"])
def _dqkg_kernel(q, k, v, g, h, do, dh, D, w, dq, dk, dq2, dk2, dg, cu_seqlens, chunk_indices, scale, T,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_k, i_h, i_s, i_n, _, m_t, row, last = _program(T, cu_seqlens, chunk_indices, H, K, BT, BK, IS_VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    p_tk = row[:, None] * K + o_k[None, :]

    b_g = tl.load(g + p_tk, mask=m_tk, other=0.0)
    b_gl = tl.load(g + last * K + o_k, mask=m_k, other=0.0)
    b_ew = tl.exp2(tl.load(w + (i_s * H + i_h) * K + o_k, mask=m_k, other=0.0))
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dgl = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv, m_vk = m_t[:, None] & m_v[None, :], m_v[:, None] & m_k[None, :]
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
        p_vk = o_k[None, :] * V + o_v[:, None]  # [BV, BK] tiles of [K, V] states
        b_h = tl.load(h + (i_s * H + i_h) * K * V + p_vk, mask=m_vk, other=0.0)
        b_dh = tl.load(dh + (i_s * H + i_h) * K * V + p_vk, mask=m_vk, other=0.0).to(tl.float32)
        b_dh += b_ew[None, :] * tl.load(D + (i_n * H + i_h) * K * V + p_vk, mask=m_vk, other=0.0)
        b_dgl += tl.sum(b_h * b_dh, axis=0)
        b_dq = tl.dot(b_do, b_h.to(b_do.dtype), b_dq)
        b_dk = tl.dot(b_v, b_dh.to(b_v.dtype), b_dk)
    b_dgl *= tl.exp2(b_gl)
    b_dq *= scale * tl.exp2(b_g)
    b_dk *= tl.exp2(b_gl[None, :] - b_g)
    b_q = tl.load(q + p_tk, mask=m_tk, other=0.0)
    b_k = tl.load(k + p_tk, mask=m_tk, other=0.0)
    b_dgl += tl.sum(b_dk * b_k, axis=0)
    b_dq += tl.load(dq + p_tk, mask=m_tk, other=0.0)
    b_dk += tl.load(dk + p_tk, mask=m_tk, other=0.0)
    b_dg = b_q * b_dq - b_k * b_dk
    b_dg = b_dg - tl.cumsum(b_dg, axis=0) + tl.sum(b_dg, axis=0)[None, :] + b_dgl[None, :]  # reverse cumsum
    tl.store(dq2 + p_tk, b_dq.to(dq2.dtype.element_ty), mask=m_tk)
    tl.store(dk2 + p_tk, b_dk.to(dk2.dtype.element_ty), mask=m_tk)
    tl.store(dg + p_tk, b_dg.to(dg.dtype.element_ty), mask=m_tk)


def _launch(x: Tensor, h: Tensor, w: Tensor, S: Tensor, BT: int, cu_seqlens: Optional[Tensor],
            chunk_indices: Optional[Tensor], what: str) -> Tuple[int, int, int, int]:
    """Check the shared arguments; return (B, T, H, number of chunk programs)."""
    B, T, H = x.shape[:3]
    K, V = h.shape[-2:]
    if cu_seqlens is not None and (B != 1 or chunk_indices is None):
        raise ValueError(f"{what}: with cu_seqlens, B must be 1 and chunk_indices given (fla's prepare_chunk_indices)")
    C = triton.cdiv(T, BT) * B if cu_seqlens is None else len(chunk_indices)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    problems = [f"{name} {tuple(t.shape)} is not contiguous" for name, t in (("h", h), ("w", w), ("S", S))
                if not t.is_contiguous()]
    if h.numel() != C * H * K * V or w.shape != (C, H, K) or S.shape != (N, H, K, V):
        problems.append(f"chunk states {tuple(h.shape)}, log2-decays {tuple(w.shape)} and states "
                        f"{tuple(S.shape)} do not fit {C} chunks of {H} heads of [{K}, {V}] in {N} sequences")
    if w.dtype != torch.float32 or S.dtype != torch.float32:
        problems.append(f"w and S must be float32, got {w.dtype} and {S.dtype}")
    if BT not in (16, 32, 64):
        problems.append(f"chunk size must be 16, 32 or 64, got {BT}")
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems))
    return B, T, H, C


def chunk_decays(g: Tensor, chunk_size: int = 64, cu_seqlens: Optional[Tensor] = None,
                 chunk_indices: Optional[Tensor] = None,
                 chunk_offsets: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Log2-decays of every chunk from its sequence's start and to its sequence's end.

    Summed in float64 (a difference of float32 prefix sums would lose the small decays of a
    chunk that follows a long stretch of gates).

    Args:
        g: ``[B, T, H, K]`` float32, in-chunk cumulative log2 gates (each chunk's last token
            holds the chunk's total).
        cu_seqlens: ``[N+1]`` token offsets of packed sequences (B = 1), or None (N = B).
        chunk_indices, chunk_offsets: with ``cu_seqlens``, fla's ``prepare_chunk_indices``
            (``[C, 2]``: sequence and chunk within it) and ``prepare_chunk_offsets`` (``[N+1]``:
            each sequence's first chunk).
    Returns:
        ``into [C, H, K]``: log2-decay from the sequence's start to each chunk's start;
        ``out_of [C, H, K]``: from each chunk's end to the sequence's end;
        ``gamma [N, H, K]``: each sequence's decay (``exp2`` of its total); all float32.
    """
    B, T, H, K = g.shape
    BT = chunk_size
    problems = []
    if g.dtype != torch.float32 or not g.is_contiguous():
        problems.append(f"g must be contiguous float32, got {g.dtype}")
    if {cu_seqlens is None, chunk_indices is None, chunk_offsets is None} != {cu_seqlens is None} \
            or (cu_seqlens is not None and B != 1):
        problems.append("cu_seqlens, chunk_indices and chunk_offsets go together, with B = 1")
    if problems:
        raise ValueError("chunk_decays: " + "; ".join(problems))
    if cu_seqlens is None:
        N, C = B, B * triton.cdiv(T, BT)
    else:
        N, C = len(cu_seqlens) - 1, len(chunk_indices)
    into, out_of = g.new_empty(C, H, K), g.new_empty(C, H, K)
    gamma = g.new_empty(N, H, K)
    # Latency-bound (each program walks its sequence's chunks twice): many narrow programs, long steps.
    BHK = min(32, triton.next_power_of_2(H * K))
    _decays_kernel[(triton.cdiv(H * K, BHK), N)](g, into, out_of, gamma, cu_seqlens, chunk_offsets, T, H * K, BT=BT,
                                                 BC=64, BHK=BHK, IS_VARLEN=cu_seqlens is not None)
    return into, out_of, gamma


def chunk_o_with_state(q: Tensor, v: Tensor, g: Tensor, A: Tensor, h: Tensor, S: Tensor, w: Tensor, scale: float,
                       chunk_size: int = 64, cu_seqlens: Optional[Tensor] = None,
                       chunk_indices: Optional[Tensor] = None) -> Tensor:
    """GLA output of every chunk with the state entering each sequence added.

    Args:
        q: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (bf16/fp16/fp32, one dtype).
        g: ``[B, T, H, K]`` float32, in-chunk cumulative log2 gates.
        A: ``[B, T, H, BT]`` float32, in-chunk attention (scaled).
        h: ``[C, H, K, V]`` (or fla's ``[B, NT, H, K, V]``) states entering each chunk from
            a zero state at the sequence's start; any float dtype.
        S: ``[N, H, K, V]`` float32, the state entering each sequence.
        w: ``[C, H, K]`` float32, log2-decay from the sequence's start to each chunk's start.
        cu_seqlens, chunk_indices: fla's varlen tables (B = 1), or None.
    Returns:
        ``o [B, T, H, V]`` in v's dtype.
    """
    B, T, H, C = _launch(q, h, w, S, chunk_size, cu_seqlens, chunk_indices, "chunk_o_with_state")
    K, V = q.shape[-1], v.shape[-1]
    o = torch.empty_like(v)
    _o_kernel[lambda meta: (triton.cdiv(V, meta["BV"]) * (C // B), B * H)](
        q, v, g, h, A, S, w, o, cu_seqlens, chunk_indices, scale, T, H=H, K=K, V=V, BT=chunk_size,
        IS_VARLEN=cu_seqlens is not None)
    return o


def chunk_dv_with_state(k: Tensor, g: Tensor, A: Tensor, do: Tensor, dh: Tensor, D: Tensor, w: Tensor,
                        chunk_size: int = 64, cu_seqlens: Optional[Tensor] = None,
                        chunk_indices: Optional[Tensor] = None) -> Tensor:
    """Value gradient of every chunk with the gradient of the state leaving each sequence added.

    Args:
        k: ``[B, T, H, K]``; do: ``[B, T, H, V]``; g, A as in :func:`chunk_o_with_state`.
        dh: ``[C, H, K, V]`` gradients of the states leaving each chunk, from a zero
            gradient at the sequence's end (float32, as fla's ``chunk_bwd_dh``).
        D: ``[N, H, K, V]`` float32, the gradient of the state leaving each sequence.
        w: ``[C, H, K]`` float32, log2-decay from each chunk's end to the sequence's end.
    Returns:
        ``dv [B, T, H, V]`` in do's dtype.
    """
    B, T, H, C = _launch(k, dh, w, D, chunk_size, cu_seqlens, chunk_indices, "chunk_dv_with_state")
    K, V = k.shape[-1], do.shape[-1]
    dv = torch.empty_like(do)
    _dv_kernel[lambda meta: (triton.cdiv(V, meta["BV"]) * (C // B), B * H)](
        k, g, A, do, dh, D, w, dv, cu_seqlens, chunk_indices, T, H=H, K=K, V=V, BT=chunk_size,
        IS_VARLEN=cu_seqlens is not None)
    return dv


def chunk_dqkg_with_state(q: Tensor, k: Tensor, v: Tensor, g: Tensor, h: Tensor, do: Tensor, dh: Tensor, D: Tensor,
                          w: Tensor, dq: Tensor, dk: Tensor, scale: float, chunk_size: int = 64,
                          cu_seqlens: Optional[Tensor] = None,
                          chunk_indices: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Query, key and gate gradients: the in-chunk parts ``dq, dk`` plus the inter-chunk ones.

    Args:
        q, k, g: ``[B, T, H, K]``; v, do: ``[B, T, H, V]``.
        h: ``[C, H, K, V]`` states entering each chunk, the entering state included.
        dh, D, w: as in :func:`chunk_dv_with_state`.
        dq, dk: ``[B, T, H, K]`` float32, the in-chunk gradients (fla's ``chunk_gla_bwd_dqk_intra``).
    Returns:
        ``dq, dk, dg``, float32 ``[B, T, H, K]``; dg is the gradient of the log gates.
    """
    B, T, H, C = _launch(q, dh, w, D, chunk_size, cu_seqlens, chunk_indices, "chunk_dqkg_with_state")
    if h.numel() != dh.numel():
        raise ValueError(f"chunk_dqkg_with_state: h {tuple(h.shape)} and dh {tuple(dh.shape)} differ in size")
    K, V = q.shape[-1], v.shape[-1]
    dq2, dk2, dg = torch.empty_like(dq), torch.empty_like(dk), torch.empty_like(g)
    _dqkg_kernel[lambda meta: (triton.cdiv(K, meta["BK"]) * (C // B), B * H)](
        q, k, v, g, h, do, dh, D, w, dq, dk, dq2, dk2, dg, cu_seqlens, chunk_indices, scale, T,
        H=H, K=K, V=V, BT=chunk_size, IS_VARLEN=cu_seqlens is not None)
    return dq2, dk2, dg
