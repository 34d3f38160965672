"""zeco_gated_delta_rule on real gloo process groups against the gated delta rule over the whole
sequence (float64 token loop, autograd for the gradients).

Every strategy (zeco, lasp2, a2a; none at P = 1), both layouts, All-Scan pipelined in blocks of
columns, every decay regime (none, ~1, strong, underflowing; beta exactly 0 and 1 at some tokens),
with and without initial and final state, pieces of 13 and 26 tokens (chunks of 16), packed
documents under both splits (lasp2 without the cross-rank input check). Outputs, final states and
the gradients of q, k, v, g, beta and the initial state to 1e-10. Every test runs on the module's pool
of up to eight processes (P = 8 for a few cases). (The scans over dense transitions alone:
tests/comm/test_all_scan.py.)
"""

import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_zeco import Layout, packed_positions, zeco_gated_delta_rule
from tests.helpers.checks import above, assert_no_failures
from tests.helpers.marks import slow, slow_except
from tests.helpers.reference import SPLITS, delta_problem, document_lengths, packed_reference, reference, rel_err

RANK_POOL = dict(world=8, pg_timeout=120)
TOL = 1e-10
K, V, B = 8, 8, 2
NAMES = ("q", "k", "v", "g", "beta")


def _cases():
    """(strategy, layout, num_blocks, gate, initial_state, output_final_state): every decay regime for
    zeco; for the others, states that cross the ranks nearly whole (tiny), barely (strong) and mixed."""
    cases = []
    for strategy, layout in itertools.product(("zeco", "lasp2", "a2a"), Layout):
        for gate in ("normal", "zero", "tiny", "strong", "underflow", "mixed") if strategy == "zeco" \
                else ("tiny", "strong", "mixed"):
            cases.append((strategy, layout, 2 if strategy == "zeco" else 1, gate, True, True))
        cases += [(strategy, layout, 1, "tiny", h0, ht) for h0, ht in ((False, False), (True, False), (False, True))]
        if strategy == "zeco":
            cases += [(strategy, layout, nb, "tiny", True, True) for nb in (4, V)]
    return cases


def _check(group, seed, local_len, cases=None):
    world = 1 if group is None else group.size()
    rank = 0 if group is None else group.rank()
    heads = world if world > 2 else 2  # a2a needs H divisible by the group size
    failures, problems = [], {}
    if cases is None:  # one rank: every strategy is the local operator
        cases = [c for c in _cases() if world > 1 or c[0] == "zeco"]
    for n, (strategy, layout, nb, gate, with_h0, with_ht, *transport) in enumerate(cases):
        transport = transport[0] if transport else "auto"
        if (gate, with_h0) not in problems:
            x = delta_problem(seed + len(problems), B, world * local_len, heads, K, V, gate, with_h0)
            problems[gate, with_h0] = x, reference(x)
        x, ref = problems[gate, with_h0]
        if not with_ht:
            ref = reference(x, output_final_state=False)
        # the final-state term of the loss is split over the ranks with weights summing to one
        weights = torch.rand(world, generator=torch.Generator().manual_seed(seed + n), dtype=torch.float64)
        weights /= weights.sum()
        local = {name: layout.shard(x[name], rank, world).requires_grad_() for name in NAMES}
        h0 = x["h0"].clone().requires_grad_() if with_h0 else None
        o, ht = zeco_gated_delta_rule(*local.values(), group=group, strategy=strategy if world > 1 else "none",
                                      layout=layout, num_blocks=nb, initial_state=h0, output_final_state=with_ht,
                                      transport=transport if strategy == "zeco" else "auto")
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
            failures.append(f"{strategy} {layout.value} blocks={nb} gate={gate} h0={with_h0} ht={with_ht} "
                            f"transport={transport}: {bad}")
    return failures


@pytest.mark.parametrize("world", slow_except([1, 2, 3, 4], 2))
def test_every_strategy_matches_whole_sequence(pool, seed, world):
    # 26 tokens per rank: zigzag pieces of 13, contiguous pieces of 26; chunks are 16
    assert_no_failures(pool.run(_check, world, seed, 26))


@slow
def test_eight_ranks(pool, seed):
    cases = [("zeco", layout, 2, gate, True, True) for layout in Layout for gate in ("tiny", "mixed")]
    cases += [("lasp2", Layout.ZIGZAG, 1, "tiny", True, True), ("a2a", Layout.CONTIGUOUS, 1, "normal", True, True)]
    assert_no_failures(pool.run(_check, 8, seed, 10, cases))


