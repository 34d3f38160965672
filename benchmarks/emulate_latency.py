"""Latency between nodes, emulated on the CPU: the chain and the hierarchical All-Scan against the cost model.

    python benchmarks/emulate_latency.py                      # P = 2, 4, 8, 16; nodes of 1 and 2; alpha 50 ms
    python benchmarks/emulate_latency.py --gpus 4 8 --alpha-ms 20 --out /tmp/emulated.json

For each P, P gloo processes on this host. ``comm.inject.link_latency`` holds every All-Scan message
between emulated nodes (``node_size`` consecutive ranks) for alpha before handing it to gloo, without
holding up its sender; messages inside a node go at once. Each case times one forward and one
backward All-Scan (send/recv transport, a small float32 state; each direction timed from a barrier,
from the first rank's start to the last rank's end) in the chain and the hierarchical shape: first
without latency, which gives this machine's cost per message and per call (a least
squares fit over every case), then with alpha. The cost model (``cost_model.scan_time``: the chain's
hops, the hierarchical scan's schedule and critical path, as built) with those two fitted costs and
alpha as the latency between nodes then predicts each emulated time. The records of the messages give
the hops between nodes each scan waits for one after another (``inject.longest_message_chain``).

Writes ``{"meta": ..., "rows": [...]}`` (rows ``part: "emulated"``) and prints the table of
docs/scaling.md. Wall times on a shared CPU: run it on an idle machine.
"""

import argparse
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, ROOT)

from megatron_zeco import cost_model as cm  # noqa: E402
from megatron_zeco.comm import Layout, Route, all_scan, inject  # noqa: E402

SHAPES = ("chain", "hierarchical")


def _worker(rank, world, store, cases, reps, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    group = dist.group.WORLD
    rows = []
    for layout, node_size, shape, alpha in cases:
        layout = Layout(layout)
        pieces = layout.pieces(rank, world)
        gamma = [torch.rand(1, 4, 16) for _ in pieces]
        delta = [torch.randn(1, 4, 16, 16) for _ in pieces]
        times, traces = [], {}
        for rep in range(reps + 1):  # the first one warms up (and gives the records)
            total = 0.0
            for reverse in (False, True):  # forward, then backward, each from a barrier
                dist.barrier()
                with inject.link_latency(alpha, node_size) as events:
                    start = time.monotonic()
                    all_scan(gamma, delta, None, Route(layout, group, 1, "send_recv", node_size, shape),
                             reverse=reverse)
                    end = time.monotonic()
                spans = [None] * world
                dist.all_gather_object(spans, (start, end, list(events) if rep == 0 else None))
                traces[reverse] = [s[2] for s in spans] if rep == 0 else traces[reverse]
                total += max(s[1] for s in spans) - min(s[0] for s in spans)
            if rep:
                times.append(total)
        if rank == 0:
            node = lambda r: r // node_size  # noqa: E731
            count = lambda weight: sum(inject.longest_message_chain(t, weight) for t in traces.values())  # noqa: E731
            rows.append(dict(part="emulated", cp=world, layout=layout.value, node_size=node_size, shape=shape,
                             alpha_ms=alpha * 1e3, ms=min(times) * 1e3, runs_ms=[t * 1e3 for t in times],
                             hops=count(lambda a, b: 1.0), inter_hops=count(lambda a, b: float(node(a) != node(b)))))
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def run(P, cases, reps):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, P, os.path.join(tmp, "store"), cases, reps, results))
                 for r in range(P)]
        for p in procs:
            p.start()
        rows = results.get(timeout=3600)
        for p in procs:
            p.join()
    return rows


def model_ms(row, call, hop):
    """The cost model's time of a forward and a backward scan of ``row``'s case: ``hop`` per message
    on the critical path, ``call`` per scan, alpha per message between nodes (no bandwidth term:
    the states are a few KiB)."""
    free = cm.Link(0.0, math.inf)
    cluster = cm.Cluster(intra=free, inter=cm.Link(row["alpha_ms"] * 1e-3, math.inf), gpus_per_node=row["node_size"])
    sw = cm.Software(message=0.0, scan_call=call, gather_call=0.0, fold_launch=0.0, state_pass=0.0,
                     state_grad_pass=0.0, a2a_copy=0.0, hop=hop, transport="send_recv")
    w = cm.Workload(P=row["cp"], tokens=0, heads=4, k_dim=16, v_dim=16, op_ms=0.0, layout=row["layout"])
    return sum(cm.scan_time(row["shape"], w, cluster, sw, 1, reverse) for reverse in (False, True)) * 1e3


def fit(rows):
    """(call, hop) in seconds from the cases without latency: time = 2 call + hop x messages on the
    critical path (the model's count, forward + backward), least squares in relative error."""
    base = [r for r in rows if r["alpha_ms"] == 0]
    xs = [[2.0, model_ms(dict(r, alpha_ms=0.0), 0.0, 1.0) * 1e-3] for r in base]
    call, hop = cm.calibration._weighted_fit(xs, [r["ms"] * 1e-3 for r in base])
    return max(call, 0.0), hop


def table(rows, call, hop):
    print(f"per call {call * 1e3:.2f} ms, per message {hop * 1e3:.2f} ms (fitted without latency)\n")
    print("| P | node size | shape | hops between nodes (fwd + bwd) | no latency ms | emulated ms | model ms "
          "| model / emulated - 1 |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["alpha_ms"] == 0:
            continue
        zero = next(z["ms"] for z in rows if z["alpha_ms"] == 0 and all(z[k] == r[k] for k in
                                                                          ("cp", "layout", "node_size", "shape")))
        print(f"| {r['cp']} | {r['node_size']} | {r['shape']} | {r['inter_hops']:g} | {zero:.1f} | {r['ms']:.1f} | "
              f"{r['model_ms']:.1f} | {r['model_ms'] / r['ms'] - 1:+.1%} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[2, 4, 8, 16], help="group sizes P (processes)")
    parser.add_argument("--node-size", type=int, nargs="+", default=[1, 2], help="ranks per emulated node")
    parser.add_argument("--layout", choices=("contiguous", "zigzag"), default="contiguous")
    parser.add_argument("--alpha-ms", type=float, default=50.0, help="latency of a message between nodes (ms)")
    parser.add_argument("--reps", type=int, default=5,
                        help="timed repetitions per case; the fastest counts (a shared CPU only adds time)")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "emulated-latency-cpu.json"))
    args = parser.parse_args()

    rows = []
    for P in args.gpus:
        cases = [(args.layout, ns, shape, alpha) for ns in args.node_size if ns < P for shape in SHAPES
                 for alpha in (0.0, args.alpha_ms * 1e-3)]
        t = time.time()
        rows += run(P, cases, args.reps)
        print(f"P = {P}: {len(cases)} cases in {time.time() - t:.0f} s", file=sys.stderr)
    call, hop = fit(rows)
    for r in rows:
        r["model_ms"] = model_ms(r, call, hop)
    table(rows, call, hop)
    meta = dict(command="python benchmarks/emulate_latency.py " + " ".join(sys.argv[1:]),
                date=str(datetime.date.today()),
                host=platform.node(), cpus=os.cpu_count(), torch=torch.__version__, build=cm.BUILD,
                fitted_call_ms=call * 1e3, fitted_message_ms=hop * 1e3,
                note="CPU emulation: gloo processes on one host, latency between emulated nodes injected by "
                     "comm.inject.link_latency; not a GPU measurement")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
