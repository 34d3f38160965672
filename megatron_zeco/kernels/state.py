"""Triton kernels for the two per-piece reductions ZeCO adds to GLA.

* :func:`chunk_state`: what a piece does to a state passing through it,
  ``S_out = Diag(gamma) S_in + E`` (E = final state from zero, gamma = exp(sum g)).
* :func:`chunk_state_grad`: the piece's share of the gradient of the state entering it,
  ``A = scale * sum_t (q_t * exp(G_t)) do_t^T``.

Both are one read of their inputs. The piece is cut into splits of ``split_size``
tokens, one program per (key block x value block, split, head) walks its split
chunk by chunk with the state in fp32 registers; a second small kernel folds
the per-split results, ``sum_s exp(w_s) X_s`` with ``w_s`` the log-decay between
split s and the piece's end (``E``) or start (``A``). Packed input (fla's
``cu_seqlens``, B = 1) gives one result per segment: each segment is cut into its
own splits (a table of token ranges, built on the host from ``cu_seqlens_cpu`` when
given), chunks start at the segment's first token. Products run on tensor cores
in the input dtype (bf16/fp16, fp32 accumulation, as fla's chunk kernels do) and in
full fp32 for fp32 inputs. Inputs may be strided views (last dim contiguous).

References in the tests: ``megatron_zeco.ops.chunk.chunk_gla_state`` /
``chunk_gla_state_grad`` in float64 (on the CPU under ``TRITON_INTERPRET=1``).
"""

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

DEFAULT_SPLIT_SIZE = 2048  # tokens per program; benchmarks/tune_state.py measures the choice


FP32, TENSOR_CORES, EMULATED = 0, 1, 2  # how _dot_t multiplies


