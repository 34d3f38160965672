"""The chunked PyTorch gated delta rule and its piece operations against the float64 token loop
(one process; gradients: autograd of the loop)."""

import pytest
import torch

from megatron_zeco.gated_delta_rule import chunk_gated_delta_rule, gdn_local, gdn_piece
from tests.helpers.reference import GATES, delta_problem, reference, rel_err

TOL = 1e-10
NAMES = ("q", "k", "v", "g", "beta")


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T,chunk", [(1, 16), (31, 8), (45, 16), (64, 32)])
def test_chunk_matches_loop(seed, gate, T, chunk):
    """Output, final state and the gradients of every input and of the initial state, for every decay
    regime (none, ~1, strong, underflowing to 0, mixed), beta exactly 0 and 1 at some tokens, lengths
    off the chunk size."""
    x = delta_problem(seed, B=2, T=T, H=2, K=8, V=5, gate=gate)
    ref = reference(x)
    leaves = {n: x[n].clone().requires_grad_() for n in (*NAMES, "h0")}
    o, ht = chunk_gated_delta_rule(*(leaves[n] for n in NAMES), None, leaves["h0"], True, chunk)
    grads = torch.autograd.grad((o * x["do"]).sum() + (ht * x["dht"]).sum(), list(leaves.values()))
    errors = {"o": rel_err(o, ref["o"]), "ht": rel_err(ht, ref["ht"])}
    errors.update({"d" + n: rel_err(d, ref["d" + n]) for n, d in zip(leaves, grads)})
    assert max(errors.values()) < TOL, errors


@pytest.mark.parametrize("gate", ["normal", "strong", "mixed"])
@pytest.mark.parametrize("lengths", [None, [3, 0, 1, 40, 17]], ids=["dense", "packed"])
def test_piece_matches_loop(seed, gate, lengths):
    """gdn_piece: the summary ``S_out = M S_in + E`` for any entering state, the output from it, the
    entering-state gradient ``A + M^T D`` and every input's gradient from the leaving state's ``D``;
    per sequence or per packed segment (an empty segment passes its state through)."""
    B, T = (2, 45) if lengths is None else (1, sum(lengths))
    x = delta_problem(seed, B=B, T=T, H=2, K=8, V=4, gate=gate)
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    spans = [(b, 0, T) for b in range(B)] if cu is None else \
        [(0, a, e) for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    N = len(spans)
    gen = torch.Generator().manual_seed(seed + 1)
    S_in, D = (torch.randn(N, 2, 8, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    scale = 8 ** -0.5
    piece = gdn_piece(*(x[n] for n in NAMES), scale, cu_seqlens=cu)
    assert piece.transition is piece.M and piece.M.shape == (N, 2, 8, 8)
    S_out = piece.M @ S_in + piece.E
    o = piece.output(S_in)
    dS_in = piece.entering_grad(x["do"]) + piece.M.transpose(-1, -2) @ D
    grads = piece.grads(D)
    for n, (b, a, e) in enumerate(spans):
        if a == e:
            assert torch.equal(S_out[n], S_in[n]) and torch.equal(dS_in[n], D[n]), n
            continue
        alone = {m: x[m][b:b + 1, a:e] for m in (*NAMES, "do")}
        ref = reference({**alone, "h0": S_in[n:n + 1], "dht": D[n:n + 1]})
        errors = {"ht": rel_err(S_out[n], ref["ht"][0]), "o": rel_err(o[b:b + 1, a:e], ref["o"]),
                  "dh0": rel_err(dS_in[n], ref["dh0"][0])}
        errors.update({"d" + m: rel_err(d[b:b + 1, a:e], ref["d" + m]) for m, d in zip(NAMES, grads)})
        assert max(errors.values()) < TOL, (n, errors)


def test_local_op_packed_and_low_precision(seed):
    """gdn_local on packed segments (each from its own initial state) and in bfloat16 inputs with
    float32 states."""
    lengths = [5, 20, 1]
    cu = torch.tensor([0, 5, 25, 26])
    x = delta_problem(seed, B=1, T=26, H=2, K=8, V=4)
    h0 = torch.randn(3, 2, 8, 4, dtype=torch.float64)
    o, ht = gdn_local(*(x[n] for n in NAMES), scale=8 ** -0.5, initial_state=h0, output_final_state=True,
                      cu_seqlens=cu)
    for n, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ref = reference({**{m: x[m][:, a:e] for m in (*NAMES, "do")}, "h0": h0[n:n + 1], "dht": x["dht"]})
        assert rel_err(o[:, a:e], ref["o"]) < TOL and rel_err(ht[n], ref["ht"][0]) < TOL, (n, lengths[n])
    low = {n: x[n].to(torch.bfloat16) for n in NAMES}
    o, ht = gdn_local(*low.values(), scale=8 ** -0.5, initial_state=h0.float(), output_final_state=True,
                      cu_seqlens=cu)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
