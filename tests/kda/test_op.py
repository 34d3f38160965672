"""zeco_kda on real gloo process groups against KDA over the whole sequence (float64 token loop,
autograd for the gradients).

Every strategy (zeco, lasp2, a2a; none at P = 1) at P = 1..8, both layouts, All-Scan pipelined in blocks of value
columns, decay regimes per key channel (none, ~1, strong, underflowing, mixed; beta exactly 0 and 1 at
some tokens), with and without initial and final state, K != V, pieces of 13 and 26 tokens (chunks of
16), odd rank counts, packed documents under both splits. Outputs, final states and the gradients of
q, k, v, g, beta and the initial state to 1e-10; bad input gets the same ValueError on every rank.
One case at P = 2 of each is in the fast tier (with bad input); the rest is marked slow.
"""

import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_zeco import Layout, packed_positions, zeco_kda
from tests.helpers.checks import above, assert_no_failures
from tests.helpers.marks import slow_except
from tests.helpers.reference import SPLITS, document_lengths, kda_problem, packed_reference, reference, rel_err

RANK_POOL = dict(world=8, pg_timeout=120)
TOL = 1e-10
K, V, B = 8, 6, 2
NAMES = ("q", "k", "v", "g", "beta")


def _cases():
    """(strategy, layout, num_blocks, gate, initial_state, output_final_state)."""
    cases = []
    for strategy, layout in itertools.product(("zeco", "lasp2", "a2a"), Layout):
        for gate in ("normal", "zero", "strong", "underflow", "mixed") if strategy == "zeco" else ("tiny", "mixed"):
            cases.append((strategy, layout, 2 if strategy == "zeco" else 1, gate, True, True))
        cases += [(strategy, layout, 1, "tiny", h0, ht) for h0, ht in ((False, False), (True, False), (False, True))]
        if strategy == "zeco":
            cases.append((strategy, layout, 3, "normal", True, True))
    return cases


def _check(group, seed, local_len, cases=None):
    world = 1 if group is None else group.size()
    rank = 0 if group is None else group.rank()
    heads = world if world > 2 else 2  # a2a needs H divisible by the group size
    failures, problems = [], {}
    if cases is None:  # one rank: every strategy is the local operator
        cases = [c for c in _cases() if world > 1 or c[0] == "zeco"]
    for n, (strategy, layout, nb, gate, with_h0, with_ht) in enumerate(cases):
        if (gate, with_h0) not in problems:
            x = kda_problem(seed + len(problems), B, world * local_len, heads, K, V, gate, with_h0)
            problems[gate, with_h0] = x, reference(x)
        x, ref = problems[gate, with_h0]
        if not with_ht:
            ref = reference(x, output_final_state=False)
        # the final-state term of the loss is split over the ranks with weights summing to one
        weights = torch.rand(world, generator=torch.Generator().manual_seed(seed + n), dtype=torch.float64)
        weights /= weights.sum()
        local = {name: layout.shard(x[name], rank, world).requires_grad_() for name in NAMES}
        h0 = x["h0"].clone().requires_grad_() if with_h0 else None
        o, ht = zeco_kda(*local.values(), group=group, strategy=strategy if world > 1 else "none", layout=layout,
                         num_blocks=nb, initial_state=h0, output_final_state=with_ht)
        loss = (o * layout.shard(x["do"], rank, world)).sum()
        if with_ht:
            loss = loss + weights[rank] * (ht * x["dht"]).sum()
        leaves = [*local.values(), *([h0] if with_h0 else [])]
        grads = dict(zip([*NAMES, "h0"], torch.autograd.grad(loss, leaves)))
        if with_h0 and group is not None:
            dist.all_reduce(grads["h0"], group=group)  # gradient of a replicated input: sum over ranks
        errors = {"o": rel_err(o, layout.shard(ref["o"], rank, world))}
        if with_ht:
            errors["ht"] = rel_err(ht, ref["ht"])
        for name, grad in grads.items():
            want = ref["d" + name]
            errors["d" + name] = rel_err(grad, want if name == "h0" else layout.shard(want, rank, world))
        bad = above(errors, TOL)
        if bad:
            failures.append(f"{strategy} {layout.value} blocks={nb} gate={gate} h0={with_h0} ht={with_ht}: {bad}")
    return failures


def test_two_ranks_zeco_matches_whole_sequence(pool, seed):
    """The fast tier's case: zeco over two ranks, zigzag, two blocks of columns, mixed decays."""
    assert_no_failures(pool.run(_check, 2, seed, 26, [("zeco", Layout.ZIGZAG, 2, "mixed", True, True)]))


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_strategy_matches_whole_sequence(pool, seed, world):
    # 26 tokens per rank: zigzag pieces of 13, contiguous pieces of 26; chunks are 16
    assert_no_failures(pool.run(_check, world, seed, 26))


