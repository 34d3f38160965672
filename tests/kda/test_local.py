"""KDA on one device: the chunked PyTorch form, its piece operations and the local op against the float64
token loop (gradients: autograd of the loop)."""

import pytest
import torch

from megatron_zeco.cp.chunked_piece import ChunkedPiece
from megatron_zeco.kda import chunk_kda, kda_local, naive_recurrent_kda
from megatron_zeco.kda.local import CHUNKED_FORMS
from megatron_zeco.gated_delta_rule import naive_recurrent_gated_delta_rule
from tests.helpers.reference import GATES, kda_problem, rel_err

TOL = 1e-10
NAMES = ("q", "k", "v", "g", "beta")


def kda_reference(x, fn=naive_recurrent_kda):
    """``fn`` (the float64 loop by default): output, final state and the gradients of
    ``sum(o * do) + sum(ht * dht)`` with respect to q, k, v, g, beta and h0 (when given)."""
    leaves = {n: x[n].double().detach().requires_grad_() for n in NAMES}
    if x["h0"] is not None:
        leaves["h0"] = x["h0"].double().detach().requires_grad_()
    o, ht = fn(*(leaves[n] for n in NAMES), None, leaves.get("h0"), output_final_state=True)
    loss = (o * x["do"].double()).sum() + (ht * x["dht"].double()).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"o": o.detach(), "ht": ht.detach(), **{"d" + n: d for n, d in zip(leaves, grads)}}


def errors(got, ref):
    """The relative error of every quantity of ``ref``."""
    return {n: rel_err(got[n], ref[n]) for n in ref}


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T,chunk", [(1, 16), (31, 8), (45, 16), (64, 32)])
def test_chunk_matches_loop(seed, gate, T, chunk):
    """Output, final state and the gradients of every input and of the initial state, for every decay
    regime drawn per key channel (none, ~1, strong, underflowing to 0, mixed), beta exactly 0 and 1 at some
    tokens, lengths off the chunk size, K != V."""
    x = kda_problem(seed, B=2, T=T, H=2, K=8, V=5, gate=gate)
    got = kda_reference(x, lambda *a, **kw: chunk_kda(*a, **kw, chunk_size=chunk))
    errs = errors(got, kda_reference(x))
    assert max(errs.values()) < TOL, errs


@pytest.mark.parametrize("initial_state", [True, False])
def test_value_heads(seed, initial_state):
    """Grouped value attention as fla's (value head h reads query/key head h // (HV // H)), with and
    without an initial state: the loop equals the loop on repeated queries and keys, and the chunked form
    (gradients summed over the heads sharing q, k) equals the loop."""
    x = kda_problem(seed, B=2, T=21, H=2, K=8, V=5, gate="mixed", initial_state=initial_state, HV=4)
    ref = kda_reference(x)
    repeated = kda_reference({**x, "q": x["q"].repeat_interleave(2, 2), "k": x["k"].repeat_interleave(2, 2)})
    assert rel_err(repeated["o"], ref["o"]) < TOL and rel_err(repeated["ht"], ref["ht"]) < TOL
    errs = errors(kda_reference(x, chunk_kda), ref)
    assert max(errs.values()) < TOL, errs


