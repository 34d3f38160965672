"""The hierarchical All-Scan (comm/hierarchical.py) on real gloo process groups, and how it is chosen.

Nodes are forced (``node_size``, ``$MEGATRON_ZECO_NODE_SIZE``, the layer's ``cp_node_size``): the
CPU has one host. Every case is checked in float64 against a sequential fold (scan level) or the
token-by-token loop (``zeco_gla``: outputs, final states and every gradient, packed input under
both splits), to 1e-10. The module's pool of up to 16 gloo processes serves every group size.
"""

import contextlib
import importlib
import itertools
import math
import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_zeco import Layout, packed_positions, zeco_gla
from megatron_zeco import cost_model as cm
from megatron_zeco.comm import Route, all_scan
from megatron_zeco.comm.all_scan import SHAPE_ENV, scan_shape
from megatron_zeco.comm.nodes import NODE_SIZE_ENV
from tests.helpers.checks import above, assert_no_failures
from tests.helpers.distributed import run_ranks
from tests.helpers.marks import slow, slow_except
from tests.helpers.megatron import host_as_cuda, transformer_config
from tests.helpers.reference import fold, packed_reference, problem, reference, rel_err

all_scan_module = importlib.import_module("megatron_zeco.comm.all_scan")

TOL = 1e-10
WORLD = 16
# group size -> node sizes: one rank per node (pure log-depth scan), nodes of 2 and 4, odd nodes and
# odd groups (a last node short of ranks), and the whole group on one node (the chain of prefix maps)
SCAN_NODE_SIZES = {2: (1, 2), 3: (1, 2), 4: (1, 2, 4), 5: (2, 3, 5), 7: (2, 3), 8: (1, 2, 4, 8), 16: (1, 2, 4)}
OP_NODE_SIZES = {2: (1,), 3: (1, 2), 4: (1, 2, 4), 8: (2, 4)}
RANK_POOL = dict(world=WORLD, timeout=float(os.environ.get("ZECO_TEST_TIMEOUT", 600)), pg_timeout=120)