@pytest.mark.slow
@pytest.mark.parametrize("world", [5, 6, 7, 8])
def test_many_ranks(pool, seed, world):
    cases = [("zeco", layout, 2, "mixed", True, True) for layout in Layout]
    cases += [("lasp2", Layout.ZIGZAG, 1, "tiny", True, True)]
    cases += [("a2a", Layout.CONTIGUOUS, 1, "normal", True, True)] if world == 8 else []
    assert_no_failures(pool.run(_check, world, seed, 10, cases))


def _check_packed(group, seed, local_len):
    world = 1 if group is None else group.size()
    rank = 0 if group is None else group.rank()
    heads = world if world > 2 else 2
    failures = []
    for n_split, (layout, per_document) in enumerate(SPLITS):
        for n_case, lengths in enumerate(document_lengths(seed + n_split, world, local_len, per_document)):
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            x = kda_problem(seed + 100 * n_split + n_case, 1, world * local_len, heads, K, V,
                            gate="mixed" if n_case == 1 else "normal", initial_state=False)
            ref = packed_reference(x, cu)  # every document alone
            mine = packed_positions(cu, layout, world, rank, per_document)
            for strategy in ("zeco", "lasp2", "a2a") if world > 1 else ("none",):
                local = {m: x[m][:, mine].requires_grad_() for m in NAMES}
                o, _ = zeco_kda(*local.values(), group=group, strategy=strategy, layout=layout,
                                num_blocks=2 if strategy == "zeco" else 1, cu_seqlens=cu, per_document=per_document)
                grads = torch.autograd.grad((o * x["do"][:, mine]).sum(), list(local.values()))
                errors = {"o": rel_err(o, ref["o"][:, mine])}
                errors.update({"d" + m: rel_err(d, ref["d" + m][:, mine]) for m, d in zip(NAMES, grads)})
                bad = above(errors, TOL)
                if bad:
                    failures.append(f"{strategy} {layout} per_document={per_document} lengths={lengths}: {bad}")
    return failures


@pytest.mark.parametrize("world", slow_except([1, 2, 3], 2))
def test_packed_documents_match_each_document_alone(pool, seed, world):
    assert_no_failures(pool.run(_check_packed, world, seed, 16))


def _inputs(rank, T=12, H=2, beta_shape=None, dims_g=4):
    gen = torch.Generator().manual_seed(rank)
    q, k = (torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, T, H, *((K,) if dims_g == 4 else ()), generator=gen, dtype=torch.float64)
    beta = torch.rand(*(beta_shape or (1, T, H)), generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


BAD = {  # name: (inputs and keywords of rank r, expected message)
    "one gate per head (the gated delta rule's)": (lambda r: (_inputs(r, dims_g=3), {}),
                                                    "g must have 4 dims [B, T, H, K]"),
    "beta of another length on one rank": (lambda r: (_inputs(r, beta_shape=(1, 11, 2) if r else None), {}),
                                           "beta must be [B, T, H]"),
    "blocks do not divide V": (lambda r: (_inputs(r), {"num_blocks": 4}),
                               "cp_num_blocks 4 must divide the value head dim (6)"),
    "lasp1": (lambda r: (_inputs(r), {"strategy": "lasp1"}), "cp_strategy 'lasp1' is not one of zeco, lasp2, a2a for KDA"),
    "a2a heads": (lambda r: (_inputs(r, H=3), {"strategy": "a2a"}), "not divisible by the group size"),
    "lengths differ": (lambda r: (_inputs(r, T=10 if r else 12), {}), "same on every rank"),
    "packed with a final state": (lambda r: (_inputs(r), {"cu_seqlens": torch.tensor([0, 24]),
                                                          "output_final_state": True}), "zero state"),
}


def _bad(group):
    messages = {}
    for name, (make, _) in BAD.items():
        tensors, kwargs = make(group.rank())
        try:
            zeco_kda(*tensors, group=group, **kwargs)
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
    return messages


def test_bad_input_fails_on_every_rank(pool):
    results = pool.run(_bad, 2)
    for name, (_, expected) in BAD.items():
        for rank, messages in enumerate(results):
            assert messages[name] is not None, f"{name}: rank {rank} accepted it"
            assert expected in messages[name] and messages[name].startswith("zeco_kda"), \
                f"{name}: rank {rank}: {messages[name]}"
        assert results[0][name] == results[1][name], name  # the same message everywhere
