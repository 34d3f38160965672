"""Triton kernel that adds ZeCO's incoming state to fla's per-chunk states, in place.

fla's chunk kernels keep one state per chunk of 64 tokens (``h``: the state entering
each chunk; ``dh``: the gradient of the state leaving it). ZeCO computes them with a
zero state from outside the piece, then, once the scan has delivered that state,
adds its decayed value to every chunk:

    h[c]  += Diag(exp2(w[c])) S[index[c]]

``w[c]`` is the log2-decay from the piece's start to chunk c's start (forward; S is the
state entering the piece) or from chunk c's end to the piece's end (backward; S is
the gradient of the state leaving it). One program per (chunk, head, tile): a single
read and write of ``h``, all chunks in parallel.

Reference in the tests: the same sum in float64 PyTorch (on the CPU under
``TRITON_INTERPRET=1``).
"""

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _add_decayed_kernel(h, out, w, S, index, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr):
    i_c, i_h, i_kv = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    o_k = (i_kv // tl.cdiv(V, BV)) * BK + tl.arange(0, BK)
    o_v = (i_kv % tl.cdiv(V, BV)) * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m = m_k[:, None] & m_v[None, :]
    i_s = tl.load(index + i_c).to(tl.int64)
    b_w = tl.load(w + (i_c * H + i_h) * K + o_k, mask=m_k, other=0.0)
    b_S = tl.load(S + (i_s * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :], mask=m, other=0.0)
    o_h = (i_c * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.load(h + o_h, mask=m, other=0.0).to(tl.float32)
    tl.store(out + o_h, (b_h + tl.exp2(b_w)[:, None] * b_S).to(out.dtype.element_ty), mask=m)


def add_decayed_states_(h: torch.Tensor, log2_decay: torch.Tensor, states: torch.Tensor,
                        index: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``h[c] += Diag(exp2(log2_decay[c])) states[index[c]]`` for every chunk c, in place
    (or into a new tensor of ``out_dtype``).

    Args:
        h: ``[..., C, H, K, V]`` contiguous, float32/bfloat16/float16 (the leading dims
            flatten into the C chunks: fla's ``[B, NT, H, K, V]``).
        log2_decay: ``[C, H, K]`` float32, log2 of the per-key decay applied to the state.
        states: ``[N, H, K, V]`` float32.
        index: ``[C]`` integer, the state each chunk takes (``0 <= index < N``).
        out_dtype: None (in place) or the dtype of a new result, e.g. bf16 from a float32
            ``h``: one rounding of the sum, as fla's output kernel rounds the states it reads.
    Returns:
        ``h``, or the new tensor. Sums run in float32 and round once to the result's dtype.
    """
    H, K, V = h.shape[-3:]
    C = h.numel() // (H * K * V)
    if not h.is_contiguous() or log2_decay.shape != (C, H, K) or states.shape[1:] != (H, K, V) \
            or index.shape != (C,):
        raise ValueError(f"add_decayed_states_: shapes h {tuple(h.shape)} (contiguous: {h.is_contiguous()}), "
                         f"log2_decay {tuple(log2_decay.shape)}, states {tuple(states.shape)}, "
                         f"index {tuple(index.shape)} do not fit [C, H, K, V], [C, H, K], [N, H, K, V], [C]")
    out = h if out_dtype is None or out_dtype == h.dtype else torch.empty_like(h, dtype=out_dtype)
    if C == 0:
        return out
    BK, BV = min(64, triton.next_power_of_2(K)), min(64, triton.next_power_of_2(V))
    grid = (C, H, triton.cdiv(K, BK) * triton.cdiv(V, BV))
    _add_decayed_kernel[grid](h, out, log2_decay.float().contiguous(), states.float().contiguous(),
                              index.contiguous(), H=H, K=K, V=V, BK=BK, BV=BV)
    return out
