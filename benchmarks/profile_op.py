"""Where the GPU time of the GLA operator goes: CUDA time per kernel, per strategy and rank.

    torchrun --nproc-per-node 2 benchmarks/profile_op.py --tokens 16384 --out results/profile.json
    torchrun --nproc-per-node 2 benchmarks/profile_op.py --tokens 16384 --doc-tokens 2048 --out results/profile-packed.json

Runs forward + backward of ``none`` (one GPU) and ``zeco`` at CP=P in both layouts (inputs as in
``bench_op.py``; with ``--doc-tokens``, also on a packed sequence of documents of that mean
length, split as a whole and, under zigzag, document by document, as bench_op's ``packed`` part),
then profiles ``--iters`` more iterations with torch.profiler and sums the CUDA time of every
kernel by name, per iteration. A kernel that waits for a peer (the All-Scan hop) counts its
waiting. Prints each rank's table and writes all of them as JSON. From the same timeline, per
iteration: how long the All-Scan's hop kernels ran (``hop_us``) and for how much of it another kernel
ran at the same time (``hop_beside_us``): the overlap, seen in the profile (``zeco`` over a device
transport runs its first waiting hop beside the in-chunk work; ``zeco-overlap`` does not). ``--graph``
profiles the replay of one captured CUDA graph of forward + backward (as bench_op's ``graph`` rows), where
the host's issue does not hold the streams back, so the overlap shows as the GPU can run it:

    torchrun --nproc-per-node 2 benchmarks/profile_op.py --graph --layouts contiguous \
        --strategies zeco@peer_memory zeco-overlap@peer_memory --out results/profile-graph.json
"""

import argparse
import collections
import os

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from bench_op import documents, graphed, inputs, op_fn, write


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per GPU")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--strategies", nargs="+", default=["zeco"])
    p.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--doc-tokens", type=int, default=None, help="also profile packed documents of this mean length")
    p.add_argument("--graph", action="store_true", help="profile the replay of a captured CUDA graph "
                   "(strategies without NCCL calls: none, zeco over peer memory or NVSHMEM)")
    p.add_argument("--out", default="profile.json")
    return p.parse_args()


HOP = "all_scan"  # the All-Scan's hop kernels (kernels/scan_hop.py) by name


def beside(intervals, others):
    """µs of ``intervals`` (start, end) during which one of ``others`` runs too."""
    merged = []
    for start, end in sorted(others):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return sum(max(0.0, min(end, e) - max(start, s)) for start, end in intervals for s, e in merged)


def kernel_times(fn, iters):
    """``{kernel name: µs per iteration}`` of ``fn``'s CUDA kernels, and ``(hop_us, hop_beside_us)`` per
    iteration (:func:`beside`)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times = collections.Counter()
    hops, others = [], []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name[:60]] += event.device_time / iters
            span = (event.time_range.start, event.time_range.end)
            (hops if HOP in event.name else others).append(span)
    hop_us = sum(end - start for start, end in hops) / iters
    return dict(times.most_common()), (hop_us, beside(hops, others) / iters)


def main():
    args = parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    world, me = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(world)))
    x = inputs(1, args.tokens, args.heads, args.dim, seed=1000 + me)
    cases = [("none", None, "contiguous", None)]
    cases += [(s, group, lay, None) for s in args.strategies for lay in args.layouts]
    if args.doc_tokens:
        gen = torch.Generator().manual_seed(11)  # the same documents on every rank
        cases += [("zeco packed", group, lay, (documents(world * args.tokens, args.doc_tokens, 1, gen), False))
                  for lay in args.layouts]
        cases.append(("zeco packed per document", group, "zigzag",
                      (documents(world * args.tokens, args.doc_tokens, 2 * world, gen), True)))
    rows = []
    for strategy, g, layout, packed in cases:
        fn = op_fn(x, "zeco" if packed else strategy, g, layout, *(packed or ()))
        times = kernel_times(graphed(fn) if args.graph else fn, args.iters)
        everyone = [None] * world
        dist.all_gather_object(everyone, times)
        for rank, (t, (hop_us, hop_beside_us)) in enumerate(everyone):
            rows.append({"part": "profile", "tokens_per_gpu": args.tokens, "strategy": strategy, "layout": layout,
                         "cp": 1 if g is None else world, "rank": rank, "total_us": sum(t.values()), "kernels_us": t,
                         "hop_us": hop_us, "hop_beside_us": hop_beside_us, "graph": args.graph})
        everyone, hops = [t for t, _ in everyone], [h for _, h in everyone]
        if me == 0:
            print(f"\n== {strategy} {layout} T/GPU={args.tokens}{' graph' if args.graph else ''}: " + ", ".join(
                f"rank {r} {sum(t.values()):.0f} us (hops {h:.0f} us, {b:.0f} us of it beside other kernels)"
                for r, (t, (h, b)) in enumerate(zip(everyone, hops))))
            for name in everyone[0]:
                print(f"  {name:60s} " + " ".join(f"{t.get(name, 0):8.1f}" for t in everyone))
        if me == 0:
            write(args, world, rows, script="profile_op.py")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
