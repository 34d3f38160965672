"""The GPU time of the delta rules' parallel correction kernels at each run length.

    python benchmarks/bench_runs.py --tokens 16384 --output-runs 1 2 4 8 --grad-runs 4 8 16 32 --out results/runs.json

A delta-rule piece (``kernels/delta_correction.py``) adds what the entering state contributes to its
output after the scan delivers it (K4: ``X_j = P_j S_in``, then ``o_c = o^0_c + R_c X_j`` per chunk) and
takes the entering state's gradient from the outputs' (K5: ``Z_r = P_j^T sum_c R_c^T do_c`` per run,
then their sum per segment). K4 and K5 run a program per run of chunks of a sub-piece, head and block of
value columns (``SubPieces.runs``): longer runs read each sub-piece's ``[K, V]`` block fewer times (K4's
loop is unrolled: a run's loads issue at once), shorter runs make more programs. Per run length
(``--output-runs``, ``--grad-runs``, and the lengths the kernels take by default, "as built"), each kernel
autotuned afresh: GPU time per call (the median over ``--iters`` calls issued back to back of
the sum of the call's kernel durations, from the profiler) and per kernel, on a piece of ``--tokens``
tokens cut into sub-pieces as the pieces cut them (``plan_sub_pieces``), bfloat16 R, o^0 and do,
``precision="input"`` as the pieces run 16-bit inputs. Every run length's output and A are checked against
the first run length's (the same up to the rounding of another autotuned config).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hop import kernels_us  # noqa: E402  (benchmarks/, beside this script)
from bench_overlap import meta  # noqa: E402  (the same meta, heads and dim)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128, help="K = V")
    p.add_argument("--output-runs", type=int, nargs="+", default=[1, 2, 4, 8], help="chunks per K4 program")
    p.add_argument("--grad-runs", type=int, nargs="+", default=[4, 8, 16, 32], help="chunks per K5 program")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="results/runs.json")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_runs.py needs a CUDA GPU")
    from megatron_zeco.kernels import delta_correction as dc

    device = torch.device("cuda")
    H, D = args.heads, args.dim
    rows = []
    for T in args.tokens:
        plan = dc.plan_sub_pieces(torch.tensor([0, T]), 64, H, D, device)
        g = torch.Generator(device=device).manual_seed(0)
        R = (torch.randn(1, T, H, D, device=device, generator=g) / D ** 0.5).bfloat16()
        o0, do = (torch.randn(1, T, H, D, device=device, generator=g).bfloat16() for _ in range(2))
        P = torch.randn(plan.num_pieces, H, D, D, device=device, generator=g) / D ** 0.5
        S_in = torch.randn(1, H, D, D, device=device, generator=g)
        longest = max(n for _, _, n in plan.pieces)
        for part, lengths, built in (("output", args.output_runs, dc.OUTPUT_RUN), ("grad", args.grad_runs, longest)):
            kernel = dc.delta_output_kernel if part == "output" else dc.delta_grad_kernel
            first = None  # (run length, result): what every other run length is checked against
            for run in sorted(set(lengths) | {built}):
                kernel.cache.clear()  # autotuned afresh at each run length
                if part == "output":
                    fn = lambda: dc.output_correction(o0, R, P, S_in, plan, precision="input", chunks_per_run=run)  # noqa: E731
                    got = fn()
                    first = first or (run, got)
                    ok = torch.allclose(got.float(), first[1].float(), rtol=1e-2, atol=1e-2)
                else:
                    fn = lambda: dc.entering_grad(R, P, do, plan, precision="input", chunks_per_run=run)  # noqa: E731
                    got = fn()
                    first = first or (run, got)
                    ok = torch.allclose(got, first[1], rtol=1e-3, atol=1e-3 * first[1].abs().max().item())
                if not ok:
                    raise RuntimeError(f"{part}, run length {run}: differs from run length {first[0]}'s")
                total, kernels = kernels_us(fn, args.iters)
                config = str(kernel.best_config) if getattr(kernel, "best_config", None) else None
                row = dict(part=part, tokens=T, sub_pieces=plan.num_pieces, chunks=plan.num_chunks,
                           chunks_per_run=run, runs=len(plan.runs(run)[0]), as_built=run == built, us=total,
                           kernels_us=kernels, config=config)
                rows.append(row)
                print(f"{part:6s} T={T} runs of {run:3d} chunks ({row['runs']:4d} runs)"
                      f"{' as built' if run == built else '':9s} {total:8.2f} us  " +
                      "  ".join(f"{k[:28]} {v:.2f}" for k, v in kernels.items()) + f"  [{config}]", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
