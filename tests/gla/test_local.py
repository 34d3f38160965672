"""The chunked PyTorch GLA and the local operations against the float64 loop (one process)."""

import pytest
import torch

from megatron_zeco.gla import chunk_gla, gla_bwd, gla_fwd, gla_piece
from tests.helpers.reference import GATES, problem, reference, rel_err

TOL = 1e-10


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T,chunk", [(1, 32), (31, 8), (64, 16), (77, 32)])
def test_chunk_gla_matches_loop(seed, gate, T, chunk):
    x = problem(seed, B=2, T=T, H=3, K=8, V=5, gate=gate)
    ref = reference(x)
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "h0")}
    o, ht = chunk_gla(leaves["q"], leaves["k"], leaves["v"], leaves["g"], None, leaves["h0"], True, chunk)
    grads = torch.autograd.grad((o * x["do"]).sum() + (ht * x["dht"]).sum(), list(leaves.values()))
    assert rel_err(o, ref["o"]) < TOL and rel_err(ht, ref["ht"]) < TOL
    for name, grad in zip(leaves, grads):
        assert rel_err(grad, ref["d" + name]) < TOL, name


@pytest.mark.parametrize("gate", ["normal", "strong", "mixed"])
def test_local_ops_match_loop(seed, gate):
    """gla_fwd/gla_bwd with states in and out, and gla_piece: the summary ZeCO scans, then the same
    results from the incoming state and the outgoing state's gradient."""
    x = problem(seed, B=2, T=45, H=2, K=8, V=4, gate=gate)
    ref = reference(x)
    scale = 8 ** -0.5
    o, ht, saved = gla_fwd((x["q"], x["k"], x["v"], x["g"]), scale, x["h0"], True)
    assert rel_err(o, ref["o"]) < TOL and rel_err(ht, ref["ht"]) < TOL
    dq, dk, dv, dg, dh0 = gla_bwd(saved, x["do"], x["dht"])
    for name, grad in zip(("q", "k", "v", "g", "h0"), (dq, dk, dv, dg, dh0)):
        assert rel_err(grad, ref["d" + name]) < TOL, name

    # S_out = gamma * S_in + E for any S_in; dL/dS_in = A + gamma * dL/dS_out.
    piece = gla_piece(x["q"], x["k"], x["v"], x["g"], scale)
    assert rel_err(piece.gamma.unsqueeze(-1) * x["h0"] + piece.E, ref["ht"]) < TOL
    assert rel_err(piece.output(x["h0"]), ref["o"]) < TOL
    A = piece.entering_grad(x["do"])
    assert rel_err(A + piece.gamma.unsqueeze(-1) * x["dht"], ref["dh0"]) < TOL
    for name, grad in zip(("q", "k", "v", "g"), piece.grads(x["dht"])):
        assert rel_err(grad, ref["d" + name]) < TOL, name


def test_low_precision_inputs_keep_fp32_states(seed):
    x = problem(seed, B=1, T=40, H=2, K=16, V=16)
    q, k, v, g = (x[n].to(torch.bfloat16) for n in ("q", "k", "v", "g"))
    o, ht, _ = gla_fwd((q, k, v, g), 0.25, x["h0"].float(), True)
    piece = gla_piece(q, k, v, g, 0.25)
    E, gamma = piece.E, piece.gamma
    assert o.dtype == torch.bfloat16 and ht.dtype == E.dtype == gamma.dtype == torch.float32
    ref = reference({**x, "q": q, "k": k, "v": v, "g": g})
    assert rel_err(o, ref["o"]) < 1e-2


@pytest.mark.parametrize("gate", ["normal", "mixed"])
def test_packed_segments_match_each_alone(seed, gate):
    """cu_seqlens: each segment runs alone from its own initial state (empty, one token, several chunks)."""
    lengths = [3, 0, 1, 40, 17]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = problem(seed, B=1, T=int(cu[-1]), H=2, K=8, V=4, gate=gate)
    h0 = torch.randn(len(lengths), 2, 8, 4, dtype=torch.float64)
    dht = torch.randn_like(h0)
    scale = 8 ** -0.5
    o, ht, saved = gla_fwd((x["q"], x["k"], x["v"], x["g"]), scale, h0, True, cu_seqlens=cu)
    grads = gla_bwd(saved, x["do"], dht)
    piece = gla_piece(x["q"], x["k"], x["v"], x["g"], scale, cu_seqlens=cu)
    E, gamma = piece.E, piece.gamma
    A = piece.entering_grad(x["do"])
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == b:  # an empty segment passes its state through
            assert torch.equal(ht[n], h0[n]) and torch.equal(grads[4][n], dht[n]) and (E[n] == 0).all()
            continue
        alone = {name: x[name][:, a:b] for name in ("q", "k", "v", "g", "do")}
        alone.update(h0=h0[n:n + 1], dht=dht[n:n + 1])
        ref = reference(alone)
        assert rel_err(o[:, a:b], ref["o"]) < TOL and rel_err(ht[n], ref["ht"][0]) < TOL, n
        for name, grad in zip(("q", "k", "v", "g"), grads[:4]):
            assert rel_err(grad[:, a:b], ref["d" + name]) < TOL, (n, name)
        assert rel_err(grads[4][n], ref["dh0"][0]) < TOL, n
        assert rel_err(gamma[n].unsqueeze(-1) * h0[n] + E[n], ref["ht"][0]) < TOL, n
        assert rel_err(A[n] + gamma[n].unsqueeze(-1) * dht[n], ref["dh0"][0]) < TOL, n