@contextlib.contextmanager
def _env(**values):
    """Set (or, with None, unset) environment variables inside the block."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _counting_hierarchical():
    """Count the calls all_scan makes to the hierarchical scan in this process."""
    calls = []
    real = all_scan_module.hierarchical_scan

    def counted(*args, **kwargs):
        calls.append(kwargs["nodes"])
        return real(*args, **kwargs)

    all_scan_module.hierarchical_scan = counted
    try:
        yield calls
    finally:
        all_scan_module.hierarchical_scan = real


def _decays(shape, gen):
    """Decays in [0, 1] with exact zeros (document resets) and ones (no decay) among them."""
    g = torch.rand(shape, generator=gen, dtype=torch.float64)
    pick = torch.rand(shape, generator=gen)
    return torch.where(pick < 0.15, 0.0, torch.where(pick > 0.85, 1.0, g))


def _scan_cases(group, seed, node_sizes):
    """Every layout, node size, direction, initial state, block count and form of ``out`` / ``delta``
    at this group size: the hierarchical scan against the fold. Returns the failures."""
    P, me = group.size(), group.rank()
    failures = []
    cases = itertools.product(Layout, node_sizes, (False, True), (False, True), (1, 2))
    with _counting_hierarchical() as calls:
        for n, (layout, node_size, reverse, with_init, blocks) in enumerate(cases):
            gen = torch.Generator().manual_seed(seed + 7919 * P + n)
            pieces = layout.num_pieces(P)
            gammas = [_decays((2, 4), gen) for _ in range(pieces)]
            deltas = [torch.randn(2, 4, 3, generator=gen, dtype=torch.float64) for _ in range(pieces)]
            init = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64) if with_init else None
            mine = layout.pieces(me, P)
            my_gammas, my_deltas = [gammas[p] for p in mine], [deltas[p] for p in mine]
            route = Route(layout, group, blocks, "send_recv", node_size, "hierarchical")
            kwargs = dict(reverse=reverse)
            form = n % 3
            if form == 1:  # as ScanGLA calls it: slots are strided views of one batch, written in place
                my_gammas, my_deltas = (torch.stack(xs, dim=1).unbind(1) for xs in (my_gammas, my_deltas))
                kwargs["out"] = torch.full((2, len(mine), 4, 3), float("nan"), dtype=torch.float64).unbind(1)
            elif form == 2:  # dense but not contiguous (value-major) deltas
                my_deltas = [d.transpose(-1, -2).contiguous().transpose(-1, -2) for d in my_deltas]
            entering, last = all_scan(my_gammas, my_deltas, init, route, **kwargs)
            order = range(pieces - 1, -1, -1) if reverse else range(pieces)
            want, want_last = fold(gammas, deltas, init, order)
            errors = [rel_err(entering[s], want[p]) for s, p in enumerate(mine)]
            ends_here = layout.owner(order[-1], P)[0] == me
            if (last is not None) != ends_here:
                errors.append(float("inf"))
            elif last is not None:
                errors.append(rel_err(last, want_last))
            if "out" in kwargs and not all(e is o for e, o in zip(entering, kwargs["out"])):
                errors.append(float("inf"))
            if not max(errors) < TOL:
                failures.append(f"P={P} {layout.value} node_size={node_size} reverse={reverse} init={with_init} "
                                f"blocks={blocks} form={form}: errors {errors}")
        expected_nodes = [tuple(r // ns for r in range(P)) for _, ns, *_ in
                          itertools.product(Layout, node_sizes, (False, True), (False, True), (1, 2))]
        if calls != expected_nodes:
            failures.append(f"P={P}: the hierarchical scan ran with nodes {calls}, expected {expected_nodes}")
    return failures


@pytest.mark.parametrize("P", slow_except(list(SCAN_NODE_SIZES), 3))
def test_hierarchical_scan_matches_sequential_fold(pool, seed, P):
    assert_no_failures(pool.run(_scan_cases, P, seed, SCAN_NODE_SIZES[P]))


# ---------------------------------------------------------------------------------------------- zeco_gla

K, V = 4, 3


def _op_cases(group, seed, node_sizes, local_len):
    """zeco_gla with the hierarchical scan (forced by $MEGATRON_ZECO_SCAN_SHAPE; nodes from the
    argument or from $MEGATRON_ZECO_NODE_SIZE) against the float64 loop: dense input with initial
    and final states over both layouts and several block counts, and packed input under both splits."""
    P, me = group.size(), group.rank()
    failures = []
    with _env(**{SHAPE_ENV: "hierarchical", NODE_SIZE_ENV: None}), _counting_hierarchical() as calls:
        expected_calls = 0
        for n, (layout, node_size) in enumerate(itertools.product(Layout, node_sizes)):
            via_env = n % 2 == 1  # the node size from the environment instead of the argument
            for with_h0, with_ht, blocks in ((True, True, 2), (False, True, 1), (True, False, 4)):
                case_seed = seed + 1000 * n + 10 * with_h0 + with_ht
                x = problem(case_seed, 2, P * local_len, 2, K, V, "mixed" if blocks == 4 else "normal", with_h0)
                ref = reference(x, output_final_state=with_ht)
                local = {name: layout.shard(x[name], me, P).requires_grad_() for name in "qkvg"}
                h0 = x["h0"].clone().requires_grad_() if with_h0 else None
                with _env(**{NODE_SIZE_ENV: node_size if via_env else None}):
                    o, ht = zeco_gla(*local.values(), group=group, layout=layout, num_blocks=blocks,
                                     initial_state=h0, output_final_state=with_ht, transport="send_recv",
                                     node_size=None if via_env else node_size)
                expected_calls += 2
                loss = (o * layout.shard(x["do"], me, P)).sum()
                if with_ht:  # the final state's loss term counted once (on rank 0)
                    loss = loss + (me == 0) * (ht * x["dht"]).sum()
                leaves = list(local.values()) + ([h0] if with_h0 else [])
                grads = dict(zip(["q", "k", "v", "g", "h0"], torch.autograd.grad(loss, leaves)))
                if with_h0:
                    dist.all_reduce(grads["h0"], group=group)
                errors = {"o": rel_err(o, layout.shard(ref["o"], me, P))}
                if with_ht:
                    errors["ht"] = rel_err(ht, ref["ht"])
                for name, grad in grads.items():
                    full = ref["d" + name]
                    errors["d" + name] = rel_err(grad, full if name == "h0" else layout.shard(full, me, P))
                bad = above(errors, TOL)
                if bad:
                    failures.append(f"P={P} {layout.value} node_size={node_size} (env: {via_env}) blocks={blocks} "
                                    f"h0={with_h0} ht={with_ht}: {bad}")
            # packed input, both splits: every document alone through the loop
            for per_document in (False, True):
                unit = 2 * P if per_document else 1
                lengths = [3 * unit, 1 * unit, P * local_len - 4 * unit]
                cu = torch.tensor([0, 3 * unit, 4 * unit, P * local_len], dtype=torch.int32)
                x = problem(seed + 5000 + n, 1, P * local_len, 2, K, V, "normal", initial_state=False)
                want = packed_reference(x, cu)
                mine = packed_positions(cu, layout, P, me, per_document)
                local = {m: x[m][:, mine].requires_grad_() for m in "qkvg"}
                o, _ = zeco_gla(*local.values(), group=group, layout=layout, num_blocks=2, cu_seqlens=cu,
                                per_document=per_document, transport="send_recv", node_size=node_size)
                expected_calls += 2
                grads = torch.autograd.grad((o * x["do"][:, mine]).sum(), list(local.values()))
                errors = {"o": rel_err(o, want["o"][:, mine])}
                errors.update({"d" + m: rel_err(d, want["d" + m][:, mine]) for m, d in zip(local, grads)})
                bad = above(errors, TOL)
                if bad:
                    failures.append(f"P={P} {layout.value} node_size={node_size} packed per_document={per_document} "
                                    f"lengths={lengths}: {bad}")
        if len(calls) != expected_calls:
            failures.append(f"P={P}: the hierarchical scan ran {len(calls)} times, expected {expected_calls}")
    return failures


@pytest.mark.parametrize("P", slow_except(list(OP_NODE_SIZES), 3))
def test_zeco_gla_over_the_hierarchical_scan_matches_the_loop(pool, seed, P):
    # 16 tokens per rank: zigzag pieces of 8; per-document pieces from 1 token up
    assert_no_failures(pool.run(_op_cases, P, seed, OP_NODE_SIZES[P], 16))


# ---------------------------------------------------------------------------------------------- shape choice

def _shape_choices(group):
    """What scan_shape picks, and what all_scan runs, for several nodes, the environment and bad values."""
    P = group.size()
    like = torch.zeros(1, 2, 4, 3, dtype=torch.float64)
    out = {}
    for layout in Layout:
        for node_size in (1, 2, P):
            out[layout.value, node_size, "auto"] = scan_shape(Route(layout, group, node_size=node_size), like)
        with _env(**{SHAPE_ENV: "chain"}):
            out[layout.value, 2, "env chain"] = scan_shape(Route(layout, group, node_size=2), like)
            forced = Route(layout, group, node_size=2, shape="hierarchical")
            out[layout.value, 2, "forced over env"] = scan_shape(forced, like)
        with _env(**{SHAPE_ENV: "hierarchical"}):
            out[layout.value, P, "env hierarchical"] = scan_shape(Route(layout, group, node_size=P), like)
        with _env(**{NODE_SIZE_ENV: 2}):
            out[layout.value, "env 2", "auto"] = scan_shape(Route(layout, group), like)
    # the device transports run it too (comm/peer_hierarchical.py)
    out["hierarchical over peer memory"] = scan_shape(Route(Layout.CONTIGUOUS, group, 1, "peer_memory", 2,
                                                            "hierarchical"), like)
    # what all_scan runs under auto (the scan itself is checked above)
    gamma, delta = [torch.rand(1, 2, 4, dtype=torch.float64)], [torch.randn(1, 2, 4, 3, dtype=torch.float64)]
    with _counting_hierarchical() as calls:
        all_scan(gamma, delta, None, Route(Layout.CONTIGUOUS, group, node_size=2))
        out["ran"] = len(calls)
    errors = {}
    for name, call in {
        "bad shape": lambda: scan_shape(Route(Layout.CONTIGUOUS, group, node_size=2, shape="tree"), like),
        "bad env shape": lambda: _with_env_shape("ring", group, like),
        "bad node size": lambda: all_scan(gamma, delta, None, Route(Layout.CONTIGUOUS, group, node_size=0,
                                                                    shape="hierarchical")),
        "bad env node size": lambda: _with_env_node_size("two", group, gamma, delta),
        "bad zeco_gla node size": lambda: zeco_gla(*(torch.zeros(1, 4, 2, 4) for _ in range(4)), group=group,
                                                    node_size=-1),
    }.items():
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    return out, errors


def _with_env_shape(value, group, like):
    with _env(**{SHAPE_ENV: value}):
        return scan_shape(Route(Layout.CONTIGUOUS, group, node_size=2), like)


def _with_env_node_size(value, group, gamma, delta):
    with _env(**{NODE_SIZE_ENV: value}):
        return all_scan(gamma, delta, None, Route(Layout.CONTIGUOUS, group, shape="hierarchical"))


@slow
@pytest.mark.parametrize("P", [4, 16])
def test_shape_is_chosen_by_the_cost_model_the_environment_or_the_caller(pool, P):
    results = pool.run(_shape_choices, P)
    out, errors = results[0]
    assert all(r == results[0] for r in results), "ranks disagree"
    state_bytes = 2 * 4 * 3 * 8
    for layout in ("contiguous", "zigzag"):
        for node_size in (1, 2, P):  # auto: what the cost model finds faster for these nodes
            nodes = tuple(r // node_size for r in range(P))
            assert out[layout, node_size, "auto"] == cm.scan_choice(layout, nodes, state_bytes, "send_recv")
        assert out[layout, P, "auto"] == "chain"  # one node
        assert out[layout, "env 2", "auto"] == out[layout, 2, "auto"]
        assert out[layout, 2, "env chain"] == "chain" and out[layout, 2, "forced over env"] == "hierarchical"
        assert out[layout, P, "env hierarchical"] == "hierarchical"
    # 16 ranks on 8 nodes: 15 hops between nodes along the chain, ~3 + 2 in the hierarchical scan;
    # 4 ranks on 2 nodes, contiguous: one hop between nodes either way, the chain has fewer steps
    assert out["contiguous", 2, "auto"] == ("hierarchical" if P == 16 else "chain")
    assert out["ran"] == (1 if P == 16 else 0)
    assert "unknown All-Scan shape 'tree'" in errors["bad shape"] and "shape" in errors["bad shape"]
    assert "unknown All-Scan shape 'ring'" in errors["bad env shape"] and SHAPE_ENV in errors["bad env shape"]
    assert out["hierarchical over peer memory"] == "hierarchical"
    assert "node_size must be a positive integer" in errors["bad node size"]
    assert NODE_SIZE_ENV in errors["bad env node size"]
    assert "cp_node_size -1 must be a positive integer" in errors["bad zeco_gla node size"]


# ---------------------------------------------------------------------------------------------- the layer

def _layer_grads(rank, world, seed, node_size, shape):
    """The GLA mixer of gla_layer_spec(cp_node_size=node_size) at CP = world under Megatron's zigzag
    split: its output, input gradient and parameter gradients (summed over CP), and its plan."""
    from megatron.core import parallel_state
    from megatron.core.transformer.spec_utils import build_module

    from megatron_zeco.specs import gla_layer_spec

    os.environ[SHAPE_ENV] = shape
    with host_as_cuda(), _counting_hierarchical() as calls:
        parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world)
        torch.manual_seed(0)
        config = transformer_config(context_parallel_size=world)
        spec = gla_layer_spec(cp_node_size=node_size, cp_transport="send_recv")
        layer = build_module(spec.submodules.self_attention, config=config, layer_number=1).double()
        gen = torch.Generator().manual_seed(seed)
        x, dy = (torch.randn(32, 2, 32, generator=gen, dtype=torch.float64) for _ in range(2))
        cp_rank = parallel_state.get_context_parallel_rank()
        x_local = Layout.ZIGZAG.shard(x, cp_rank, world, dim=0).requires_grad_()
        y, _ = layer(x_local)
        (y * Layout.ZIGZAG.shard(dy, cp_rank, world, dim=0)).sum().backward()
        grads = {}
        for name, p in layer.named_parameters():
            g = p.grad.clone()
            if world > 1:
                dist.all_reduce(g, group=parallel_state.get_context_parallel_group())
            grads[name] = g
        plan = layer.cp.plan
        return (Layout.ZIGZAG.shard(torch.arange(32), cp_rank, world, dim=0), y.detach(), x_local.grad, grads,
                plan.node_size, len(calls))


@slow
def test_layer_cp_node_size_reaches_the_hierarchical_scan(seed):
    """gla_layer_spec(cp_node_size=2) at CP = 4: the plan carries it, the scan runs hierarchical (forced
    by the environment) over nodes of 2, and output and gradients equal those at CP = 1."""
    (_, y_ref, dx_ref, grads_ref, _, _), = run_ranks(_layer_grads, 1, seed, None, "chain")
    for rank, (positions, y, dx, grads, node_size, calls) in enumerate(
            run_ranks(_layer_grads, 4, seed, 2, "hierarchical")):
        assert node_size == 2 and calls == 2, (rank, node_size, calls)
        assert rel_err(y, y_ref[positions]) < TOL, f"rank {rank}: output"
        assert rel_err(dx, dx_ref[positions]) < TOL, f"rank {rank}: input grad"
        for name, g in grads.items():
            assert rel_err(g, grads_ref[name]) < TOL, f"rank {rank}: grad of {name}"


@slow
def test_layer_refuses_a_bad_cp_node_size():
    from megatron_zeco.cp import CPConfig

    for bad in (0, -2, 1.5, True, "8"):
        with pytest.raises(ValueError, match=f"cp_node_size {bad!r} must be a positive integer"):
            CPConfig(node_size=bad)


@slow
def test_specs_pass_cp_node_size_to_the_layer():
    from megatron_zeco.specs import gla_layer_spec, hybrid_layer_spec

    assert gla_layer_spec(cp_node_size=8).submodules.self_attention.params["cp_config"].node_size == 8
    assert gla_layer_spec().submodules.self_attention.params["cp_config"].node_size is None
    hybrid = hybrid_layer_spec(cp_node_size=4)
    assert hybrid.submodules.gla.self_attention.params["cp_config"].node_size == 4


# ---------------------------------------------------------------------------------------------- latency

ALPHA = 0.02  # s per message between emulated nodes


def _latency_runs(group, seed, cases):
    """Forward and backward scans under inject.link_latency: per case, whether the result is exact,
    the wall time from the first rank's start to the last rank's end, and this rank's record of
    messages. (Pool groups are the first ranks: group ranks are global ranks.)"""
    from megatron_zeco.comm import inject

    P, me = group.size(), group.rank()
    out = []
    for n, (layout, node_size, shape, blocks) in enumerate(cases):
        layout = Layout(layout)
        gen = torch.Generator().manual_seed(seed + n)
        pieces = layout.num_pieces(P)
        gammas = [_decays((1, 2, 4), gen) for _ in range(pieces)]
        deltas = [torch.randn(1, 2, 4, 3, generator=gen, dtype=torch.float64) for _ in range(pieces)]
        mine = layout.pieces(me, P)
        route = Route(layout, group, blocks, "send_recv", node_size, shape)
        for reverse in (False, True):  # each direction from a barrier, as the model times them apart
            dist.barrier(group=group)
            with inject.link_latency(ALPHA, node_size) as events:
                start = time.monotonic()
                got, _ = all_scan([gammas[p] for p in mine], [deltas[p] for p in mine], None, route, reverse=reverse)
                end = time.monotonic()
            want, _ = fold(gammas, deltas, None, range(pieces - 1, -1, -1) if reverse else range(pieces))
            exact = all(rel_err(got[s], want[p]) < TOL for s, p in enumerate(mine))
            out.append((exact, start, end, list(events)))
    return out


LATENCY_CASES = {  # group size -> (layout, node size, shape, blocks)
    5: [("contiguous", 2, "chain", 1), ("zigzag", 2, "hierarchical", 1), ("zigzag", 2, "chain", 2)],
    16: [(layout, ns, shape, 1) for layout in ("contiguous", "zigzag") for ns in (1, 4)
         for shape in ("chain", "hierarchical")],
}


@slow
@pytest.mark.parametrize("P", list(LATENCY_CASES))
def test_latency_emulation_counts_the_hops_the_cost_model_counts(pool, seed, P):
    """With a latency between emulated nodes, every scan stays exact; the chain of messages each scan
    waits for (counted from the records, forward + backward) is the one the cost model times: the
    chain's hops (``cost_model.chain_hops``) and the hierarchical scan's schedule
    (``cost_model.hierarchical_steps``) with the same weights; the chain's hops between nodes grow
    like P / node size, the hierarchical scan's like log2 of the nodes. The wall time is at least
    the latency times the hops between nodes on that path (a lower bound: no timing can make this
    flake). Times themselves are compared in benchmarks/emulate_latency.py."""
    from megatron_zeco.comm import inject

    cases = LATENCY_CASES[P]
    results = pool.run(_latency_runs, P, seed, cases)
    inter_of = {}
    for n, (layout, node_size, shape, blocks) in enumerate(cases):
        node = lambda r: r // node_size  # noqa: E731
        weights = {"inter": lambda a, b: float(node(a) != node(b)), "all": lambda a, b: 1.0,
                   "mixed": lambda a, b: 1.0 if node(a) != node(b) else 1e-3}
        nodes_crossed = (P + node_size - 1) // node_size - 1  # a walk up the ranks crosses this many
        for reverse in (False, True):
            runs = [rank[2 * n + reverse] for rank in results]
            assert all(exact for exact, *_ in runs), (layout, node_size, shape, reverse)
            recorded = {k: inject.longest_message_chain([events for *_, events in runs], w) for k, w in weights.items()}
            if shape == "chain":  # (the blocks follow one another: the path counts each hop once)
                intra, inter, _ = cm.chain_hops(P, layout, node_size)
                model = {"inter": inter, "all": intra + inter, "mixed": inter + 1e-3 * intra}
                assert inter == (1 if layout == "contiguous" else 2) * nodes_crossed
            else:
                steps = cm.hierarchical_steps(P, layout, node_size, reverse)
                model = {k: cm.critical_path(steps, P, lambda a, b, what, phase, w=w: w(a, b))
                         for k, w in weights.items()}
                walk = cm.walk_ranks(P, layout)
                runs_ = 1 + sum(a // node_size != b // node_size for a, b in zip(walk, walk[1:]))  # segments
                assert recorded["inter"] <= (math.ceil(math.log2(runs_ - 1)) if runs_ > 2 else 0) + 1
            assert recorded == pytest.approx(model, rel=1e-12), (layout, node_size, shape, reverse, recorded, model)
            start, end = min(s for _, s, _, _ in runs), max(e for _, _, e, _ in runs)
            assert end - start >= ALPHA * recorded["inter"] * (1 - 1e-6), (layout, node_size, shape, end - start)
            inter_of[layout, node_size, shape, reverse] = recorded["inter"]
    if P == 16:  # the scaling shape: between nodes the chain waits for ~P hops, the hierarchical scan ~log P
        for reverse in (False, True):
            assert inter_of["contiguous", 1, "chain", reverse] == 15
            assert inter_of["contiguous", 1, "hierarchical", reverse] <= 5
            assert inter_of["zigzag", 4, "chain", reverse] == 6 and inter_of["zigzag", 4, "hierarchical", reverse] <= 3