@pytest.mark.parametrize("world", slow_except([2, 3], 2))
def test_peer_memory_transport_matches_whole_sequence(pool, seed, world):
    """zeco with its All-Scan through peer memory (the dense hop kernel, interpreted): both layouts, one
    and two blocks of columns, strong and mixed decays, initial and final state, every gradient."""
    cases = [("zeco", layout, nb, gate, True, True, "peer_memory")
             for layout in Layout for nb, gate in ((1, "mixed"), (2, "strong"))]
    assert_no_failures(pool.run(_check, world, seed, 26, cases + [("zeco", Layout.ZIGZAG, 1, "tiny", False, False,
                                                              "peer_memory")]))


def _check_packed(group, seed, local_len):
    world = 1 if group is None else group.size()
    rank = 0 if group is None else group.rank()
    heads = world if world > 2 else 2
    failures = []
    for n_split, (layout, per_document) in enumerate(SPLITS):
        for n_case, lengths in enumerate(document_lengths(seed + n_split, world, local_len, per_document)):
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            x = delta_problem(seed + 100 * n_split + n_case, 1, world * local_len, heads, K, V,
                              gate="mixed" if n_case == 1 else "normal", initial_state=False)
            ref = packed_reference(x, cu)  # every document alone
            mine = packed_positions(cu, layout, world, rank, per_document)
            for strategy in ("zeco", "lasp2", "a2a") if world > 1 else ("none",):
                local = {m: x[m][:, mine].requires_grad_() for m in NAMES}
                o, _ = zeco_gated_delta_rule(*local.values(), group=group, strategy=strategy, layout=layout,
                                             num_blocks=2 if strategy == "zeco" else 1, cu_seqlens=cu,
                                             per_document=per_document, validate=strategy != "lasp2")
                grads = torch.autograd.grad((o * x["do"][:, mine]).sum(), list(local.values()))
                errors = {"o": rel_err(o, ref["o"][:, mine])}
                errors.update({"d" + m: rel_err(d, ref["d" + m][:, mine]) for m, d in zip(NAMES, grads)})
                bad = above(errors, TOL)
                if bad:
                    failures.append(f"{strategy} {layout} per_document={per_document} lengths={lengths}: {bad}")
    return failures


@pytest.mark.parametrize("world", slow_except([1, 2, 3, 4], 2))
def test_packed_documents_match_each_document_alone(pool, seed, world):
    assert_no_failures(pool.run(_check_packed, world, seed, 16))


