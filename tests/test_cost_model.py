"""Cost model (megatron_zeco/cost_model.py): calibration against the measured points, the formulas, the
scan shapes as built (hop counts and schedules against comm/), and the command line. No timing."""

import ast
import collections
import contextlib
import dataclasses
import functools
import io
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_zeco import cost_model as cm

FREE = cm.Software(message=0.0, scan_call=0.0, gather_call=0.0, fold_launch=0.0, state_pass=0.0,
                   state_grad_pass=0.0, a2a_copy=0.0)


def workload(P, layout="contiguous", **kw):
    return cm.Workload(**{**dict(P=P, tokens=16384, heads=16, k_dim=128, v_dim=128, op_ms=4.0, layout=layout), **kw})


def test_measured_points_within_15_percent():
    """Every measured operator (and model-level) point that is not an input is reproduced within 15%."""
    cal = cm.calibrate(cm.default_rows())
    checked = [r for r in cal.residuals if r.what.startswith(("op ", "model ")) and not r.fitted]
    assert sum("CP=2" in r.what for r in checked) >= 6, [r.what for r in checked]  # zeco/lasp1/lasp2 x 2 layouts
    assert sum("CP=4" in r.what for r in checked) >= 6, [r.what for r in checked]
    bad = {r.what: f"{r.rel:+.1%}" for r in checked if abs(r.rel) > 0.15}
    assert set(bad) == set(KNOWN_MISSES), bad  # a known miss that is fixed must leave the list too


# Points the model misses by more than 15%, and why (docs/scaling.md). None at present; the
# closest are eager ops at 16K (the model has no host term, and there an op timed from an empty
# queue is host-bound: lasp2 CP=2 at 16K measured 4.6 to 6.2 ms over four runs).
KNOWN_MISSES: dict = {}


def test_state_passing_micro_benchmarks_fit_within_bounds():
    """The scan micro-benchmarks (noisy, not monotone in size: one run's 2 MiB points are twice its
    1 and 4 MiB ones, another's 4 MiB one-hop point, 78 µs, half its 1 MiB one) are fitted by few
    parameters: typical misfit <= 25%, none beyond 60% from an empty queue; their GPU times (a hop
    of 10-60 µs, timed after a sleep) within 80%."""
    cal = cm.calibrate(cm.default_rows())
    rel = sorted(abs(r.rel) for r in cal.residuals)
    assert rel[len(rel) // 2] <= 0.25, rel
    bad = [f"{r.what}: {r.rel:+.1%}" for r in cal.residuals if abs(r.rel) > (0.80 if "GPU)" in r.what else 0.60)]
    assert not bad, bad
    sw = cal.software
    assert min(sw.scan_call, sw.gather_call, cal.nccl_call, sw.a2a_copy) > 0 and sw.message >= 0, sw
    measured = [b for b, sw in cal.builds.items() if sw.pass_unit]  # the builds with passes beyond the op
    assert len(measured) >= 2 and all(min(cal.builds[b].state_pass, cal.builds[b].state_grad_pass) > 0
                                      for b in measured), cal.builds
    for transport in ("send_recv", "peer_memory"):  # a device hop was measured for both
        steady = cal.sw(transport, "steady")
        assert steady.hop > 0 and steady.scan_call == 0, steady
        assert cal.sw(transport, "eager").hop == steady.hop  # a host-issued call's hops are the device's


def test_calibration_recovers_known_costs_from_json(tmp_path, seed):
    """Rows made by the model from random costs, written as JSON files: calibrate() finds those costs again."""
    rng = random.Random(seed)
    cluster = cm.Cluster()
    # per-block issue above the hop time (hop + wire), as measured: the form calibrate() fits
    true = dataclasses.replace(FREE, message=rng.uniform(4e-5, 2e-4), hop=rng.uniform(1e-6, 1e-5),
                               scan_call=rng.uniform(0, 3e-4), a2a_wire=rng.uniform(0.5, 3),
                               gather_call=rng.uniform(0, 3e-4), fold_launch=cm.FOLD_LAUNCH["eager"],
                               state_pass=rng.uniform(1e-12, 1e-11), state_grad_pass=rng.uniform(1e-12, 1e-11),
                               a2a_copy=rng.uniform(1e-12, 1e-11), pass_unit="chunk_state_bytes")
    build = "fla piece"  # a build with passes beyond the local op, as its files' meta says
    passes = {"forward": "add_state h", "backward": "add_state dh", "per_byte_of": true.pass_unit}
    meta = {"build": build, "transport": "send_recv", "scan_code": {"send_recv": "v1"}, "passes": passes}
    nccl_call, op_ms, other_ms, T, H, D = rng.uniform(1e-5, 1e-4), rng.uniform(1, 10), rng.uniform(1, 20), 8192, 8, 64
    w = cm.Workload(P=1, tokens=T, heads=H, k_dim=D, v_dim=D, op_ms=op_ms)
    ops = [dict(part="op", tokens_per_gpu=T, heads=H, dim=D, strategy="none", cp=1, layout="contiguous", ms=op_ms)]
    ops += [dict(part="op", tokens_per_gpu=T, heads=H, dim=D, strategy=s, cp=P, layout=lay,
                 ms=cm.layer_time(s, dataclasses.replace(w, P=P, layout=lay), cluster, true) * 1e3)
            for s in ("zeco", "lasp1", "lasp2", "a2a") for P in (2, 4) for lay in ("contiguous", "zigzag")]
    ops += [dict(part="kernel", tokens_per_gpu=T, name=passes[d], ms=getattr(w, true.pass_unit) * per_byte * 1e3)
            for d, per_byte in (("forward", true.state_pass), ("backward", true.state_grad_pass))]
    scans = []
    for mib, P in ((0.25, 2), (1.0, 2), (4.0, 2), (1.0, 4)):  # hops and blocks apart: two P
        s = cm.Workload(P=P, tokens=0, heads=round(mib * 16), k_dim=128, v_dim=128, op_ms=0.0)
        scans += [dict(part="scan", state_mib=mib, cp=P, method=f"all_scan K={K}",
                       ms=cm.chain_time(s, cluster, true, K) * 1e3) for K in (1, 2, 8)]
    for mib in (0.25, 1.0, 4.0):
        s = cm.Workload(P=2, tokens=0, heads=round(mib * 16), k_dim=128, v_dim=128, op_ms=0.0)
        scans += [dict(part="scan", state_mib=mib, cp=2, method="gather_scan",
                       ms=sum(cm.gather_time(s, cluster, true)) * 1e3),
                  dict(part="scan", state_mib=mib, cp=2, method="nccl all_gather",
                       ms=(nccl_call + cluster.intra.time(mib * 2 ** 20)) * 1e3)]
    layers, zeco2 = 4, cm.layer_time("zeco", dataclasses.replace(w, P=2, layout="zigzag"), cluster, true) * 1e3
    models = [dict(part="model", tokens_per_gpu=T, heads=H, dim=D, layers=layers, strategy="zeco", cp=P,
                   layout="zigzag", tokens_per_s_per_gpu=T / (layers * (other_ms + ms)) * 1e3)
              for P, ms in ((1, op_ms), (2, zeco2))]
    for name, rows in (("op", ops), ("scan", scans), ("model", models)):  # one measurement per file, as they come
        (tmp_path / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}))

    cal = cm.calibrate(cm.load_rows(str(tmp_path / "*.json")), cluster, build=build)
    for field in ("message", "hop", "scan_call", "gather_call", "state_pass", "state_grad_pass", "a2a_copy",
                  "a2a_wire"):
        assert getattr(cal.builds[build], field) == pytest.approx(getattr(true, field), rel=1e-9), field
    assert cal.nccl_call == pytest.approx(nccl_call, rel=1e-9)
    assert cal.other_ms[(T, H, D, layers)] == pytest.approx(other_ms, rel=1e-9)
    assert len(cal.residuals) == 2 + len(scans) + len(ops) - 3 + 1  # op rows: one run per configuration
    assert max(abs(r.rel) for r in cal.residuals) < 1e-9


