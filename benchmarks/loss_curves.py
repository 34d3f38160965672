"""Loss curves of Megatron-LM training runs, kept as one CSV, and their comparison tables.

    # one row per logged iteration of each run, from its pretrain_gpt.py log
    python benchmarks/loss_curves.py extract docs/results/loss-curves.csv \
        gla-bf16-cp1=runs/parity/cp1.log gla-bf16-cp2=runs/parity/cp2.log --date 2026-11-22 --code 6d0fe83
    # the comparison table of runs (the first is the reference), as docs/megatron.md shows it
    python benchmarks/loss_curves.py compare docs/results/loss-curves.csv gla-bf16-cp1 gla-bf16-cp2

``extract`` appends the runs to the CSV (replacing rows of a run of the same name): columns
``run, date, code, iteration, lm_loss, ms_per_iteration``, the loss as Megatron printed it.
``compare`` prints a markdown table of the runs' losses at every iteration they all logged (or
``--iterations``), with the largest relative difference to the first run, and exits non-zero
beyond ``--tol``, as ``compare_losses.py`` does for the logs themselves.
"""

import argparse
import csv
import os
import sys

from compare_losses import curve

COLUMNS = ("run", "date", "code", "iteration", "lm_loss", "ms_per_iteration")


def read(path):
    """``{run: {iteration: (loss, ms)}}`` and ``{run: (date, code)}`` of a loss-curve CSV."""
    curves, meta = {}, {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            curves.setdefault(row["run"], {})[int(row["iteration"])] = (float(row["lm_loss"]),
                                                                       float(row["ms_per_iteration"]))
            meta[row["run"]] = (row["date"], row["code"])
    return curves, meta


def extract(args):
    kept = []
    names = [spec.split("=", 1)[0] for spec in args.runs]
    if os.path.exists(args.csv):
        with open(args.csv, newline="") as f:
            kept = [row for row in csv.DictReader(f) if row["run"] not in names]
    rows = []
    for spec in args.runs:
        name, log = spec.split("=", 1)
        points = curve(log)
        if not points:
            print(f"{log}: no 'lm loss' lines", file=sys.stderr)
            return 1
        rows += [{"run": name, "date": args.date, "code": args.code, "iteration": it, "lm_loss": f"{loss:.6E}",
                  "ms_per_iteration": f"{ms:.1f}"} for it, (loss, ms) in sorted(points.items())]
    with open(args.csv, "w", newline="") as f:
        out = csv.DictWriter(f, COLUMNS, lineterminator="\n")
        out.writeheader()
        out.writerows(kept + rows)
    return 0


def compare(args):
    curves, meta = read(args.csv)
    missing = [r for r in args.runs if r not in curves]
    if missing:
        print(f"{args.csv} has no run {', '.join(missing)}; it has {', '.join(curves)}", file=sys.stderr)
        return 2
    common = sorted(set.intersection(*(set(curves[r]) for r in args.runs)))
    iterations = [i for i in (args.iterations or common) if i in common]
    if not iterations:
        print("the runs share no logged iteration", file=sys.stderr)
        return 2
    print("| iteration | " + " | ".join(args.runs) + " | largest rel. diff |")
    print("|---:|" + "---:|" * (len(args.runs) + 1))
    worst = 0.0
    for it in iterations:
        losses = [curves[r][it][0] for r in args.runs]
        diff = max(abs(x - losses[0]) / abs(losses[0]) for x in losses)
        worst = max(worst, diff)
        print(f"| {it} | " + " | ".join(f"{x:.4f}" for x in losses) + f" | {diff:.1e} |")
    for r in args.runs:
        times = [curves[r][it][1] for it in common[1:]] or [curves[r][common[0]][1]]
        date, code = meta[r]
        print(f"{r} ({date}, code {code or 'not recorded'}): median ms/iteration {sorted(times)[len(times) // 2]:.1f}")
    print(f"largest relative loss difference {worst:.2e} (tolerance {args.tol})")
    return 0 if worst <= args.tol else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("extract", help="add runs from pretrain_gpt.py logs to the CSV")
    p.add_argument("csv")
    p.add_argument("runs", nargs="+", metavar="NAME=LOG")
    p.add_argument("--date", default="")
    p.add_argument("--code", default="", help="the commit the run used")
    p = sub.add_parser("compare", help="a markdown table of runs' losses")
    p.add_argument("csv")
    p.add_argument("runs", nargs="+", metavar="NAME")
    p.add_argument("--iterations", type=int, nargs="+")
    p.add_argument("--tol", type=float, default=float("inf"), help="largest relative loss difference allowed")
    args = parser.parse_args()
    return extract(args) if args.what == "extract" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
