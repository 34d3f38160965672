"""Compare the loss curves in Megatron-LM training logs: a table and the largest difference.

    python benchmarks/compare_losses.py cp1.log cp2.log [--tol 0.02]

Exits non-zero if the logs cover different iterations or differ by more than ``--tol``
(relative) at any logged iteration.
"""

import argparse
import re
import sys

LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.eE+-]+).*?elapsed time per iteration \(ms\): ([0-9.]+)"
                  r"|iteration\s+(\d+)/\s*\d+ .*?elapsed time per iteration \(ms\): ([0-9.]+).*?lm loss: ([0-9.eE+-]+)")


def curve(path):
    points = {}
    for line in open(path, errors="replace"):
        m = LINE.search(line)
        if m:
            it, loss, ms = (m.group(1), m.group(2), m.group(3)) if m.group(1) else (m.group(4), m.group(6), m.group(5))
            points[int(it)] = (float(loss), float(ms))
    return points


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--tol", type=float, default=0.02, help="largest relative loss difference allowed")
    args = parser.parse_args()
    curves = [curve(p) for p in args.logs]
    iterations = sorted(curves[0])
    if not iterations or any(sorted(c) != iterations for c in curves):
        print("logs cover different iterations:", [sorted(c) for c in curves])
        return 1
    print("iteration | " + " | ".join(f"loss {p}" for p in args.logs) + " | max rel diff")
    worst = 0.0
    for it in iterations:
        losses = [c[it][0] for c in curves]
        diff = max(abs(x - losses[0]) / abs(losses[0]) for x in losses)
        worst = max(worst, diff)
        print(f"{it:9d} | " + " | ".join(f"{x:.4f}" for x in losses) + f" | {diff:.2e}")
    for p, c in zip(args.logs, curves):
        times = [c[it][1] for it in iterations[1:]] or [c[iterations[0]][1]]
        print(f"{p}: median ms/iteration {sorted(times)[len(times) // 2]:.1f}")
    print(f"largest relative loss difference {worst:.2e} (tolerance {args.tol})")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
