"""The GPU time of the delta rules' parallel correction kernels at each run length.

    python benchmarks/bench_runs.py --tokens 16384 --runs 1 2 4 8 16 32 --out results/runs.json

A delta-rule piece (``kernels/delta_correction.py``) adds what the entering state contributes to its
output after the scan delivers it (K4: ``X_j = P_j S_in``, then ``o_c = o^0_c + R_c X_j`` per chunk) and
takes the entering state's gradient from the outputs' (K5: ``Z_r = P_j^T sum_c R_c^T do_c`` per run,
then their sum per segment). K4 and K5 run a program per run of chunks of a sub-piece, head and block of
value columns (``SubPieces.runs``): longer runs read each sub-piece's ``[K, V]`` block fewer times, shorter
runs make more programs. Per run length (``--runs``, and the length ``chunks_per_run`` picks, "as built"),
each kernel autotuned afresh: GPU time per call (the median over ``--iters`` calls issued back to back of
the sum of the call's kernel durations, from the profiler) and per kernel, on a piece of ``--tokens``
tokens cut into sub-pieces as the pieces cut them (``plan_sub_pieces``), bfloat16 R, o^0 and do,
``precision="input"`` as the pieces run 16-bit inputs. A run length of 1 is K4 as it was (a program per
chunk); one at least a sub-piece's length is K5 as it was (a program per sub-piece). Every run length's
output is checked to be the same bits as a run of one chunk's, and its A to agree with it.
"""

import argparse
import collections
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overlap import meta  # noqa: E402  (benchmarks/, beside this script: the same meta, heads and dim)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128, help="K = V")
    p.add_argument("--runs", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="chunks per run")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="results/runs.json")
    return p.parse_args(argv)


def gpu_us(fn, iters):
    """Per call of ``fn``: the median over ``iters`` calls of the sum of its kernels' GPU durations, and the
    median duration of each kernel (by name)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_kernel = collections.defaultdict(list)
    for e in events:
        per_kernel[e.name].append(e.device_time)
    if any(len(v) % iters for v in per_kernel.values()):
        raise RuntimeError(f"the profiler saw {len(events)} kernels over {iters} calls")
    calls = [sum(v[i * (len(v) // iters) + r] for v in per_kernel.values() for r in range(len(v) // iters))
             for i in range(iters)]
    return statistics.median(calls), {k: statistics.median(v) for k, v in per_kernel.items()}


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_runs.py needs a CUDA GPU")
    import triton

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
        built = dc.chunks_per_run(plan, H, triton.cdiv(D, min(triton.next_power_of_2(D), 64)), device)
        lengths = sorted(set(args.runs) | {built})
        first = None
        for run in lengths:
            for kernel in (dc.delta_output_kernel, dc.delta_grad_kernel):
                kernel.cache.clear()  # autotuned afresh at each run length
            out = lambda: dc.output_correction(o0, R, P, S_in, plan, precision="input", chunks_per_run=run)  # noqa: E731
            grad = lambda: dc.entering_grad(R, P, do, plan, precision="input", chunks_per_run=run)  # noqa: E731
            o, A = out(), grad()
            if first is None:
                first = (o, A)
            elif not torch.equal(o, first[0]) or not torch.allclose(A, first[1], rtol=1e-4, atol=1e-4 * A.abs().max()):
                raise RuntimeError(f"run length {run}: the output or A differs from run length {lengths[0]}'s")
            for part, fn, kernel in (("output", out, dc.delta_output_kernel), ("grad", grad, dc.delta_grad_kernel)):
                total, kernels = gpu_us(fn, args.iters)
                config = str(kernel.best_config) if getattr(kernel, "best_config", None) else None
                row = dict(part=part, tokens=T, sub_pieces=plan.num_pieces, chunks=plan.num_chunks,
                           chunks_per_run=run, runs=len(plan.runs(run)[0]), as_built=run == built, us=total,
                           kernels_us=kernels, config=config)
                rows.append(row)
                print(f"{part:6s} T={T} runs of {run:3d} chunks ({row['runs']:4d} runs){' as built' if run == built else '':9s}"
                      f" {total:8.2f} us  " + "  ".join(f"{k[:28]} {v:.2f}" for k, v in kernels.items()) +
                      f"  [{config}]", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