@pytest.mark.parametrize("P", [2, 3, 8, 100])
def test_pipelined_chain_is_the_papers_formula(P):
    """One link, no software cost: K blocks take tau(S) + (P-2) tau(S)/K (paper eq. 12 counts one block stage
    more: tau(S) + (P-1) tau(S)/K); K = 1 is P - 1 sequential hops. The latency and the per-hop cost are paid
    once per hop; the blocks follow at the pace of their issue or their transfer, whichever is longer."""
    link = cm.Link(latency=0.0, bandwidth=50e9)
    c = cm.Cluster(intra=link, inter=link)
    w = workload(P)
    tau = w.state_bytes / link.bandwidth
    for K in (1, 2, 8, 128):
        assert cm.chain_time(w, c, FREE, K) == pytest.approx(tau + (P - 1) * tau / K - tau / K, rel=1e-12)
    alpha, m, call = 3e-6, 2e-6, 7e-6
    c = cm.Cluster(intra=dataclasses.replace(link, latency=alpha), inter=dataclasses.replace(link, latency=alpha))
    sw = dataclasses.replace(FREE, message=m, hop=m, scan_call=call)
    assert cm.chain_time(w, c, sw, 1) == pytest.approx(call + (P - 1) * (m + alpha + tau), rel=1e-12)
    for K in (2, 16):
        assert cm.chain_time(w, c, sw, K) == pytest.approx(
            call + (P - 1) * (m + alpha + tau / K) + (K - 1) * max(m, tau / K), rel=1e-12)
    # zigzag: up the ranks, a same-rank turn (a combine: the per-hop cost), back down
    zig = cm.chain_time(workload(P, "zigzag"), c, sw, 4)
    assert zig == pytest.approx(call + 2 * (P - 1) * (m + alpha + tau / 4) + m + 3 * max(m, tau / 4), rel=1e-12)
    # over peer memory a zigzag scan runs as two legs of P - 1 hops at once
    legs = cm.chain_time(workload(P, "zigzag"), c, dataclasses.replace(sw, transport="peer_memory"), 4)
    assert legs == pytest.approx(cm.chain_time(w, c, sw, 4), rel=1e-12)


def test_slowest_hop_paces_the_pipeline():
    """Hops of different speed: sum of the per-block hop times + (K-1) x the slowest transfer (InfiniBand)."""
    c = cm.Cluster(gpus_per_node=4)
    w = workload(12)
    assert cm.chain_hops(12, "contiguous", 4) == (9, 2, 0)
    assert cm.chain_hops(12, "zigzag", 4) == (18, 4, 1)
    for K in (1, 4):
        nv, ib = (link.time(w.state_bytes / K) for link in (c.intra, c.inter))
        pace = w.state_bytes / K / c.inter.bandwidth
        assert cm.chain_time(w, c, FREE, K) == pytest.approx(9 * nv + 2 * ib + (K - 1) * pace, rel=1e-12)


def test_a_zigzag_walks_rounds_wait_for_whole_messages():
    """A zigzag walk passes every rank twice, so a rank's steps of B and C for its two runs interleave, a launch
    each: the model does not pipeline them by tile, and they take as long at every K (only A's chains do not)."""
    c = cm.Cluster()
    sw = dataclasses.replace(FREE, transport="nvshmem", hop=5e-6)
    w = workload(256, "zigzag")
    for reverse in (False, True):
        spans = {K: (lambda p: p["C"] - p["A"])(cm.hierarchical_phases(w, c, sw, K, reverse)) for K in (1, 2, 8)}
        assert spans[2] == pytest.approx(spans[1], rel=1e-12) and spans[8] == pytest.approx(spans[1], rel=1e-12), spans
    contiguous = {K: (lambda p: p["C"] - p["A"])(cm.hierarchical_phases(workload(256), c, sw, K)) for K in (1, 8)}
    assert contiguous[8] < contiguous[1], contiguous


