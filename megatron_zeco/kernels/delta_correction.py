"""Triton kernels: what the state entering a delta-rule piece adds to it, computed without that state.

For the gated delta rule (a log decay per head and token) and KDA (a log decay per head, token and key
channel) alike: the gate's form is a constexpr of the two kernels that read it (K1, K2), chosen from
the shape of ``g``. fla's forward run from a zero entering state gives a piece's output ``o^0`` and
leaving state ``E`` (one GPU's ordinary work). The entering state ``S_in [K, V]`` (per segment and
head) that ZeCO's scan delivers later acts on the piece linearly, through maps computed here (fla's
conventions, chunks of BT tokens; G the in-chunk cumulative log decay, ``[.., H]`` or ``[.., H, K]``;
``*`` the product per key channel; ``w = (I + L)^-1 (beta exp(G) * k)`` fla's WY factor):

    T_c  = Diag(exp(G_last)) - (k_c * exp(G_last - G))^T w_c              the chunk's map of the state, K x K
    Qt_c = scale (q_c * exp(G)) - Aqk_c w_c,  Aqk_c = scale tril_incl(sum_c q_ic k_jc exp(G_ic - G_jc))
    o_c  = o^0_c + Qt_c M_{<c} S_in,        S_out = M S_in + E,   M_{<c} = T_{c-1} ... T_0,   M = M_{<end}

Each segment's chunks are cut into sub-pieces (runs of whole chunks; ``SubPieces``), so the one
sequential product runs on ``sub-pieces x heads x column blocks`` programs:

    K1 ``delta_reads_kernel``     Qt_c, every chunk at once (Aqk formed in place for a
                                  gate per head, or read: fla's KDA forward returns it)  grid (chunks, H)
    K2 ``delta_maps_kernel``      per sub-piece j from M = I: R_c = Qt_c M; M <- T_c M; L_j = M
                                  (M: a [K, BV] column block in float32 registers)      grid (K/BV, sub-pieces, H)
                                  ``FUSED`` (``fused_maps``): K1 inside K2, Qt never stored:
                                  R_c = scale (q_c * exp(G)) M - Aqk_c (w_c M); the pieces run K1
                                  apart (K2's sequential loop is shorter without Qt's two products)
    K3 ``delta_prefix_kernel``    P_j = L_{j-1} ... L_0 (P_0 = I), the segment's M       grid (K/BC, segments, H)
  after the scan delivered S_in:
    K4 ``delta_entering_kernel``  X_j = P_j S_in, the sub-piece's share of S_in          grid (V/BV, sub-pieces, H)
       ``delta_output_kernel``    o_c = o^0_c + R_c X_j per chunk of a run (float32,
                                  rounded once), X_j read once per run                   grid (V/BV, runs, H)
  backward, from the outputs' gradient do:
    K5 ``delta_grad_kernel``      Z_r = P_j^T sum_{c in r} R_c^T do_c, r a run of j      grid (V/BV, runs, H)
       ``delta_grad_sum_kernel``  A_n = sum_{r in n} Z_r (in order: deterministic)       grid (KV/BLOCK, segments, H)

K4 and K5 run over runs of chunks of a sub-piece (``SubPieces.runs``): K4 a few chunks per program
(``OUTPUT_RUN``, its loop unrolled, so their loads are issued at once), K5 a sub-piece per program by
default. Under ``"input"`` K4's X is stored in R's 16-bit dtype, the rounding its product makes.

``A`` is the gradient of ``<do, o>`` with respect to ``S_in``; the entering state's full gradient is
``A + M^T D`` (the backward scan adds the second term), and the inputs' gradients are fla's backward
from ``initial_state=S_in`` with ``dht=D``. The math, the plan and the float64 reference:
``megatron_zeco.kernels.delta_reference``; the Python wrappers here take the same arguments and return
the same tensors.

Layouts (token-major, as fla): q, k ``[B, T, HQ, K]`` (HQ query/key heads; value head h reads head
``h // (H // HQ)``); w, Qt, R ``[B, T, H, K]``; g (G) ``[B, T, H]`` or ``[B, T, H, K]`` float32; Aqk
``[B, T, H, BT]`` (fla's: row i a token, column j the j-th token of its chunk; only its causal part is
read); o, do ``[B, T, H, V]``; L, P ``[sub-pieces, H, K, K]``, M ``[N, H, K, K]``, S_in, A ``[N, H, K, V]``
float32, ``K x V`` states with ``M`` acting on their K rows. Packed input is one row of N segments
(``cu_seqlens``); dense ``[B, T]`` input is B segments. Launch tables come from the plan's host copy of
the offsets, so no launch reads the device.

Precision (``precision``, a constexpr of every kernel): every product accumulates in float32. ``"input"``
multiplies as fla's own state passes do: a float32 tile (M, w M, the states) meets a 16-bit input tile
(q, k, w, Qt, R, do; under a per-channel gate the decayed keys ``k * exp(G_last - G)``, rounded to the
input's dtype as fla's state pass rounds them) rounded to the input's dtype, on 16-bit tensor cores (one
pass); two float32 tiles in one TF32 pass. The other modes keep float32 operands: ``"ieee"`` (CUDA-core
FMAs: the tests' mode, slow on the GPU), ``"tf32"`` (one TF32 pass: the float32 operand truncated to 10
explicit mantissa bits) or ``"tf32x3"`` (three TF32 passes, float32 accuracy; a float32 tile against a
bfloat16 input is split into three bfloat16 terms instead, ``hi + mid + lo`` within 2^-24 of it, three
bfloat16 passes). The pieces (``gated_delta_rule/fla_piece.py``, ``kda/fla_piece.py``) run ``"input"``
for 16-bit inputs, whose roundings are then those of fla's own state pass on one GPU, and ``"tf32x3"``
for float32 inputs, whose caller asked for float32 accuracy: the chunk recurrence of K2 compounds its
roundings over a sub-piece, and its maps enter the scan.

On the GPU, K2 and K3 keep 64 columns of M per program (``block_cols``): Triton 3.7.1 miscomputed K2 on
sm_90 with 32 columns of a K = 128 map, so fewer are refused there for K > 64.

Under ``TRITON_INTERPRET=1`` (tests on the CPU) the interpreter multiplies 16-bit tiles wrongly, so
16-bit products are computed from the same values in float32 (exact products, as on tensor cores).
"""

import functools
from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from . import interpreted, map_precision
from .delta_reference import SubPieces, choose_sub_pieces

Tensor = torch.Tensor
PRECISIONS = ("ieee", "tf32", "tf32x3", "input")
# chunks per K4 program (``output_correction``), its loop unrolled: the loads of a few chunks at once
OUTPUT_RUN = 4

__all__ = [
    "SubPieces", "choose_sub_pieces", "plan_sub_pieces", "PRECISIONS", "correction_reads", "sub_piece_maps",
    "fused_maps", "prefix_maps", "output_correction", "entering_grad", "piece_transition", "PieceCorrection",
    "side_stream", "urgent_stream", "OUTPUT_RUN",
]


