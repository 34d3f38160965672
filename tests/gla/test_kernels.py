"""GLA's Triton kernels (megatron_zeco/gla/kernels.py) against float64 PyTorch (on the CPU through
TRITON_INTERPRET=1)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from megatron_zeco.gla.kernels import (  # noqa: E402
    chunk_decays,
    chunk_dqkg_with_state,
    chunk_dv_with_state,
    chunk_o_with_state,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sequences(B, T, lengths):
    """(sequence, first token, length) of every sequence: B dense rows of T, or packed ``lengths``."""
    if lengths is None:
        return [(b, b * T, T) for b in range(B)]
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    return [(n, starts[n], L) for n, L in enumerate(lengths)]


def _chunk_inputs(gen, B, T, H, K, V, BT, lengths, dtype, gate):
    """Random inputs in fla's layouts; per chunk: (state index, sequence, token slice)."""
    seqs = _sequences(B, T, lengths)
    chunks = [(n, slice(s + i, s + min(i + BT, L))) for n, s, L in seqs for i in range(0, L, BT)]
    total = B * T if lengths is None else sum(lengths)
    log_gate = -gate * torch.rand(total, H, K, generator=gen).double()  # per token, log2 units
    g = torch.zeros(total, H, K, dtype=torch.float64)
    for _, t in chunks:  # in-chunk cumulative sums, as chunk_local_cumsum gives
        g[t] = log_gate[t].cumsum(0)
    x = {name: torch.randn(total, H, dim, generator=gen).double() for name, dim in
         (("q", K), ("k", K), ("v", V), ("do", V))}
    x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
    x.update(g=g, A=torch.randn(total, H, BT, generator=gen).double() / BT,
             h=torch.randn(len(chunks), H, K, V, generator=gen).double(),
             dh=torch.randn(len(chunks), H, K, V, generator=gen).double(),
             S=torch.randn(len(seqs), H, K, V, generator=gen).double(),
             w=-gate * 8 * torch.rand(len(chunks), H, K, generator=gen).double(),
             dq=torch.randn(total, H, K, generator=gen).double(), dk=torch.randn(total, H, K, generator=gen).double())
    x = {name: t.to(dtype) if name in ("q", "k", "v", "do") else t for name, t in x.items()}
    return x, chunks


def _reference(x, chunks, scale):
    """The three kernels' formulas in float64, chunk by chunk: (o, dv, dq, dk, dg), and the
    size of the terms each element sums (for relative errors)."""
    d = {n: t.double() for n, t in x.items()}
    out = {n: torch.zeros_like(d[like]) for n, like in (("o", "v"), ("dv", "v"), ("dq", "q"), ("dk", "q"), ("dg", "q"))}
    size = {n: torch.zeros_like(t) for n, t in out.items()}
    for s, (n, t) in enumerate(chunks):
        q, k, v, do, g = (d[name][t] for name in ("q", "k", "v", "do", "g"))
        L, gl = len(q), d["g"][t][-1]
        h, S_term = d["h"][s], torch.exp2(d["w"][s])[..., None] * d["S"][n]  # [H, K, V]
        dh = d["dh"][s] + torch.exp2(d["w"][s])[..., None] * d["S"][n]     # S doubles as D
        A = torch.tril(d["A"][t][:, :, :L].permute(1, 0, 2))  # [H, L, L]
        qg = q * torch.exp2(g)
        terms = [scale * torch.einsum("thk,hkv->thv", qg, h), scale * torch.einsum("thk,hkv->thv", qg, S_term),
                 torch.einsum("hts,shv->thv", A, v)]
        out["o"][t] = sum(terms)
        size["o"][t] = sum(torch.einsum("thk,hkv->thv", a.abs(), b.abs()) for a, b in
                           ((scale * qg, h), (scale * qg, S_term))) + torch.einsum("hts,shv->thv", A.abs(), v.abs())
        kg = k * torch.exp2(gl - g)
        out["dv"][t] = torch.einsum("hst,shv->thv", A, do) + torch.einsum("thk,hkv->thv", kg, dh)
        size["dv"][t] = torch.einsum("hst,shv->thv", A.abs(), do.abs()) + torch.einsum("thk,hkv->thv", kg.abs(), dh.abs())
        dq = scale * torch.exp2(g) * torch.einsum("thv,hkv->thk", do, h)
        dk = torch.exp2(gl - g) * torch.einsum("thv,hkv->thk", v, dh)
        dgl = torch.exp2(gl) * (h * dh).sum(-1) + (dk * k).sum(0)
        dq, dk = dq + d["dq"][t], dk + d["dk"][t]
        out["dq"][t], out["dk"][t] = dq, dk
        out["dg"][t] = (q * dq - k * dk).flip(0).cumsum(0).flip(0) + dgl
        size["dq"][t] = scale * torch.exp2(g) * torch.einsum("thv,hkv->thk", do.abs(), h.abs()) + d["dq"][t].abs()
        size["dk"][t] = torch.exp2(gl - g) * torch.einsum("thv,hkv->thk", v.abs(), dh.abs()) + d["dk"][t].abs()
        size["dg"][t] = ((q * dq).abs() + (k * dk).abs()).flip(0).cumsum(0).flip(0) + dgl.abs()
    return out, size


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="Triton's interpreter (every release to 3.9.0, the test extra's) multiplies the bit "
    "patterns of bf16 tiles in tl.dot (triton-lang/triton#11584); bf16 runs on GPUs"))])
