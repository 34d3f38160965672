"""Cost model (megatron_zeco/cost_model.py): calibration against the measured points, and the formulas."""

import dataclasses
import json
import random

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
    parameters: typical misfit <= 25%, none beyond 60%."""
    cal = cm.calibrate(cm.default_rows())
    rel = sorted(abs(r.rel) for r in cal.residuals)
    assert rel[len(rel) // 2] <= 0.25, rel
    bad = [f"{r.what}: {r.rel:+.1%}" for r in cal.residuals if abs(r.rel) > 0.60]
    assert not bad, bad
    sw = cal.software
    assert min(sw.scan_call, sw.gather_call, cal.nccl_call, sw.a2a_copy) > 0 and sw.message >= 0, sw
    measured = [b for b, spec in cm.BUILDS.items() if spec is not None and b in cal.builds]
    assert len(measured) >= 2 and all(min(cal.builds[b].state_pass, cal.builds[b].state_grad_pass) > 0
                                      for b in measured), cal.builds


def test_calibration_recovers_known_costs_from_json(tmp_path, seed):
    """Rows made by the model from random costs, written as JSON files: calibrate() finds those costs again."""
    rng = random.Random(seed)
    cluster = cm.Cluster()
    # per-block issue above the hop time (hop + wire), as measured: the form calibrate() fits
    true = dataclasses.replace(FREE, message=rng.uniform(4e-5, 2e-4), hop=rng.uniform(1e-6, 1e-5),
                               scan_call=rng.uniform(0, 3e-4), a2a_wire=rng.uniform(0.5, 3),
                               gather_call=rng.uniform(0, 3e-4), fold_launch=cm.FOLD_LAUNCH_BUILT,
                               state_pass=rng.uniform(1e-12, 1e-11), state_grad_pass=rng.uniform(1e-12, 1e-11),
                               a2a_copy=rng.uniform(1e-12, 1e-11), build="fla piece")
    nccl_call, op_ms, other_ms, T, H, D = rng.uniform(1e-5, 1e-4), rng.uniform(1, 10), rng.uniform(1, 20), 8192, 8, 64
    w = cm.Workload(P=1, tokens=T, heads=H, k_dim=D, v_dim=D, op_ms=op_ms)
    ops = [dict(part="op", tokens_per_gpu=T, heads=H, dim=D, strategy="none", cp=1, layout="contiguous", ms=op_ms)]
    ops += [dict(part="op", tokens_per_gpu=T, heads=H, dim=D, strategy=s, cp=P, layout=lay,
                 ms=cm.layer_time(s, dataclasses.replace(w, P=P, layout=lay), cluster, true) * 1e3)
            for s in ("zeco", "lasp1", "lasp2", "a2a") for P in (2, 4) for lay in ("contiguous", "zigzag")]
    (fwd, bwd), unit = cm.BUILDS[true.build]
    ops += [dict(part="kernel", tokens_per_gpu=T, name=name, ms=getattr(w, unit) * per_byte * 1e3)
            for name, per_byte in ((fwd, true.state_pass), (bwd, true.state_grad_pass))]
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
        (tmp_path / f"{name}.json").write_text(json.dumps({"meta": {"build": true.build}, "rows": rows}))

    cal = cm.calibrate(cm.load_rows(str(tmp_path / "*.json")), cluster, build=true.build)
    for field in ("message", "hop", "scan_call", "gather_call", "state_pass", "state_grad_pass", "a2a_copy",
                  "a2a_wire"):
        assert getattr(cal.builds[true.build], field) == pytest.approx(getattr(true, field), rel=1e-9), field
    assert cal.nccl_call == pytest.approx(nccl_call, rel=1e-9)
    assert cal.other_ms[(T, H, D, layers)] == pytest.approx(other_ms, rel=1e-9)
    assert len(cal.residuals) == 2 + len(scans) + len(ops) - 3 + 1  # op rows: one run per configuration
    assert max(abs(r.rel) for r in cal.residuals) < 1e-9


@pytest.mark.parametrize("P", [2, 3, 8, 100])
def test_pipelined_chain_is_the_papers_formula(P):
    """One link, no software cost: K blocks take tau(S) + (P-2) tau(S)/K (paper eq. 12 counts one block stage
    more: tau(S) + (P-1) tau(S)/K); K = 1 is P - 1 sequential hops; latency and per-message costs add per stage."""
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
        assert cm.chain_time(w, c, sw, K) == pytest.approx(call + (P + K - 2) * (m + alpha + tau / K), rel=1e-12)
    # zigzag: up the ranks, a same-rank turn (message only), back down
    zig = cm.chain_time(workload(P, "zigzag"), c, sw, 4)
    assert zig == pytest.approx(call + 2 * (P - 1) * (m + alpha + tau / 4) + m + 3 * (m + alpha + tau / 4), rel=1e-12)


def test_slowest_hop_paces_the_pipeline():
    """Hops of different speed: sum of the per-block hop times + (K-1) x the slowest (the InfiniBand hop)."""
    c = cm.Cluster(gpus_per_node=4)
    w = workload(12)
    assert c.chain_hops(12, "contiguous") == (9, 2, 0)
    for K in (1, 4):
        nv, ib = (link.time(w.state_bytes / K) for link in (c.intra, c.inter))
        assert cm.chain_time(w, c, FREE, K) == pytest.approx(9 * nv + 2 * ib + (K - 1) * ib, rel=1e-12)


def _softwares():
    cal = cm.calibrate(cm.default_rows())
    return {"built": cal.software, "design": cm.target(cal), "exposed": cm.target(cal, overlapped=False)}


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_time_grows_with_P_and_efficiency_is_at_most_one(layout):
    c = cm.Cluster()
    for name, sw in _softwares().items():
        for strategy in cm.STRATEGIES:
            ps = [P for P in [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 256, 1024] if strategy != "a2a" or 16 % P == 0]
            w = [workload(P, layout) for P in ps]
            times = [cm.best_blocks(x, c, sw)[1] if strategy == "zeco" else cm.layer_time(strategy, x, c, sw)
                     for x in w]
            assert all(a <= b * (1 + 1e-12) for a, b in zip(times, times[1:])), (name, strategy, times)
            assert all(cm.efficiency(strategy, x, c, sw) <= 1 + 1e-12 for x in w), (name, strategy)
        ks = [cm.best_blocks(workload(P, layout), c, sw)[0] for P in (2, 16, 256, 1024)]
        assert ks == sorted(ks), (name, ks)  # deeper chains want more blocks


def test_limits():
    c = cm.Cluster()
    sws = _softwares()
    for sw in sws.values():  # one rank: every strategy is the local op
        assert {cm.layer_time(s, workload(1), c, sw) for s in cm.STRATEGIES} == {4e-3}
    free_link = cm.Link(latency=0.0, bandwidth=float("inf"))
    free = cm.Cluster(intra=free_link, inter=free_link)
    design = dataclasses.replace(sws["design"], message=0.0, hop=0.0, scan_call=0.0, gather_call=0.0)
    for P in (2, 1024):  # free links: the corrections, LASP-2's fold and the ring's serialisation remain
        assert cm.efficiency("zeco", workload(P), free, design) == pytest.approx(1 / (1 + design.extra))
        fold = cm.gather_time(workload(P), free, design)[1]
        assert cm.layer_time("lasp2", workload(P), free, design) == pytest.approx(4e-3 * (1 + design.extra) + 2 * fold)
        assert cm.layer_time("lasp1", workload(P), free, FREE) == pytest.approx(P * 4e-3)
    # one hop (P = 2) gains nothing from blocks when each message costs something
    assert cm.best_blocks(workload(2), c, sws["exposed"])[0] == 1
    # the overlap hides the scan while it fits in the window, and only then
    w = workload(8)
    assert cm.layer_time("zeco", w, c, sws["design"]) == pytest.approx(4e-3 * (1 + sws["design"].extra))
    assert cm.efficiency("zeco", workload(1024), c, sws["design"]) < 0.9


def test_bad_input_names_the_argument():
    c, sw = cm.Cluster(), _softwares()["built"]
    with pytest.raises(ValueError, match="K .* must divide k_dim"):
        cm.layer_time("zeco", workload(4), c, sw, K=3)
    with pytest.raises(ValueError, match="P must divide heads"):
        cm.layer_time("a2a", workload(32), c, sw)
    with pytest.raises(ValueError, match="strategy must be one of"):
        cm.layer_time("ring", workload(4), c, sw)
    with pytest.raises(ValueError, match="layout must be"):
        cm.layer_time("zeco", workload(4, "striped"), c, sw)
    with pytest.raises(ValueError, match="no measured rows"):
        cm.load_rows("/nonexistent/*.json")