@triton.jit
def _dot_t(a, b, DOT: tl.constexpr):
    """``a^T b`` with fp32 accumulation for fp32 ``a`` and ``b`` of the input dtype: full fp32
    for fp32 inputs, else on tensor cores with ``a`` rounded to ``b``'s dtype (EMULATED: the
    same rounding, fp32 products; Triton's interpreter has no correct bf16 ``tl.dot``)."""
    if DOT == 0:  # FP32
        return tl.dot(tl.trans(a), b.to(tl.float32), input_precision="ieee")
    if DOT == 1:  # TENSOR_CORES
        return tl.dot(tl.trans(a.to(b.dtype)), b)
    return tl.dot(tl.trans(a.to(b.dtype).to(tl.float32)), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _split(i_s, splits, T, NS, TS, VARLEN: tl.constexpr):
    """Batch entry and token range ``[bos, eos)`` of split ``i_s``: from the table of a packed
    input, else split ``i_s % NS`` of batch entry ``i_s // NS`` (splits of TS tokens)."""
    if VARLEN:
        i_b = i_s * 0
        bos = tl.load(splits + 2 * i_s)
        eos = tl.load(splits + 2 * i_s + 1)
    else:
        i_b = i_s // NS
        bos = (i_s % NS) * TS
        eos = tl.minimum(bos + TS, T)
    return i_b, bos, eos


@triton.jit
def _tile(i_kv, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Key and value offsets of tile ``i_kv`` (key blocks outer) and their bounds masks."""
    o_k = (i_kv // tl.cdiv(V, BV)) * BK + tl.arange(0, BK)
    o_v = (i_kv % tl.cdiv(V, BV)) * BV + tl.arange(0, BV)
    return o_k, o_v, o_k < K, o_v < V


def _configs():
    """Tile and pipelining choices, tuned once per (K, V, dtype) on a GPU; one under the interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config({"BK": 64, "BV": 64})]
    return [triton.Config({"BK": bk, "BV": 64}, num_warps=w, num_stages=s)
            for bk in (64, 128) for w in (4, 8) for s in (2, 3)]


@triton.autotune(configs=_configs(), key=["K", "V", "DOT"])
@triton.jit
def _state_kernel(k, v, g, E_part, g_part, splits, T, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h,
                  NS, TS, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr, VARLEN: tl.constexpr):
    i_kv, i_s, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, bos, eos = _split(i_s, splits, T, NS, TS, VARLEN)
    o_k, o_v, m_k, m_v = _tile(i_kv, K, V, BK, BV)
    o_c = tl.arange(0, BT)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    g_sum = tl.zeros([BK], dtype=tl.float32)
    for t0 in range(bos, eos, BT):
        o_t = t0 + o_c
        m_t, m_next = o_t < eos, (o_c < BT - 1) & (o_t + 1 < eos)
        p_g = g + i_b * sg_b + o_t[:, None] * sg_t + i_h * sg_h + o_k[None, :]
        b_k = tl.load(k + i_b * sk_b + o_t[:, None] * sk_t + i_h * sk_h + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0).to(tl.float32)
        b_v = tl.load(v + i_b * sv_b + o_t[:, None] * sv_t + i_h * sv_h + o_v[None, :],
                      mask=m_t[:, None] & m_v[None, :], other=0)
        b_g = tl.load(p_g, mask=m_t[:, None] & m_k[None, :], other=0).to(tl.float32)
        b_g_next = tl.load(p_g + sg_t, mask=m_next[:, None] & m_k[None, :], other=0).to(tl.float32)
        # Decay from each token to the chunk's end: a reversed cumulative sum of the *next*
        # gates, i.e. the gates after the token summed directly. A difference of cumulative
        # sums would cancel in fp32 for large gates.
        b_kd = b_k * tl.exp(tl.cumsum(b_g_next, axis=0, reverse=True))
        g_chunk = tl.sum(b_g, axis=0)
        S = S * tl.exp(g_chunk)[:, None] + _dot_t(b_kd, b_v, DOT)
        g_sum += g_chunk
    part = i_s * H + i_h
    tl.store(E_part + part * K * V + o_k[:, None] * V + o_v[None, :], S, mask=m_k[:, None] & m_v[None, :])
    if i_kv % tl.cdiv(V, BV) == 0:  # one value block writes the split's log-decay
        tl.store(g_part + part * K + o_k, g_sum, mask=m_k)


@triton.autotune(configs=_configs(), key=["K", "V", "DOT"])
@triton.jit
def _state_grad_kernel(q, g, do, A_part, g_part, splits, scale, T, sq_b, sq_t, sq_h, sg_b, sg_t, sg_h,
                       so_b, so_t, so_h, NS, TS, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr,
                       VARLEN: tl.constexpr):
    i_kv, i_s, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, bos, eos = _split(i_s, splits, T, NS, TS, VARLEN)
    o_k, o_v, m_k, m_v = _tile(i_kv, K, V, BK, BV)
    acc = tl.zeros([BK, BV], dtype=tl.float32)
    g_before = tl.zeros([BK], dtype=tl.float32)  # log-decay from the split's start to this chunk
    for t0 in range(bos, eos, BT):
        o_t = t0 + tl.arange(0, BT)
        m_t = o_t < eos
        b_q = tl.load(q + i_b * sq_b + o_t[:, None] * sq_t + i_h * sq_h + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0).to(tl.float32)
        b_g = tl.load(g + i_b * sg_b + o_t[:, None] * sg_t + i_h * sg_h + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0).to(tl.float32)
        b_do = tl.load(do + i_b * so_b + o_t[:, None] * so_t + i_h * so_h + o_v[None, :],
                       mask=m_t[:, None] & m_v[None, :], other=0)
        b_qd = b_q * tl.exp(g_before[None, :] + tl.cumsum(b_g, axis=0))
        acc += _dot_t(b_qd, b_do, DOT)
        g_before += tl.sum(b_g, axis=0)
    part = i_s * H + i_h
    tl.store(A_part + part * K * V + o_k[:, None] * V + o_v[None, :], acc * scale, mask=m_k[:, None] & m_v[None, :])
    if i_kv % tl.cdiv(V, BV) == 0:
        tl.store(g_part + part * K + o_k, g_before, mask=m_k)


@triton.jit
def _fold_kernel(X_part, g_part, out, gamma, rows, NS, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, TO_END: tl.constexpr, VARLEN: tl.constexpr):
    """``out = sum_s exp(w_s) X_s`` over the splits s of one batch entry (segment: splits
    ``rows[r]`` to ``rows[r + 1]``); ``w_s`` sums the splits' log-decays after s (TO_END) or before s."""
    i_kv, i_bh = tl.program_id(0), tl.program_id(1)
    i_r, i_h = i_bh // H, i_bh % H
    if VARLEN:
        lo = tl.load(rows + i_r)
        hi = tl.load(rows + i_r + 1)
    else:
        lo = i_r * NS
        hi = lo + NS
    o_k, o_v, m_k, m_v = _tile(i_kv, K, V, BK, BV)
    acc = tl.zeros([BK, BV], dtype=tl.float32)
    w = tl.zeros([BK], dtype=tl.float32)
    for i in range(hi - lo):
        s = hi - 1 - i if TO_END else lo + i
        part = s * H + i_h
        X = tl.load(X_part + part * K * V + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0)
        acc += tl.exp(w)[:, None] * X
        w += tl.load(g_part + part * K + o_k, mask=m_k, other=0)
    tl.store(out + i_bh * K * V + o_k[:, None] * V + o_v[None, :], acc, mask=m_k[:, None] & m_v[None, :])
    if TO_END and i_kv % tl.cdiv(V, BV) == 0:
        tl.store(gamma + i_bh * K + o_k, tl.exp(w), mask=m_k)


def _dot_mode(dtype: torch.dtype) -> int:
    if dtype == torch.float32:
        return FP32
    return EMULATED if os.environ.get("TRITON_INTERPRET") == "1" else TENSOR_CORES


def _strides(x: torch.Tensor):
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(kernel, inputs, extra, K: int, V: int, chunk_size: int, split_size: int, to_end: bool,
            cu_seqlens: Optional[torch.Tensor], cu_seqlens_cpu: Optional[torch.Tensor]):
    """Run ``kernel`` per split into fp32 partials, then fold them per batch entry (segment);
    returns ``(out, gamma or None)``."""
    B, T, H = inputs[0].shape[:3]
    inputs = [_strides(x) for x in inputs]
    TS = triton.cdiv(max(split_size, 1), chunk_size) * chunk_size
    dev = inputs[0].device
    if cu_seqlens is None:
        NS, R, splits, rows = max(1, triton.cdiv(T, TS)), B, None, None
        n_splits = B * NS
    else:
        if B != 1:
            raise ValueError(f"packed input (cu_seqlens) must have batch size 1, got {B}")
        cu = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()
        bounds, ends = [], [0]
        for bos, eos in zip(cu[:-1], cu[1:]):  # an empty segment gets one empty split (E = 0, gamma = 1)
            for t in range(bos, eos, TS) or [bos]:
                bounds += [t, min(t + TS, eos)]
            ends.append(len(bounds) // 2)
        NS, R, n_splits = 1, len(cu) - 1, len(bounds) // 2
        tables = torch.tensor(bounds + ends, dtype=torch.int32)  # one copy that does not wait for the GPU
        if dev.type == "cuda":
            tables = tables.pin_memory()
        splits, rows = tables.to(dev, non_blocking=True).split([len(bounds), len(ends)])
    X_part = torch.empty(n_splits * H, K, V, dtype=torch.float32, device=dev)
    g_part = torch.empty(n_splits * H, K, dtype=torch.float32, device=dev)
    strides = [s for x in inputs for s in x.stride()[:3]]

    def grid(meta):
        return triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]), n_splits, H

    varlen = cu_seqlens is not None
    kernel[grid](*inputs, X_part, g_part, splits, *extra, T, *strides, NS, TS, H, K, V, BT=chunk_size,
                 DOT=_dot_mode(inputs[0].dtype), VARLEN=varlen)
    out = torch.empty(R, H, K, V, dtype=torch.float32, device=dev)
    gamma = torch.empty(R, H, K, dtype=torch.float32, device=dev) if to_end else None
    BK, BV = min(64, triton.next_power_of_2(K)), min(64, triton.next_power_of_2(V))
    n_kv = triton.cdiv(K, BK) * triton.cdiv(V, BV)
    _fold_kernel[(n_kv, R * H)](X_part, g_part, out, gamma, rows, NS, H, K, V, BK=BK, BV=BV, TO_END=to_end,
                                VARLEN=varlen)
    return out, gamma


