"""zeco_gated_delta_rule on real gloo process groups against the gated delta rule over the whole
sequence (float64 token loop, autograd for the gradients), and the scans over dense transitions.

Every strategy (zeco, lasp2, a2a; none at P = 1), both layouts, All-Scan pipelined in blocks of
columns, every decay regime (none, ~1, strong, underflowing; beta exactly 0 and 1 at some tokens),
with and without initial and final state, pieces of 13 and 26 tokens (chunks of 16), packed
documents under both splits (lasp2 without the cross-rank input check). Outputs, final states and
the gradients of q, k, v, g, beta and the initial state to 1e-10. Every test runs on one pool of
eight processes (P = 8 for a few cases).
"""

import itertools

import pytest
import torch
import torch.distributed as dist

from distributed import RankPool
from megatron_zeco import Layout, packed_positions, zeco_gated_delta_rule
from megatron_zeco.comm import Route, all_scan, gather_scan
from reference import delta_problem, reference, rel_err
from test_packed import SPLITS, _documents

TOL = 1e-10
K, V, B = 8, 8, 2
NAMES = ("q", "k", "v", "g", "beta")


@pytest.fixture(scope="module")
def pool():
    with RankPool(8, pg_timeout=120) as p:
        yield p


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
        bad = {k: f"{e:.1e}" for k, e in errors.items() if not e < TOL}
        if bad:
            failures.append(f"{strategy} {layout.value} blocks={nb} gate={gate} h0={with_h0} ht={with_ht} "
                            f"transport={transport}: {bad}")
    return failures


def _assert_none(results):
    assert not any(results), "\n".join(f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_strategy_matches_whole_sequence(pool, seed, world):
    # 26 tokens per rank: zigzag pieces of 13, contiguous pieces of 26; chunks are 16
    _assert_none(pool.run(_check, world, seed, 26))


def test_eight_ranks(pool, seed):
    cases = [("zeco", layout, 2, gate, True, True) for layout in Layout for gate in ("tiny", "mixed")]
    cases += [("lasp2", Layout.ZIGZAG, 1, "tiny", True, True), ("a2a", Layout.CONTIGUOUS, 1, "normal", True, True)]
    _assert_none(pool.run(_check, 8, seed, 10, cases))


@pytest.mark.parametrize("world", [2, 3])
def test_peer_memory_transport_matches_whole_sequence(pool, seed, world):
    """zeco with its All-Scan through peer memory (the dense hop kernel, interpreted): both layouts, one
    and two blocks of columns, strong and mixed decays, initial and final state, every gradient."""
    cases = [("zeco", layout, nb, gate, True, True, "peer_memory")
             for layout in Layout for nb, gate in ((1, "mixed"), (2, "strong"))]
    _assert_none(pool.run(_check, world, seed, 26, cases + [("zeco", Layout.ZIGZAG, 1, "tiny", False, False,
                                                              "peer_memory")]))


def _check_packed(group, seed, local_len):
    world = 1 if group is None else group.size()
    rank = 0 if group is None else group.rank()
    heads = world if world > 2 else 2
    failures = []
    for n_split, (layout, per_document) in enumerate(SPLITS):
        for n_case, lengths in enumerate(_documents(seed + n_split, world, local_len, per_document)):
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            x = delta_problem(seed + 100 * n_split + n_case, 1, world * local_len, heads, K, V,
                              gate="mixed" if n_case == 1 else "normal", initial_state=False)
            parts = {name: [] for name in ("o", "dq", "dk", "dv", "dg", "dbeta")}
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):  # every document alone
                alone = reference({**{m: x[m][:, a:b] for m in (*NAMES, "do")}, "h0": None}, output_final_state=False)
                for name in parts:
                    parts[name].append(alone[name])
            ref = {name: torch.cat(p, dim=1) for name, p in parts.items()}
            mine = packed_positions(cu, layout, world, rank, per_document)
            for strategy in ("zeco", "lasp2", "a2a") if world > 1 else ("none",):
                local = {m: x[m][:, mine].requires_grad_() for m in NAMES}
                o, _ = zeco_gated_delta_rule(*local.values(), group=group, strategy=strategy, layout=layout,
                                             num_blocks=2 if strategy == "zeco" else 1, cu_seqlens=cu,
                                             per_document=per_document, validate=strategy != "lasp2")
                grads = torch.autograd.grad((o * x["do"][:, mine]).sum(), list(local.values()))
                errors = {"o": rel_err(o, ref["o"][:, mine])}
                errors.update({"d" + m: rel_err(d, ref["d" + m][:, mine]) for m, d in zip(NAMES, grads)})
                bad = {k: f"{e:.1e}" for k, e in errors.items() if not e < TOL}
                if bad:
                    failures.append(f"{strategy} {layout} per_document={per_document} lengths={lengths}: {bad}")
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_packed_documents_match_each_document_alone(pool, seed, world):
    _assert_none(pool.run(_check_packed, world, seed, 16))


def _fold(Ms, deltas, init, order):
    """Entering state of each piece when walking ``order``, and the state leaving the walk."""
    x, entering = (torch.zeros_like(deltas[0]) if init is None else init), {}
    for p in order:
        entering[p] = x
        x = (Ms[p] @ x if Ms[p].dim() == x.dim() else Ms[p].unsqueeze(-1) * x) + deltas[p]
    return entering, x