def _inputs(rank, T=12, H=2, beta_shape=None, dims_g=3):
    gen = torch.Generator().manual_seed(rank)
    q, k = (torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, T, H, *((K,) if dims_g == 4 else ()), generator=gen, dtype=torch.float64)
    beta = torch.rand(*(beta_shape or (1, T, H)), generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


BAD = {  # name: (inputs and keywords of rank r, expected message)
    "per-key gates (GLA's)": (lambda r: (_inputs(r, dims_g=4), {}), "g must have 3 dims [B, T, H]"),
    "beta of another length on one rank": (lambda r: (_inputs(r, beta_shape=(1, 11, 2) if r else None), {}),
                                           "g and beta must be [B, T, H]"),
    "blocks do not divide V": (lambda r: (_inputs(r), {"num_blocks": 3}), "cp_num_blocks 3 must divide the value head dim (8)"),
    "NVSHMEM on the CPU": (lambda r: (_inputs(r), {"transport": "nvshmem"}), "'nvshmem' needs CUDA tensors"),
    "lasp1": (lambda r: (_inputs(r), {"strategy": "lasp1"}),
              "cp_strategy 'lasp1' is not one of zeco, lasp2, a2a for the gated delta rule"),
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
            zeco_gated_delta_rule(*tensors, group=group, **kwargs)
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
    return messages


@slow
def test_bad_input_fails_on_every_rank(pool):
    results = pool.run(_bad, 2)
    for name, (_, expected) in BAD.items():
        for rank, messages in enumerate(results):
            assert messages[name] is not None, f"{name}: rank {rank} accepted it"
            assert expected in messages[name] and messages[name].startswith("zeco_gated_delta_rule"), \
                f"{name}: rank {rank}: {messages[name]}"
        assert results[0][name] == results[1][name], name  # the same message everywhere


def _mixed_dtypes(group, seed):
    """q, k, v, beta in bfloat16 with g in float32 (Megatron-Core's GatedDeltaNet passes them so) against
    the same values all in float32: the same outputs (rounded to bfloat16) and gradients, dg in float32.

    Both runs take the same output gradient, rounded to bfloat16 (the gradient of a bfloat16 output is
    bfloat16): dg sums terms that cancel, so an output gradient rounded in one run only would move it by
    more than a bfloat16 rounding. Given the same values both runs compute in float32: dg agrees to
    float32's precision, the output and the other gradients are the float32 run's rounded once to bfloat16
    (well under one bfloat16 rounding apart, ~2e-3, which rounding an intermediate would add)."""
    world, rank = group.size(), group.rank()
    x = delta_problem(seed, 1, world * 8, 2, K, V, initial_state=False)
    errors = {}
    for strategy, layout in (("zeco", Layout.ZIGZAG), ("lasp2", Layout.CONTIGUOUS), ("a2a", Layout.ZIGZAG)):
        do = layout.shard(x["do"], rank, world).to(torch.bfloat16)
        runs = []
        for low in (torch.bfloat16, torch.float32):
            # the same values (bfloat16's) either way; g float32 in both runs
            local = {n: layout.shard(x[n], rank, world).to(torch.float32 if n == "g" else torch.bfloat16)
                     .to(torch.float32 if n == "g" else low).requires_grad_() for n in NAMES}
            o, _ = zeco_gated_delta_rule(*local.values(), group=group, strategy=strategy, layout=layout)
            grads = torch.autograd.grad(o, list(local.values()), do.to(o.dtype))
            runs.append((o, grads))
        (o_mixed, g_mixed), (o_fp32, g_fp32) = runs
        if g_mixed[3].dtype != torch.float32 or o_mixed.dtype != torch.bfloat16:
            errors[strategy] = f"dtypes o {o_mixed.dtype}, dg {g_mixed[3].dtype}"
            continue
        rounded = [rel_err(o_mixed, o_fp32.to(torch.bfloat16))] + \
                  [rel_err(a, b.to(a.dtype)) for n, a, b in zip(NAMES, g_mixed, g_fp32) if n != "g"]
        errors[strategy] = (max(rounded), rel_err(g_mixed[3], g_fp32[3]))
    return errors


@slow
def test_float32_log_decays_beside_bfloat16_inputs(pool, seed):
    for rank, errors in enumerate(pool.run(_mixed_dtypes, 2, seed)):
        for strategy, err in errors.items():
            assert isinstance(err, tuple), f"rank {rank} {strategy}: {err}"
            rounded, dg = err
            assert rounded < 1e-3 and dg < 1e-5, f"rank {rank} {strategy}: bfloat16 outputs/gradients {rounded}, dg {dg}"


def _check_scan_precision(group, seed):
    """The precision each scan's route carries for inputs of each dtype (``cp/scan.py``)."""
    from megatron_zeco.cp import scan as scans

    scan, routes = scans.all_scan, []

    def spy(gamma, delta, init, route, **kw):
        routes.append(route.precision)
        return scan(gamma, delta, init, route, **kw)

    scans.all_scan = spy
    seen, world, rank = {}, group.size(), group.rank()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            x = delta_problem(seed, 1, world * 16, 2, K, V, "normal", False)
            local = {n: Layout.CONTIGUOUS.shard(x[n], rank, world).to(dtype).requires_grad_() for n in NAMES}
            routes.clear()
            o, _ = zeco_gated_delta_rule(*local.values(), group=group, strategy="zeco", transport="send_recv")
            o.float().sum().backward()
            seen[str(dtype)] = list(routes)
    finally:
        scans.all_scan = scan
    return seen


def test_scans_take_the_pieces_map_precision(pool, seed):
    """Both scans of a call (forward and backward) route the pieces' map precision of its inputs' dtype
    (``kernels.map_precision``): ``input`` for bfloat16 (the device hops' products in one TF32 pass, as the maps'
    own), ``tf32x3`` for float32."""
    for seen in pool.run(_check_scan_precision, 2, seed):
        assert seen == {"torch.float32": ["tf32x3"] * 2, "torch.bfloat16": ["input"] * 2}, seen
