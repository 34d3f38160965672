"""A delta-rule piece as a zero-state run plus a correction (``kernels/delta_reference.py``) against the float64
token loop, and its Triton kernels (``kernels/delta_correction.py``, on the CPU under TRITON_INTERPRET=1) against
that reference; the kernels also compile for sm_90.

Both gate forms the kernels serve: a log decay per head and token (``head``: the gated delta rule) and per
head, token and key channel (``channel``: KDA, whose in-chunk attention Aqk the kernels read, as fla's KDA
forward returns it).
"""

import os
import subprocess
import sys

import pytest
import torch

from megatron_zeco.gated_delta_rule import chunk_gated_delta_rule_state
from megatron_zeco.kda import chunk_kda_state
from megatron_zeco.kernels import delta_reference as ref
from tests.helpers.marks import slow
from tests.helpers.reference import delta_problem, kda_problem, reference, rel_err

NAMES = ("q", "k", "v", "g", "beta")
FORMS = ("head", "channel")  # the gate: one log decay per head (the gated delta rule) or per key channel (KDA)
TOL64 = 1e-12  # float64 decomposition against the float64 loop
# float64 transition against the token loop: the floor above 4x the state pass's own error, per gate regime;
# KDA's mixed per-channel gates (no decay beside underflow, element by element) condition M's triangular solves
# so that ours reaches ~8e-10 where the state pass's error is ~2e-11 (the worst over thousands of seeds)
TOL64_M = {"mixed": 1e-8}
TOL64_M_DEFAULT = 1e-10  # every other regime stays under 1e-12 beyond 4x the state pass's error
TOL32 = 1e-5  # float32 kernels against the float64 reference of the same inputs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels' device (the reference runs on the CPU)


def _cu(lengths):
    return [0, *torch.tensor(lengths).cumsum(0).tolist()]


