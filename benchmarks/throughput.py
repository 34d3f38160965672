"""Model-level throughput: GLA-1B with Megatron-LM's pretrain_gpt.py, or a Gated DeltaNet hybrid with its
pretrain_hybrid.py, on one node.

    MEGATRON_LM=third_party/megatron-lm python benchmarks/throughput.py --gpus 2 --out results/throughput.json
    MEGATRON_LM=third_party/megatron-lm python benchmarks/throughput.py --model gdn-1b --gpus 4 --cp 2 4 \
        --strategies zeco lasp2 a2a megatron --transports send_recv peer_memory --cuda-graphs off on \
        --out results/throughput-gdn.json

For each tokens-per-GPU T, trains the model for a few iterations on all GPUs of the node (bf16, mock data):
``gla-1b`` the paper's GLA-1B shape (examples/pretrain_gpt_gla.sh MODEL=gla-1b); ``gdn-1b`` a HybridModel
shaped like Qwen3-Next, three Gated DeltaNet layers to one softmax layer, about 1B parameters
(examples/pretrain_hybrid_gla.sh MODEL=gdn-1b). Runs:

* ``cp1``: CP = 1 (data parallel over the GPUs), sequence T, one sequence per GPU;
* ``cp<N>`` with each strategy, for each N in ``--cp`` (default: all GPUs): CP = N, data parallel
  over the other GPUs/N, sequence N*T, one sequence per CP group. ``zeco`` once per ``--transports``
  entry (``auto``: the layer's own choice); ``megatron`` (``gdn-1b`` only) is Megatron-Core's own Gated
  DeltaNet with its own context parallelism (head all-to-all) in the same model
  (benchmarks/reference_specs.py);
* with ``--gpus 1`` (no CP size): ``cp1`` and, if among the strategies, ``megatron`` at CP = 1 (Megatron-Core's
  own layer in the same model, on one GPU);
* each of those eager and, with ``--cuda-graphs on``, under Megatron-Core's CUDA graphs of layers
  (``--cuda-graph-impl local``).

So every run processes T tokens per GPU per iteration and all-reduces the same gradients. Per
run: median time per iteration over the logged intervals after the first ``--skip``, tokens/s per
GPU, efficiency against cp1 at the same T, peak memory (Megatron's report), and the loss. Logs
go beside the JSON.

Communication share (``--profile-steps``, default 2): after the timed iterations, Megatron's
PyTorch profiler records that many more steps on global rank 0; the NCCL kernels in the trace
are split into CP collectives (send/recv, all-gather, all-to-all, broadcast: the strategies'
traffic) and gradient reductions (all-reduce, reduce-scatter, present at CP = 1 too). A row gets
their GPU time per step and the CP share of the step time. NCCL kernel time includes waiting for
the peer, and counts whether or not the transfer overlapped compute.
"""

import argparse
import datetime
import glob
import gzip
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

from compare_losses import curve
from megatron_zeco.comm.transport import TRANSPORT_ENV
from megatron_zeco.cost_model import BUILD