def test_rounds_between_nodes_share_their_senders_link():
    """Diagonal maps over the device transports go through the rounds and into the next node tile by tile
    in one launch, so a rank's messages between nodes of those phases travel at once, all through its one
    link: from the end of A to the end of C a scan takes at least the busiest such link's bytes (sent or
    received; a lane's message carries its lane's states) over the link's bandwidth; with every tile's path
    counted and the pipeline drained at that pace, no more than that plus each step's cost. In lanes the
    busiest link carries less than the one leader of each node sending every map would. (A contiguous walk:
    a zigzag walk's steps wait for whole messages, the test above.)"""
    from megatron_zeco.comm.shape import message_share

    layout = "contiguous"
    c = cm.Cluster()
    sw = dataclasses.replace(FREE, transport="nvshmem")
    for P in (64, 256, 1024):
        w = workload(P, layout)
        for reverse in (False, True):
            steps = cm.hierarchical_steps(P, layout, c.gpus_per_node, reverse, True)
            load = collections.Counter()
            for step in steps:
                for a, b, what, phase in step:
                    if phase in "BC" and a // c.gpus_per_node != b // c.gpus_per_node:
                        part = math.ceil(w.heads / message_share(what)[1]) / w.heads
                        load[a, "out"] += part
                        load[b, "in"] += part
            busiest = max(load.values())
            leaders = collections.Counter(a for step in cm.hierarchical_steps(P, layout, c.gpus_per_node, reverse)
                                          for a, b, _, phase in step
                                          if phase in "BC" and a // c.gpus_per_node != b // c.gpus_per_node)
            assert 0 < busiest < max(leaders.values()) - 1, (P, reverse, busiest, max(leaders.values()))
            depth = sum(1 for step in steps if step[0][3] in "BC")
            for K in (1, 4, 8):
                phases = cm.hierarchical_phases(w, c, sw, K, reverse)
                floor = busiest * w.map_bytes / c.inter.bandwidth
                assert phases["C"] - phases["A"] >= floor * (1 - 1e-12), (P, K, reverse)
                assert phases["C"] - phases["A"] <= floor + depth * (c.inter.latency + sw.hop + w.map_bytes / K
                                                                     / c.inter.bandwidth) * (1 + 1e-12), (P, K)


@pytest.mark.parametrize("transport", ["nvshmem", "send_recv"])
def test_a_senders_messages_of_one_step_share_its_link(transport):
    """A rank's messages of one step over one link leave through it together: with a slow NVLink and free hops,
    C inside a node of 8 takes as long as its busiest sender's bytes over that link, the taker of a lane's
    part sending it to the 7 other ranks (device transports: an all-gather of 1/8 parts) or the first rank
    sending the whole state to each (send/recv)."""
    c = cm.Cluster(intra=cm.Link(0.0, 1e9), inter=cm.Link(0.0, 1e15), gpus_per_node=8)
    sw = dataclasses.replace(FREE, transport=transport)
    w = workload(16, "contiguous")
    sent = 7 / 8 * w.state_bytes if transport == "nvshmem" else 7 * w.state_bytes
    for reverse in (False, True):
        phases = cm.hierarchical_phases(w, c, sw, 1, reverse)
        assert phases["C"] - phases["B"] == pytest.approx(sent / c.intra.bandwidth, rel=1e-6), (transport, reverse)


@functools.lru_cache(maxsize=1)
def _calibration():
    return cm.calibrate(cm.default_rows())


def _softwares():
    """The code as built over every transport, in both regimes."""
    cal = _calibration()
    return {f"{t} {regime}": cal.sw(t, regime) for t in cm.TRANSPORTS for regime in cm.REGIMES}


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_time_grows_with_P_and_efficiency_is_at_most_one(layout):
    c = cm.Cluster()
    for name, sw in _softwares().items():
        for strategy in cm.STRATEGIES:
            ps = [P for P in [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 256, 1024] if strategy != "a2a" or 16 % P == 0]
            if sw.transport == "peer_memory":
                ps = [P for P in ps if P <= c.gpus_per_node]
            w = [workload(P, layout) for P in ps]
            times = [cm.best_blocks(x, c, sw)[1] if strategy == "zeco" else cm.layer_time(strategy, x, c, sw)
                     for x in w]
            assert all(a <= b * (1 + 1e-12) for a, b in zip(times, times[1:])), (name, strategy, times)
            assert all(cm.efficiency(strategy, x, c, sw) <= 1 + 1e-12 for x in w), (name, strategy)
        if sw.transport != "peer_memory":
            ks = [cm.best_blocks(workload(P, layout), c, sw)[0] for P in (2, 16, 256, 1024)]
            assert ks == sorted(ks), (name, ks)  # deeper chains want more blocks
        if "hierarchical" in cm.TRANSPORTS[sw.transport].shapes:
            top = 3 if cm.TRANSPORTS[sw.transport].one_node else 10  # peer memory: one node of 8
            hier = [cm.best_blocks(workload(2 ** k, layout), c, sw, "hierarchical")[1] for k in range(1, top + 1)]
            assert all(a <= b * (1 + 1e-12) for a, b in zip(hier, hier[1:])), (name, hier)


def _hops(P, layout, node_size, shape, reverse=False):
    """(critical-path messages, of which between nodes) of one scan at unit costs."""
    node = lambda r: r // node_size  # noqa: E731
    if shape == "chain":
        intra, inter, _ = cm.chain_hops(P, layout, node_size)
        return intra + inter, inter
    steps = cm.hierarchical_steps(P, layout, node_size, reverse)
    return tuple(cm.critical_path(steps, P, lambda a, b, what, phase, w=w: w(a, b))
                 for w in (lambda a, b: 1.0, lambda a, b: float(node(a) != node(b))))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_hierarchical_scan_waits_log_depth_between_nodes(layout):
    """Between nodes the chain waits for one hop per node (contiguous; two under zigzag), the
    hierarchical scan for at most log2 of twice the nodes, plus one (its rounds and the hop into the
    next node)."""
    for node_size in (1, 2, 8):
        chain, tree = [], []
        for k in range(1, 11):
            P = 2 ** k
            if P <= node_size:
                continue
            chain.append(_hops(P, layout, node_size, "chain")[1])
            tree.append(max(_hops(P, layout, node_size, "hierarchical", reverse)[1] for reverse in (False, True)))
            nodes = P // node_size
            assert chain[-1] == (1 if layout == "contiguous" else 2) * (nodes - 1)
            assert tree[-1] <= math.ceil(math.log2(2 * nodes)) + 1, (P, node_size, tree)
        if len(tree) > 4:
            assert tree[-1] < chain[-1] / 8, (layout, node_size, chain, tree)


def test_hierarchical_steps_are_those_of_the_code():
    """The replayed schedule has the rounds and runs of comm.hierarchical.Walk, and the chain's hops are
    comm.all_scan._chain_hops, for groups of every size up to 24 and nodes of 1 to 5 and the whole group."""
    from megatron_zeco.comm import Layout
    from megatron_zeco.comm.all_scan import _chain_hops
    from megatron_zeco.comm.hierarchical import Walk

    for P in range(1, 25):
        for node_size in {1, 2, 3, 4, 5, P}:
            nodes = tuple(r // node_size for r in range(P))
            for layout in Layout:
                for reverse in (False, True):
                    walk = Walk(layout, P, nodes, reverse)
                    steps = cm.hierarchical_steps(P, layout.value, node_size, reverse)
                    assert sum(s[0][3] == "B" for s in steps) <= walk.rounds
                    assert all(s[0][3] != "A" for s in steps[max(len(seg) for seg in walk.segments) - 1:])
                    sent = {(a, b) for step in steps for a, b, *_ in step}
                    assert all(a != b and 0 <= a < P and 0 <= b < P for a, b in sent)
                    if len(walk.segments) > 1:  # every run but the first gets its state from another rank
                        # (but the run after a zigzag walk's turn, which starts on the rank ending the one before)
                        firsts = {walk.rank(seg[0]) for j, seg in enumerate(walk.segments[1:], 1)
                                  if walk.rank(seg[0]) != walk.leader(j - 1)}
                        assert firsts <= {b for step in steps if step[0][3] == "C" for _, b, *_ in step}
                intra, inter, _ = cm.chain_hops(P, layout.value, node_size)
                assert (intra, inter) == _chain_hops(Walk(layout, P, nodes, False), nodes)
                assert cm.chain_hops(P, layout.value, nodes) == cm.chain_hops(P, layout.value, node_size)


# Groups, node-major, whose chain and hierarchical scan take the same hops inside and between nodes
# (P = 3; 4 ranks on 2 nodes, contiguous): (P, node size, layout).
TIES = {(3, 1, "contiguous"), (3, 2, "contiguous"), (3, 2, "zigzag"), (4, 2, "contiguous")}


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shape_choice_is_set_by_the_hops(layout):
    """Over send/recv the hierarchical scan's critical path never takes more hops, inside or between
    nodes, than the chain's: at the stated hop cost and NVLink the choice is the hierarchical scan
    for every node-major group of 3 to 24 ranks, whatever the latency between nodes (0 to 1 ms),
    but where both take the same hops: the chain (which rounding used to turn at some latencies)."""
    for P in range(3, 25):
        for node_size in range(1, P):
            nodes = tuple(r // node_size for r in range(P))
            choices = {cm.scan_choice(layout, nodes, 2 ** 20, "send_recv", cm.Cluster(inter=cm.Link(alpha, 50e9)))
                       for alpha in (0.0, 5e-6, 1e-4, 1e-3)}
            assert choices == {"chain" if (P, node_size, layout) in TIES else "hierarchical"}, (P, node_size)
    # one rank alone on its node, the others together: the same hops either way, at any latency
    for alpha in (0.0, 1e-5, 1e-4, 1e-3):
        assert cm.scan_choice("zigzag", (0, 0, 1), 96, "send_recv", cm.Cluster(inter=cm.Link(alpha, 50e9))) == "chain"


def test_limits():
    c = cm.Cluster()
    for sw in _softwares().values():  # one rank: every strategy is the local op
        assert {cm.layer_time(s, workload(1), c, sw) for s in cm.STRATEGIES} == {4e-3}
    free_link = cm.Link(latency=0.0, bandwidth=float("inf"))
    free = cm.Cluster(intra=free_link, inter=free_link)
    for P in (2, 1024):  # free links and no software cost: zeco is the local op; the ring's serialisation remains
        for shape in cm.SHAPES:
            assert cm.efficiency("zeco", workload(P), free, FREE, shape) == pytest.approx(1.0)
        assert cm.layer_time("lasp1", workload(P), free, FREE) == pytest.approx(P * 4e-3)
    # one hop (P = 2) gains nothing from blocks when each message costs something
    assert cm.best_blocks(workload(2), c, _calibration().sw("send_recv", "eager"))[0] == 1
    # the overlap hides the scan while it fits in the window, and only then
    sw = dataclasses.replace(_calibration().sw("nvshmem", "steady"), overlap=1.0)
    assert cm.layer_time("zeco", workload(8), c, sw) == pytest.approx(4e-3)
    assert cm.layer_time("zeco", workload(1024), c, sw) > 4e-3


def test_bad_input_names_the_argument():
    c, sw = cm.Cluster(), _softwares()["send_recv steady"]
    with pytest.raises(ValueError, match="K .* must divide k_dim"):
        cm.layer_time("zeco", workload(4), c, sw, K=3)
    with pytest.raises(ValueError, match="P must divide heads"):
        cm.layer_time("a2a", workload(32), c, sw)
    with pytest.raises(ValueError, match="strategy must be one of"):
        cm.layer_time("ring", workload(4), c, sw)
    with pytest.raises(ValueError, match="layout must be"):
        cm.layer_time("zeco", workload(4, "striped"), c, sw)
    with pytest.raises(ValueError, match="shape must be one of"):
        cm.scan_time("tree", workload(4), c, sw)
    with pytest.raises(ValueError, match="shape 'tree' does not run over transport 'peer_memory'"):
        cm.layer_time("zeco", workload(4), c, _softwares()["peer_memory steady"], shape="tree")
    with pytest.raises(ValueError, match="needs the CP group on one node"):
        cm.layer_time("zeco", workload(16), c, _softwares()["peer_memory steady"])
    with pytest.raises(ValueError, match="regime must be one of"):
        _calibration().sw("send_recv", "warm")
    with pytest.raises(ValueError, match="no measured rows"):
        cm.load_rows("/nonexistent/*.json")


def test_nvshmem_is_projected_from_the_peer_memory_hop():
    """Until an NVSHMEM run is measured, its hop is the peer-memory hop's measured GPU time, with the
    stated InfiniBand link between nodes; the command line marks it (projected)."""
    cal = _calibration()
    assert cal.projected("nvshmem") and not cal.projected("send_recv") and not cal.projected("peer_memory")
    for regime in cm.REGIMES:
        assert dataclasses.replace(cal.sw("nvshmem", regime), transport="peer_memory") == cal.sw("peer_memory", regime)
    assert cm.NVSHMEM_PROJECTION["priced_as"] == "peer_memory"


def _cli(*args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cm.main(list(args))
    return out.getvalue().splitlines()


LINE = re.compile(r"^(zeco|zeco-chain|zeco-hierarchical|lasp2|lasp1|a2a) +layout=(contiguous|zigzag) .*"
                  r"efficiency=(\d\.\d{3})$")


@pytest.mark.parametrize("gpus", [2, 256, 1024])
def test_command_line_prints_one_line_per_strategy_and_layout(gpus):
    lines = _cli("--gpus", str(gpus), "--tokens-per-gpu", "16384")
    body = [line for line in lines if not line.startswith("#")]
    assert all(LINE.match(line) for line in body), body
    seen = [(m.group(1), m.group(2)) for m in map(LINE.match, body)]
    strategies = ["zeco", "zeco-chain", "zeco-hierarchical", "lasp2", "lasp1", "a2a"]
    assert seen == [(s, layout) for layout in ("contiguous", "zigzag") for s in strategies], seen
    eff = {key: float(m.group(3)) for key, m in zip(seen, map(LINE.match, body))}
    for layout in ("contiguous", "zigzag"):
        assert eff["zeco", layout] == max(eff["zeco-chain", layout], eff["zeco-hierarchical", layout])
        assert 0 < eff["lasp1", layout] < eff["zeco", layout] <= 1
    if gpus > 16:
        assert all("cannot run" in line for line in body if line.startswith("a2a"))
        # across nodes as built: the hierarchical shape in the device kernels over NVSHMEM (projected costs)
        assert "transport=nvshmem (projected) shape=hierarchical" in body[0]
        assert "transport=nvshmem (projected) shape=chain" in body[1]
        assert "transport=nvshmem (projected) shape=hierarchical" in body[2]
    one = [line for line in _cli("--gpus", str(gpus), "--layout", "zigzag", "--node-size", "4",
                                 "--transport", "send_recv") if not line.startswith("#")]
    assert [LINE.match(line).group(2) for line in one] == ["zigzag"] * 6
    assert "transport=send_recv" in one[0] and "projected" not in one[0]


def test_command_line_help_documents_every_flag():
    done = subprocess.run([sys.executable, "-m", "megatron_zeco.cost_model", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    for flag in ("--gpus", "--op", "--tokens-per-gpu", "--layout", "--node-size", "--regime", "--transport", "--heads",
                 "--head-dim", "--ib-latency-us", "--ib-bandwidth-gbs", "--results"):
        assert re.search(rf"{flag}\b[^\n]*\n?\s+\S", done.stdout), flag
    with pytest.raises(SystemExit):
        with contextlib.redirect_stderr(io.StringIO()):
            cm.main(["--gpus", "0"])


def test_result_files_say_what_they_measured(tmp_path):
    """A result file's meta names its build and, for another build than the current one, what that
    build measured (cost_model.META); a file of the current build may name the build alone."""
    row = {"part": "op", "mode": "steady", "tokens_per_gpu": 16384, "heads": 16, "dim": 128, "strategy": "none",
           "cp": 1, "layout": "contiguous", "ms": 2.6}
    cases = [({}, "must name the build measured"),
             ({"build": "fused"}, "transport, scan_code, passes missing"),
             ({"build": "fused", "transport": "send_recv", "scan_code": {"send_recv": "v2"}, "passes": "fused"},
              "meta passes must be null or"),
             ({"build": cm.BUILD, "transport": "ring"}, "meta transport 'ring'")]
    for meta, message in cases:
        (tmp_path / "op.json").write_text(json.dumps({"meta": meta, "rows": [row]}))
        with pytest.raises(ValueError, match=message):
            cm.load_rows(str(tmp_path / "op.json"))
    (tmp_path / "op.json").write_text(json.dumps({"meta": {"build": cm.BUILD}, "rows": [row]}))
    assert cm.load_rows(str(tmp_path / "op.json"))[0]["build_meta"] == cm.BUILD_META


def test_rows_of_another_operator_stay_out_of_the_fit(tmp_path):
    """bench_op.py --op gdn writes op rows beside GLA's: the GLA model must not calibrate on them."""
    from megatron_zeco.cost_model import load_rows

    row = {"part": "op", "mode": "steady", "tokens_per_gpu": 16384, "heads": 16, "dim": 128, "strategy": "fla",
           "cp": 1, "layout": "contiguous", "ms": 2.6}
    path = tmp_path / "op.json"
    path.write_text(json.dumps({"meta": {"build": "peer memory"}, "rows": [row, dict(row, op="gdn", ms=9.9),
                                                                            dict(row, op="gla", ms=2.7)]}))
    assert [r["ms"] for r in load_rows(str(path))] == [2.6, 2.7]


ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
SHIPPED = ROOT / "megatron_zeco" / "cost_model" / cm.DATA


def test_a_run_in_a_forced_scan_shape_is_no_calibration_point():
    """bench_op.py under $MEGATRON_ZECO_SCAN_SHAPE records the shape it forced; such a file compares the
    shapes (the chain's rows too) and holds no calibration row, the same rows without it do."""
    data = json.loads((RESULTS / "op-gla-chain-h200x2-2026-11-29b.json").read_text(encoding="utf-8"))
    assert data["meta"]["scan_shape"] == "chain" and not cm.calibration_rows(data)
    unforced = dict(data, meta={k: v for k, v in data["meta"].items() if k not in ("scan_shape", "node_size")})
    assert cm.calibration_rows(unforced)


def test_shipped_calibration_data_are_the_result_files():
    """The calibration data shipped with the package are copies of the result files in docs/results
    that hold calibration rows (another operator's one-GPU op times included): every such file, with
    the same rows and meta, and nothing else; the calibration reads them and not docs/results. Each
    copy holding rows of a build says in full what it measured (cost_model.META), where docs/results'
    may leave out what the benchmarks did not write then."""
    results = {p.name: json.loads(p.read_text(encoding="utf-8")) for p in RESULTS.glob("*.json")}
    shipped = {p.name: json.loads(p.read_text(encoding="utf-8")) for p in SHIPPED.glob("*.json")}
    needed = {name for name, data in results.items() if cm.calibration_rows(data)}
    missing, extra = sorted(needed - set(shipped)), sorted(set(shipped) - needed)
    assert not missing, f"docs/results files with calibration rows not shipped: {missing}; copy them into {SHIPPED}"
    assert not extra, f"shipped calibration files with no calibration rows in docs/results: {extra}"
    for name in sorted(needed):
        copy, source = shipped[name], results[name]
        assert copy["rows"] == source["rows"], f"{name}: the shipped rows differ from docs/results'"
        added = {k: v for k, v in copy["meta"].items() if k not in source["meta"]}
        assert {**source["meta"], **added} == copy["meta"], f"{name}: the shipped meta differs from docs/results'"
        assert set(added) <= {*cm.META, cm.PIECE_META}, f"{name}: meta adds {sorted(added)}"
        of_a_build = [r for r in cm.calibration_rows(source) if r["part"] in cm.PARTS and r.get("op", "gla") == "gla"]
        if of_a_build:  # rows of a build, not op times or overlap shares alone
            assert set(cm.META) <= set(copy["meta"]), f"{name}: meta says not all of {cm.META}"
    assert {r["file"] for r in cm.default_rows()} == needed


def test_command_line_runs_from_an_installed_copy(tmp_path):
    """The package as a wheel installs it (setup.py build_py: no docs/results beside it) calibrates on
    its shipped data and prints what the checkout prints."""
    lib = tmp_path / "lib"
    built = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(lib)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    assert sorted(p.name for p in (lib / "megatron_zeco" / "cost_model" / cm.DATA).glob("*.json")) == sorted(
        p.name for p in SHIPPED.glob("*.json"))
    args = ["--gpus", "16", "--node-size", "8"]
    done = subprocess.run([sys.executable, "-m", "megatron_zeco.cost_model", *args], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(lib)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == _cli(*args)


def test_the_run_time_choice_stands_alone():
    """comm/shape.py, what an All-Scan of shape "auto" asks, loads on the standard library alone (no
    torch, no result files; with comm/transport.py, the transports it prices), and nothing in comm
    imports the cost model."""
    folder = ROOT / "megatron_zeco" / "comm"
    code = ("import importlib, sys, types; sys.modules['torch'] = None; before = set(sys.modules); "
            "comm = sys.modules['comm'] = types.ModuleType('comm'); "  # the folder, without its __init__
            f"comm.__path__ = [{str(folder)!r}]; m = importlib.import_module('comm.shape'); "
            "print(m.scan_choice('contiguous', (0, 0, 1, 1, 2, 2), 2 ** 20, 'send_recv')); "
            "print(*sorted({n.split('.')[0] for n in set(sys.modules) - before}"
            " - set(sys.stdlib_module_names) - {'comm'}))")
    done = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["hierarchical", ""], done.stdout  # and no module beyond the standard library
    for path in sorted((ROOT / "megatron_zeco" / "comm").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [getattr(node, "module", None) or "", *(a.name for a in node.names)]
                assert not any("cost_model" in name for name in names), f"comm/{path.name} imports {names}"


# ---------------------------------------------------------------------------------------------- stated figures
# The model's stated constants, each against its source (docs/scaling.md, "What each transport's numbers
# rest on"), and the projections recorded in docs/scaling.md against the model: a test computing its
# expectation from the model's own constants cannot tell a wrong constant.

MiB = 2 ** 20
SCALING = ROOT / "docs" / "scaling.md"


def test_stated_links_are_their_sources():
    # InfiniBand NDR: 400 Gb/s, i.e. 50 GB/s per GPU with one NIC per GPU; 5 us per message (stated)
    assert cm.INFINIBAND.time(0) == pytest.approx(5e-6, rel=1e-12)
    assert cm.INFINIBAND.time(MiB) == pytest.approx(5e-6 + MiB / 50e9, rel=1e-12)
    # NVLink: 268 GB/s per GPU, the bandwidth NCCL's all-to-all reached on 2 H200; 1 us per message (stated)
    assert cm.NVLINK.time(0) == pytest.approx(1e-6, rel=1e-12)
    assert cm.NVLINK.time(MiB) == pytest.approx(1e-6 + MiB / 268e9, rel=1e-12)
    # the cluster of the projections and of the run-time choice: 8 GPUs per node (an H200 node)
    c = cm.Cluster()
    assert c.gpus_per_node == 8
    assert c.link(0, 7).time(MiB) == pytest.approx(1e-6 + MiB / 268e9, rel=1e-12)
    assert c.link(7, 8).time(MiB) == pytest.approx(5e-6 + MiB / 50e9, rel=1e-12)


def test_stated_hop_costs_are_the_fitted_hops():
    # What the run-time choice charges per hop beyond the wire: the GPU time of a hop fitted on the
    # measured scan rows, rounded to the microsecond (send/recv 20.7 us, peer memory 5.8 us); NVSHMEM,
    # not measured, as peer memory.
    assert cm.HOP_COST == {"send_recv": 21e-6, "peer_memory": 6e-6, "nvshmem": 6e-6}
    cal = _calibration()
    for transport, stated in cm.HOP_COST.items():
        assert abs(cal.sw(transport, "steady").hop - stated) <= 0.5e-6, (transport, cal.sw(transport, "steady").hop)


def test_recorded_runs_are_what_the_command_line_prints():
    """The runs of the command line docs/scaling.md records (256 GPUs on 32 nodes, 16 GPUs on two)
    print what the page says, line for line."""
    runs = re.findall(r"^```\n\$ python -m megatron_zeco\.cost_model ([^\n]*)\n(.*?)^```",
                      SCALING.read_text(encoding="utf-8"), flags=re.S | re.M)
    assert {args for args, _ in runs} >= {"--gpus 256 --tokens-per-gpu 16384", "--gpus 16 --node-size 8"}, runs
    for args, printed in runs:
        assert _cli(*args.split()) == printed.splitlines(), args


def test_recorded_efficiencies_are_the_models():
    """docs/scaling.md's table of projected efficiencies (16K and 32K tokens per GPU, 256 and 1024
    GPUs, contiguous / zigzag), row by row."""
    table = {m.group(1): [float(x) for x in m.group(2, 3, 4, 5)] for m in re.finditer(
        r"^\| (.+?) \| (\d\.\d{3}) / (\d\.\d{3}) \| (\d\.\d{3}) / (\d\.\d{3}) \|$", SCALING.read_text(encoding="utf-8"),
        flags=re.M)}
    cal = _calibration()

    def efficiencies(tokens, strategy, transports=None):
        return [round(next(ch for ch in cm.project(cal, P, tokens, layout, transports=transports)
                           if ch.strategy == strategy).efficiency, 3)
                for P in (256, 1024) for layout in cm.LAYOUTS]

    rows = {"as built: the hierarchical shape in the device kernels over NVSHMEM, the overlap measured on one GPU "
            "(*projected* transport costs)": (16384, "zeco-hierarchical", ["nvshmem"]),
            "as built: hierarchical over send/recv (NCCL; measured costs)": (16384, "zeco-hierarchical", ["send_recv"]),
            "as built: chain over NVSHMEM, the overlap measured on one GPU (*projected* transport costs)":
                (16384, "zeco-chain", None),
            "same as built at 32K tokens per GPU (the best shape and transport)": (32768, "zeco", None),
            "LASP-2 (all-gather), 16K": (16384, "lasp2", None)}
    assert set(rows) <= set(table), sorted(table)
    for label, args in rows.items():
        assert table[label] == efficiencies(*args), label
    # the best at 16K is the device kernels' hierarchical shape
    assert efficiencies(16384, "zeco") == efficiencies(16384, "zeco-hierarchical", ["nvshmem"])


def test_recorded_transport_costs_are_the_calibrations():
    """docs/scaling.md's table of each transport's fitted (or projected) costs, in microseconds."""
    rows = re.findall(r"^\| (send_recv|peer_memory|nvshmem) \| (steady|eager) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|",
                      SCALING.read_text(encoding="utf-8"), flags=re.M)
    assert len(rows) == len(cm.TRANSPORTS) * len(cm.REGIMES), rows
    cal = _calibration()
    for transport, regime, *recorded in rows:
        sw = cal.sw(transport, regime)
        assert [f"{x * 1e6:.1f}" for x in (sw.scan_call, sw.message, sw.hop)] == recorded, (transport, regime)



# ---------------------------------------------------------------------------------------------- operators
# The delta rules' maps are dense (a K x K transition per head) where GLA's are diagonal: every size and
# product of their scans follows from the heads and dims through cost_model.Operator.


@pytest.mark.parametrize("k_dim", [32, 64, 128, 256])
def test_delta_rule_messages_and_products_follow_the_dims(k_dim):
    H, V = 16, 128
    for op in (cm.GDN, cm.KDA):
        assert op.state_bytes(H, k_dim, V) == H * k_dim * V * 4
        assert op.map_bytes(H, k_dim, V) == H * (k_dim * V + k_dim * k_dim) * 4  # the state and a K x K map, fp32
        assert op.apply_flops(H, k_dim, V) == 2 * H * k_dim * k_dim * V  # M S: K x K by K x V
        assert op.compose_flops(H, k_dim, V) == 2 * H * (k_dim ** 3 + k_dim * k_dim * V)  # (M2 M1, M2 d1 + d2)
    assert cm.Dense.compose_macs(2 * k_dim) == 8 * cm.Dense.compose_macs(k_dim)  # K^3
    assert cm.Dense.apply_macs(2 * k_dim, V) == 4 * cm.Dense.apply_macs(k_dim, V)  # K^2 V
    growth = cm.GDN.map_bytes(H, 2 * k_dim, V) / cm.GDN.map_bytes(H, k_dim, V)
    assert growth == pytest.approx((2 * k_dim * V + 4 * k_dim ** 2) / (k_dim * V + k_dim ** 2), rel=1e-12)
    # GLA: a K-vector decay per head, its elementwise work inside the measured hop (no product charged)
    assert cm.GLA.map_bytes(H, k_dim, V) == H * k_dim * (V + 1) * 4
    assert cm.GLA.apply_flops(H, k_dim, V) == cm.GLA.compose_flops(H, k_dim, V) == 0


def test_operators_are_those_of_the_code():
    """Each operator's map, blocks and strategies in the cost model are the code's: the message of a map
    is the state and comm/transition.py's transition columns, the blocks split the axis cp/config.py's
    RULES name, and the strategies are the ones built."""
    from megatron_zeco.comm import transition
    from megatron_zeco.cp.config import RULES

    code = {cm.Diagonal: transition.Diagonal, cm.Dense: transition.Dense}
    for op in cm.OPERATORS.values():
        for k in (16, 64, 128):
            assert op.map_bytes(4, k, 32) == 4 * k * (32 + code[op.transition].width(k)) * 4, (op.name, k)
        assert {"k_dim": "rows", "v_dim": "columns"}[op.transition.block_dim] == RULES[op.rules].blocks
        assert set(op.strategies) == {"none", *RULES[op.rules].strategies}
    assert "lasp1" in cm.GLA.strategies and "lasp1" not in cm.GDN.strategies + cm.KDA.strategies


def test_dense_maps_cross_the_wire_and_cost_their_products():
    """The model charges what the operator moves and computes: LASP-2 all-gathers each piece's map
    (K x K more per head for the delta rule), each chain hop combines its block by a K x K product,
    and a dense zigzag walk runs as one chain (no two legs over peer memory)."""
    c = cm.Cluster()
    P, H, Kd, V = 8, 16, 128, 128
    gla, gdn = workload(P), workload(P, op=cm.GDN)
    assert gdn.map_bytes - gla.map_bytes == H * Kd * (Kd - 1) * 4
    comm_gla, _ = cm.gather_time(gla, c, FREE)
    comm_gdn, fold_gdn = cm.gather_time(gdn, c, FREE)
    assert comm_gdn - comm_gla == pytest.approx((P - 1) * (gdn.map_bytes - gla.map_bytes) / c.intra.bandwidth,
                                                rel=1e-9)
    assert fold_gdn == pytest.approx(P * (3 * gdn.map_bytes / cm.HBM_BANDWIDTH + 2 * H * Kd * Kd * V / cm.FP32_FLOPS))
    # a chain of P - 1 hops in one block: the same wire, plus one product per hop
    apply = 2 * H * Kd * Kd * V / cm.FP32_FLOPS
    assert cm.chain_time(gdn, c, FREE, 1) - cm.chain_time(gla, c, FREE, 1) == pytest.approx((P - 1) * apply, rel=1e-9)
    # blocks: of columns (the value dim) for dense maps, of rows (the key dim) for diagonal ones
    narrow = dict(k_dim=64, v_dim=128)
    assert max(cm.blocks(workload(P, op=cm.GDN, **narrow))) == 128 and max(cm.blocks(workload(P, **narrow))) == 64
    with pytest.raises(ValueError, match="must divide k_dim"):
        cm.layer_time("zeco", workload(P, **narrow), c, FREE, K=128)
    with pytest.raises(ValueError, match="must divide v_dim"):
        cm.layer_time("zeco", workload(P, op=cm.GDN, **narrow), c, FREE, K=3)
    # zigzag over peer memory: GLA's two legs of P - 1 hops, the delta rule's one chain of 2(P - 1) and a turn
    peer = dataclasses.replace(FREE, transport="peer_memory", hop=1e-5)
    hops = {op.name: sum(cm.chain_hops(P, "zigzag", c.gpus_per_node, op.transition.two_legs))
            for op in (cm.GLA, cm.GDN)}
    assert hops == {"gla": P - 1, "gdn": 2 * (P - 1) + 1}
    zig = {op.name: cm.chain_time(workload(P, "zigzag", op=op), c, peer, 1) for op in (cm.GLA, cm.GDN)}
    assert zig["gdn"] > 2 * zig["gla"]


def test_one_gpu_op_times_of_the_delta_rules_are_the_measured_ones():
    """Each delta rule's one-GPU time is fla's own op measured on an H200 (profile_piece.py's fla fwd+bwd
    rows, back to back, and bench_op.py's one-GPU rows), the mean of its runs over the files; a file from
    another GPU is not read; GLA's is as before."""
    cal = _calibration()
    files = {op: [json.loads((RESULTS / name).read_text(encoding="utf-8")) for name in names] for op, names in {
        "gdn": ("profile-gdn-piece-h200x1-2026-11-26.json", "piece-gdn-h200x1-2026-11-28b.json",
                "piece-gdn-h200x1-2026-11-30.json", "piece-gdn-h200x1-2026-11-30b.json",
                "piece-gdn-h200x1-2026-11-30c.json", "piece-gdn-h200x1-2026-12-01.json",
                "piece-gdn-h200x1-2026-12-01b.json"),
        "kda": ("piece-kda-h200x1-2026-11-28.json", "piece-kda-h200x1-2026-11-30.json",
                "piece-kda-h200x1-2026-12-01.json", "piece-kda-h200x1-2026-12-01b.json")}.items()}
    # and bench_op.py's one-GPU rows (strategy none, steady) of a run in no forced scan shape
    ops = {"gdn": [json.loads((RESULTS / name).read_text(encoding="utf-8"))
                   for name in ("op-gdn-overlap-h200x2-2026-11-30.json", "op-gdn-overlap-h200x2-2026-11-30b.json")],
           "kda": []}
    for op, datas in files.items():
        for T in (16384, 32768):
            runs = [r["steady_ms"] for data in datas for r in data["rows"] if r["case"] == "fla"
                    and r["direction"] == "fwd+bwd" and r["tokens"] == T]
            runs += [r["ms"] for data in ops[op] for r in data["rows"] if r.get("strategy") == "none"
                     and r["mode"] == "steady" and r["tokens_per_gpu"] == T and r["part"] == "op"]
            assert len(runs) >= 1
            assert cal.one_gpu[op]["steady"][T, 16, 128] == pytest.approx(sum(runs) / len(runs), rel=1e-12)
        assert "eager" not in cal.one_gpu[op]
    assert not cm.op_time_rows(json.loads((RESULTS / "op-gdn-h100x1-2026-11-25.json").read_text(encoding="utf-8")))
    assert cal.one_gpu["gla"] == cal.op_ms
    assert cm.projection_workload(cal, 256, 16384, op=cm.KDA).op_ms == pytest.approx(
        cal.one_gpu["kda"]["steady"][16384, 16, 128])
    with pytest.raises(ValueError, match="no measured one-GPU eager op time of gdn"):
        cm.projection_workload(cal, 256, 16384, regime="eager", op=cm.GDN)
    # GLA's projections are those without an operator named
    assert cm.project(cal, 256, 16384, "zigzag", layer=cm.LayerShape(op=cm.GLA)) == cm.project(cal, 256, 16384, "zigzag")


def test_the_delta_rules_pieces_are_their_newest_measurement_and_cost_what_they_add():
    """A delta rule's ZeCO piece adds to the layer its measured share of the one-GPU op: the mean GPU time of
    the newest file's pieces (first, middle, last; or the cases its shipped copy names, where the build
    changed after the file was written) over fla's op on the same tokens, forward + backward (an older file
    times a piece since replaced); at the measured tokens nearest those projected; zeco and lasp2 pay it, a2a
    (fla's op on other heads) does not, and GLA has none."""
    cal = _calibration()
    for op, name, cases in (("gdn", "piece-gdn-h200x1-2026-12-01b.json", cm.PIECE_CASES),
                            ("kda", "piece-kda-h200x1-2026-12-01b.json", cm.PIECE_CASES)):
        shipped = json.loads((SHIPPED / name).read_text(encoding="utf-8"))
        assert tuple(shipped["meta"].get(cm.PIECE_META, cm.PIECE_CASES)) == cases
        rows = [r for r in shipped["rows"] if r["direction"] == "fwd+bwd" and r["tokens"] == 16384]
        pieces = [r["gpu_ms"] for r in rows if r["case"] in cases]
        (fla,) = [r["gpu_ms"] for r in rows if r["case"] == "fla"]
        assert len(pieces) == len(cases)
        assert cal.piece_share[op][16384, 16, 128] == pytest.approx(sum(pieces) / len(pieces) / fla - 1, rel=1e-12)
        assert 0 < cal.piece_share[op][16384, 16, 128] < 0.5
    # the file as docs/results holds it: its "piece" cases timed the maps fused into K2, no longer built
    data = json.loads((RESULTS / "piece-gdn-h200x1-2026-11-30.json").read_text(encoding="utf-8"))
    assert cm.PIECE_META not in data["meta"]
    fused = {r["share"] for r in cm.piece_rows("x", data) if r["tokens_per_gpu"] == 16384}
    assert len(fused) == 1 and fused.pop() > cal.piece_share["gdn"][16384, 16, 128]
    # profile_piece.py's other piece cases (the one-stream variant) are not the piece as built
    data = json.loads((RESULTS / "piece-gdn-h200x1-2026-11-28b.json").read_text(encoding="utf-8"))
    variant = [dict(r, case="piece middle, one stream", gpu_ms=10 * r["gpu_ms"]) for r in data["rows"]
               if r["case"] == "piece middle"]
    assert cm.piece_rows("x", dict(data, rows=data["rows"] + variant)) == cm.piece_rows("x", data)
    assert "gla" not in cal.piece_share
    assert cm.piece_share(cal, cm.GDN, 20000, 128) == (cal.piece_share["gdn"][16384, 16, 128], 16384)
    assert cm.piece_share(cal, cm.GDN, 10 ** 6, 128)[1] == max(t for t, *_ in cal.piece_share["gdn"])
    assert cm.piece_share(cal, cm.GLA, 16384, 128) == (0.0, None)
    assert cm.piece_share(cal, cm.GDN, 16384, 64) == (0.0, None)
    w = cm.projection_workload(cal, 8, 16384, op=cm.GDN)
    assert w.piece_share == cal.piece_share["gdn"][16384, 16, 128]
    bare, sw = dataclasses.replace(w, piece_share=0.0), cal.sw("send_recv")
    c = cm.Cluster()
    for strategy in ("zeco", "lasp2"):
        added = cm.layer_time(strategy, w, c, sw) - cm.layer_time(strategy, bare, c, sw)
        assert added == pytest.approx(w.piece_share * w.op_ms * 1e-3, rel=1e-9), strategy
    assert cm.layer_time("a2a", w, c, sw) == cm.layer_time("a2a", bare, c, sw)


def test_the_overlap_is_the_measured_one_and_hides_the_scan_over_the_device_transports(monkeypatch):
    """What the scan's overlap hides (the in-chunk work's share of each direction, without the overlap and the
    state arriving at once), costs (that work slowed beside a spinning hop) and how much slower a hop runs
    beside that work (when the successor holds the state with the overlap, against the hop's time after the
    in-chunk work without) are bench_overlap.py's measurements, read off its rows here; as built they count
    over the device transports only (over send/recv the overlap is off by default) and for the operators whose
    rules turn it on (all three as built; an operator whose rules leave it off counts nothing)."""
    data = json.loads((RESULTS / "overlap-h200x1-2026-11-29c.json").read_text(encoding="utf-8"))
    at = {(r["op"], r["tokens"], r["arrival_us"], r["mode"]): r for r in data["rows"] if r["side_priority"] == "high"}
    gla = lambda arrival, mode, key: at["gla", 16384, arrival, mode][key]  # noqa: E731
    hidden = tuple(gla(0, "serial", f"{d}_local_ms") / gla(0, "serial", f"{d}_ms") for d in ("fwd", "bwd"))
    last = max(a for op, t, a, _ in at if (op, t) == ("gla", 16384))
    spin = tuple(max(0.0, gla(last, "overlap", f"{d}_local_ms") / gla(last, "serial", f"{d}_local_ms") - 1)
                 for d in ("fwd", "bwd"))
    aside = tuple(gla(0, "overlap", f"{d}_departure_ms")
                  / (gla(0, "serial", f"{d}_departure_ms") - gla(0, "serial", f"{d}_local_ms")) for d in ("fwd", "bwd"))
    cal = _calibration()
    w = cm.projection_workload(cal, 256, 16384, op=cm.GLA)
    assert w.hidden == pytest.approx(hidden, rel=1e-12) and w.spin == pytest.approx(spin, rel=1e-12)
    assert w.aside == pytest.approx(aside, rel=1e-12)
    assert 0.3 < hidden[0] < 0.6 and 0.3 < hidden[1] < 0.6  # GLA's in-chunk attention and gradients
    assert aside[0] > 1 and aside[1] > 1  # a hop on few programs beside that work is slower than alone
    gdn = cm.projection_workload(cal, 256, 16384, op=cm.GDN)
    # the delta rules', from their newest file: work beside the scan in both directions (before_grads), the rows
    # of their hops in the products as built (one TF32 pass for the model's 16-bit inputs), not those in three
    newest = json.loads((RESULTS / "overlap-precision-h200x1-2026-12-02.json").read_text(encoding="utf-8"))["rows"]
    assert {r.get("precision") for r in newest} == {"tf32", "tf32x3"} and cm.DENSE_PRECISION == "tf32"
    kda = cm.projection_workload(cal, 256, 16384, op=cm.KDA)
    for op, workload in (("gdn", gdn), ("kda", kda)):
        (serial,), (overlap,) = ([r for r in newest if (r["op"], r["mode"], r["arrival_us"], r["precision"])
                                  == (op, mode, 0, "tf32")] for mode in ("serial", "overlap"))
        alone = serial["fwd_departure_ms"] - serial["fwd_local_ms"]
        assert workload.aside[0] == pytest.approx(overlap["fwd_departure_ms"] / alone, rel=1e-12), op
        assert workload.hidden[1] == pytest.approx(serial["bwd_local_ms"] / serial["bwd_ms"], rel=1e-12), op
        assert workload.hidden[0] > 0.0 and workload.hidden[1] > 0.1 and workload.aside[1] > 1, op
    assert cm.overlap_shares(cal, cm.GLA, 16384, 64) == (((0.0, 0.0, 1.0), (0.0, 0.0, 1.0), None), None)
    assert cm.overlap_shares(cal, cm.GLA, 16384, 128)[0][2] == "high"  # the side stream as built
    c = cm.Cluster()
    sw = cal.sw("send_recv")
    bare = dataclasses.replace(w, hidden=(0.0, 0.0), spin=(0.0, 0.0), aside=(1.0, 1.0))
    assert cm.layer_time("zeco", w, c, sw, 1, "hierarchical") == cm.layer_time("zeco", bare, c, sw, 1, "hierarchical")
    sw = cal.sw("nvshmem")
    t_op = w.op_ms * 1e-3
    windows = (cm.FWD_FRACTION * t_op, (1 - cm.FWD_FRACTION) * t_op)
    scans = [cm.chain_time(w, c, sw, 32)] * 2
    want = sum(max(0.0, s - h * t / a) + k * min(a * s, h * t)
               for s, h, k, a, t in zip(scans, hidden, spin, aside, windows))
    got = cm.layer_time("zeco", w, c, sw, 32) - cm.layer_time("zeco", bare, c, sw, 32) + sum(scans)
    assert got == pytest.approx(want, rel=1e-9)
    assert cm.layer_time("zeco", w, c, sw, 32) < cm.layer_time("zeco", bare, c, sw, 32)
    # the delta rules' overlap is on (measured and counted); an operator whose rules leave it off counts nothing
    from megatron_zeco.cp.config import RULES

    for workload in (gdn, kda):
        bare = dataclasses.replace(workload, hidden=(0.0, 0.0), spin=(0.0, 0.0), aside=(1.0, 1.0))
        assert cm.layer_time("zeco", workload, c, sw, 32) < cm.layer_time("zeco", bare, c, sw, 32), workload.op.name
    monkeypatch.setitem(RULES, "kda", dataclasses.replace(RULES["kda"], auto_overlap=False))
    bare = dataclasses.replace(kda, hidden=(0.0, 0.0), spin=(0.0, 0.0), aside=(1.0, 1.0))
    assert cm.layer_time("zeco", kda, c, sw, 32) == cm.layer_time("zeco", bare, c, sw, 32)
    assert any(line.startswith("# overlap as built (kda): off by default")
               for line in _cli("--gpus", "16", "--op", "kda"))
    monkeypatch.undo()
    assert any(line.startswith("# overlap as built (gla): over peer_memory and nvshmem the hops run beside 42% / 49%")
               for line in _cli("--gpus", "16"))
    assert any(line.startswith("# overlap as built (gdn): over peer_memory and nvshmem the hops run beside")
               for line in _cli("--gpus", "16", "--op", "gdn"))
    assert any(line.startswith("# overlap as built (kda): over peer_memory and nvshmem the hops run beside")
               for line in _cli("--gpus", "16", "--op", "kda"))


def test_hop_pace_alone_is_a_what_if_of_the_hops_pace_alone():
    """``--hop-pace alone`` (``Calibration.with_hops_alone``): the hops beside the local op as fast as alone
    (``aside`` 1), all else as measured, so the overlap hides more of the scan over the device transports and
    nothing changes where it is off (send/recv); its rows and the overlap line say it is a what-if."""
    cal, c = _calibration(), cm.Cluster()
    alone_cal = cal.with_hops_alone()
    assert alone_cal.overlap.keys() == cal.overlap.keys() and cal.overlap != alone_cal.overlap
    for op in (cm.GLA, cm.GDN, cm.KDA):
        w = cm.projection_workload(cal, 256, 16384, op=op)
        alone = cm.projection_workload(alone_cal, 256, 16384, op=op)
        assert min(w.aside) > 1 and alone == dataclasses.replace(w, aside=(1.0, 1.0)), op.name
        for transport, faster in (("nvshmem", True), ("send_recv", False)):
            sw = cal.sw(transport)
            t, t_alone = (cm.layer_time("zeco", x, c, sw, 8, "hierarchical") for x in (w, alone))
            assert (t_alone < t) if faster else (t_alone == t), (op.name, transport)
        measured, what_if = (next(ch for ch in cm.project(k, 256, 16384, "contiguous", layer=cm.LayerShape(op=op))
                                  if ch.strategy == "zeco") for k in (cal, alone_cal))
        assert what_if.efficiency > measured.efficiency, op.name
    lines = _cli("--gpus", "256", "--op", "gdn", "--hop-pace", "alone")
    header = [line for line in lines if line.startswith("# overlap as built (gdn):")]
    (_, _, af), (_, _, ab), _ = cm.overlap_shares(cal, cm.GDN, 16384, 128)[0]
    assert len(header) == 1 and f"{af:.1f}x / {ab:.1f}x as long as alone there as measured, WHAT IF" in header[0]
    rows = [line for line in lines if not line.startswith("#")]
    assert rows and all(LINE.match(line) for line in rows)
    for line in rows:
        device = "transport=peer_memory" in line or "transport=nvshmem" in line
        assert ("(what if: --hop-pace alone)" in line) == device, line
    assert not any("what if" in line.lower() for line in _cli("--gpus", "256", "--op", "gdn"))


def test_the_overlap_is_read_off_the_side_stream_as_built_where_a_file_has_it():
    """A file that times the side stream at both priorities (``bench_overlap.py --side-priority``) gives the
    rows of the highest (as built); one with the default priority's alone, those; rows of another program count
    (``--aside-programs``) are not the hops as built."""
    data = json.loads((RESULTS / "overlap-h200x1-2026-11-29b.json").read_text(encoding="utf-8"))  # default priority
    normal = cm.overlap_rows("x.json", data)
    assert normal and {r["priority"] for r in normal} == {"normal"}
    high = [dict(r, side_priority="high", fwd_departure_ms=r["fwd_departure_ms"] / 2) for r in data["rows"]]
    both = cm.overlap_rows("x.json", dict(data, rows=[dict(r, side_priority="normal") for r in data["rows"]] + high))
    assert {r["priority"] for r in both} == {"high"}
    forward = lambda rows: [r["aside"] for r in rows if r["direction"] == "fwd" and r["hidden"]]  # noqa: E731
    assert all(h < n for h, n in zip(forward(both), forward(normal)))
    other = [dict(r, aside_programs=64) for r in data["rows"]]
    assert cm.overlap_rows("x.json", dict(data, rows=other)) == []
    # the shipped file with both: the high priority's, whose forward hop keeps a better pace
    shipped = cm.overlap_rows("x.json", json.loads((RESULTS / "overlap-h200x1-2026-11-29c.json").read_text(encoding="utf-8")))
    assert {r["priority"] for r in shipped} == {"high"}
    gla = lambda rows: forward([r for r in rows if r["op"] == "gla"])  # noqa: E731
    assert len(gla(shipped)) == 2 and all(h < n for h, n in zip(gla(shipped), gla(normal)))


def test_command_line_prints_rows_for_each_operator():
    lines = _cli("--gpus", "256", "--tokens-per-gpu", "16384", "--op", "all")
    blocks, ops = [], []
    for line in lines:
        if line.startswith("#") and not line.startswith(("# gdn:", "# kda:", "# overlap")):
            blocks.append([])
            ops.append(line)
        elif not line.startswith("#"):
            assert LINE.match(line), line
            blocks[-1].append(line)
    assert len(blocks) == 3 and all(len(b) == 12 for b in blocks)
    assert "measured on the H200" in ops[1] and ops[1].startswith("# gdn (")
    assert "measured on the H200" in ops[2] and ops[2].startswith("# kda (")
    assert sum("the ZeCO piece 1." in x and "x the one-GPU op (measured, GPU time at 16384 tokens)" in x
               for x in lines) == 2
    gla = _cli("--gpus", "256", "--tokens-per-gpu", "16384")
    assert blocks[0] == [line for line in gla if not line.startswith("#")] and ops[0] == gla[0]
    assert blocks[1] != blocks[0]  # the dense maps cost more per hop; the local op differs
    # LASP-1's ring is built for GLA only (megatron_zeco.cp.config.RULES)
    assert [line.startswith("lasp1") and "cannot run: not built for" in line for line in blocks[1]] == [
        line.startswith("lasp1") for line in blocks[1]]
    assert not any("cannot run" in line for line in blocks[0] if line.startswith("lasp1"))
    # at 256 GPUs the device transport is NVSHMEM, whose costs are projected
    for line in blocks[1] + blocks[2]:
        if "transport=peer_memory" in line or "transport=nvshmem" in line:
            assert "(projected)" in line, line
    assert sum("# gdn: dense K x K maps: 1 MiB per state hop, 2 MiB per map message" in x for x in lines) == 1
    assert _cli("--gpus", "8", "--op", "gdn", "--op", "gla")[0].startswith("# gdn (")
    with pytest.raises(SystemExit):
        with contextlib.redirect_stderr(io.StringIO()) as err:
            cm.main(["--gpus", "8", "--op", "gdn", "--regime", "eager"])
    assert "no measured one-GPU eager op time of gdn" in err.getvalue()


def test_the_dense_hop_is_the_timed_kernel_over_the_device_transports_and_the_products_over_send_recv():
    """The delta rules' hop over peer memory and NVSHMEM costs the measured per-hop cost (GLA's) plus what the
    dense hop kernel takes beyond GLA's, read off bench_hop.py's newest file (one launch for the whole state, every
    program, the rows per product and the products as built: one TF32 pass, for the 16-bit inputs the model
    describes), per block of K; over send/recv the combine is PyTorch's products, charged at the stated FP32 rate.
    Rows of the hop on few programs, of other rows per product or of three TF32 passes are not read; a file with
    no dense hop as built holds no calibration rows."""
    newest = json.loads((RESULTS / "hop-h200x1-2026-12-02b.json").read_text(encoding="utf-8"))
    us = {r["kind"]: r["us"] for r in newest["rows"] if r["part"] == "hop" and r["blocks"] == 1 and not r["aside"]
          and r["as_built"] and r["precision"] in (None, "tf32")}
    want = ((us["dense"] - us["diagonal"]) * 1e-6, (us["dense map"] - us["diagonal"]) * 1e-6)
    cal = _calibration()
    assert cal.dense_hop[16, 128] == pytest.approx(want, rel=1e-12)
    assert {r["part"] for r in newest["rows"]} == {"hop", "handout"}  # the hand-out's rows are not a hop's
    assert len(cm.hop_rows("x.json", newest)) == 2
    three = [r for r in newest["rows"] if r.get("precision") == "tf32x3" and r["blocks"] == 1 and not r["aside"]]
    assert three and all(r["us"] > us[r["kind"]] for r in three)  # one TF32 pass is the faster
    older = json.loads((RESULTS / "hop-h200x1-2026-12-02.json").read_text(encoding="utf-8"))  # three passes
    assert cm.hop_rows("x.json", older) == [] and cm.calibration_rows(older) == []
    data = json.loads((RESULTS / "hop-h200x1-2026-12-01.json").read_text(encoding="utf-8"))  # rows per product
    us = {r["kind"]: r["us"] for r in data["rows"] if r["blocks"] == 1 and not r["aside"] and r["as_built"]}
    slower = [r for r in data["rows"] if r["blocks"] == 1 and not r["aside"] and r["kind"] != "diagonal"
              and not r["as_built"]]
    assert slower and all(r["us"] > us[r["kind"]] for r in slower)  # the rows per product as built are the faster
    assert cm.hop_rows("x.json", dict(data, rows=[dict(r, aside=True) for r in data["rows"]])) == []
    for op in (cm.GDN, cm.KDA):
        w = cm.projection_workload(cal, 256, 16384, op=op)
        assert w.dense_hop == cal.dense_hop[16, 128]
        assert w.hop_apply_time(True, 4) == pytest.approx(want[0] / 4) and w.hop_compose_time(True) == want[1]
        assert w.hop_apply_time(False, 4) == w.apply_time(4) and w.hop_compose_time(False) == w.compose_time()
        untimed = dataclasses.replace(w, dense_hop=())
        c = cm.Cluster()
        for transport in ("send_recv", "nvshmem"):
            sw = cal.sw(transport)
            for shape in ("chain", "hierarchical"):
                timed, stated = (cm.layer_time("zeco", x, c, sw, 8, shape) for x in (w, untimed))
                if transport == "send_recv":
                    assert timed == stated, (op.name, shape)
                else:
                    assert timed != stated, (op.name, shape)  # the kernel's time, not the stated rate's products
    assert cm.projection_workload(cal, 256, 16384, op=cm.GLA).dense_hop == ()
    header = [x for x in _cli("--gpus", "8", "--op", "gdn") if x.startswith("# gdn:")]
    assert len(header) == 1 and "beyond GLA's hop per combine / compose (measured, one GPU)" in header[0], header
    # over peer memory on one node the dense hop is timed: not marked projected
    assert any("transport=peer_memory shape=chain" in x and "(projected)" not in x
               for x in _cli("--gpus", "8", "--op", "gdn"))


def test_recorded_delta_rule_efficiencies_are_the_models():
    """docs/scaling.md's table of the gated delta rule's projected efficiencies (16K tokens per GPU,
    64, 256 and 1024 GPUs, contiguous / zigzag), row by row."""
    pair = r"(\d\.\d{3}) / (\d\.\d{3})"
    table = {m.group(1): [float(x) for x in m.group(*range(2, 8))] for m in re.finditer(
        rf"^\| (.+?) \| {pair} \| {pair} \| {pair} \|$", SCALING.read_text(encoding="utf-8"), flags=re.M)}
    cal = _calibration()
    rows = {"zeco: the hierarchical shape in the device kernels over NVSHMEM (*projected*; its overlap measured on "
            "one GPU)": ("zeco-hierarchical", ["nvshmem"]),
            "zeco: hierarchical over send/recv (measured message costs, *projected* products)":
                ("zeco-hierarchical", ["send_recv"]),
            "zeco: chain over NVSHMEM (*projected*)": ("zeco-chain", None),
            "LASP-2 (all-gather of state and transition)": ("lasp2", None)}
    assert set(rows) <= set(table), sorted(table)
    for label, (strategy, transports) in rows.items():
        assert table[label] == [round(next(ch for ch in cm.project(cal, P, 16384, layout, layer=cm.LayerShape(op=cm.GDN),
                                                                   transports=transports)
                                           if ch.strategy == strategy).efficiency, 3)
                                for P in (64, 256, 1024) for layout in cm.LAYOUTS], label


def test_overlap_rows_read_the_modes_as_built_only():
    """bench_overlap.py's modes that are not built (``partition``: the hop on SMs of its own; ``after``) do not
    move the calibration; its ``overlap`` rows do. The delta rules' rows of hops in other products than as built
    (this file's: three TF32 passes, from before the ``precision`` field) give none."""
    name = "overlap-partition-h200x1-2026-12-02.json"
    data = json.loads((RESULTS / name).read_text(encoding="utf-8"))
    assert cm.overlap_rows(name, data) == []
    data = dict(data, rows=[dict(r, precision=cm.DENSE_PRECISION) for r in data["rows"]])
    base = cm.overlap_rows(name, data)
    assert {r["op"] for r in base} == {"gdn"} and all(r["aside"] > 1 for r in base)

    def bent(modes):
        return dict(data, rows=[dict(r, **{k: 10 * r[k] for k in r if k.endswith("_ms")}) if r["mode"] in modes
                                else r for r in data["rows"]])

    assert cm.overlap_rows(name, bent({"partition", "after"})) == base
    assert cm.overlap_rows(name, bent({"overlap"})) != base
