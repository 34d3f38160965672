"""The delta rules' CUDA pieces (``gated_delta_rule/fla_piece.py``, ``kda/fla_piece.py``: fla's internal functions
from a zero state, this package's correction kernels, fla's backward from S_in) run on fla-core 0.6.0's own
Triton kernels under the interpreter, on the CPU, against the float64 token loop: the calls into fla's
internals, the decomposition around them and the correction kernels together (tests/helpers/fla_interpreter.py).

Opt-in: skipped unless fla-core 0.6.0 and einops import (``pip install --no-deps fla-core==0.6.0 einops``) and
Triton interprets (no CUDA); with ``ZECO_TEST_FLA=1`` (``.ci/run``'s third pass, which installs them) they run
and fail where they cannot, rather than skip. Seconds to a minute per case; float32 only (the interpreter's
16-bit products are wrong).
"""

import os

import pytest
import torch

from megatron_zeco.kernels.delta_reference import SubPieces
from tests.helpers import fla_interpreter
from tests.helpers.marks import slow
from tests.helpers.reference import delta_problem, kda_problem, reference, rel_err

REQUIRED = os.environ.get("ZECO_TEST_FLA") == "1"
pytestmark = [slow, pytest.mark.skipif(bool(fla_interpreter.available()) and not REQUIRED,
                                       reason=fla_interpreter.available() or "-")]
NAMES = ("q", "k", "v", "g", "beta")
FACTOR, FLOOR = 1.1, 1e-6  # each error within 1.1x fla's own (its op from the same S_in, same D) plus 1e-6


@pytest.fixture
def pieces(monkeypatch):
    """The two CUDA piece modules on the CPU: fla under the interpreter, no pinned host memory (no CUDA), and
    three sub-pieces per segment (the plan for a GPU would keep these short segments whole)."""
    fla_interpreter.enable()
    from megatron_zeco.common import backend
    from megatron_zeco.gated_delta_rule import fla_piece as gdn
    from megatron_zeco.kda import fla_piece as kda
    from megatron_zeco.kernels import delta_correction

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self)
    monkeypatch.setattr(delta_correction, "plan_sub_pieces", lambda cu, chunk, *args, **kwargs: SubPieces(cu, chunk, 3))
    caches = (delta_correction.segment_plan, backend.fla_varlen)  # made under the patches above: not kept
    for cache in caches:
        cache.cache_clear()
    yield {"gdn": gdn.FlaPiece, "kda": kda.FlaPiece}
    for cache in caches:
        cache.cache_clear()


@pytest.mark.parametrize("op,gate", [("gdn", "normal"), ("kda", "normal"), ("kda", "mixed")])
@pytest.mark.parametrize("lengths", [[150, 150], [1, 70, 130, 5, 64]], ids=["dense", "packed"])
@pytest.mark.parametrize("hook", [True, False], ids=["before_grads", "grads-alone"])
def test_piece_on_fla_matches_loop(pieces, seed, op, gate, lengths, hook):
    """The summary ``M S_in + E``, the output from S_in, ``A + M^T D`` and every input's gradient from D, per
    sequence (dense: two of 150 tokens, three chunks of 64 each, three sub-pieces) or packed segment (one of
    a single token, one ending mid-chunk, one of exactly a chunk), against the loop: within 1.1x the error
    of fla's own op (``chunk_gated_delta_rule``, ``chunk_kda``) entered by the same states, ~1e-6 here
    (~1e-4 for ``mixed``: KDA's gates per key channel none, ~1, strong and underflowing side by side). The
    backward's first part runs as the scan runs it (``before_grads``, then ``grads``) or inside ``grads``."""
    packed = len(lengths) > 2
    B, T = (1, sum(lengths)) if packed else (len(lengths), lengths[0])
    H, K, V = 2, 32, 16
    x = (kda_problem if op == "kda" else delta_problem)(seed, B=B, T=T, H=H, K=K, V=V, gate=gate)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if packed else None
    spans = [(0, a, e) for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())] if packed else [(b, 0, T) for b in range(B)]
    gen = torch.Generator().manual_seed(seed + 1)
    S_in, D = (torch.randn(len(spans), H, K, V, generator=gen, dtype=torch.float64) for _ in range(2))
    piece = pieces[op](*(x[n].float() for n in NAMES), K ** -0.5, cu_seqlens=cu, cu_seqlens_cpu=cu)
    piece.before_output()
    got = {"ht": piece.M @ S_in.float() + piece.E, "o": piece.output(S_in.float())}
    got["dh0"] = piece.entering_grad(x["do"].float()) + piece.M.transpose(-1, -2) @ D.float()
    if hook:
        piece.before_grads()
    got.update({"d" + n: t for n, t in zip(NAMES, piece.grads(D.float()))})
    results = {"got": got, "fla": _fla(op, x, S_in, D, cu, K ** -0.5)}
    parts = {who: {m: [] for m in got} for who in ("got", "fla", "ref")}
    for n, (b, a, e) in enumerate(spans):
        ref = reference({**{m: x[m][b:b + 1, a:e] for m in (*NAMES, "do")}, "h0": S_in[n:n + 1], "dht": D[n:n + 1]},
                        K ** -0.5)
        for m in got:
            parts["ref"][m].append(ref[m].reshape(-1))
            for who, result in results.items():
                parts[who][m].append((result[m][n] if m in ("ht", "dh0") else result[m][b:b + 1, a:e]).double()
                                     .reshape(-1))
    errors = {who: {m: rel_err(torch.cat(parts[who][m]), torch.cat(parts["ref"][m])) for m in got}
              for who in results}
    over = {m: (e, errors["fla"][m]) for m, e in errors["got"].items() if not e <= FACTOR * errors["fla"][m] + FLOOR}
    assert not over, (over, errors)


def _fla(op, x, S_in, D, cu, scale):
    """fla's own op over ``x`` (float32) from ``S_in`` with final-state gradient ``D``: ``o``, ``ht`` and the
    gradients of q, k, v, g, beta and the initial state (``dh0``)."""
    if op == "kda":
        from fla.ops.kda import chunk_kda as fla_op
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_op
    leaves = [x[n].float().requires_grad_() for n in NAMES]
    h0 = S_in.float().requires_grad_()
    o, ht = fla_op(*leaves, scale=scale, initial_state=h0, output_final_state=True,
                   **({} if cu is None else {"cu_seqlens": cu}))
    grads = torch.autograd.grad((o * x["do"].float()).sum() + (ht * D.float()).sum(), leaves + [h0])
    return {"o": o, "ht": ht, "dh0": grads[-1], **{"d" + n: g for n, g in zip(NAMES, grads)}}