HERE = os.path.dirname(os.path.abspath(__file__))
# model -> (launcher, spec per strategy, layers, description, its G layers' operator: the rows' "op")
MODELS = {
    "gla-1b": ("pretrain_gpt_gla.sh",
               {"zeco": "gla_local_spec", "lasp2": "gla_local_lasp2_spec", "a2a": "gla_local_a2a_spec",
                "lasp1": "gla_local_lasp1_spec"},
               20, "GLA-1B: 20 layers, hidden 2048, 16 heads of 128, ffn 5632, bf16, mock data", "gla"),
    "gdn-1b": ("pretrain_hybrid_gla.sh",
               {"zeco": "gdn_hybrid_stack_local_spec", "lasp2": "gdn_hybrid_stack_local_lasp2_spec",
                "a2a": "gdn_hybrid_stack_local_a2a_spec",
                "megatron": "benchmarks.reference_specs megatron_gdn_hybrid_stack_local_spec"},
               16, "Gated DeltaNet hybrid: 12 Gated DeltaNet + 4 softmax layers (G-G-G-* x 4), hidden 2048, "
                   "16 heads of 128, SwiGLU ffn 5632, bf16, mock data", "gdn"),
}
CUDA_GRAPH_FLAGS = ["--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "2"]
MEMORY = re.compile(r"max allocated: ([0-9.]+)")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="gla-1b")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--cp", type=int, nargs="+", default=None, help="CP sizes (divisors of --gpus; default: --gpus)")
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768], help="tokens per GPU")
    p.add_argument("--strategies", nargs="+", default=None,
                   help="default: every strategy the model's specs offer (gla-1b: zeco lasp2 a2a lasp1; gdn-1b: "
                        "zeco lasp2 a2a megatron)")
    p.add_argument("--transports", nargs="+", default=["auto"],
                   help="zeco's All-Scan transports, a run each (auto, send_recv, peer_memory, nvshmem)")
    p.add_argument("--cuda-graphs", nargs="+", choices=["off", "on"], default=["off"],
                   help="eager runs (off) and runs under Megatron-Core's CUDA graphs of layers (on)")
    p.add_argument("--strategies-at-largest", nargs="+", default=None,
                   help="strategies run at the largest T (default: all)")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="logged intervals to drop (warm-up)")
    p.add_argument("--limit", type=int, default=240, help="seconds per run")
    p.add_argument("--profile-steps", type=int, default=2, help="steps profiled after the timed ones (0: none)")
    p.add_argument("--out", default="throughput.json")
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    return p.parse_args()