def _dense_scans(group, seed):
    """all_scan (the chain in blocks of columns over messages and over peer memory, and the
    hierarchical shape over nodes of two ranks) and gather_scan with dense transitions, against a
    sequential fold (the hierarchical shape also with GLA's diagonal ones). Peer memory also in
    float32 with 32 x 32 states, where the hop kernel multiplies through tl.dot."""
    P, me = group.size(), group.rank()
    failures = []
    impls = ("chain", "chain peer_memory", "hierarchical", "gather", "hierarchical diagonal", "chain peer_memory dot")
    for n, (layout, blocks, reverse, with_init, impl) in enumerate(
            itertools.product(Layout, (1, 3), (False, True), (False, True), impls)):
        if (not impl.startswith("chain") or impl.endswith("dot")) and blocks > 1:
            continue
        gen = torch.Generator().manual_seed(seed + n)
        pieces = layout.num_pieces(P)
        k, v = (32, 32) if impl.endswith("dot") else (4, 6)
        shape = (2, 3, k) if impl.endswith("diagonal") else (2, 3, k, k)
        Ms = [torch.randn(*shape, generator=gen, dtype=torch.float64) / (2 * k ** 0.5) for _ in range(pieces)]
        deltas = [torch.randn(2, 3, k, v, generator=gen, dtype=torch.float64) for _ in range(pieces)]
        init = torch.randn(2, 3, k, v, generator=gen, dtype=torch.float64) if with_init else None
        mine = layout.pieces(me, P)
        dtype, tol = (torch.float32, 1e-5) if impl.endswith("dot") else (torch.float64, 1e-12)
        my_Ms, my_deltas = [Ms[p].to(dtype) for p in mine], [deltas[p].to(dtype) for p in mine]
        kw = dict(reverse=reverse)
        if impl == "gather":
            entering, last = gather_scan(my_Ms, my_deltas, init, Route(layout, group), **kw)
        else:
            transport = "peer_memory" if "peer_memory" in impl else "send_recv"
            if n % 2 and transport == "peer_memory":  # as ScanOp calls it: slots are strided views of one batch
                my_Ms, my_deltas = (torch.stack(xs, dim=1).unbind(1) for xs in (my_Ms, my_deltas))
                kw["out"] = torch.full((2, len(mine), 3, k, v), float("nan"), dtype=dtype).unbind(1)
            route = Route(layout, group, blocks, transport, 2, impl.split()[0])
            entering, last = all_scan(my_Ms, my_deltas, None if init is None else init.to(dtype), route, **kw)
            if "out" in kw and not all(e is o for e, o in zip(entering, kw["out"])):
                failures.append(f"{impl}: the result is not out")
        order = range(pieces - 1, -1, -1) if reverse else range(pieces)
        want, want_last = _fold(Ms, deltas, init, order)
        ok = all(rel_err(entering[s], want[p]) < tol for s, p in enumerate(mine))
        ends_here = layout.owner(order[-1], P)[0] == me
        ok &= (last is not None) == ends_here and (last is None or rel_err(last, want_last) < tol)
        if not ok:
            failures.append(f"{impl} {layout.value} blocks={blocks} reverse={reverse} init={with_init}")
    return failures


@pytest.mark.parametrize("world", [3, 4])
def test_dense_scans_match_sequential_fold(pool, seed, world):
    _assert_none(pool.run(_dense_scans, world, seed))


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
    the same values all in float32: the same outputs (rounded to bfloat16) and gradients, dg in float32."""
    world, rank = group.size(), group.rank()
    x = delta_problem(seed, 1, world * 8, 2, K, V, initial_state=False)
    errors = {}
    for strategy, layout in (("zeco", Layout.ZIGZAG), ("lasp2", Layout.CONTIGUOUS), ("a2a", Layout.ZIGZAG)):
        runs = []
        for low in (torch.bfloat16, torch.float32):
            # the same values (bfloat16's) either way; g float32 in both runs
            local = {n: layout.shard(x[n], rank, world).to(torch.float32 if n == "g" else torch.bfloat16)
                     .to(torch.float32 if n == "g" else low).requires_grad_() for n in NAMES}
            o, _ = zeco_gated_delta_rule(*local.values(), group=group, strategy=strategy, layout=layout)
            grads = torch.autograd.grad((o.float() * layout.shard(x["do"], rank, world).float()).sum(),
                                        list(local.values()))
            runs.append((o, grads))
        (o_mixed, g_mixed), (o_fp32, g_fp32) = runs
        if g_mixed[3].dtype != torch.float32 or o_mixed.dtype != torch.bfloat16:
            errors[strategy] = f"dtypes o {o_mixed.dtype}, dg {g_mixed[3].dtype}"
            continue
        errors[strategy] = max([rel_err(o_mixed, o_fp32.to(torch.bfloat16))] +
                               [rel_err(a, b.to(a.dtype)) for a, b in zip(g_mixed, g_fp32)])
    return errors


def test_float32_log_decays_beside_bfloat16_inputs(pool, seed):
    for rank, errors in enumerate(pool.run(_mixed_dtypes, 2, seed)):
        for strategy, err in errors.items():
            assert isinstance(err, float) and err < 1e-2, f"rank {rank} {strategy}: {err}"
