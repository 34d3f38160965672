"""Efficiency of the CP strategies as P grows, from the cost model as built; the emulated latency check.

    python benchmarks/plot_scaling.py > /tmp/scaling-tables.md

Calibrates ``megatron_zeco.cost_model`` on every ``docs/results/*.json`` and writes

* ``docs/img/scaling-{16k,32k}.png``: efficiency t(one GPU) / t(strategy) of one GLA layer for
  P = 2..1024 GPUs (8 per node), layers issued back to back as in training (the model's ``steady``
  regime), both layouts: ZeCO over each transport and shape, LASP-2, LASP-1, all-to-all; the
  points measured at P = 2 and 4 on one node (*measured*); every curve beyond them *projected*,
  the NVSHMEM curves from projected costs (dashed);
* ``docs/img/scaling-emulated.png``: the All-Scan's time with a latency between emulated nodes
  (``benchmarks/emulate_latency.py``'s results, *emulated* on the CPU) against the model's;

and prints the tables of ``docs/scaling.md``. CPU only, about a minute.
"""

import dataclasses
import glob
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, ROOT)

from megatron_zeco import cost_model as cm  # noqa: E402
PS = [2 ** i for i in range(1, 11)]
HEADS, DIM = 16, 128  # the measured shape (and GLA-1B's: 16 heads of 128)
COLORS = {"zeco": "tab:blue", "lasp2": "tab:orange", "lasp1": "tab:red", "a2a": "tab:green"}
ZECO = {  # label: (transport, shape, style)
    "zeco, peer memory, chain (one node)": ("peer_memory", "chain", dict(color="tab:cyan", ls="-", marker=".")),
    "zeco, send/recv, chain": ("send_recv", "chain", dict(color="tab:purple", ls=":")),
    "zeco, send/recv, hierarchical": ("send_recv", "hierarchical", dict(color="tab:purple", ls="-")),
    "zeco, NVSHMEM, chain (projected costs)": ("nvshmem", "chain", dict(color="tab:blue", ls=":")),
    "zeco, NVSHMEM, hierarchical (projected costs)": ("nvshmem", "hierarchical", dict(color="tab:blue", ls="--")),
}


def zeco_eff(cal, cluster, P, tokens, layout, transport, shape, regime="steady"):
    w = cm.projection_workload(cal, P, tokens, layout, HEADS, DIM, regime)
    choices = cm.zeco_choices(w, cluster, cal, regime, shapes=(shape,), transports=(transport,))
    return choices[0] if choices else None


