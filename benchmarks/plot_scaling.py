"""Projected CP efficiency vs P per strategy from the calibrated cost model.

    python benchmarks/plot_scaling.py > /tmp/scaling-tables.md

Calibrates ``megatron_zeco.cost_model`` on every ``docs/results/*.json``, draws efficiency
(t(none) / t(strategy), same tokens per GPU) for P = 2..1024 at 16K and 32K tokens per GPU into
``docs/img/scaling-{16k,32k}.png`` with the measured points and the ZeCO paper's reported ones,
and prints the tables of ``docs/scaling.md`` (residuals, projection, the 256-GPU breakdown).
CPU only, a few seconds.
"""

import dataclasses
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from megatron_zeco import cost_model as cm

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
PS = [2 ** i for i in range(1, 11)]
HEADS, DIM = 16, 128  # the measured shape (and GLA-1B's: 16 heads of 128)
COLORS = {"zeco": "tab:blue", "lasp2": "tab:orange", "lasp1": "tab:red", "a2a": "tab:green"}
# ZeCO paper (Chou et al., NeurIPS 2025), reported, not verified here: efficiency = no-CP / ZeCO at the same P.
PAPER_OP_16K = {8: 6.39 / 7.32, 128: 6.12 / 9.88}  # GLA operator fwd+bwd, 16K tokens/GPU, H = 16
PAPER_MODEL_32K = {"zeco": {8: 47.4 / 49.6, 256: 41.0 / 46.6}, "lasp2": {256: 25.4 / 46.6}}  # GLA-1B tokens/s


def workload(cal, P, tokens, layout="contiguous", other_ms=0.0):
    """16 heads of 128, bf16; op time from the measurement at 16K, linear in tokens (docs/scaling.md)."""
    base_tokens = min(t for t, h, d in cal.op_ms if (h, d) == (HEADS, DIM))
    op_ms = cal.op_ms[(base_tokens, HEADS, DIM)] * tokens / base_tokens
    return cm.Workload(P=P, tokens=tokens, heads=HEADS, k_dim=DIM, v_dim=DIM, op_ms=op_ms, layout=layout,
                       other_ms=other_ms)


def curves(cal, cluster, tokens):
    """{label: (software, strategy, layout)} per panel; lasp1 and a2a only as built (the design leaves them)."""
    built, design, exposed = cal.software, cm.target(cal), cm.target(cal, overlapped=False)
    return (
        {"zeco": (built, "zeco", "contiguous"), "zeco zigzag": (built, "zeco", "zigzag"),
         "lasp2": (built, "lasp2", "contiguous"), "lasp1": (built, "lasp1", "contiguous"),
         "a2a": (built, "a2a", "contiguous")},
        {"zeco overlapped": (design, "zeco", "contiguous"), "zeco overlapped zigzag": (design, "zeco", "zigzag"),
         "zeco exposed": (exposed, "zeco", "contiguous"), "lasp2 overlapped": (design, "lasp2", "contiguous")},
    )


def efficiencies(cal, cluster, sw, strategy, layout, tokens, other_ms=0.0):
    ps = [P for P in PS if strategy != "a2a" or HEADS % P == 0]
    return ps, [cm.efficiency(strategy, workload(cal, P, tokens, layout, other_ms), cluster, sw) for P in ps]


