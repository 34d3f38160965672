"""Model-level throughput (issue 5): GLA-1B with Megatron-LM's pretrain_gpt.py on one node.

    MEGATRON_LM=third_party/megatron-lm python benchmarks/throughput.py --gpus 2 --out results/throughput.json

For each tokens-per-GPU T, trains the paper's GLA-1B shape (examples/pretrain_gla.sh MODEL=gla-1b,
bf16, mock data) for a few iterations on all GPUs of the node:

* ``cp1``: CP = 1 (data parallel over the GPUs), sequence T, one sequence per GPU;
* ``cp<N>`` with each strategy: CP = N = all GPUs, sequence N*T, one sequence per step.

So every run processes T tokens per GPU per iteration and has the same gradient all-reduce. Per
run: median time per iteration over the logged intervals after the first ``--skip``, tokens/s per
GPU, efficiency against cp1 at the same T, peak memory (Megatron's report), and the loss. Logs
go beside the JSON.
"""

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

from compare_losses import curve

HERE = os.path.dirname(os.path.abspath(__file__))
SPECS = {"zeco": "gla_local_spec", "lasp1": "gla_local_lasp1_spec", "lasp2": "gla_local_lasp2_spec",
         "a2a": "gla_local_a2a_spec"}
MEMORY = re.compile(r"max allocated: ([0-9.]+)")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768], help="tokens per GPU")
    p.add_argument("--strategies", nargs="+", default=["zeco", "lasp2", "a2a", "lasp1"])
    p.add_argument("--strategies-at-largest", nargs="+", default=None,
                   help="strategies run at the largest T (default: all)")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="logged intervals to drop (warm-up)")
    p.add_argument("--limit", type=int, default=240, help="seconds per run")
    p.add_argument("--out", default="throughput.json")
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    return p.parse_args()


def run(args, cp, T, strategy, logdir):
    """One pretrain_gpt.py run at T tokens per GPU; returns its row."""
    name, seq = f"cp{cp}-{strategy}-T{T}", cp * T
    env = dict(os.environ, GPUS=str(args.gpus), CP=str(cp), SEQ=str(seq), MODEL="gla-1b", ITERS=str(args.iters),
               SPEC=SPECS["zeco" if strategy == "none" else strategy])
    flags = ["--global-batch-size", str(args.gpus // cp), "--log-interval", "2", *args.extra]
    log_path = os.path.join(logdir, f"{name}.log")
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", os.path.join(HERE, "..", "examples", "pretrain_gla.sh"), *flags],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=args.limit)
        except subprocess.TimeoutExpired:  # stop torchrun and its workers, which hold the GPUs
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "timeout"
    points = curve(log_path)  # {iteration: (loss, ms)}
    times = [ms for _, (_, ms) in sorted(points.items())][args.skip:]
    memory = [float(m) for m in MEMORY.findall(open(log_path, errors="replace").read())]
    ms = statistics.median(times) if times else None
    row = {"part": "model", "run": name, "cp": cp, "strategy": strategy, "layout": "zigzag",  # the specs' layout
           "layers": 20, "heads": 16, "dim": 128, "seq_length": seq, "tokens_per_gpu": T, "exit": code,
           "wall_s": round(time.time() - start, 1),
           "ms_per_iter": ms, "tokens_per_s_per_gpu": None if ms is None else T / ms * 1000,
           "max_allocated_gib": max(memory) / 1024 if memory else None,
           "final_loss": points[max(points)][0] if points else None}
    speed = "-" if ms is None else f"{ms:9.1f} ms/iter {row['tokens_per_s_per_gpu']:9.0f} tok/s/GPU"
    print(f"{name:14s} exit {code!s:7s} {speed}  mem {row['max_allocated_gib'] or 0:.1f} GiB  "
          f"({row['wall_s']} s)", flush=True)
    return row


def main():
    args = parse_args()
    logdir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(logdir, exist_ok=True)
    rows = []
    for T in args.tokens:
        strategies = args.strategies if T != max(args.tokens) or args.strategies_at_largest is None \
            else args.strategies_at_largest
        base = run(args, 1, T, "none", logdir)
        rows.append(base)
        _write(args, rows)
        for s in strategies:
            row = run(args, args.gpus, T, s, logdir)
            if row["ms_per_iter"] and base["ms_per_iter"]:
                row["efficiency"] = base["ms_per_iter"] / row["ms_per_iter"]
                print(f"{'':14s} efficiency vs cp1: {row['efficiency']:.3f}", flush=True)
            rows.append(row)
            _write(args, rows)


def _write(args, rows):
    import torch
    meta = {"command": f"python benchmarks/throughput.py {' '.join(sys.argv[1:])}",
            "device": f"{torch.cuda.get_device_name()} x{args.gpus}" if torch.cuda.is_available() else "cpu",
            "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1 (launcher default)"),
            "model": "GLA-1B: 20 layers, hidden 2048, 16 heads of 128, ffn 5632, bf16, mock data"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
