"""Spread of fla's bf16 errors on one GPU over many seeds, for the two-GPU exactness test's problem.

For each seed and gate regime (``normal``, ``tiny``) of ``tests/gla/test_gpu.py``'s exactness problem
(B = 2, T = 640, H = 4, K = V = 64), runs ``zeco_gla`` on one GPU (fla's ``chunk_gla``) in bf16 and
compares every result with the float64 loop: the relative error ``||got - ref|| / ||ref||`` (what
the test bounds), and the error against the magnitude (the same result computed from |q|, |k|, ...:
what a cancellation cannot inflate). Prints the largest and median relative error per result and
writes every row as JSON lines to ``$OUT/errors.jsonl`` (or ``./errors.jsonl``).

    PYTHONPATH=. N=60 python benchmarks/bf16_error_spread.py
"""

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: tests.*
from tests.gla.test_gpu import NAMES, _run  # noqa: E402
from tests.helpers.reference import problem, reference, rel_err  # noqa: E402


def main():
    n = int(os.environ.get("N", 40))
    rows, start = [], time.time()
    for i in range(n):
        seed = 1000 + 7919 * i
        for gate in ("normal", "tiny"):
            x = problem(seed, B=2, T=640, H=4, K=64, V=64, gate=gate)
            ref = reference(x)
            magnitude = reference({k: t if t is None or k == "g" else t.abs() for k, t in x.items()})
            got = _run(x, torch.bfloat16)
            row = dict(seed=seed, gate=gate)
            for name in NAMES:
                error = float((got[name].double() - ref[name]).norm())
                row[name] = dict(rel=rel_err(got[name], ref[name]), of_magnitude=error / float(magnitude[name].norm()))
            rows.append(row)
        if i % 10 == 0:
            print(f"{i + 1} seeds, {time.time() - start:.0f} s", flush=True)
    out = os.path.join(os.environ.get("OUT", "."), "errors.jsonl")
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {n} seeds; rows in {out}")
    for gate in ("normal", "tiny"):
        mine = [r for r in rows if r["gate"] == gate]
        print(f"gate={gate}: result, relative error largest / median, error over magnitude largest")
        for name in NAMES:
            rel = sorted(r[name]["rel"] for r in mine)
            print(f"  {name:4s} {rel[-1]:.2e} / {rel[len(rel) // 2]:.2e}   "
                  f"{max(r[name]['of_magnitude'] for r in mine):.2e}")


if __name__ == "__main__":
    main()