@pytest.mark.parametrize("B,T,H,K,V,BT,lengths,gate", [
    (2, 100, 2, 32, 64, 64, None, 1.0),         # T not a multiple of the chunk
    (1, 64, 1, 128, 128, 64, None, 1e-4),       # decay ~ 1, several key tiles
    (1, None, 2, 64, 32, 32, [5, 70, 1, 33], 30.0),  # packed; decay ~ 0 (exp2 underflows)
    (3, 16, 1, 16, 16, 16, None, 1.0),
])
def test_chunk_kernels_with_state_match_float64(seed, dtype, B, T, H, K, V, BT, lengths, gate):
    """o, dv and dq/dk/dg with the incoming state (gradient) fused in, against the float64 formulas."""
    gen = torch.Generator().manual_seed(seed)
    x, chunks = _chunk_inputs(gen, B, T, H, K, V, BT, lengths, dtype, gate)
    want, size = _reference(x, chunks, scale := K ** -0.5)
    Bk, Tk = (B, T) if lengths is None else (1, sum(lengths))
    dev = {n: t.float().to(DEVICE) if t.dtype == torch.float64 else t.to(DEVICE) for n, t in x.items()}
    tok = {n: dev[n].view(Bk, Tk, *dev[n].shape[1:]) for n in ("q", "k", "v", "do", "g", "A", "dq", "dk")}
    varlen = {}
    if lengths is not None:
        seq_of = torch.tensor([[n, i] for n, s, L in _sequences(1, 0, lengths) for i in range((L + BT - 1) // BT)])
        varlen = dict(cu_seqlens=torch.tensor([0, *lengths]).cumsum(0).to(DEVICE),
                      chunk_indices=seq_of.to(DEVICE))
    got = {"o": chunk_o_with_state(tok["q"], tok["v"], tok["g"], tok["A"], dev["h"].to(dtype), dev["S"], dev["w"],
                                   scale, BT, **varlen)}
    got["dv"] = chunk_dv_with_state(tok["k"], tok["g"], tok["A"], tok["do"], dev["dh"], dev["S"], dev["w"], BT, **varlen)
    got["dq"], got["dk"], got["dg"] = chunk_dqkg_with_state(
        tok["q"], tok["k"], tok["v"], tok["g"], dev["h"], tok["do"], dev["dh"], dev["S"], dev["w"], tok["dq"],
        tok["dk"], scale, BT, **varlen)
    # bf16: products round q * exp2(g) (and k's), h and dh to bf16 before the dot (several units
    # of 2^-8); float32: exact on the CPU, tf32 products (10-bit mantissa) on the GPU.
    tol = {torch.bfloat16: 2 ** -5, torch.float32: 2 ** -7 if DEVICE == "cuda" else 1e-4}[dtype]
    for name, t in got.items():
        assert t.shape[:2] == (Bk, Tk), name
        err = ((t.cpu().double().flatten(0, 1) - want[name]).abs() / size[name].clamp(min=1e-30)).max().item()
        assert err <= tol, f"{name}: max error {err:.1e} of the terms' size"


def test_chunk_kernels_with_state_check_shapes(seed):
    gen = torch.Generator().manual_seed(seed)
    x, _ = _chunk_inputs(gen, 1, 64, 1, 16, 16, 64, None, torch.float32, 1.0)
    q, v, g, A = (x[n].float().view(1, 64, *x[n].shape[1:]).to(DEVICE) for n in ("q", "v", "g", "A"))
    h, S, w = (x[n].float().to(DEVICE) for n in ("h", "S", "w"))
    with pytest.raises(ValueError, match="do not fit"):
        chunk_o_with_state(q, v, g, A, h, S, w[:, :, :8], 0.25, 64)
    with pytest.raises(ValueError, match="must be float32"):
        chunk_o_with_state(q, v, g, A, h, S.double(), w, 0.25, 64)
    with pytest.raises(ValueError, match="chunk_indices"):
        chunk_o_with_state(q, v, g, A, h, S, w, 0.25, 64, cu_seqlens=torch.tensor([0, 64], device=DEVICE))


@pytest.mark.parametrize("B,T,H,K,BT,lengths,gate", [
    (2, 100, 2, 32, 64, None, 1.0),                 # T not a multiple of the chunk
    (1, 2000, 1, 16, 16, None, 1e-6),               # decay ~ 1 over many chunk blocks
    (1, None, 3, 64, 32, [5, 70, 1, 33, 300], 30.0),  # packed; decay ~ 0
    (1, None, 1, 200, 16, [17], 1.0),               # channels not a power of two
])
def test_chunk_decays_match_float64(seed, B, T, H, K, BT, lengths, gate):
    """Per-chunk log2-decays into and out of each chunk, and each sequence's decay, against
    float64 sums of the chunks' totals."""
    gen = torch.Generator().manual_seed(seed)
    x, chunks = _chunk_inputs(gen, B, T, H, K, 1, BT, lengths, torch.float32, gate)
    g = x["g"].float()  # what the kernel sees; the reference sums these values in float64
    totals = torch.stack([g[t][-1].double() for _, t in chunks])  # [C, H, K]
    seq = torch.tensor([n for n, _ in chunks])
    N = int(seq.max()) + 1
    into, out_of = torch.zeros_like(totals), torch.zeros_like(totals)
    log_gamma = torch.zeros(N, H, K, dtype=torch.float64)
    for n in range(N):
        mine = (seq == n).nonzero().flatten()
        through = totals[mine].cumsum(0)
        into[mine], out_of[mine] = through - totals[mine], through[-1] - through
        log_gamma[n] = through[-1]
    Bk, Tk = (B, T) if lengths is None else (1, sum(lengths))
    tables = {}
    if lengths is not None:
        counts = [(L + BT - 1) // BT for L in lengths]
        tables = dict(cu_seqlens=torch.tensor([0, *lengths]).cumsum(0).to(DEVICE),
                      chunk_indices=torch.tensor([[n, i] for n, c in enumerate(counts) for i in range(c)]).to(DEVICE),
                      chunk_offsets=torch.tensor([0, *counts]).cumsum(0).to(DEVICE))
    got = chunk_decays(g.view(Bk, Tk, H, K).to(DEVICE), BT, **tables)
    for name, t, want in zip(("into", "out_of", "gamma"), got, (into, out_of, log_gamma.exp2())):
        assert t.dtype == torch.float32 and t.shape == want.shape, name
        err = (t.cpu().double() - want).abs().max().item()
        assert err <= 2 ** -22 * max(want.abs().max().item(), 1.0), f"{name}: max error {err:.1e}"