def plot(rows, cal, cluster, tokens, path):
    fig, axes = plt.subplots(1, 2, figsize=(13, 6.2), sharey=True)
    titles = ("as built (calibrated on 2 x H200, P = 2)", "overlapped design (stated figures, not built)")
    for ax, title, panel in zip(axes, titles, curves(cal, cluster, tokens)):
        for label, (sw, strategy, layout) in panel.items():
            style = "--" if "zigzag" in label else (":" if "exposed" in label else "-")
            ax.plot(*efficiencies(cal, cluster, sw, strategy, layout, tokens), style, color=COLORS[strategy],
                    label=label)
        ax.axhline(0.9, color="gray", lw=0.8)
        ax.axvline(cluster.gpus_per_node, color="gray", lw=0.8, ls=":")
        ax.text(cluster.gpus_per_node * 1.1, 0.02, "NVLink | InfiniBand", fontsize=7, color="gray")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("P (GPUs in the CP group)")
        ax.set_title(title, fontsize=10)
    none = {(r["tokens_per_gpu"], r["heads"], r["dim"]): r["ms"]
            for r in rows if r["part"] == "op" and r["strategy"] == "none"}
    measured = [r for r in rows if r["part"] == "op" and r["cp"] > 1 and r["tokens_per_gpu"] == tokens
                and (r["heads"], r["dim"]) == (HEADS, DIM) and r["strategy"] in COLORS]
    for r in measured:
        eff = none[(r["tokens_per_gpu"], r["heads"], r["dim"])] / r["ms"]
        axes[0].plot(r["cp"], eff, "o" if r["layout"] == "contiguous" else "s", ms=8, color=COLORS[r["strategy"]],
                     mfc="none" if r["layout"] == "zigzag" else COLORS[r["strategy"]])
    if measured:
        axes[0].plot([], [], "ko", label="measured (filled: contiguous, open: zigzag)")
    other = {k: v for k, v in cal.other_ms.items() if k[:3] == (tokens, HEADS, DIM)}
    for (_, _, _, layers), other_ms in other.items():
        axes[1].plot(*efficiencies(cal, cluster, cm.target(cal), "zeco", "zigzag", tokens, other_ms), "-.",
                     color="k", label=f"zeco overlapped zigzag, model level ({layers} layers, measured non-GLA time)")
    if tokens == 16384:
        axes[1].plot(list(PAPER_OP_16K), list(PAPER_OP_16K.values()), "*", ms=13, color=COLORS["zeco"],
                     label="ZeCO paper, operator (reported, not verified)")
    if tokens == 32768:
        for strategy, pts in PAPER_MODEL_32K.items():
            axes[1].plot(list(pts), list(pts.values()), "P", ms=10, color=COLORS[strategy], mfc="none",
                         label=f"{strategy}, paper GLA-1B model level (reported, not verified)")
    axes[0].set_ylabel("efficiency = t(none) / t(strategy), same tokens/GPU")
    axes[0].set_ylim(0, 1.05)
    for ax in axes:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    fig.suptitle(f"GLA layer fwd+bwd, {tokens // 1024}K tokens/GPU, H = {HEADS}, D = {DIM}, bf16; NVLink "
                 f"{cluster.intra.bandwidth / 1e9:.0f} GB/s, InfiniBand {cluster.inter.bandwidth / 1e9:.0f} GB/s "
                 f"{cluster.inter.latency * 1e6:.0f} us, {cluster.gpus_per_node} GPUs/node", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def residual_table(cal):
    """Operator (and model) rows one per line; the scan micro-benchmarks as (P, method) x state size."""
    print("| measured point | measured ms | model ms | model / measured - 1 | |\n|---|---|---|---|---|")
    scans = {}
    for r in cal.residuals:
        if r.what.startswith("scan "):
            _, P, mib, _, method = r.what.split(" ", 4)
            scans.setdefault(f"{P}, {method}", {})[mib] = r
            continue
        kind = "fitted" if r.fitted else "predicted"
        print(f"| {r.what} | {r.measured_ms:.3f} | {r.model_ms:.3f} | {r.rel:+.1%} | {kind} |")
    sizes = list(dict.fromkeys(mib for row in scans.values() for mib in row))
    print("\n| measured / model us | " + " | ".join(f"{m} MiB" for m in sizes) + " |\n|---|"
          + "---|" * len(sizes))
    for method, row in scans.items():
        kind = "fitted" if next(iter(row.values())).fitted else "predicted"
        cells = [f"{row[m].measured_ms * 1e3:.0f} / {row[m].model_ms * 1e3:.0f} ({row[m].rel:+.0%})" if m in row else "-"
                 for m in sizes]
        print(f"| {method} ({kind}) | " + " | ".join(cells) + " |")


def projection_table(cal, cluster, tokens):
    built, design, exposed = cal.software, cm.target(cal), cm.target(cal, overlapped=False)
    print("| P | zeco built (K) | lasp2 built | lasp1 | a2a | zeco design exposed (K) | zeco design overlapped (K) "
          "| same, zigzag (K) | lasp2 design overlapped |\n|---|---|---|---|---|---|---|---|---|")
    for P in PS[2:]:
        w, wz = workload(cal, P, tokens), workload(cal, P, tokens, "zigzag")

        def zeco(w, sw):
            K, t = cm.best_blocks(w, cluster, sw)
            return f"{w.op_ms * 1e-3 / t:.1%} ({K})"

        a2a = f"{cm.efficiency('a2a', w, cluster, built):.1%}" if HEADS % P == 0 else "- (P > H)"
        print(f"| {P} | {zeco(w, built)} | {cm.efficiency('lasp2', w, cluster, built):.1%} | "
              f"{cm.efficiency('lasp1', w, cluster, built):.2%} | {a2a} | {zeco(w, exposed)} | {zeco(w, design)} | "
              f"{zeco(wz, design)} | {cm.efficiency('lasp2', w, cluster, design):.1%} |")


def solve(f, lo, hi, want=0.9, steps=60):
    """x in [lo, hi] where the monotone f(x) crosses ``want`` (bisection)."""
    up = f(hi) > f(lo)
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (f(mid) < want) == up else (lo, mid)
    return (lo + hi) / 2


def breakdown(cal, cluster, P=256, tokens=16384):
    """Where ZeCO's time goes at P (design figures), and what each stated figure would have to be for 90%."""
    design = cm.target(cal)
    w = workload(cal, P, tokens)
    K, t = cm.best_blocks(w, cluster, design)
    intra, inter, _ = cluster.chain_hops(P, "contiguous")
    tau_nv, tau_ib = (design.hop + link.time(w.state_bytes / K) for link in (cluster.intra, cluster.inter))
    chain = cm.chain_time(w, cluster, design, K)
    no_wire = dataclasses.replace(cluster, intra=dataclasses.replace(cluster.intra, bandwidth=float("inf")),
                                  inter=dataclasses.replace(cluster.inter, bandwidth=float("inf")))
    t_op, us, ms = w.op_ms * 1e-3, 1e6, 1e3
    win_f, win_b = (design.overlap * f * t_op for f in (cm.FWD_FRACTION, 1 - cm.FWD_FRACTION))
    print(f"P = {P}, {tokens} tokens/GPU, best K = {K}: efficiency {t_op / t:.1%} "
          f"(t = {t * ms:.3f} ms, t_op = {t_op * ms:.3f} ms)")
    print(f"- chain = {design.scan_call * us:.0f} us + {intra} NVLink hops x {tau_nv * us:.2f} us + {inter} IB hops "
          f"x {tau_ib * us:.2f} us + {K - 1} x {max(tau_nv, tau_ib) * us:.2f} us = {chain * ms:.3f} ms, of which "
          f"latency and per-message terms {cm.chain_time(w, no_wire, design, K) * ms:.3f} ms")
    print(f"- forward window {win_f * ms:.3f} ms -> exposed {max(0, chain - win_f) * ms:.3f} ms; backward window "
          f"{win_b * ms:.3f} ms -> exposed {max(0, chain - win_b) * ms:.3f} ms; "
          f"corrections {design.extra * t_op * ms:.3f} ms")

    def eff(sw, w=w):
        return cm.efficiency("zeco", w, cluster, sw)

    message = solve(lambda m: eff(dataclasses.replace(design, message=m, hop=m)), 0, 1e-5)
    overlap = solve(lambda o: eff(dataclasses.replace(design, overlap=o)), 0, 1)
    need_tokens = solve(lambda n: eff(design, workload(cal, P, int(n))), 1024, 262144)
    print(f"- 90% needs one of: per-message cost <= {message * us:.2f} us (stated {design.message * us:.0f}); "
          f"overlap share >= {overlap:.2f} (stated {design.overlap}); tokens/GPU >= {need_tokens:.0f}")
    zig = workload(cal, P, tokens, "zigzag")
    print(f"- zigzag (Megatron's split, 2(P-1) hops): {cm.efficiency('zeco', zig, cluster, design):.1%}")


def paper_check(cal, cluster):
    """The model (design figures) at the paper's All-Scan benchmark: 256 GPUs, 32 heads of 128, fp32 state."""
    w = cm.Workload(P=256, tokens=8192, heads=32, k_dim=128, v_dim=128, op_ms=0.0)
    design = cm.target(cal)
    K = min((k for k in range(1, 129) if 128 % k == 0), key=lambda k: cm.chain_time(w, cluster, design, k))
    scan = cm.chain_time(w, cluster, design, K)
    gather = cm.gather_time(w, cluster, design)[0]
    print(f"256 GPUs, state 32x128x128 fp32: All-Scan {scan * 1e3:.2f} ms (K = {K}; paper 2.17), "
          f"NCCL all-gather {gather * 1e3:.2f} ms (paper 8.51)")
    m = solve(lambda m: cm.chain_time(w, cluster, dataclasses.replace(design, message=m, hop=m), K), 0, 1e-4,
              want=2.17e-3)
    sw = dataclasses.replace(design, message=m, hop=m)
    print(f"per-message cost reproducing the paper's 2.17 ms: {m * 1e6:.1f} us; with it ZeCO at 16K tokens/GPU: "
          + ", ".join(f"P={P} {cm.efficiency('zeco', workload(cal, P, 16384), cluster, sw):.1%}" for P in (8, 128, 256))
          + " (paper operator: 8 -> 87.3%, 128 -> 61.9%)")


def main():
    rows = cm.default_rows()
    cal, cluster = cm.calibrate(rows), cm.Cluster()
    for tokens in (16384, 32768):
        plot(rows, cal, cluster, tokens, os.path.join(ROOT, "docs", "img", f"scaling-{tokens // 1024}k.png"))
    sw = cal.software
    passes = (f"state passes {1 / sw.state_pass / 1e9:.0f} / {1 / sw.state_grad_pass / 1e9:.0f} GB/s"
              if sw.state_pass else "state terms fused into the chunk kernels (no separate passes)")
    print(f"as built: per block {sw.message * 1e6:.1f} us, per hop {sw.hop * 1e6:.1f} us, scan call {sw.scan_call * 1e6:.1f} us, gather call "
          f"{sw.gather_call * 1e6:.1f} us, NCCL all-gather call {cal.nccl_call * 1e6:.1f} us, {passes}, a2a copies "
          f"{1 / sw.a2a_copy / 1e9:.0f} GB/s, a2a wire x{sw.a2a_wire:.2f} of the stated links\n")
    residual_table(cal)
    for tokens in (16384, 32768):
        print(f"\n{tokens} tokens/GPU\n")
        projection_table(cal, cluster, tokens)
    print()
    breakdown(cal, cluster)
    paper_check(cal, cluster)


if __name__ == "__main__":
    main()