def _problem(seed, lengths, H, K, V, gate, form, HQ=None, dtype=torch.float64):
    """One packed row of ``lengths`` segments (``HQ`` query/key heads, default H, for the channel form), its
    random entering states S_in and leaving-state gradients D per segment."""
    T = sum(lengths)
    if form == "head":
        x = delta_problem(seed, B=1, T=T, H=H, K=K, V=V, gate=gate, dtype=dtype)
    else:
        x = kda_problem(seed, B=1, T=T, H=HQ or H, K=K, V=V, gate=gate, HV=H, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    S_in, D = (torch.randn(len(lengths), H, K, V, generator=gen, dtype=dtype) for _ in range(2))
    return x, S_in, D


def _truth(x, plan, S_in, D, scale):
    """Per segment (the float64 loop): the output from a zero state, the leaving state from zero (E), and
    the output, leaving state and entering-state gradient of ``<o, do> + <S_out, D>`` from S_in."""
    o0, o, E, S_out, dS = (torch.zeros_like(t) for t in (x["v"], x["v"], S_in, S_in, S_in))
    for n, (a, e) in enumerate(plan.segments):
        if a == e:
            E[n], S_out[n], dS[n] = 0, S_in[n], D[n]
            continue
        alone = {m: x[m][:, a:e] for m in (*NAMES, "do")}
        zero = reference({**alone, "h0": None, "dht": D[n:n + 1]}, scale)
        full = reference({**alone, "h0": S_in[n:n + 1], "dht": D[n:n + 1]}, scale)
        o0[:, a:e], E[n] = zero["o"], zero["ht"][0]
        o[:, a:e], S_out[n], dS[n] = full["o"], full["ht"][0], full["dh0"][0]
    return o0, o, E, S_out, dS


# ------------------------------------------------------------------------------------------ the plan


def test_plan_cuts_whole_chunks_per_segment():
    """Sub-pieces are balanced runs of whole chunks inside one segment; counts clamp to a segment's chunk
    count (an empty segment has none); every chunk lies in exactly one sub-piece, in order."""
    plan = ref.SubPieces(_cu([37, 5, 0, 100, 16]), 16, 3)
    assert plan.counts() == [3, 1, 0, 3, 1] and plan.num_chunks == 3 + 1 + 7 + 1
    assert plan.pieces == ((0, 0, 1), (0, 1, 1), (0, 2, 1), (1, 0, 1), (3, 0, 3), (3, 3, 2), (3, 5, 2), (4, 0, 1))
    assert plan.piece_offsets == (0, 3, 4, 4, 7, 8)
    assert [j for _, _, j in plan.chunks] == [0, 1, 2, 3, 4, 4, 4, 5, 5, 6, 6, 7]
    covered = [t for n, c, _ in plan.chunks for t in range(*plan.chunk_bounds(n, c))]
    assert covered == list(range(plan.tokens))
    assert ref.SubPieces(_cu([200]), 16, [20]).counts() == [13]  # more sub-pieces than chunks: one per chunk
    assert ref.SubPieces.dense(2, 65, 16, [1, 2]).pieces == ((0, 0, 5), (1, 0, 3), (1, 3, 2))
    tables = plan.tables("cpu")
    assert tables["chunks"].shape == (12, 4) and tables["pieces"].shape == (8, 5)
    assert tables["chunks"][4].tolist() == [42, 142, 0, 4] and tables["pieces"][5].tolist() == [3, 42, 142, 3, 2]
    for bad in (0, [1, 1], [1, 0, 1, 1, 1]):
        with pytest.raises(ValueError, match="sub_pieces"):
            ref.SubPieces(_cu([37, 5, 0, 100, 16]), 16, bad)
    with pytest.raises(ValueError, match="nondecreasing"):
        ref.SubPieces([0, 5, 3], 16)


def test_runs_cut_each_sub_piece_in_order():
    """K4's and K5's runs: each sub-piece cut into runs of at most the given chunks (its last run shorter),
    never straddling a sub-piece, every chunk in exactly one run, segment-major and in order; an empty
    segment owns none; a run length past every sub-piece gives one run per sub-piece."""
    plan = ref.SubPieces(_cu([37, 5, 0, 100, 16]), 16, 3)  # sub-pieces of 1, 1, 1 | 1 | - | 3, 2, 2 | 1 chunks
    runs, offsets = plan.runs(2)
    assert runs == ((0, 0, 1, 0), (0, 1, 1, 1), (0, 2, 1, 2), (1, 0, 1, 3), (3, 0, 2, 4), (3, 2, 1, 4),
                    (3, 3, 2, 5), (3, 5, 2, 6), (4, 0, 1, 7))
    assert offsets == (0, 3, 4, 4, 8, 9)
    for chunks in (1, 2, 3, 7, 100):
        runs, offsets = plan.runs(chunks)
        assert [(n, c, j) for n, c0, nc, j in runs for c in range(c0, c0 + nc)] == list(plan.chunks)
        assert all(1 <= nc <= chunks for _, _, nc, _ in runs)
        assert [sum(1 for r in runs if r[0] == n) for n in range(plan.num_segments)] == \
            [b - a for a, b in zip(offsets, offsets[1:])]
    assert plan.runs(3)[0] == tuple((n, c0, nc, j) for j, (n, c0, nc) in enumerate(plan.pieces))
    tables = plan.tables("cpu", 2)
    assert tables["runs"].shape == (9, 5) and tables["runs"][5].tolist() == [42, 142, 2, 1, 4]
    assert tables["run_offsets"].tolist() == [0, 3, 4, 4, 8, 9]
    assert plan.tables("cpu", 2) is tables and "chunks" in plan.tables("cpu")
    with pytest.raises(ValueError, match="positive"):
        plan.runs(0)


def test_choose_sub_pieces_fills_the_device():
    """The default split gives K2 as many programs as two waves of the SMs hold and no more (a third wave
    partly filled would take as long as a full one), unless runs would get shorter than ``min_chunks``
    chunks."""
    counts = ref.choose_sub_pieces([0, 16384], 64, heads=16, column_blocks=2, processors=132)
    assert counts == [8] and 8 * 16 * 2 <= 2 * 132 < 9 * 16 * 2
    assert ref.choose_sub_pieces([0, 16384], 64, heads=16, column_blocks=2, processors=128) == [8]  # exactly two
    assert ref.choose_sub_pieces([0, 1024], 64, heads=16, column_blocks=2, processors=132) == [4]
    assert ref.choose_sub_pieces([0, 60, 60, 4000], 64, 16, 2, 132) == [1, 1, 8]  # SubPieces clamps the empty one
    assert ref.choose_sub_pieces([0, 16384], 64, heads=64, column_blocks=2, processors=132) == [2]
    assert ref.choose_sub_pieces([0, 16384], 64, heads=512, column_blocks=2, processors=132) == [1]  # one at least


# ------------------------------------------------------------------------------------------ float64 decomposition


def _loop_transition(x, plan):
    """M of every segment as the float64 token loop forms it: the product of the tokens' transitions
    ``(I - beta_t k_t k_t^T) diag(exp g_t)``, latest on the left."""
    k, g, beta = x["k"][0], x["g"][0], x["beta"][0]
    H, K = k.shape[1:]
    eye = torch.eye(K, dtype=k.dtype)
    out = []
    for a, e in plan.segments:
        M = eye.repeat(H, 1, 1)
        for t in range(a, e):
            decay = (g[t] if g.dim() == 3 else g[t, :, None].expand(H, K)).exp()
            M = (eye - beta[t, :, None, None] * k[t, :, :, None] * k[t, :, None, :]) @ (decay[:, :, None] * M)
        out.append(M)
    return torch.stack(out)


def _state_pass(x, form, chunk, plan):
    """M of every segment from the operator's own chunked state pass (its WY solve), float64."""
    fn = chunk_gated_delta_rule_state if form == "head" else chunk_kda_state
    return fn(x["k"], x["v"], x["g"], x["beta"], chunk_size=chunk, cu_seqlens=torch.tensor(plan.cu_seqlens))[1]


@pytest.mark.parametrize("form,gate", [("head", "normal"), ("head", "tiny"), ("head", "strong"),
                                       ("channel", "normal"), ("channel", "tiny"), ("channel", "strong"),
                                       ("channel", "mixed")])
@pytest.mark.parametrize("lengths,chunk,sub_pieces", [
    ([1], 16, 1), ([63], 16, 2), ([65], 16, 3), ([200], 16, 3), ([200], 64, 2), ([200], 16, 40),
    ([37, 5, 0, 100, 16], 16, 2), ([70, 130], 64, [1, 3]),
], ids=lambda v: str(v).replace(" ", ""))
def test_decomposition_matches_loop(seed, form, gate, lengths, chunk, sub_pieces):
    """float64: ``o^0 + R X == o`` from S_in, ``M`` == the operator's chunked state pass's and
    ``M S_in + E`` == the leaving state, ``A + M^T D`` == the loop's gradient of S_in; per segment, with
    lengths off the chunk (a 1-token piece, a segment shorter than a chunk, segments starting mid-chunk of
    the row, an empty one), 1..3 sub-pieces and more than chunks (clamped), G in base 2 and e; the channel
    form with Aqk formed by the reference and given (as the kernels take it), its gates drawn per channel
    (``mixed``: no decay, decay ~1, strong, underflowing to 0, side by side)."""
    H, K, V = 2, 8, 5
    x, S_in, D = _problem(seed, lengths, H, K, V, gate, form)
    plan = ref.SubPieces(_cu(lengths), chunk, sub_pieces)
    scale = K ** -0.5
    o0, o, E, S_out, dS = _truth(x, plan, S_in, D, scale)
    w, _ = ref.wy_representation(x["k"], x["v"], x["g"], x["beta"], plan)
    M_loop = _loop_transition(x, plan)
    state_err = rel_err(_state_pass(x, form, chunk, plan), M_loop)
    for log2 in (True, False):
        G = ref.chunk_local_cumsum(x["g"], plan, log2=log2)
        given = [None] if form == "head" else [None, ref.attention(x["q"], x["k"], G, scale, plan, g_log2=log2)]
        for aqk in given:
            R, P, M = ref.piece_transition(x["q"], x["k"], w, G, scale, plan, aqk=aqk, g_log2=log2)
            errors = {
                "o": rel_err(ref.output_correction(o0, R, P, S_in, plan), o),
                "S_out": rel_err(M @ S_in + E, S_out),
                "dS_in": rel_err(ref.entering_grad(R, P, x["do"], plan) + M.transpose(-1, -2) @ D, dS),
            }
            assert max(errors.values()) < TOL64, (log2, aqk is None, errors)
        # M from the sub-pieces' maps and M from the operator's WY state pass, both against the token loop's
        # product: each goes through triangular solves whose rounding grows with the gates' spread (KDA's
        # mixed per-channel gates reach ~1e-9 in both, not always in the same cases), so ours is bounded by
        # the state pass's own error plus the regime's floor; a wrong factor or a float32 step (>= 1e-7) is off
        # by far more
        floor = TOL64_M.get(gate, TOL64_M_DEFAULT)
        assert rel_err(M, M_loop) < 4 * state_err + floor, (log2, rel_err(M, M_loop), state_err)


@pytest.mark.parametrize("form", FORMS)
def test_decomposition_dense_batch(seed, form):
    """Dense ``[B, T]`` input is B segments of T tokens."""
    B, T, H, K, V = 2, 45, 2, 8, 4
    x = (delta_problem if form == "head" else kda_problem)(seed, B=B, T=T, H=H, K=K, V=V)
    plan = ref.SubPieces.dense(B, T, 16, 2)
    flat = {n: t.reshape(1, B * T, *t.shape[2:]) for n, t in x.items() if n not in ("h0", "dht")}
    o0, o, E, S_out, dS = _truth(flat, plan, x["h0"], x["dht"], None)
    w, _ = ref.wy_representation(x["k"], x["v"], x["g"], x["beta"], plan)
    R, P, M = ref.piece_transition(x["q"], x["k"], w, ref.chunk_local_cumsum(x["g"], plan, log2=True), K ** -0.5,
                                   plan)
    assert R.shape == x["q"].shape and M.shape == (B, H, K, K)
    assert rel_err(ref.output_correction(o0.view(B, T, H, V), R, P, x["h0"], plan), o.view(B, T, H, V)) < TOL64
    assert rel_err(ref.entering_grad(R, P, x["do"], plan) + M.transpose(-1, -2) @ x["dht"], dS) < TOL64


def test_decomposition_grouped_value_heads(seed):
    """KDA with grouped value attention (two value heads per query/key head, as fla's): q and k keep their
    heads; w, Aqk, R and the maps are per value head."""
    lengths, H, K, V = [37, 30], 4, 8, 5
    x, S_in, D = _problem(seed, lengths, H, K, V, "mixed", "channel", HQ=2)
    plan = ref.SubPieces(_cu(lengths), 16, 2)
    o0, o, E, S_out, dS = _truth(x, plan, S_in, D, K ** -0.5)
    w, _ = ref.wy_representation(x["k"], x["v"], x["g"], x["beta"], plan)
    R, P, M = ref.piece_transition(x["q"], x["k"], w, ref.chunk_local_cumsum(x["g"], plan, log2=True), K ** -0.5,
                                   plan)
    assert w.shape == R.shape == (1, sum(lengths), H, K)
    errors = {"o": rel_err(ref.output_correction(o0, R, P, S_in, plan), o), "S_out": rel_err(M @ S_in + E, S_out),
              "dS_in": rel_err(ref.entering_grad(R, P, x["do"], plan) + M.transpose(-1, -2) @ D, dS)}
    assert max(errors.values()) < TOL64, errors


# ------------------------------------------------------------------------------------------ Triton kernels


def _kernel_inputs(seed, lengths, H, K, V, dtype, form="head", log2=True, gate="normal", mild=True, HQ=None):
    """Inputs of the kernels (q, k, w in ``dtype``; G float32; the channel form's Aqk in ``dtype``, as fla
    keeps it) drawn from a float64 problem, by default with mild decay (so the maps of a 200-token piece stay
    far from float32's underflow); S_in and D float32."""
    x, S_in, D = _problem(seed, lengths, H, K, V, gate, form, HQ=HQ)
    if mild:
        x["g"] = x["g"] * 0.05
    plan = ref.SubPieces(_cu(lengths), 16, 1)
    w, _ = ref.wy_representation(x["k"], x["v"], x["g"], x["beta"], plan)
    G = ref.chunk_local_cumsum(x["g"], plan, log2=log2)
    aqk = None if form == "head" else ref.attention(x["q"], x["k"], G, K ** -0.5, plan, g_log2=log2)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    low = lambda t: None if t is None else dev(t.to(dtype))  # noqa: E731
    return x, (low(x["q"]), low(x["k"]), low(w), dev(G.float())), low(aqk), dev(S_in.float()), dev(D.float())


def _d(t):
    """float64 on the CPU: the reference's input."""
    return None if t is None else t.cpu().double()


PRECISIONS = [(torch.float32, "ieee"), (torch.float32, "tf32x3"), (torch.bfloat16, "tf32x3"), (torch.bfloat16, "ieee")]
PRECISION_IDS = ["fp32-ieee", "fp32-tf32x3", "bf16-split", "bf16-ieee"]
LENGTHS = [([200], 3, True), ([37, 5, 0, 100, 16], 2, True), ([65], 1, False), ([1, 40], [1, 40], True)]
LENGTH_IDS = ["one-3", "packed-2", "65-1-natural", "tiny-clamped"]


def _kernel_cases():
    """Every precision and length case with the gate per head; with the gate per key channel each precision
    and each length case once in the fast tier, the rest in the full suite."""
    cases = []
    for form in FORMS:
        for i, (dtype, precision) in enumerate(PRECISIONS):
            for j, (lengths, sub_pieces, log2) in enumerate(LENGTHS):
                marks = slow if form == "channel" and i != j else ()
                cases.append(pytest.param(form, dtype, precision, lengths, sub_pieces, log2, marks=marks,
                                          id=f"{form}-{PRECISION_IDS[i]}-{LENGTH_IDS[j]}"))
    return cases


@pytest.mark.parametrize("form,dtype,precision,lengths,sub_pieces,log2", _kernel_cases())
def test_kernels_match_reference(seed, form, dtype, precision, lengths, sub_pieces, log2):
    """Every kernel against the float64 reference of the same (rounded) inputs: Qt (K1), R and L (K2; and
    from the queries, K1 inside K2, against the exact Qt's), P and M (K3), the corrected output (K4) and A
    (K5). bfloat16 inputs under tf32x3 take the split products (the float32 tile as three bfloat16 terms);
    K = 32: M in two column blocks of two row tiles."""
    from megatron_zeco.kernels import delta_correction as dc

    H, K, V = 2, 32, 16
    _, (q, k, w, G), aqk, S_in, _ = _kernel_inputs(seed, lengths, H, K, V, dtype, form, log2)
    plan = ref.SubPieces(_cu(lengths), 16, sub_pieces)
    scale = K ** -0.5
    kw = dict(precision=precision)
    qt = dc.correction_reads(q, k, w, G, scale, plan, aqk=aqk, g_log2=log2, **kw)
    R, L = dc.sub_piece_maps(qt, k, w, G, plan, g_log2=log2, block_cols=16, block_rows=16, **kw)
    P, M = dc.prefix_maps(L, plan, block_cols=16, **kw)
    R_f, L_f = dc.fused_maps(q, k, w, G, scale, plan, aqk=aqk, g_log2=log2, block_cols=16, block_rows=16, **kw)
    gen = torch.Generator().manual_seed(seed + 2)
    o0, do = (torch.randn(1, plan.tokens, H, V, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    o = dc.output_correction(o0, R, P, S_in, plan, out_dtype=torch.float32, **kw)
    A = dc.entering_grad(R, P, do, plan, **kw)
    assert qt.dtype == R.dtype == L.dtype == P.dtype == M.dtype == A.dtype == R_f.dtype == torch.float32
    qt_ref = ref.correction_reads(_d(q), _d(k), _d(w), _d(G), scale, plan, aqk=_d(aqk), g_log2=log2)
    R_ref, L_ref = ref.sub_piece_maps(_d(qt), _d(k), _d(w), _d(G), plan, g_log2=log2)
    R_fref, L_fref = ref.sub_piece_maps(qt_ref, _d(k), _d(w), _d(G), plan, g_log2=log2)
    P_ref, M_ref = ref.prefix_maps(_d(L), plan)
    errors = {
        "Qt": rel_err(_d(qt), qt_ref), "R": rel_err(_d(R), R_ref), "L": rel_err(_d(L), L_ref),
        "R fused": rel_err(_d(R_f), R_fref), "L fused": rel_err(_d(L_f), L_fref),
        "P": rel_err(_d(P), P_ref), "M": rel_err(_d(M), M_ref),
        "o": rel_err(_d(o), ref.output_correction(_d(o0), _d(R), _d(P), _d(S_in), plan)),
        "A": rel_err(_d(A), ref.entering_grad(_d(R), _d(P), _d(do), plan)),
    }
    assert max(errors.values()) < TOL32, errors
    # the correction is not negligible next to o0, and M is far from the identity: the checks have teeth
    assert rel_err(o.cpu(), o0.cpu()) > 0.05 and (M_ref - torch.eye(K, dtype=torch.float64)).norm() > 0.1


@pytest.mark.parametrize("form", FORMS)
def test_kernels_with_four_row_tiles(seed, form):
    """K = 64 held as four tiles of 16 rows in K2 (the third and fourth tiles' own load, update and store
    branches; with a gate per key channel each tile's own channels of the decay; from the queries, each
    tile's share of q M and q k^T) and four column blocks in K3, packed: R, L, P and M against the float64
    reference."""
    from megatron_zeco.kernels import delta_correction as dc

    lengths, H, K, V = [37, 70], 2, 64, 16
    _, (q, k, w, G), aqk, _, _ = _kernel_inputs(seed, lengths, H, K, V, torch.float32, form)
    plan = ref.SubPieces(_cu(lengths), 16, 2)
    kw = dict(precision="ieee")
    qt = dc.correction_reads(q, k, w, G, K ** -0.5, plan, aqk=aqk, **kw)
    R, L = dc.sub_piece_maps(qt, k, w, G, plan, block_cols=16, block_rows=16, **kw)
    P, M = dc.prefix_maps(L, plan, block_cols=16, **kw)
    R_f, L_f = dc.fused_maps(q, k, w, G, K ** -0.5, plan, aqk=aqk, block_cols=16, block_rows=16, **kw)
    R_ref, L_ref = ref.sub_piece_maps(_d(qt), _d(k), _d(w), _d(G), plan)
    R_fref, L_fref = ref.fused_maps(_d(q), _d(k), _d(w), _d(G), K ** -0.5, plan, aqk=_d(aqk))
    P_ref, M_ref = ref.prefix_maps(_d(L), plan)
    errors = {"R": rel_err(_d(R), R_ref), "L": rel_err(_d(L), L_ref), "P": rel_err(_d(P), P_ref),
              "M": rel_err(_d(M), M_ref), "R fused": rel_err(_d(R_f), R_fref), "L fused": rel_err(_d(L_f), L_fref)}
    assert max(errors.values()) < TOL32, errors


@pytest.mark.parametrize("form,gate", [("head", "normal"), ("channel", "normal"),
                                       pytest.param("channel", "mixed", marks=slow)])
@pytest.mark.parametrize("lengths,sub_pieces", [([200], 3), ([37, 5, 0, 100, 16], 2)], ids=["one-3", "packed-2"])
def test_kernels_match_loop(seed, form, gate, lengths, sub_pieces):
    """The kernels end to end (float32) against the float64 loop: o^0 + correction is the output from
    S_in, M S_in + E the leaving state, A + M^T D the entering state's gradient (``mixed``: KDA's gates per
    channel from none to underflowing, at full strength)."""
    from megatron_zeco.kernels import delta_correction as dc

    H, K, V = 2, 16, 32
    x, (q, k, w, G), aqk, S_in, D = _kernel_inputs(seed, lengths, H, K, V, torch.float32, form, gate=gate,
                                                   mild=gate == "normal")
    plan = ref.SubPieces(_cu(lengths), 16, sub_pieces)
    o0, o, E, S_out, dS = _truth(x, plan, _d(S_in), _d(D), K ** -0.5)
    R, P, M = dc.piece_transition(q, k, w, G, K ** -0.5, plan, aqk=aqk, precision="ieee")
    o_k = dc.output_correction(o0.float().to(DEVICE), R, P, S_in, plan, precision="ieee")
    A = dc.entering_grad(R, P, x["do"].float().to(DEVICE), plan, precision="ieee")
    M, S_in, D = _d(M), _d(S_in), _d(D)
    errors = {"o": rel_err(o_k.cpu(), o), "S_out": rel_err(M @ S_in + E, S_out),
              "dS_in": rel_err(_d(A) + M.transpose(-1, -2) @ D, dS)}
    assert max(errors.values()) < TOL32, errors


@pytest.mark.parametrize("gate", ["zero", "tiny", "strong", "underflow", "mixed"])
def test_kernels_at_gate_extremes(seed, gate):
    """A gate per key channel at full strength in every regime (no decay, decay ~1 - 1e-6, ~e^-30..-60 per
    token, underflowing to 0, all of them side by side over the channels): K1..K5 against the float64
    reference of the same inputs; with no decay M is far from the identity through the keys alone, under
    strong decay the maps keep only the last tokens' terms, and nothing overflows (every exponent <= 0)."""
    from megatron_zeco.kernels import delta_correction as dc

    lengths, H, K, V = [70, 37], 2, 32, 16
    _, (q, k, w, G), aqk, S_in, _ = _kernel_inputs(seed, lengths, H, K, V, torch.float32, "channel", gate=gate,
                                                   mild=False)
    plan = ref.SubPieces(_cu(lengths), 16, 2)
    kw = dict(precision="ieee")
    qt = dc.correction_reads(q, k, w, G, K ** -0.5, plan, aqk=aqk, **kw)
    R, L = dc.sub_piece_maps(qt, k, w, G, plan, block_cols=16, block_rows=16, **kw)
    P, M = dc.prefix_maps(L, plan, block_cols=16, **kw)
    gen = torch.Generator().manual_seed(seed + 2)
    o0, do = (torch.randn(1, plan.tokens, H, V, generator=gen).to(DEVICE) for _ in range(2))
    o = dc.output_correction(o0, R, P, S_in, plan, **kw)
    A = dc.entering_grad(R, P, do, plan, **kw)
    assert all(torch.isfinite(t).all() for t in (qt, R, L, P, M, o, A))
    R_ref, L_ref = ref.sub_piece_maps(_d(qt), _d(k), _d(w), _d(G), plan)
    P_ref, M_ref = ref.prefix_maps(_d(L), plan)

    def err(a, b):  # relative, except where the truth itself lies below float32's range (strong decay's maps)
        return float((_d(a) - b).norm() / max(b.norm(), 1e-30))

    R_f, L_f = dc.fused_maps(q, k, w, G, K ** -0.5, plan, aqk=aqk, block_cols=16, block_rows=16, **kw)
    R_fref, L_fref = ref.fused_maps(_d(q), _d(k), _d(w), _d(G), K ** -0.5, plan, aqk=_d(aqk))
    errors = {
        "Qt": err(qt, ref.correction_reads(_d(q), _d(k), _d(w), _d(G), K ** -0.5, plan, aqk=_d(aqk))),
        "R": err(R, R_ref), "L": err(L, L_ref), "P": err(P, P_ref), "M": err(M, M_ref),
        "R fused": err(R_f, R_fref), "L fused": err(L_f, L_fref),
        "o": err(o, ref.output_correction(_d(o0), _d(R), _d(P), _d(S_in), plan)),
        "A": err(A, ref.entering_grad(_d(R), _d(P), _d(do), plan)),
    }
    assert max(errors.values()) < TOL32, errors


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "K1-apart"])
def test_kernels_grouped_value_heads(seed, fused):
    """Two value heads per query/key head (fla's grouped value attention): K1 and K2 (apart, or K1 inside
    K2) read the query/key head of each value head, against the reference."""
    from megatron_zeco.kernels import delta_correction as dc

    lengths, H, K, V = [37, 40], 4, 16, 16
    _, (q, k, w, G), aqk, S_in, _ = _kernel_inputs(seed, lengths, H, K, V, torch.float32, "channel", HQ=2)
    assert q.shape[2] == 2 and w.shape[2] == 4
    plan = ref.SubPieces(_cu(lengths), 16, 2)
    R, P, M = dc.piece_transition(q, k, w, G, K ** -0.5, plan, aqk=aqk, precision="ieee", fused=fused)
    R_ref, P_ref, M_ref = ref.piece_transition(_d(q), _d(k), _d(w), _d(G), K ** -0.5, plan, aqk=_d(aqk))
    errors = {"R": rel_err(_d(R), R_ref), "M": rel_err(_d(M), M_ref)}
    assert max(errors.values()) < TOL32, errors


@pytest.mark.parametrize("form", FORMS)
def test_input_precision_is_within_bfloat16_rounding(seed, form):
    """Precision ``"input"`` (the piece's for 16-bit inputs): every float32 operand rounded to bfloat16 as
    fla's state passes round theirs (the channel form's decayed keys too), Qt and R stored in bfloat16.
    Against the float64 loop the output, M S_in + E and A + M^T D stay within bfloat16's rounding of the
    inputs (a few 2^-8), as the tf32x3 products do within float32's; a wrong operand (a transposed map, a
    missing decay) is off by far more."""
    from megatron_zeco.kernels import delta_correction as dc

    lengths, H, K, V = [200, 37], 2, 32, 16
    x, (q, k, w, G), aqk, S_in, D = _kernel_inputs(seed, lengths, H, K, V, torch.bfloat16, form)
    plan = ref.SubPieces(_cu(lengths), 16, 3)
    o0, o, E, S_out, dS = _truth(x, plan, _d(S_in), _d(D), K ** -0.5)
    errors = {}
    for precision, stored in (("input", torch.bfloat16), ("tf32x3", torch.float32)):
        R, P, M = dc.piece_transition(q, k, w, G, K ** -0.5, plan, aqk=aqk, r_dtype=stored, precision=precision)
        assert R.dtype == stored
        o_k = dc.output_correction(o0.float().to(DEVICE), R, P, S_in, plan, precision=precision)
        A = dc.entering_grad(R, P, x["do"].to(torch.bfloat16).to(DEVICE), plan, precision=precision)
        M_d = _d(M)
        errors[precision] = {"o": rel_err(o_k.cpu(), o), "S_out": rel_err(M_d @ _d(S_in) + E, S_out),
                             "dS_in": rel_err(_d(A) + M_d.transpose(-1, -2) @ _d(D), dS)}
    assert max(errors["input"].values()) < 1e-2, errors
    assert max(errors["tf32x3"].values()) < 5e-3, errors  # the inputs' own bfloat16 rounding bounds both


def test_kernels_low_precision_storage(seed):
    """R kept in bfloat16 and a bfloat16 output: K4 and K5 read the rounded R exactly (split products
    under tf32x3), and the output is the float32 sum rounded once (within one bfloat16 ulp: the
    interpreter rounds toward zero where the GPU rounds to nearest)."""
    from megatron_zeco.kernels import delta_correction as dc

    lengths, H, K, V = [37, 5, 100], 2, 32, 16
    _, (q, k, w, G), _, S_in, _ = _kernel_inputs(seed, lengths, H, K, V, torch.bfloat16)
    plan = ref.SubPieces(_cu(lengths), 16, 2)
    R, P, M = dc.piece_transition(q, k, w, G, K ** -0.5, plan, r_dtype=torch.bfloat16)
    assert R.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(seed + 2)
    o0, do = (torch.randn(1, plan.tokens, H, V, generator=gen).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    o = dc.output_correction(o0, R, P, S_in, plan).cpu()
    want = ref.output_correction(_d(o0), _d(R), _d(P), _d(S_in), plan, out_dtype=torch.float64)
    assert o.dtype == torch.bfloat16
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    # plus the float32 sum's own rounding, which matters where o0 and R X nearly cancel (want ~ 0)
    terms = ref.output_correction(_d(o0).abs(), _d(R).abs(), _d(P).abs(), _d(S_in).abs(), plan, out_dtype=torch.float64)
    assert ((o.double() - want).abs() <= ulp * (1 + 1e-4) + 4 * K * 2.0 ** -24 * terms).all()
    assert rel_err(_d(dc.entering_grad(R, P, do, plan)), ref.entering_grad(_d(R), _d(P), _d(do), plan)) < TOL32


@pytest.mark.parametrize("precision", ["ieee", "input"])
def test_parallel_kernels_at_every_run_length(seed, precision):
    """K4 and K5 over runs of 1, 2, 3 and more chunks than a sub-piece holds, and as built (packed, an empty
    segment, sub-pieces of uneven length): K4's output is the same bits at every run length (each chunk's
    product is the same); K5's A is the float64 reference's within float32 summation (runs summed in order:
    the same bits on a second call); bfloat16 R under ``"input"`` (X stored in bfloat16, as the pieces run)."""
    from megatron_zeco.kernels import delta_correction as dc

    H, K, V = 2, 32, 16
    lengths = [37, 5, 0, 100, 16]
    dtype = torch.bfloat16 if precision == "input" else torch.float32
    _, (q, k, w, G), _, S_in, _ = _kernel_inputs(seed, lengths, H, K, V, dtype)
    plan = ref.SubPieces(_cu(lengths), 16, [3, 1, 1, 2, 1])  # the 7-chunk segment: sub-pieces of 4 and 3
    kw = dict(precision=precision)
    qt = dc.correction_reads(q, k, w, G, K ** -0.5, plan, out_dtype=dtype, **kw)
    R, L = dc.sub_piece_maps(qt, k, w, G, plan, r_dtype=dtype, block_cols=16, block_rows=16, **kw)
    P, _ = dc.prefix_maps(L, plan, block_cols=16, **kw)
    gen = torch.Generator().manual_seed(seed + 3)
    o0, do = (torch.randn(1, plan.tokens, H, V, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    outs = {c: dc.output_correction(o0, R, P, S_in, plan, out_dtype=torch.float32, chunks_per_run=c, **kw)
            for c in (None, 1, 2, 3, 5)}
    grads = {c: dc.entering_grad(R, P, do, plan, chunks_per_run=c, **kw) for c in (None, 1, 2, 3, 50)}
    want_o = ref.output_correction(_d(o0), _d(R), _d(P), _d(S_in), plan)
    want_A = ref.entering_grad(_d(R), _d(P), _d(do), plan)
    tol = TOL32 if precision == "ieee" else 2e-2  # "input": X meets bfloat16 R rounded to bfloat16
    for c in outs:
        assert torch.equal(outs[c], outs[1]) and rel_err(_d(outs[c]), want_o) < tol, c
    for c in grads:
        assert rel_err(_d(grads[c]), want_A) < tol, c
        assert torch.equal(dc.entering_grad(R, P, do, plan, chunks_per_run=c, **kw), grads[c])
    assert rel_err(outs[1].cpu(), o0.cpu()) > 0.05 and want_A.abs().max() > 0.1
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="chunks_per_run"):
            dc.output_correction(o0, R, P, S_in, plan, chunks_per_run=bad, **kw)
        with pytest.raises(ValueError, match="chunks_per_run"):
            dc.entering_grad(R, P, do, plan, chunks_per_run=bad, **kw)


@pytest.mark.parametrize("form", FORMS)
def test_kernels_dense_batch(seed, form):
    """Dense ``[B, T, ...]`` input runs as B segments: the same results as the packed row."""
    from megatron_zeco.kernels import delta_correction as dc

    H, K, V, B, T = 2, 16, 16, 2, 40
    x, (q, k, w, G), aqk, S_in, _ = _kernel_inputs(seed, [T] * B, H, K, V, torch.float32, form)
    do = x["do"].float().to(DEVICE)
    packed, dense = ref.SubPieces(_cu([T] * B), 16, 2), ref.SubPieces.dense(B, T, 16, 2)
    view = lambda t: None if t is None else t.view(B, T, *t.shape[2:])  # noqa: E731
    R, P, M = dc.piece_transition(q, k, w, G, K ** -0.5, packed, aqk=aqk, precision="ieee")
    Rd, Pd, Md = dc.piece_transition(view(q), view(k), view(w), view(G), K ** -0.5, dense, aqk=view(aqk),
                                     precision="ieee")
    assert Rd.shape == (B, T, H, K) and torch.equal(Rd.flatten(0, 1), R[0]) and torch.equal(Md, M)
    o0 = torch.randn(1, B * T, H, V).to(DEVICE)
    o = dc.output_correction(o0, R, P, S_in, packed, precision="ieee")
    assert torch.equal(dc.output_correction(view(o0), Rd, Pd, S_in, dense, precision="ieee").flatten(0, 1), o[0])
    assert torch.equal(dc.entering_grad(Rd, Pd, view(do), dense, precision="ieee"),
                       dc.entering_grad(R, P, do, packed, precision="ieee"))


@pytest.mark.parametrize("form", FORMS)
def test_piece_correction_is_the_kernels(seed, form):
    """``PieceCorrection`` (what the CUDA pieces hold): K1..K3 at construction, K4 and K5 after the scan, in
    the piece's precision (``"input"`` for 16-bit inputs, R in their dtype; ``"tf32x3"`` for float32)."""
    from megatron_zeco.kernels import delta_correction as dc

    lengths, H, K, V = [37, 20], 2, 16, 16
    for dtype, precision in ((torch.float32, "tf32x3"), (torch.bfloat16, "input")):
        x, (q, k, w, G), aqk, S_in, _ = _kernel_inputs(seed, lengths, H, K, V, dtype, form)
        plan = ref.SubPieces(_cu(lengths), 16, 2)
        piece = dc.PieceCorrection(q, k, w, G, K ** -0.5, plan, aqk=aqk)
        piece.join()
        R, P, M = dc.piece_transition(q, k, w, G, K ** -0.5, plan, aqk=aqk, r_dtype=dtype, precision=precision)
        assert piece.precision == precision and piece.R.dtype == dtype
        assert torch.equal(piece.R, R) and torch.equal(piece.P, P) and torch.equal(piece.M, M)
        o0, do = (x[n].to(dtype).to(DEVICE) for n in ("v", "do"))
        assert torch.equal(piece.output(o0, S_in), dc.output_correction(o0, R, P, S_in, plan, precision=precision))
        assert torch.equal(piece.entering_grad(do), dc.entering_grad(R, P, do, plan, precision=precision))


def test_kernels_refuse_what_they_cannot_run():
    from megatron_zeco.kernels import delta_correction as dc

    x = torch.zeros(1, 20, 2, 16)
    g = torch.zeros(1, 20, 2)
    plan = ref.SubPieces([0, 20], 16)
    with pytest.raises(ValueError, match="chunk size"):
        dc.correction_reads(x, x, x, g, 1.0, ref.SubPieces([0, 20], 8), precision="ieee")
    with pytest.raises(ValueError, match="precision"):
        dc.correction_reads(x, x, x, g, 1.0, plan, precision="bf16x9")
    with pytest.raises(ValueError, match="tokens"):
        dc.correction_reads(x, x, x, g, 1.0, ref.SubPieces([0, 21], 16))
    with pytest.raises(ValueError, match="float64"):
        dc.correction_reads(x.double(), x, x, g, 1.0, plan)
    with pytest.raises(ValueError, match="needs aqk"):
        dc.correction_reads(x, x, x, x, 1.0, plan)
    with pytest.raises(ValueError, match="aqk"):
        dc.correction_reads(x, x, x, x, 1.0, plan, aqk=torch.zeros(1, 20, 2, 8))
    with pytest.raises(ValueError, match=r"g \(1, 20, 3\)"):
        dc.sub_piece_maps(x, x, x, torch.zeros(1, 20, 3), plan)
    with pytest.raises(ValueError, match="multiple"):
        dc.sub_piece_maps(x, torch.zeros(1, 20, 3, 16), x, g, plan)



def test_segment_plan_is_the_plan_made_once_per_shape():
    """``segment_plan`` (what the CUDA pieces call every step) is ``plan_sub_pieces`` over the offsets, and the
    same object on a second call with the same shape."""
    from megatron_zeco.kernels import delta_correction as dc

    offsets = (0, 70, 71, 300, 512)
    plan = dc.segment_plan(offsets, 64, 4, 32, torch.device("cpu"))
    want = dc.plan_sub_pieces(torch.tensor(offsets), 64, 4, 32, torch.device("cpu"))
    assert (plan.segments, plan.pieces, plan.chunks, plan.piece_offsets) == \
        (want.segments, want.pieces, want.chunks, want.piece_offsets)
    assert dc.segment_plan(offsets, 64, 4, 32, torch.device("cpu")) is plan
    assert dc.segment_plan(offsets[:-1], 64, 4, 32, torch.device("cpu")).segments == want.segments[:-1]

_COMPILE = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from megatron_zeco.kernels import delta_correction as dc

f, i = "*fp32", "*i32"
# (input dtype, precision, kernels, dtype of the stored Qt and R, gate per key channel); argv: which of them
VARIANTS = [
    ("bf16", "input", [*dc.KERNELS, "fused"], "*bf16", False), ("bf16", "tf32x3", dc.KERNELS, f, False),
    ("fp32", "tf32x3", [*dc.KERNELS, "fused"], f, False), ("bf16", "tf32", ["maps"], f, False),
    ("fp32", "ieee", ["maps"], f, False), ("bf16", "input", ["reads", "maps", "fused"], "*bf16", True),
    ("fp32", "tf32x3", ["reads", "maps", "fused"], f, True)]
for x, precision, names, stored, vector in [VARIANTS[int(n)] for n in sys.argv[1].split(",")]:
    signatures = {
        "reads": dict(q="*" + x, k="*" + x, w="*" + x, g=f, qt=stored, chunks=i, scale="fp32",
                      **({"aqk": "*" + x} if vector else {})),
        "maps": dict(qt=stored, k="*" + x, w="*" + x, g=f, r=stored, L=f, pieces=i, scale="fp32",
                     **({"aqk": "*" + x} if vector else {})),
        "fused": dict(q="*" + x, k="*" + x, w="*" + x, g=f, r=stored, L=f, pieces=i, scale="fp32",
                      **({"aqk": "*" + x} if vector else {})),
        "prefix": dict(L=f, P=f, M=f, piece_offsets=i),
        "entering": dict(P=f, s_in=f, X=stored if precision == "input" else f, pieces=i),
        "output": dict(o0="*" + x, r=stored, X=stored if precision == "input" else f, out="*" + x, runs=i),
        "grad": dict(r=stored, do="*" + x, P=f, Z=f, runs=i),
        "grad_sum": dict(Z=f, A=f, run_offsets=i),
    }
    tiles = dict(H=16, HQ=16, K=128, V=128, BT=64, BV=64, BC=64, RUN=2, KV=128 * 128, BLOCK=1024, G_LOG2=True,
                 GATE_VECTOR=vector, GIVEN_A=vector, PRECISION=precision, INTERPRETED=False,
                 **({} if vector else {"aqk": None}))
    for name in names:
        kernel = dc.KERNELS["maps" if name == "fused" else name]  # "fused": K2 with K1 inside
        blocks = dict(BK=64 if name in ("reads", "maps", "fused") else 128, FUSED=name == "fused",
                      **({"q": None} if name == "maps" else {"qt": None} if name == "fused" else {}))
        constexprs = {n: v for n, v in {**tiles, **blocks}.items() if n in kernel.arg_names}
        signature = {n: signatures[name].get(n, "constexpr") for n in kernel.arg_names}
        compiled = triton.compile(triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        if name in ("maps", "fused") and precision != "ieee":
            assert "wgmma" in compiled.asm["ptx"], (name, x, precision, vector)
print("ok")
'''


def test_kernels_compile_for_hopper():
    """K1..K5 build for sm_90 (bfloat16 and float32 inputs under tf32x3; K2 also under tf32 and ieee; K1 and
    K2 with a gate per key channel, reading Aqk; K2 with K1 inside, either gate), without a GPU, in a fresh
    interpreter without TRITON_INTERPRET; K2's recurrence runs on Hopper's tensor cores (wgmma)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    # the seven variants in two processes side by side (compiling is most of this test's time)
    procs = [subprocess.Popen([sys.executable, "-c", _COMPILE, part], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for part in ("0,2,4,6", "1,3,5")]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        if "ptxas" in err and "not found" in err:
            pytest.skip("Triton's CUDA backend has no ptxas here")
        assert proc.returncode == 0 and out.strip().endswith("ok"), err[-3000:]


def test_the_pieces_streams_are_one_per_device_the_state_pass_at_the_highest_priority(monkeypatch):
    """K1..K3's side stream at the default priority and the state pass's stream at the highest (its few programs
    take the SMs ahead of the maps' pending ones; torch clamps -1 to the device's range), each made once per
    device."""
    from megatron_zeco.kernels import delta_correction as dc
    from tests.helpers.streams import made_streams

    made = made_streams(monkeypatch)
    monkeypatch.setattr(dc, "_SIDE_STREAMS", {})
    monkeypatch.setattr(dc, "_URGENT_STREAMS", {})
    a, b = torch.device("cuda", 0), torch.device("cuda", 1)
    urgent, side = dc.urgent_stream(a), dc.side_stream(a)
    assert dc.urgent_stream(a) is urgent and dc.side_stream(a) is side and urgent is not side
    assert dc.urgent_stream(b) is not urgent
    assert made == [(a, -1), (a, 0), (b, -1)]
