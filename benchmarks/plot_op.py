"""Draw bench_op.py's JSON: operator time per strategy, and state-passing time per method.

    python benchmarks/plot_op.py results/op.json docs/img/op.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    data = json.load(open(src))
    rows, meta = data["rows"], data["meta"]
    scans = [r for r in rows if r["part"] == "scan"]
    fig, axes = plt.subplots(1, 2 if scans else 1, figsize=(13 if scans else 8, 5), squeeze=False)
    left = axes[0][0]
    ops = [r for r in rows if r["part"] == "op"]
    ops = [r for r in ops if r["tokens_per_gpu"] == ops[0]["tokens_per_gpu"]]  # the first length
    labels = [f"{r['strategy']} CP={r['cp']}" + ("" if r["cp"] == 1 else f" {r['layout'][:6]}")
              + (f" ({r['mode']})" if r.get("mode", "eager") != "eager" else "") for r in ops]
    colors = {(True, False): "tab:gray", (False, False): "tab:blue", (True, True): "silver", (False, True): "tab:cyan"}
    left.bar(range(len(ops)), [r["ms"] for r in ops],
             color=[colors[r["cp"] == 1, r.get("mode", "eager") != "eager"] for r in ops])
    left.set_xticks(range(len(ops)), labels, fontsize=7, rotation=90)
    left.set_ylabel("fwd + bwd, ms (slowest rank, median)")
    left.set_title(f"GLA operator, {ops[0]['tokens_per_gpu']} tokens/GPU, H={ops[0]['heads']}, D={ops[0]['dim']}, bf16")
    if scans:
        right = axes[0][1]
        for method in dict.fromkeys(r["method"] for r in scans):
            pts = [(r["state_mib"], r["ms"] * 1000) for r in scans if r["method"] == method]
            right.plot(*zip(*pts), marker="o", label=method)
        right.set_xscale("log", base=2)
        right.set_yscale("log")
        right.set_xlabel("state size, MiB (fp32)")
        right.set_ylabel("us (slowest rank, median)")
        right.set_title("passing one state between 2 GPUs")
        right.legend(fontsize=7)
    fig.suptitle(f"{meta['device']}, {meta['date']}, torch {meta['torch']}, fla {meta['fla']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