def _configs():
    """One configuration under the interpreter; on the GPU the warps and stages are tuned per shape."""
    if interpreted():
        return [triton.Config({}, num_warps=4, num_stages=1)]
    return [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (2, 3)]


# ------------------------------------------------------------------------------------------ helpers


@triton.jit
def _exp(x, G_LOG2: tl.constexpr):
    """exp of a log decay: base 2 (fla's G) or natural."""
    if G_LOG2:
        y = tl.exp2(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _dot16(a, b, acc, INTERPRETED: tl.constexpr):
    """``acc + a @ b`` for two 16-bit tiles: exact products, float32 accumulation."""
    if INTERPRETED:  # the interpreter's 16-bit tl.dot is wrong: the same exact products in float32
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _split3(x):
    """float32 ``x`` as ``hi + mid + lo`` in bfloat16 (each the rounding of what is left; exact to 2^-24 |x|)."""
    hi = x.to(tl.bfloat16)
    rest = x - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """``acc + a @ b`` in float32 (acc float32; a, b float32 or an input's 16-bit dtype), see the module
    docstring for ``PRECISION``."""
    if PRECISION == "input":  # the float32 operand rounded to the other's 16-bit dtype, as fla's state passes
        if a.dtype == tl.float32 and b.dtype == tl.float32:
            acc = tl.dot(a, b, acc, input_precision="tf32")
        elif a.dtype == tl.float32:
            acc = _dot16(a.to(b.dtype), b, acc, INTERPRETED)
        elif b.dtype == tl.float32:
            acc = _dot16(a, b.to(a.dtype), acc, INTERPRETED)
        else:
            acc = _dot16(a, b, acc, INTERPRETED)
    elif a.dtype == tl.float32:
        if b.dtype == tl.float32:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        elif b.dtype == tl.bfloat16 and PRECISION == "tf32x3":
            hi, mid, lo = _split3(a)
            acc = _dot16(hi, b, acc, INTERPRETED)
            acc = _dot16(mid, b, acc, INTERPRETED)
            acc = _dot16(lo, b, acc, INTERPRETED)
        else:
            acc = tl.dot(a, b.to(tl.float32), acc, input_precision=PRECISION)
    elif b.dtype == tl.float32:
        if a.dtype == tl.bfloat16 and PRECISION == "tf32x3":
            hi, mid, lo = _split3(b)
            acc = _dot16(a, hi, acc, INTERPRETED)
            acc = _dot16(a, mid, acc, INTERPRETED)
            acc = _dot16(a, lo, acc, INTERPRETED)
        else:
            acc = tl.dot(a.to(tl.float32), b, acc, input_precision=PRECISION)
    else:
        acc = _dot16(a, b, acc, INTERPRETED)
    return acc


@triton.jit
def _chunk_rows(bos, eos, i_t, H: tl.constexpr, i_h, BT: tl.constexpr):
    """Chunk ``i_t`` of the segment ``[bos, eos)``: its tokens' row offsets into ``[rows, H, *]`` tensors
    (``(bos + t) * H + i_h``, int64), their mask, and the row of its last token."""
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    T = eos - bos
    last = tl.minimum(i_t.to(tl.int64) * BT + BT, T) - 1
    return (bos + o_t) * H + i_h, o_t < T, (bos + last) * H + i_h


@triton.jit
def _key_rows(rows, i_h, H: tl.constexpr, HQ: tl.constexpr):
    """The rows of query/key head ``i_h // (H // HQ)`` (of HQ) at the tokens of value head ``i_h``'s ``rows``."""
    if HQ == H:
        out = rows
    else:
        out = (rows - i_h) // H * HQ + i_h // (H // HQ)
    return out


# ------------------------------------------------------------------------------------------ kernels


@triton.jit
def _delta_reads_kernel(q, k, w, g, aqk, qt, chunks, scale, H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr,
                        BT: tl.constexpr, BK: tl.constexpr, G_LOG2: tl.constexpr, GATE_VECTOR: tl.constexpr,
                        GIVEN_A: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """K1, one chunk and head: ``Qt = scale (q * exp(G)) - Aqk w``. q, k ``[rows, HQ, K]``, w, qt ``[rows, H, K]``,
    g (G) ``[rows, H]`` (``GATE_VECTOR``: ``[rows, H, K]``); BK: a block of K. ``GIVEN_A``: Aqk read from aqk
    ``[rows, H, BT]`` (its causal part), else formed here as ``scale tril_incl(q k^T exp(G_i - G_j))``
    (a gate per head only)."""
    tl.static_assert(GIVEN_A or not GATE_VECTOR, "a gate per key channel needs Aqk given")
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos = tl.load(chunks + i_c * 4).to(tl.int64)
    eos = tl.load(chunks + i_c * 4 + 1).to(tl.int64)
    i_t = tl.load(chunks + i_c * 4 + 2)
    rows, m_t, _ = _chunk_rows(bos, eos, i_t, H, i_h, BT)
    rows_k = _key_rows(rows, i_h, H, HQ)
    o_i = tl.arange(0, BT)
    m_A = (o_i[:, None] >= o_i[None, :]) & m_t[:, None] & m_t[None, :]
    if not GATE_VECTOR:
        b_g = tl.load(g + rows, mask=m_t, other=0.).to(tl.float32)
        b_qg = tl.where(m_t, _exp(b_g, G_LOG2), 0.) * scale
    if GIVEN_A:
        b_A = tl.load(aqk + rows[:, None] * BT + o_i[None, :], mask=m_A, other=0.)
    else:
        b_A = tl.zeros([BT, BT], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            b_q = tl.load(q + rows_k[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
            b_kT = tl.load(k + rows_k[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.)
            b_A = _dot(b_q, b_kT, b_A, PRECISION, INTERPRETED)
        b_A = b_A * tl.where(m_A, _exp(b_g[:, None] - b_g[None, :], G_LOG2), 0.) * scale
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m = m_t[:, None] & (o_k < K)[None, :]
        b_q = tl.load(q + rows_k[:, None] * K + o_k[None, :], mask=m, other=0.).to(tl.float32)
        if GATE_VECTOR:
            b_gk = tl.load(g + rows[:, None] * K + o_k[None, :], mask=m, other=0.).to(tl.float32)
            b_q = b_q * tl.where(m, _exp(b_gk, G_LOG2), 0.) * scale
        else:
            b_q = b_q * b_qg[:, None]
        b_w = tl.load(w + rows[:, None] * K + o_k[None, :], mask=m, other=0.)
        b_qt = b_q - _dot(b_A, b_w, tl.zeros([BT, BK], dtype=tl.float32), PRECISION, INTERPRETED)
        tl.store(qt + rows[:, None] * K + o_k[None, :], b_qt.to(qt.dtype.element_ty), mask=m)


@triton.jit
def _eye_rows(o_v, m_v, OFF: tl.constexpr, BK: tl.constexpr):
    """Rows ``OFF .. OFF+BK`` of the identity's columns ``o_v``."""
    o_k = OFF + tl.arange(0, BK)
    return tl.where((o_k[:, None] == o_v[None, :]) & m_v[None, :], 1., 0.)


@triton.jit
def _maps_read(qt, w, rows, m_t, b_M, b_r, b_wm, OFF: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
               PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """What rows ``OFF .. OFF+BK`` of M (``b_M``) add to ``R = Qt M`` and to ``w M``."""
    o_k = OFF + tl.arange(0, BK)
    m = m_t[:, None] & (o_k < K)[None, :]
    b_qt = tl.load(qt + rows[:, None] * K + o_k[None, :], mask=m, other=0.)
    b_r = _dot(b_qt, b_M, b_r, PRECISION, INTERPRETED)
    b_w = tl.load(w + rows[:, None] * K + o_k[None, :], mask=m, other=0.)
    b_wm = _dot(b_w, b_M, b_wm, PRECISION, INTERPRETED)
    return b_r, b_wm


@triton.jit
def _maps_read_q(q, k, w, g, rows, rows_k, m_t, b_M, b_r, b_wm, b_A, OFF: tl.constexpr, K: tl.constexpr,
                 BK: tl.constexpr, G_LOG2: tl.constexpr, GATE_VECTOR: tl.constexpr, FORM_A: tl.constexpr,
                 PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """K2 from the queries (``FUSED``): what rows ``OFF .. OFF+BK`` of M add to ``q M`` (the queries decayed
    per key channel under ``GATE_VECTOR``, rounded to their dtype under ``"input"``) and to ``w M``, and
    (``FORM_A``) what these key channels add to ``q k^T``."""
    o_k = OFF + tl.arange(0, BK)
    m_k = o_k < K
    m = m_t[:, None] & m_k[None, :]
    b_q = tl.load(q + rows_k[:, None] * K + o_k[None, :], mask=m, other=0.)
    if FORM_A:
        b_kT = tl.load(k + rows_k[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.)
        b_A = _dot(b_q, b_kT, b_A, PRECISION, INTERPRETED)
    if GATE_VECTOR:
        b_gk = tl.load(g + rows[:, None] * K + o_k[None, :], mask=m, other=0.).to(tl.float32)
        b_qg = b_q.to(tl.float32) * tl.where(m, _exp(b_gk, G_LOG2), 0.)
        if PRECISION == "input":
            b_qg = b_qg.to(b_q.dtype)
        b_r = _dot(b_qg, b_M, b_r, PRECISION, INTERPRETED)
    else:
        b_r = _dot(b_q, b_M, b_r, PRECISION, INTERPRETED)
    b_w = tl.load(w + rows[:, None] * K + o_k[None, :], mask=m, other=0.)
    b_wm = _dot(b_w, b_M, b_wm, PRECISION, INTERPRETED)
    return b_r, b_wm, b_A


@triton.jit
def _maps_update(k, g, rows_k, rows, last, m_t, b_M, b_wm, OFF: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                 G_LOG2: tl.constexpr, GATE_VECTOR: tl.constexpr, PRECISION: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    """Rows ``OFF .. OFF+BK`` of ``Diag(exp(G_last)) M + (k * exp(G_last - G))^T b_wm``. A gate per head:
    b_wm is ``-exp(G_last - G) w M`` (the decay applied per token); per key channel: b_wm is ``-w M`` and
    the keys are decayed here, channel by channel (rounded to their dtype under ``"input"``, as fla's
    state pass rounds them)."""
    o_k = OFF + tl.arange(0, BK)
    m_k = o_k < K
    b_kT = tl.load(k + rows_k[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.)
    if GATE_VECTOR:
        b_gl = tl.load(g + last * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_gT = tl.load(g + rows[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.)
        b_kd = b_kT.to(tl.float32) * tl.where(m_t[None, :], _exp(b_gl[:, None] - b_gT.to(tl.float32), G_LOG2), 0.)
        if PRECISION == "input":
            b_kd = b_kd.to(b_kT.dtype)
        b_M = b_M * _exp(b_gl, G_LOG2)[:, None]
    else:
        b_kd = b_kT
        b_M = b_M * _exp(tl.load(g + last).to(tl.float32), G_LOG2)
    return _dot(b_kd, b_wm, b_M, PRECISION, INTERPRETED)


@triton.jit
def _maps_store(L, base, b_M, o_v, m_v, OFF: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    o_k = OFF + tl.arange(0, BK)
    tl.store(L + (base + o_k[:, None]) * K + o_v[None, :], b_M, mask=(o_k < K)[:, None] & m_v[None, :])


@triton.jit
def _delta_maps_kernel(qt, q, aqk, scale, k, w, g, r, L, pieces, H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, G_LOG2: tl.constexpr,
                       GATE_VECTOR: tl.constexpr, FUSED: tl.constexpr, GIVEN_A: tl.constexpr,
                       PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """K2, one sub-piece, head and block of BV columns of M: from ``M = I``, per chunk ``R = Qt M``
    (stored), ``M <- Diag(exp(G_last)) M - (k * exp(G_last - G))^T (w M)``; then ``L_j = M``. M is held in
    float32 as up to four tiles of BK rows (``K <= 4 BK``), so no tile outgrows the registers.
    qt, w, r ``[rows, H, K]``, k ``[rows, HQ, K]``, g ``[rows, H]`` (``GATE_VECTOR``: ``[rows, H, K]``),
    L ``[sub-pieces, H, K, K]`` float32.

    ``FUSED`` (K1 and K2 in one): Qt is never stored; R is formed from the queries ``q [rows, HQ, K]`` as
    ``scale (q * exp(G)) M - Aqk (w M)``, Aqk read from ``aqk`` (``GIVEN_A``, as K1) or formed from the
    chunk's ``q k^T`` (a gate per head). ``qt`` is unused then; ``q``, ``aqk`` and ``scale`` otherwise."""
    i_v, i_j, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(pieces + i_j * 5 + 1).to(tl.int64)
    eos = tl.load(pieces + i_j * 5 + 2).to(tl.int64)
    first = tl.load(pieces + i_j * 5 + 3)
    count = tl.load(pieces + i_j * 5 + 4)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < K
    b_M1 = _eye_rows(o_v, m_v, 0, BK)
    if K > BK:
        b_M2 = _eye_rows(o_v, m_v, BK, BK)
    if K > 2 * BK:
        b_M3 = _eye_rows(o_v, m_v, 2 * BK, BK)
    if K > 3 * BK:
        b_M4 = _eye_rows(o_v, m_v, 3 * BK, BK)
    tl.static_assert(GIVEN_A or not GATE_VECTOR or not FUSED, "a gate per key channel needs Aqk given")
    FORM_A: tl.constexpr = FUSED and not GIVEN_A
    o_i = tl.arange(0, BT)
    for i in range(count):
        rows, m_t, last = _chunk_rows(bos, eos, first + i, H, i_h, BT)
        rows_k = _key_rows(rows, i_h, H, HQ)
        b_r = tl.zeros([BT, BV], dtype=tl.float32)
        b_wm = tl.zeros([BT, BV], dtype=tl.float32)
        if FUSED:
            b_A = tl.zeros([BT, BT], dtype=tl.float32)
            b_r, b_wm, b_A = _maps_read_q(q, k, w, g, rows, rows_k, m_t, b_M1, b_r, b_wm, b_A, 0, K, BK, G_LOG2,
                                          GATE_VECTOR, FORM_A, PRECISION, INTERPRETED)
            if K > BK:
                b_r, b_wm, b_A = _maps_read_q(q, k, w, g, rows, rows_k, m_t, b_M2, b_r, b_wm, b_A, BK, K, BK, G_LOG2,
                                              GATE_VECTOR, FORM_A, PRECISION, INTERPRETED)
            if K > 2 * BK:
                b_r, b_wm, b_A = _maps_read_q(q, k, w, g, rows, rows_k, m_t, b_M3, b_r, b_wm, b_A, 2 * BK, K, BK,
                                              G_LOG2, GATE_VECTOR, FORM_A, PRECISION, INTERPRETED)
            if K > 3 * BK:
                b_r, b_wm, b_A = _maps_read_q(q, k, w, g, rows, rows_k, m_t, b_M4, b_r, b_wm, b_A, 3 * BK, K, BK,
                                              G_LOG2, GATE_VECTOR, FORM_A, PRECISION, INTERPRETED)
            # R = scale (q * exp(G)) M - Aqk (w M), Aqk the chunk's causal in-chunk attention
            m_A = (o_i[:, None] >= o_i[None, :]) & m_t[:, None] & m_t[None, :]
            if GIVEN_A:
                b_A = tl.load(aqk + rows[:, None] * BT + o_i[None, :], mask=m_A, other=0.).to(tl.float32)
            if GATE_VECTOR:
                b_r = b_r * scale
            else:
                b_gq = tl.load(g + rows, mask=m_t, other=0.).to(tl.float32)
                if FORM_A:
                    b_A = b_A * tl.where(m_A, _exp(b_gq[:, None] - b_gq[None, :], G_LOG2), 0.) * scale
                b_r = b_r * (tl.where(m_t, _exp(b_gq, G_LOG2), 0.) * scale)[:, None]
            b_r = b_r - _dot(b_A, b_wm, tl.zeros([BT, BV], dtype=tl.float32), PRECISION, INTERPRETED)
        else:
            b_r, b_wm = _maps_read(qt, w, rows, m_t, b_M1, b_r, b_wm, 0, K, BK, PRECISION, INTERPRETED)
            if K > BK:
                b_r, b_wm = _maps_read(qt, w, rows, m_t, b_M2, b_r, b_wm, BK, K, BK, PRECISION, INTERPRETED)
            if K > 2 * BK:
                b_r, b_wm = _maps_read(qt, w, rows, m_t, b_M3, b_r, b_wm, 2 * BK, K, BK, PRECISION, INTERPRETED)
            if K > 3 * BK:
                b_r, b_wm = _maps_read(qt, w, rows, m_t, b_M4, b_r, b_wm, 3 * BK, K, BK, PRECISION, INTERPRETED)
        tl.store(r + rows[:, None] * K + o_v[None, :], b_r.to(r.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        if GATE_VECTOR:
            b_wm = -b_wm  # rows past the segment are zero (w is read as zero there)
        else:
            b_gl = tl.load(g + last).to(tl.float32)
            b_g = tl.load(g + rows, mask=m_t, other=0.).to(tl.float32)
            b_wm = b_wm * tl.where(m_t, -_exp(b_gl - b_g, G_LOG2), 0.)[:, None]
        b_M1 = _maps_update(k, g, rows_k, rows, last, m_t, b_M1, b_wm, 0, K, BK, G_LOG2, GATE_VECTOR, PRECISION,
                            INTERPRETED)
        if K > BK:
            b_M2 = _maps_update(k, g, rows_k, rows, last, m_t, b_M2, b_wm, BK, K, BK, G_LOG2, GATE_VECTOR, PRECISION,
                                INTERPRETED)
        if K > 2 * BK:
            b_M3 = _maps_update(k, g, rows_k, rows, last, m_t, b_M3, b_wm, 2 * BK, K, BK, G_LOG2, GATE_VECTOR,
                                PRECISION, INTERPRETED)
        if K > 3 * BK:
            b_M4 = _maps_update(k, g, rows_k, rows, last, m_t, b_M4, b_wm, 3 * BK, K, BK, G_LOG2, GATE_VECTOR,
                                PRECISION, INTERPRETED)
    base = (i_j.to(tl.int64) * H + i_h) * K
    _maps_store(L, base, b_M1, o_v, m_v, 0, K, BK)
    if K > BK:
        _maps_store(L, base, b_M2, o_v, m_v, BK, K, BK)
    if K > 2 * BK:
        _maps_store(L, base, b_M3, o_v, m_v, 2 * BK, K, BK)
    if K > 3 * BK:
        _maps_store(L, base, b_M4, o_v, m_v, 3 * BK, K, BK)


@triton.jit
def _delta_prefix_kernel(L, P, M, piece_offsets, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                         BC: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """K3, one segment, head and block of BC columns: ``P_j = L_{j-1} ... L_0`` over the segment's
    sub-pieces (``P_0 = I``, stored), then ``M = L_{S-1} ... L_0`` (the identity if it has none).
    L, P ``[sub-pieces, H, K, K]``, M ``[N, H, K, K]``, float32."""
    i_c, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    j0 = tl.load(piece_offsets + i_n)
    j1 = tl.load(piece_offsets + i_n + 1)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < K
    b_P = tl.where((o_k[:, None] == o_c[None, :]) & m_c[None, :], 1., 0.)
    for j in range(j0, j1):
        base = (i_h + j * H).to(tl.int64) * K * K
        tl.store(P + base + o_k[:, None] * K + o_c[None, :], b_P, mask=m_k[:, None] & m_c[None, :])
        b_L = tl.load(L + base + o_k[:, None] * K + o_k[None, :], mask=m_k[:, None] & m_k[None, :], other=0.)
        b_P = _dot(b_L, b_P, tl.zeros([BK, BC], dtype=tl.float32), PRECISION, INTERPRETED)
    p_M = M + (i_n.to(tl.int64) * H + i_h) * K * K + o_k[:, None] * K + o_c[None, :]
    tl.store(p_M, b_P, mask=m_k[:, None] & m_c[None, :])


@triton.jit
def _run(runs, i_r):
    """Row ``i_r`` of a runs table (``SubPieces.tables(device, chunks_per_run)``): its segment's ``bos`` and
    ``eos`` (int64), first chunk in the segment, chunk count and sub-piece (int64)."""
    bos = tl.load(runs + i_r * 5).to(tl.int64)
    eos = tl.load(runs + i_r * 5 + 1).to(tl.int64)
    first = tl.load(runs + i_r * 5 + 2)
    count = tl.load(runs + i_r * 5 + 3)
    i_j = tl.load(runs + i_r * 5 + 4).to(tl.int64)
    return bos, eos, first, count, i_j


@triton.jit
def _delta_entering_kernel(P, s_in, X, pieces, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """K4 (first part), one sub-piece j, head and block of BV value columns: ``X_j = P_j S_in[n]``, the part of
    the state entering sub-piece j that comes from the segment's entering state. P ``[sub-pieces, H, K, K]``,
    s_in ``[N, H, K, V]``, float32; X ``[sub-pieces, H, K, V]`` (rounded to its dtype once); BK >= K."""
    i_v, i_j, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n = tl.load(pieces + i_j * 5).to(tl.int64)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_P = tl.load(P + (i_j.to(tl.int64) * H + i_h) * K * K + o_k[:, None] * K + o_k[None, :],
                  mask=m_k[:, None] & m_k[None, :], other=0.)
    b_S = tl.load(s_in + (i_n * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :],
                  other=0.)
    b_X = _dot(b_P, b_S.to(tl.float32), tl.zeros([BK, BV], dtype=tl.float32), PRECISION, INTERPRETED)
    tl.store(X + (i_j.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :], b_X.to(X.dtype.element_ty),
             mask=m_k[:, None] & m_v[None, :])


@triton.jit
def _delta_output_kernel(o0, r, X, out, runs, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, RUN: tl.constexpr,
                         PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """K4 (second part), one run of at most RUN chunks of sub-piece j, head and block of BV value columns:
    ``out = o0 + R_c X_j`` for each chunk c of the run, summed in float32 and rounded once. The run's loop is
    unrolled, so X_j and every chunk's loads are issued at once; no chunk waits for another. o0, out
    ``[rows, H, V]``, r ``[rows, H, K]``, X ``[sub-pieces, H, K, V]`` (float32, or r's dtype under
    ``"input"``, which rounds X to it), runs ``[NR, 5]`` (``SubPieces.tables(device, RUN)``); BK >= K."""
    i_v, i_r, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, first, count, i_j = _run(runs, i_r)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_X = tl.load(X + (i_j * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :],
                  other=0.)
    for i in tl.static_range(RUN):
        rows, m_t, _ = _chunk_rows(bos, eos, first + i, H, i_h, BT)
        m_t = m_t & (tl.full([BT], i, tl.int32) < count)  # past the run's last chunk: nothing
        m_o = m_t[:, None] & m_v[None, :]
        b_r = tl.load(r + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
        b_o = tl.load(o0 + rows[:, None] * V + o_v[None, :], mask=m_o, other=0.).to(tl.float32)
        b_o = _dot(b_r, b_X, b_o, PRECISION, INTERPRETED)
        tl.store(out + rows[:, None] * V + o_v[None, :], b_o.to(out.dtype.element_ty), mask=m_o)


@triton.jit
def _delta_grad_kernel(r, do, P, Z, runs, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """K5 (first part), one run of chunks of sub-piece j, head and block of BV columns: ``Z_r = P_j^T sum_{c in
    r} R_c^T do_c``. r ``[rows, H, K]``, do ``[rows, H, V]``, P ``[sub-pieces, H, K, K]``, Z ``[runs, H, K, V]``
    float32, runs ``[NR, 5]`` (``SubPieces.tables(device, chunks_per_run)``)."""
    i_v, i_r, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, first, count, i_j = _run(runs, i_r)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_Y = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(count):
        rows, m_t, _ = _chunk_rows(bos, eos, first + i, H, i_h, BT)
        b_rT = tl.load(r + rows[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.)
        b_do = tl.load(do + rows[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.)
        b_Y = _dot(b_rT, b_do, b_Y, PRECISION, INTERPRETED)
    b_P = tl.load(P + (i_j * H + i_h) * K * K + o_k[:, None] * K + o_k[None, :], mask=m_k[:, None] & m_k[None, :],
                  other=0.)
    b_Z = _dot(tl.trans(b_P), b_Y, tl.zeros([BK, BV], dtype=tl.float32), PRECISION, INTERPRETED)
    tl.store(Z + (i_r.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :], b_Z,
             mask=m_k[:, None] & m_v[None, :])


@triton.jit
def _delta_grad_sum_kernel(Z, A, run_offsets, H: tl.constexpr, KV: tl.constexpr, BLOCK: tl.constexpr):
    """K5 (second part), one segment, head and block of the state: ``A_n = sum_{r in n} Z_r`` in order
    (zero for a segment without chunks). Z ``[runs, H, K, V]``, A ``[N, H, K, V]`` float32."""
    i_b, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    j0 = tl.load(run_offsets + i_n)
    j1 = tl.load(run_offsets + i_n + 1)
    o = i_b * BLOCK + tl.arange(0, BLOCK)
    m = o < KV
    b_A = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(j0, j1):
        b_A += tl.load(Z + (i_h + j * H).to(tl.int64) * KV + o, mask=m, other=0.)
    tl.store(A + (i_n.to(tl.int64) * H + i_h) * KV + o, b_A, mask=m)


def _tuned(fn, key):
    return triton.autotune(configs=_configs(), key=key)(fn)


delta_reads_kernel = _tuned(_delta_reads_kernel, ["H", "HQ", "K", "BT", "BK", "GATE_VECTOR", "GIVEN_A", "PRECISION"])
delta_maps_kernel = _tuned(_delta_maps_kernel, ["H", "HQ", "K", "BT", "BK", "BV", "GATE_VECTOR", "FUSED", "GIVEN_A",
                                                   "PRECISION"])
delta_prefix_kernel = _tuned(_delta_prefix_kernel, ["H", "K", "BK", "BC", "PRECISION"])
delta_entering_kernel = _tuned(_delta_entering_kernel, ["H", "K", "V", "BK", "BV", "PRECISION"])
delta_output_kernel = _tuned(_delta_output_kernel, ["H", "K", "V", "BT", "BK", "BV", "RUN", "PRECISION"])
delta_grad_kernel = _tuned(_delta_grad_kernel, ["H", "K", "V", "BT", "BK", "BV", "PRECISION"])
delta_grad_sum_kernel = _tuned(_delta_grad_sum_kernel, ["H", "KV", "BLOCK"])
KERNELS = {  # name -> the jit function (for compile checks)
    "reads": _delta_reads_kernel, "maps": _delta_maps_kernel, "prefix": _delta_prefix_kernel,
    "entering": _delta_entering_kernel, "output": _delta_output_kernel, "grad": _delta_grad_kernel,
    "grad_sum": _delta_grad_sum_kernel,
}


# ------------------------------------------------------------------------------------------ wrappers


def default_block_cols(K: int) -> int:
    """Columns of M per K2 (and K3) program: 64 (fewer for K < 64)."""
    return min(triton.next_power_of_2(K), 64)


def _block_cols(K: int, block_cols: Optional[int], device: torch.device) -> int:
    BV = block_cols or default_block_cols(K)
    if device.type == "cuda" and K > 64 and BV < 64:
        # Triton 3.7.1 on sm_90 miscomputes K2 with 32 columns of a K = 128 map at every num_warps and
        # num_stages tried (wrong values, NaN, illegal addresses); 64 columns are exact
        raise ValueError(f"block_cols = {BV} < 64 for K = {K} is refused on the GPU (miscompiled); use 64")
    return BV


def plan_sub_pieces(cu_seqlens_cpu: Tensor, chunk_size: int, heads: int, K: int, device: torch.device,
                    block_cols: Optional[int] = None, waves: float = 2.0, min_chunks: int = 4) -> SubPieces:
    """A plan whose K2 launch fills ``waves`` times the device's SMs (``choose_sub_pieces``)."""
    props = torch.cuda.get_device_properties(device) if torch.device(device).type == "cuda" else None
    processors = props.multi_processor_count if props is not None else 1
    blocks = triton.cdiv(K, block_cols or default_block_cols(K))
    return SubPieces(cu_seqlens_cpu, chunk_size,
                     choose_sub_pieces(cu_seqlens_cpu, chunk_size, heads, blocks, processors, waves, min_chunks))


@functools.lru_cache(maxsize=64)
def segment_plan(offsets: Tuple[int, ...], chunk_size: int, heads: int, K: int, device: torch.device) -> SubPieces:
    """:func:`plan_sub_pieces` over segments at ``offsets``, made once per shape (a layer's pieces have the
    same segments every step of an unpacked batch)."""
    return plan_sub_pieces(torch.tensor(offsets, dtype=torch.long), chunk_size, heads, K, device)


def _check(plan: SubPieces, precision: str, **tensors: Tensor) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    BT = plan.chunk_size
    if BT < 16 or BT & (BT - 1):
        raise ValueError(f"the kernels need a power-of-two chunk size of at least 16, got {BT}")
    for name, x in tensors.items():
        if x is None:
            continue
        if x.dtype == torch.float64:
            raise ValueError(f"{name}: float64 runs on the reference (megatron_zeco.kernels.delta_reference)")
        if x.dim() >= 3 and name in ("q", "k", "w", "g", "qt", "aqk", "R", "o0", "do") and \
                x.shape[0] * x.shape[1] != plan.tokens:
            raise ValueError(f"{name} {tuple(x.shape)} holds {x.shape[0] * x.shape[1]} tokens, the plan {plan.tokens}")


def _heads(k: Tensor, w: Tensor, g: Tensor) -> Tuple[int, int, int, bool]:
    """``(H, HQ, K, gate per key channel)`` of keys ``[B, T, HQ, K]``, w ``[B, T, H, K]`` and G
    ``[B, T, H]`` or ``[B, T, H, K]``; ValueError for shapes that do not fit."""
    HQ, K, H = k.shape[2], k.shape[3], w.shape[2]
    if H % HQ or w.shape[3] != K:
        raise ValueError(f"w {tuple(w.shape)} must have K = {K} and a multiple of the keys' {HQ} heads")
    if tuple(g.shape[2:]) not in ((H,), (H, K)):
        raise ValueError(f"g {tuple(g.shape)} must be [B, T, {H}] (a gate per head) or [B, T, {H}, {K}] (per key "
                         "channel)")
    return H, HQ, K, g.dim() == 4


def _query_heads(q: Tensor, k: Tensor, w: Tensor, g: Tensor, aqk: Optional[Tensor], plan: SubPieces,
                 precision: str) -> Tuple[int, int, int, bool]:
    """:func:`_heads` of a call that reads the queries (K1, or K2 ``FUSED``), its inputs checked; ValueError
    where a gate per key channel comes without ``aqk`` or ``aqk`` does not fit."""
    _check(plan, precision, q=q, k=k, w=w, g=g, aqk=aqk)
    H, HQ, K, vector = _heads(k, w, g)
    if vector and aqk is None:
        raise ValueError("a gate per key channel needs aqk, the in-chunk attention (fla's chunk_kda_fwd_intra "
                         "returns it)")
    if aqk is not None and tuple(aqk.shape) != (*w.shape[:3], plan.chunk_size):
        raise ValueError(f"aqk {tuple(aqk.shape)}: expected {(*w.shape[:3], plan.chunk_size)}")
    return H, HQ, K, vector


def correction_reads(q: Tensor, k: Tensor, w: Tensor, g: Tensor, scale: float, plan: SubPieces, *,
                     aqk: Optional[Tensor] = None, g_log2: bool = True, out_dtype: torch.dtype = torch.float32,
                     precision: str = "tf32x3") -> Tensor:
    """K1: ``Qt [B, T, H, K]`` (``out_dtype``) of q, k ``[B, T, HQ, K]``, w ``[B, T, H, K]`` and G ``[B, T, H]``
    or ``[B, T, H, K]`` (float32, base 2 when ``g_log2``: fla's ``chunk_local_cumsum(g, scale=1/ln 2)``).
    ``aqk [B, T, H, BT]``: the in-chunk attention (fla's KDA forward returns it), needed with a gate per key
    channel; without it a gate per head forms it in place."""
    H, HQ, K, vector = _query_heads(q, k, w, g, aqk, plan, precision)
    qt = torch.empty(w.shape, dtype=out_dtype, device=q.device)
    if plan.num_chunks:
        BK = min(triton.next_power_of_2(K), 64)
        delta_reads_kernel[(plan.num_chunks, H)](
            q.contiguous(), k.contiguous(), w.contiguous(), g.contiguous(),
            None if aqk is None else aqk.contiguous(), qt, plan.tables(q.device)["chunks"], float(scale), H=H, HQ=HQ,
            K=K, BT=plan.chunk_size, BK=BK, G_LOG2=g_log2, GATE_VECTOR=vector, GIVEN_A=aqk is not None,
            PRECISION=precision, INTERPRETED=interpreted())
    return qt


def sub_piece_maps(qt: Tensor, k: Tensor, w: Tensor, g: Tensor, plan: SubPieces, *, g_log2: bool = True,
                   r_dtype: torch.dtype = torch.float32, precision: str = "tf32x3", block_cols: Optional[int] = None,
                   block_rows: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """K2: ``R [B, T, H, K]`` (``r_dtype``) and ``L [sub-pieces, H, K, K]`` (float32); ``block_cols``
    columns of M per program (default :func:`default_block_cols`), held as tiles of ``block_rows`` rows
    (default ``min(K, 64)``; at most four)."""
    _check(plan, precision, qt=qt, k=k, w=w, g=g)
    return _maps(k, w, g, plan, g_log2, r_dtype, precision, block_cols, block_rows, _heads(k, w, g), qt=qt)


def fused_maps(q: Tensor, k: Tensor, w: Tensor, g: Tensor, scale: float, plan: SubPieces, *,
               aqk: Optional[Tensor] = None, g_log2: bool = True, r_dtype: torch.dtype = torch.float32,
               precision: str = "tf32x3", block_cols: Optional[int] = None, block_rows: Optional[int] = None
               ) -> Tuple[Tensor, Tensor]:
    """K1 and K2 in one kernel: the ``R`` and ``L`` of :func:`sub_piece_maps` over :func:`correction_reads`'
    Qt, with Qt never stored: K2 forms ``R = scale (q * exp(G)) M - Aqk (w M)`` chunk by chunk from the
    queries (Aqk as K1 takes it: read from ``aqk``, or formed from the chunk's ``q k^T`` for a gate per
    head). Arguments as those two functions'."""
    heads = _query_heads(q, k, w, g, aqk, plan, precision)
    return _maps(k, w, g, plan, g_log2, r_dtype, precision, block_cols, block_rows, heads, q=q, aqk=aqk,
                 scale=scale)


def _maps(k, w, g, plan, g_log2, r_dtype, precision, block_cols, block_rows, heads, *, qt=None, q=None, aqk=None,
          scale=1.0) -> Tuple[Tensor, Tensor]:
    """Launch K2 from Qt (``qt``) or from the queries (``q``: ``FUSED``)."""
    H, HQ, K, vector = heads
    BV = _block_cols(K, block_cols, k.device)
    BK = block_rows or min(triton.next_power_of_2(K), 64)
    if triton.cdiv(K, BK) > 4:
        raise ValueError(f"K = {K}: K2 holds M as at most four tiles of {BK} rows (K <= {4 * BK})")
    R = torch.empty(w.shape, dtype=r_dtype, device=k.device)
    L = torch.empty(plan.num_pieces, H, K, K, dtype=torch.float32, device=k.device)
    if plan.num_pieces:
        contiguous = lambda t: None if t is None else t.contiguous()  # noqa: E731
        delta_maps_kernel[(triton.cdiv(K, BV), plan.num_pieces, H)](
            contiguous(qt), contiguous(q), contiguous(aqk), float(scale), k.contiguous(), w.contiguous(),
            g.contiguous(), R, L, plan.tables(k.device)["pieces"], H=H, HQ=HQ, K=K, BT=plan.chunk_size, BK=BK,
            BV=BV, G_LOG2=g_log2, GATE_VECTOR=vector, FUSED=q is not None, GIVEN_A=aqk is not None,
            PRECISION=precision, INTERPRETED=interpreted())
    return R, L


def prefix_maps(L: Tensor, plan: SubPieces, *, precision: str = "tf32x3",
                block_cols: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """K3: ``P [sub-pieces, H, K, K]`` and every segment's ``M [N, H, K, K]`` (float32)."""
    _check(plan, precision)
    H, K = L.shape[1], L.shape[-1]
    BC = _block_cols(K, block_cols, L.device)
    P = torch.empty_like(L, dtype=torch.float32)
    M = torch.empty(plan.num_segments, H, K, K, dtype=torch.float32, device=L.device)
    delta_prefix_kernel[(triton.cdiv(K, BC), plan.num_segments, H)](
        L.contiguous(), P, M, plan.tables(L.device)["piece_offsets"], H=H, K=K, BK=triton.next_power_of_2(K),
        BC=BC, PRECISION=precision, INTERPRETED=interpreted())
    return P, M


def _run_length(chunks: Optional[int], default: int) -> int:
    if chunks is None:
        return default
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks_per_run must be a positive int, got {chunks!r}")
    return chunks


def output_correction(o0: Tensor, R: Tensor, P: Tensor, S_in: Tensor, plan: SubPieces, *,
                      precision: str = "tf32x3", out_dtype: Optional[torch.dtype] = None,
                      chunks_per_run: Optional[int] = None) -> Tensor:
    """K4: ``o [B, T, H, V]`` = o0 + R_c (P_j S_in[n]) per chunk, in float32, rounded once to
    ``out_dtype`` (default o0's). o0 ``[B, T, H, V]``, R ``[B, T, H, K]``, P ``[sub-pieces, H, K, K]``,
    S_in ``[N, H, K, V]``. ``chunks_per_run``: chunks per program (default ``OUTPUT_RUN``); the result does
    not depend on it. A new tensor (o0 is not written)."""
    _check(plan, precision, o0=o0, R=R)
    H, V = o0.shape[2], o0.shape[3]
    K = R.shape[-1]
    if tuple(S_in.shape) != (plan.num_segments, H, K, V):
        raise ValueError(f"S_in {tuple(S_in.shape)}: expected {(plan.num_segments, H, K, V)}")
    run = _run_length(chunks_per_run, OUTPUT_RUN)
    out = torch.empty(o0.shape, dtype=out_dtype or o0.dtype, device=o0.device)
    if plan.num_pieces:
        BK, BV = triton.next_power_of_2(K), min(triton.next_power_of_2(V), 64)
        # under "input" the output's product rounds X to R's 16-bit dtype: rounded once, when it is made
        x_dtype = R.dtype if precision == "input" and R.dtype in (torch.bfloat16, torch.float16) else torch.float32
        X = torch.empty(plan.num_pieces, H, K, V, dtype=x_dtype, device=o0.device)
        delta_entering_kernel[(triton.cdiv(V, BV), plan.num_pieces, H)](
            P.contiguous(), S_in.contiguous(), X, plan.tables(o0.device)["pieces"], H=H, K=K, V=V, BK=BK, BV=BV,
            PRECISION=precision, INTERPRETED=interpreted())
        runs = plan.tables(o0.device, run)["runs"]
        delta_output_kernel[(triton.cdiv(V, BV), runs.shape[0], H)](
            o0.contiguous(), R.contiguous(), X, out, runs, H=H, K=K, V=V, BT=plan.chunk_size, BK=BK, BV=BV, RUN=run,
            PRECISION=precision, INTERPRETED=interpreted())
    return out


def entering_grad(R: Tensor, P: Tensor, do: Tensor, plan: SubPieces, *, precision: str = "tf32x3",
                  chunks_per_run: Optional[int] = None) -> Tensor:
    """K5: ``A [N, H, K, V]`` (float32), the gradient of ``<do, o>`` with respect to each segment's
    entering state. R ``[B, T, H, K]``, P ``[sub-pieces, H, K, K]``, do ``[B, T, H, V]``.
    ``chunks_per_run``: chunks per program (default: a sub-piece each); the runs' parts are summed in
    order, so a given run length gives the same bits every call."""
    _check(plan, precision, R=R, do=do)
    H, K = R.shape[2], R.shape[3]
    V = do.shape[-1]
    A = torch.empty(plan.num_segments, H, K, V, dtype=torch.float32, device=R.device)
    BV = min(triton.next_power_of_2(V), 64)
    tables = plan.tables(R.device, _run_length(chunks_per_run, max([n for _, _, n in plan.pieces], default=1)))
    runs = tables["runs"]
    Z = torch.empty(runs.shape[0], H, K, V, dtype=torch.float32, device=R.device)
    if runs.shape[0]:
        delta_grad_kernel[(triton.cdiv(V, BV), runs.shape[0], H)](
            R.contiguous(), do.contiguous(), P.contiguous(), Z, runs, H=H, K=K, V=V, BT=plan.chunk_size,
            BK=triton.next_power_of_2(K), BV=BV, PRECISION=precision, INTERPRETED=interpreted())
    BLOCK = min(triton.next_power_of_2(K * V), 1024)
    delta_grad_sum_kernel[(triton.cdiv(K * V, BLOCK), plan.num_segments, H)](
        Z, A, tables["run_offsets"], H=H, KV=K * V, BLOCK=BLOCK)
    return A


def piece_transition(q: Tensor, k: Tensor, w: Tensor, g: Tensor, scale: float, plan: SubPieces, *,
                     aqk: Optional[Tensor] = None, g_log2: bool = True, r_dtype: torch.dtype = torch.float32,
                     precision: str = "tf32x3", block_cols: Optional[int] = None, block_rows: Optional[int] = None,
                     fused: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """K1..K3, what the forward needs before the scan: ``R [B, T, H, K]``, ``P [sub-pieces, H, K, K]``
    and the segments' ``M [N, H, K, K]``. ``fused``: K1 inside K2 (:func:`fused_maps`, Qt never stored);
    else K1 apart, Qt kept in ``r_dtype`` as R is (a 16-bit Qt meets M on 16-bit tensor cores under
    ``"input"``) and freed on return."""
    maps = dict(g_log2=g_log2, r_dtype=r_dtype, precision=precision, block_cols=block_cols, block_rows=block_rows)
    if fused:
        R, L = fused_maps(q, k, w, g, scale, plan, aqk=aqk, **maps)
    else:
        qt = correction_reads(q, k, w, g, scale, plan, aqk=aqk, g_log2=g_log2, out_dtype=r_dtype,
                              precision=precision)
        R, L = sub_piece_maps(qt, k, w, g, plan, **maps)
        del qt
    P, M = prefix_maps(L, plan, precision=precision, block_cols=block_cols)
    return R, P, M


# ------------------------------------------------------------------------------------------ a piece's correction

_SIDE_STREAMS: Dict[torch.device, "torch.cuda.Stream"] = {}
_URGENT_STREAMS: Dict[torch.device, "torch.cuda.Stream"] = {}


def _stream(streams: Dict[torch.device, "torch.cuda.Stream"], device: torch.device, **kw) -> "torch.cuda.Stream":
    """``streams``' CUDA stream of ``device`` (made on first use with ``kw``)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in streams:
        streams[device] = torch.cuda.Stream(device, **kw)
    return streams[device]


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The CUDA stream K1..K3 run on beside a piece's own work (one per device, made on first use)."""
    return _stream(_SIDE_STREAMS, device)


def urgent_stream(device: torch.device) -> "torch.cuda.Stream":
    """A CUDA stream of the highest priority (one per device, made on first use): a piece's state pass on it
    takes the SMs as they free up, ahead of the programs K1..K3 have pending on :func:`side_stream`."""
    return _stream(_URGENT_STREAMS, device, priority=-1)  # lower is higher; torch clamps


class PieceCorrection:
    """What the state entering one piece adds to it, for an operator's piece on fla's kernels: K1..K3
    before the scan (``R``, ``P`` and the segments' transitions ``M``), K4 and K5 after it.

    Products round as fla's own state passes do for 16-bit inputs (``"input"``, R kept in the input
    dtype) and keep float32 accuracy for float32 inputs (``"tf32x3"``). With ``beside`` (CUDA), K1..K3
    run on :func:`side_stream`, after the work already issued on the current stream and beside what the
    caller issues next (fla's state pass, which leaves most SMs idle); :meth:`join` then makes the current
    stream wait for them. Elsewhere they run at once and :meth:`join` does nothing.

    Args:
        q, k: ``[B, T, HQ, K]``; w: ``[B, T, H, K]`` fla's WY factor; g: G ``[B, T, H]`` or ``[B, T, H, K]``
            (base 2, fla's); aqk: ``[B, T, H, BT]`` fla's in-chunk attention (a gate per key channel);
            plan: the piece's :class:`SubPieces`; fused: K1 inside K2 (:func:`piece_transition`).
    """

    def __init__(self, q: Tensor, k: Tensor, w: Tensor, g: Tensor, scale: float, plan: SubPieces, *,
                 aqk: Optional[Tensor] = None, beside: bool = False, fused: bool = False):
        self.plan = plan
        self.precision = map_precision(q.dtype)
        self._side = side_stream(q.device) if beside and q.device.type == "cuda" else None
        compute = lambda: piece_transition(q, k, w, g, scale, plan, aqk=aqk, r_dtype=q.dtype,  # noqa: E731
                                           precision=self.precision, fused=fused)
        if self._side is None:
            self.R, self.P, self.M = compute()
            return
        self._side.wait_stream(torch.cuda.current_stream(q.device))
        with torch.cuda.stream(self._side):
            self.R, self.P, self.M = compute()
        for t in (q, k, w, g, aqk):  # read on the side stream; the caller may drop them before it is done
            if t is not None:
                t.record_stream(self._side)

    def join(self) -> None:
        """The current stream waits for K1..K3 (made on the side stream, used on this one)."""
        if self._side is not None:
            main = torch.cuda.current_stream(self.M.device)
            main.wait_stream(self._side)
            for t in (self.R, self.P, self.M):
                t.record_stream(main)
            self._side = None

    def output(self, o0: Tensor, S_in: Tensor) -> Tensor:
        """K4: the piece's output ``[B, T, H, V]`` (o0's dtype) entered by ``S_in [N, H, K, V]`` float32, from
        its output from a zero entering state ``o0``."""
        return output_correction(o0, self.R, self.P, S_in.contiguous(), self.plan, precision=self.precision)

    def entering_grad(self, do: Tensor) -> Tensor:
        """K5: ``A [N, H, K, V]`` float32, the gradient of ``<do, o>`` with respect to ``S_in``."""
        return entering_grad(self.R, self.P, do, self.plan, precision=self.precision)