def run(args, cp, T, strategy, logdir, transport="auto", graphs="off"):
    """One training run at T tokens per GPU; returns its row."""
    launcher, specs, layers, _, op = MODELS[args.model]
    variant = ("" if transport == "auto" else f"-{transport}") + ("-graphs" if graphs == "on" else "")
    name, seq = f"cp{cp}-{strategy}{variant}-T{T}", cp * T
    iters = args.iters + (args.profile_steps + 3 if args.profile_steps else 0)
    env = dict(os.environ, GPUS=str(args.gpus), CP=str(cp), SEQ=str(seq), MODEL=args.model, ITERS=str(iters),
               SPEC=specs["zeco" if strategy == "none" else strategy])
    env.pop(TRANSPORT_ENV, None)
    if transport != "auto":
        env[TRANSPORT_ENV] = transport
    # one sequence per data-parallel rank
    flags = ["--global-batch-size", str(args.gpus // cp), "--log-interval", "2",
             *(CUDA_GRAPH_FLAGS if graphs == "on" else []), *args.extra]
    trace_dir = os.path.join(logdir, f"{name}-profile")
    if args.profile_steps:  # Megatron writes the trace to <tensorboard-dir>/../torch_profile/rank-0.json.gz
        flags += ["--profile", "--use-pytorch-profiler", "--profile-ranks", "0",
                  "--profile-step-start", str(args.iters + 2), "--profile-step-end", str(args.iters + 2 + args.profile_steps),
                  "--tensorboard-dir", os.path.join(trace_dir, "tb")]
    log_path = os.path.join(logdir, f"{name}.log")
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", os.path.join(HERE, "..", "examples", launcher), *flags],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=args.limit)
        except subprocess.TimeoutExpired:  # stop torchrun and its workers, which hold the GPUs
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "timeout"
    points = {it: p for it, p in curve(log_path).items() if it <= args.iters}  # {iteration: (loss, ms)}
    times = [ms for _, (_, ms) in sorted(points.items())][args.skip:]
    memory = [float(m) for m in MEMORY.findall(open(log_path, errors="replace").read())]
    ms = statistics.median(times) if times else None
    row = {"part": "model", "op": op, "model": args.model, "run": name, "gpus": args.gpus, "cp": cp, "strategy": strategy,
           "transport": transport if strategy == "zeco" else None, "cuda_graphs": graphs == "on",
           "layout": "zigzag",  # the specs' layout
           "layers": layers, "heads": 16, "dim": 128, "seq_length": seq, "tokens_per_gpu": T, "exit": code,
           "wall_s": round(time.time() - start, 1),
           "ms_per_iter": ms, "tokens_per_s_per_gpu": None if ms is None else T / ms * 1000,
           "max_allocated_gib": max(memory) / 1024 if memory else None,
           "final_loss": points[max(points)][0] if points else None}
    traces = glob.glob(os.path.join(trace_dir, "torch_profile", "rank-0.json.gz"))
    if traces and ms:
        comm = nccl_ms_per_step(traces[0], args.profile_steps)
        row.update(cp_comm_ms=comm["cp"], grad_comm_ms=comm["grad"], cp_comm_share=comm["cp"] / ms)
    speed = "-" if ms is None else f"{ms:9.1f} ms/iter {row['tokens_per_s_per_gpu']:9.0f} tok/s/GPU"
    share = "" if "cp_comm_ms" not in row else \
        f"  CP comm {row['cp_comm_ms']:.1f} ms ({100 * row['cp_comm_share']:.1f}%), grad comm {row['grad_comm_ms']:.1f} ms"
    print(f"{name:28s} exit {code!s:7s} {speed}  mem {row['max_allocated_gib'] or 0:.1f} GiB{share}  "
          f"({row['wall_s']} s)", flush=True)
    return row


def nccl_ms_per_step(path, steps):
    """GPU time per step of NCCL kernels in a Chrome trace: {"cp": collectives, "grad": reductions}."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    total = {"cp": 0.0, "grad": 0.0}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "kernel" and name.startswith("ncclDevKernel"):
            total["grad" if "AllReduce" in name or "ReduceScatter" in name else "cp"] += e["dur"] / 1000
    return {k: v / steps for k, v in total.items()}


def main():
    args = parse_args()
    cps = args.cp or ([args.gpus] if args.gpus > 1 else [])
    if any(cp < 2 or args.gpus % cp for cp in cps):
        sys.exit(f"throughput.py: --cp {' '.join(map(str, cps))}: each must be >= 2 and divide --gpus {args.gpus}")
    specs = MODELS[args.model][1]
    args.strategies = args.strategies or list(specs)
    unknown = [s for s in args.strategies + (args.strategies_at_largest or []) if s not in specs]
    if unknown:
        sys.exit(f"throughput.py: --model {args.model} has no strategy {', '.join(unknown)} (its strategies: "
                 f"{', '.join(specs)})")
    logdir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(logdir, exist_ok=True)
    rows = []
    for T in args.tokens:
        strategies = args.strategies if T != max(args.tokens) or args.strategies_at_largest is None \
            else args.strategies_at_largest
        for graphs in args.cuda_graphs:
            base = run(args, 1, T, "none", logdir, graphs=graphs)
            rows.append(base)
            _write(args, rows)
            # On one GPU (no CP size): beside cp1, Megatron-Core's own layer at CP = 1, if asked for.
            runs = [(cp, s) for cp in cps for s in strategies] if cps else [(1, s) for s in strategies if s == "megatron"]
            for cp, s in runs:
                for transport in (args.transports if s == "zeco" else ["auto"]):
                    row = run(args, cp, T, s, logdir, transport, graphs)
                    if row["ms_per_iter"] and base["ms_per_iter"]:  # against CP = 1 run the same way
                        row["efficiency"] = base["ms_per_iter"] / row["ms_per_iter"]
                        print(f"{'':28s} efficiency vs cp1: {row['efficiency']:.3f}", flush=True)
                    rows.append(row)
                    _write(args, rows)


def _write(args, rows):
    import torch
    meta = {"command": f"python benchmarks/throughput.py {' '.join(sys.argv[1:])}",
            "device": f"{torch.cuda.get_device_name()} x{args.gpus}" if torch.cuda.is_available() else "cpu",
            "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1 (launcher default)"),
            "model": MODELS[args.model][3], "build": BUILD}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