def chunk_state(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, chunk_size: int = 64,
                split_size: int = DEFAULT_SPLIT_SIZE, cu_seqlens: Optional[torch.Tensor] = None,
                cu_seqlens_cpu: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Piece summary ``(E [B, H, K, V], gamma [B, H, K])`` in float32.

    Args:
        k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; float32, bfloat16 or float16.
        cu_seqlens: ``[N+1]`` offsets of N segments (B = 1): one summary per segment, ``[N, ...]``.
        cu_seqlens_cpu: the same offsets on the host (else ``cu_seqlens`` is read back, waiting for the GPU).
    """
    return _launch(_state_kernel, [k, v, g], [], k.shape[-1], v.shape[-1], chunk_size, split_size, to_end=True,
                   cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)


def chunk_state_grad(q: torch.Tensor, g: torch.Tensor, do: torch.Tensor, scale: Optional[float] = None,
                     chunk_size: int = 64, split_size: int = DEFAULT_SPLIT_SIZE,
                     cu_seqlens: Optional[torch.Tensor] = None,
                     cu_seqlens_cpu: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``A = scale * sum_t (q_t * exp(G_t)) do_t^T``: ``[B, H, K, V]`` float32.

    Args:
        q, g: ``[B, T, H, K]``; do: ``[B, T, H, V]``; float32, bfloat16 or float16.
        cu_seqlens: ``[N+1]`` offsets of N segments (B = 1): ``[N, H, K, V]``, G_t counted from
            each segment's start.
        cu_seqlens_cpu: the same offsets on the host (else ``cu_seqlens`` is read back, waiting for the GPU).
    """
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    return _launch(_state_grad_kernel, [q, g, do], [scale], K, do.shape[-1], chunk_size, split_size,
                   to_end=False, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)[0]