def plot(rows, cal, cluster, tokens, path):
    fig, axes = plt.subplots(1, 2, figsize=(13, 6.2), sharey=True)
    for ax, layout in zip(axes, cm.LAYOUTS):
        for label, (transport, shape, style) in ZECO.items():
            pts = [(P, ch.efficiency) for P in PS
                   if (ch := zeco_eff(cal, cluster, P, tokens, layout, transport, shape))]
            ax.plot(*zip(*pts), label=label, **style)
        for strategy in ("lasp2", "lasp1", "a2a"):
            ps = [P for P in PS if strategy != "a2a" or HEADS % P == 0]
            sw = cal.sw("send_recv")
            eff = [cm.efficiency(strategy, cm.projection_workload(cal, P, tokens, layout, HEADS, DIM), cluster, sw)
                   for P in ps]
            ax.plot(ps, eff, "-", color=COLORS[strategy], label=strategy)
        steady_none = {(r["file"], r["tokens_per_gpu"]): r["ms"] for r in rows
                       if r["part"] == "op" and r["strategy"] == "none" and r["mode"] == "steady"}
        measured = [r for r in rows if r["part"] == "op" and r["mode"] == "steady" and r["cp"] > 1
                    and r["tokens_per_gpu"] == tokens and r["layout"] == layout and r["strategy"] in COLORS
                    and (r["file"], tokens) in steady_none]
        for r in measured:
            ax.plot(r["cp"], steady_none[r["file"], tokens] / r["ms"], "o", ms=7, color=COLORS[r["strategy"]],
                    mfc="none")
        if measured:
            ax.plot([], [], "ko", mfc="none", label="measured (2 x H200, back to back; zeco over peer memory)")
        ax.axhline(0.95, color="gray", lw=0.8)
        ax.axhline(0.90, color="gray", lw=0.6, ls=":")
        ax.axvline(cluster.gpus_per_node, color="gray", lw=0.8, ls=":")
        ax.text(cluster.gpus_per_node * 1.1, 0.02, "one node | several", fontsize=7, color="gray")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("P (GPUs in the CP group)")
        ax.set_title(f"{layout} layout: projected from the model as built (points: measured)", fontsize=10)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    axes[0].set_ylabel("efficiency = t(one GPU) / t(strategy), same tokens per GPU")
    axes[0].set_ylim(0, 1.05)
    fig.suptitle(f"Projected: GLA layer fwd+bwd, {tokens // 1024}K tokens/GPU, H = {HEADS}, D = {DIM}, bf16, layers "
                 f"back to back; NVLink {cluster.intra.bandwidth / 1e9:.0f} GB/s {cluster.intra.latency * 1e6:.0f} us, "
                 f"InfiniBand {cluster.inter.bandwidth / 1e9:.0f} GB/s {cluster.inter.latency * 1e6:.0f} us (stated), "
                 f"{cluster.gpus_per_node} GPUs/node", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def emulated_rows():
    files = sorted(glob.glob(os.path.join(ROOT, "docs", "results", "emulated-latency-*.json")))
    out = []
    for path in files:
        with open(path) as f:
            data = json.load(f)
        out += [dict(r, file=os.path.basename(path), meta=data["meta"]) for r in data["rows"]]
    return out


def plot_emulated(rows, path):
    delayed = [r for r in rows if r["alpha_ms"] > 0]
    if not delayed:
        return
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for (ns, shape), color in zip(sorted({(r["node_size"], r["shape"]) for r in delayed}),
                                  ["tab:red", "tab:blue", "tab:orange", "tab:green"]):
        pts = sorted((r["cp"], r["ms"], r["model_ms"]) for r in delayed if (r["node_size"], r["shape"]) == (ns, shape))
        ps, ms, model = zip(*pts)
        ax.plot(ps, ms, "o", color=color, label=f"{shape}, nodes of {ns}: emulated")
        ax.plot(ps, model, "-", color=color, lw=1, label=f"{shape}, nodes of {ns}: cost model")
    alpha = delayed[0]["alpha_ms"]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("P (gloo processes)")
    ax.set_ylabel("forward + backward All-Scan, ms")
    ax.set_title(f"Emulated on the CPU: {alpha:g} ms per message between nodes (send/recv transport)", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def emulated_table(rows):
    delayed = [r for r in rows if r["alpha_ms"] > 0]
    if not delayed:
        print("(no emulated results: run benchmarks/emulate_latency.py)")
        return
    meta = delayed[0]["meta"]
    print(f"{meta['command']} ({meta['date']}, {meta['cpus']} CPUs): per call {meta['fitted_call_ms']:.2f} ms, per "
          f"message {meta['fitted_message_ms']:.2f} ms (fitted without latency), alpha {delayed[0]['alpha_ms']:g} ms\n")
    print("| P | nodes of | shape | hops between nodes (fwd + bwd) | no latency ms | emulated ms | model ms "
          "| model / emulated - 1 |\n|---|---|---|---|---|---|---|---|")
    for r in delayed:
        zero = next(z["ms"] for z in rows if z["alpha_ms"] == 0 and all(z[k] == r[k] for k in
                                                                          ("cp", "layout", "node_size", "shape")))
        print(f"| {r['cp']} | {r['node_size']} | {r['shape']} | {r['inter_hops']:g} | {zero:.1f} | {r['ms']:.1f} | "
              f"{r['model_ms']:.1f} | {r['model_ms'] / r['ms'] - 1:+.1%} |")


def parameters(cal):
    print("| transport | regime | per call us | per message us | per hop us (beyond the wire) | rests on |\n"
          "|---|---|---|---|---|---|")
    source = {"send_recv": "scan code v2 rows (2 x H200)", "peer_memory": "scan code v3 rows (2 x H200)",
              "nvshmem": "projected: the peer-memory rows, stated InfiniBand between nodes"}
    for (t, regime), sw in cal.transports.items():
        print(f"| {t} | {regime} | {sw.scan_call * 1e6:.1f} | {sw.message * 1e6:.1f} | {sw.hop * 1e6:.1f} | "
              f"{source[t]} |")


def residual_table(cal):
    print("| measured point | measured ms | model ms | model / measured - 1 |\n|---|---|---|---|")
    for r in cal.residuals:
        if r.what.startswith(("op ", "model ")) and not r.fitted:
            print(f"| {r.what} | {r.measured_ms:.3f} | {r.model_ms:.3f} | {r.rel:+.1%} |")
    scans = [r for r in cal.residuals if r.what.startswith("scan ")]
    groups = {}
    for r in scans:
        key = r.what.split("(")[-1].rstrip(")") if "(code" in r.what else r.what.split(" MiB ")[1]
        groups.setdefault(key, []).append(abs(r.rel))
    print("\n| scan micro-benchmarks | rows | median misfit | largest |\n|---|---|---|---|")
    for key, rel in groups.items():
        rel.sort()
        print(f"| {key} | {len(rel)} | {rel[len(rel) // 2]:.0%} | {rel[-1]:.0%} |")


def projection_table(cal, cluster, tokens, regime="steady"):
    print("| P | layout | zeco: best (transport, shape, K) | zeco chain | zeco hierarchical | lasp2 | lasp1 | a2a |\n"
          "|---|---|---|---|---|---|---|---|")
    for P in PS[2:]:
        for layout in cm.LAYOUTS:
            lines = cm.project(cal, P, tokens, layout, cluster, regime, (HEADS, DIM))
            by = {ch.strategy: ch for ch in lines}

            def cell(ch, full=False):
                if ch.why_not:
                    return "-"
                where = f" ({ch.transport}{'*' if ch.projected else ''}, {ch.shape}, K={ch.K})" if full else \
                    (f" ({ch.transport}{'*' if ch.projected else ''})" if ch.transport else "")
                return f"{ch.efficiency:.1%}{where}"

            print(f"| {P} | {layout} | {cell(by['zeco'], True)} | {cell(by['zeco-chain'])} | "
                  f"{cell(by['zeco-hierarchical'])} | {cell(by['lasp2'])} | {cell(by['lasp1'])} | {cell(by['a2a'])} |")


def solve(f, lo, hi, want, steps=60):
    """x in [lo, hi] where the monotone f(x) crosses ``want`` (bisection); None if it does not."""
    if (f(lo) - want) * (f(hi) - want) > 0:
        return None
    up = f(hi) > f(lo)
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (f(mid) < want) == up else (lo, mid)
    return (lo + hi) / 2


def breakdown(cal, cluster, P, tokens=16384, want=0.95, regime="steady"):
    """Where the best ZeCO layer's time goes at P, and what one change alone would reach ``want``."""
    for layout in cm.LAYOUTS:
        w = cm.projection_workload(cal, P, tokens, layout, HEADS, DIM, regime)
        best = cm.zeco_choices(w, cluster, cal, regime)[0]
        sw = cal.sw(best.transport, regime)
        t_op = w.op_ms * 1e-3
        scans = [cm.scan_time(best.shape, w, cluster, sw, best.K, reverse) for reverse in (False, True)]
        print(f"- **{P} GPUs, {layout}**: zeco over {best.transport} ({best.shape}, K = {best.K}): "
              f"{best.efficiency:.1%}; layer {best.seconds * 1e3:.3f} ms = one GPU {t_op * 1e3:.3f} ms + forward scan "
              f"{scans[0] * 1e6:.0f} us + backward scan {scans[1] * 1e6:.0f} us ("
              + ("beside the in-chunk work as built)" if cm.TRANSPORTS[best.transport].device
                 else "nothing overlapped over send/recv as built)"))
        if best.shape == "hierarchical":
            ph = cm.hierarchical_phases(w, cluster, sw, best.K)
            print(f"  - forward scan by phase: A (prefix maps in nodes) {ph['A'] * 1e6:.0f} us, B (rounds between "
                  f"nodes) {(ph['B'] - ph['A']) * 1e6:.0f} us, C (state into nodes) {(ph['C'] - ph['B']) * 1e6:.0f} us")

        def eff(sw=sw, c=cluster, w=w):
            return cm.zeco_choices(w, c, dataclasses.replace(cal, transports={
                **cal.transports, (best.transport, regime): sw}), regime, transports=(best.transport,),
                shapes=(best.shape,))[0].efficiency

        needs = []
        omega = solve(lambda o: eff(dataclasses.replace(sw, overlap=o)), 0.0, 1.0, want)
        needs.append(f"overlap share of the local op >= {omega:.2f}" if omega is not None else "no overlap share")
        hop = solve(lambda h: eff(dataclasses.replace(sw, hop=h)), 0.0, sw.hop, want)
        needs.append(f"per-hop device cost <= {hop * 1e6:.1f} us (now {sw.hop * 1e6:.1f})" if hop is not None
                     else "no per-hop cost alone")
        ib = solve(lambda b: eff(c=dataclasses.replace(cluster, inter=dataclasses.replace(cluster.inter, bandwidth=b))),
                   cluster.inter.bandwidth, 1e13, want)
        needs.append(f"InfiniBand >= {ib / 1e9:.0f} GB/s per GPU" if ib is not None
                     else "no InfiniBand bandwidth alone")
        n = solve(lambda T: eff(w=cm.projection_workload(cal, P, int(T), layout, HEADS, DIM, regime)), 1024, 1 << 20,
                  want)
        needs.append(f">= {n / 1024:.0f}K tokens per GPU" if n is not None else "no token count")
        print(f"  - {want:.0%} needs one of: " + "; ".join(needs))


def main():
    rows = cm.default_rows()
    cal, cluster = cm.calibrate(rows), cm.Cluster()
    for tokens in (16384, 32768):
        plot(rows, cal, cluster, tokens, os.path.join(ROOT, "docs", "img", f"scaling-{tokens // 1024}k.png"))
    emulated = emulated_rows()
    plot_emulated(emulated, os.path.join(ROOT, "docs", "img", "scaling-emulated.png"))
    print("## Transport costs\n")
    parameters(cal)
    for tokens in (16384, 32768):
        print(f"\n## Projection, {tokens // 1024}K tokens per GPU (steady; * = projected transport costs)\n")
        projection_table(cal, cluster, tokens)
    print("\n## Where the time goes (16K tokens per GPU, steady)\n")
    for P in (256, 1024):
        breakdown(cal, cluster, P)
    print("\n## Emulated\n")
    emulated_table(emulated)
    print("\n## Calibration residuals\n")
    residual_table(cal)


if __name__ == "__main__":
    main()