def test_loop_with_equal_channel_decays_is_gated_delta_rule(seed):
    """A decay equal over the key channels commutes with the delta update: KDA is then the gated delta
    rule (whose loop has its own tests), in outputs, states and all gradients."""
    x = kda_problem(seed, B=2, T=17, H=2, K=8, V=5)
    x["g"] = x["g"][..., 0]

    def kda(q, k, v, g, *args, **kw):
        return naive_recurrent_kda(q, k, v, g.unsqueeze(-1).expand(*g.shape, q.shape[-1]), *args, **kw)

    errs = errors(kda_reference(x, kda), kda_reference(x, naive_recurrent_gated_delta_rule))
    assert max(errs.values()) < TOL, errs


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("lengths", [None, [3, 0, 1, 40, 17]], ids=["dense", "packed"])
def test_piece_matches_loop(seed, gate, lengths):
    """ChunkedPiece on chunk.py (the CPU's piece): the summary ``S_out = M S_in + E`` for any entering state,
    the output from it, the entering-state gradient ``A + M^T D`` and every input's gradient from the leaving
    state's ``D``; per sequence or per packed segment (an empty segment passes its state through). The CUDA
    piece's decomposition: tests/kernels/test_delta_correction.py."""
    B, T = (2, 45) if lengths is None else (1, sum(lengths))
    H, K, V = 2, 8, 5
    x = kda_problem(seed, B=B, T=T, H=H, K=K, V=V, gate=gate)
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    spans = [(b, 0, T) for b in range(B)] if cu is None else \
        [(0, a, e) for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    N = len(spans)
    gen = torch.Generator().manual_seed(seed + 1)
    S_in, D = (torch.randn(N, H, K, V, generator=gen, dtype=torch.float64) for _ in range(2))
    inputs = tuple(x[n] for n in NAMES)
    piece = ChunkedPiece(CHUNKED_FORMS, inputs, K ** -0.5, cu_seqlens=cu)
    assert piece.transition is piece.M and piece.M.dtype == torch.float64 and piece.M.shape == (N, H, K, K) and piece.E.shape == (N, H, K, V)
    piece.before_output()
    S_out = piece.M @ S_in + piece.E
    o = piece.output(S_in)
    dS_in = piece.entering_grad(x["do"]) + piece.M.transpose(-1, -2) @ D
    piece.before_grads()
    grads = piece.grads(D)
    for n, (b, a, e) in enumerate(spans):
        if a == e:
            assert torch.equal(S_out[n], S_in[n]) and torch.equal(dS_in[n], D[n]), n
            continue
        alone = {m: x[m][b:b + 1, a:e] for m in (*NAMES, "do")}
        ref = kda_reference({**alone, "h0": S_in[n:n + 1], "dht": D[n:n + 1]})
        errs = {"ht": rel_err(S_out[n], ref["ht"][0]), "o": rel_err(o[b:b + 1, a:e], ref["o"]),
                "dh0": rel_err(dS_in[n], ref["dh0"][0])}
        errs.update({"d" + m: rel_err(d[b:b + 1, a:e], ref["d" + m]) for m, d in zip(NAMES, grads)})
        assert max(errs.values()) < TOL, (n, errs)


def test_local_op_packed_and_low_precision(seed):
    """kda_local on packed segments (each from its own initial state, with gradients), and bfloat16 inputs
    giving bfloat16 outputs and float32 states, also for the piece's summary and gradients."""
    cu = torch.tensor([0, 5, 25, 26])
    x = kda_problem(seed, B=1, T=26, H=2, K=8, V=5, gate="mixed")
    h0 = torch.randn(3, 2, 8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    leaves = [x[n].clone().requires_grad_() for n in NAMES] + [h0.clone().requires_grad_()]
    o, ht = kda_local(*leaves[:5], scale=8 ** -0.5, initial_state=leaves[5], output_final_state=True,
                      cu_seqlens=cu, cu_seqlens_cpu=cu)
    grads = torch.autograd.grad((o * x["do"]).sum() + (ht * x["dht"][:1]).sum(), leaves)
    for n, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ref = kda_reference({**{m: x[m][:, a:e] for m in (*NAMES, "do")}, "h0": h0[n:n + 1], "dht": x["dht"]})
        errs = {"o": rel_err(o[:, a:e], ref["o"]), "ht": rel_err(ht[n], ref["ht"][0]),
                "dh0": rel_err(grads[5][n], ref["dh0"][0])}
        errs.update({"d" + m: rel_err(d[:, a:e], ref["d" + m]) for m, d in zip(NAMES, grads)})
        assert max(errs.values()) < TOL, (n, errs)

    low = {n: x[n].to(torch.bfloat16) for n in NAMES}
    o, ht = kda_local(*low.values(), scale=8 ** -0.5, initial_state=h0.float(), output_final_state=True,
                      cu_seqlens=cu)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    piece = ChunkedPiece(CHUNKED_FORMS, tuple(low.values()), 8 ** -0.5, cu_seqlens=cu)
    assert piece.E.dtype == piece.M.dtype == torch.float32
    o = piece.output(h0.float())
    A = piece.entering_grad(x["do"].to(torch.bfloat16))
    grads = piece.grads(torch.zeros_like(A))
    assert o.dtype == torch.bfloat16 and A.dtype == torch.float32
    assert all(d.dtype == torch.bfloat16 for d in grads)
