"""Operator benchmark: GLA fwd+bwd under every CP strategy, All-Scan alone, accuracy.

    torchrun --nproc-per-node 2 benchmarks/bench_op.py --out results/op.json
    python benchmarks/plot_op.py results/op.json docs/img/op.png
    torchrun --nproc-per-node 2 benchmarks/bench_op.py --op gdn --out results/op-gdn.json
    python benchmarks/bench_op.py --op gdn --piece --out results/piece-gdn.json
    python benchmarks/bench_op.py --op kda --piece --tokens 16384 32768 65536 --out results/piece-kda.json

``--op gdn`` times the gated delta rule instead (``zeco_gated_delta_rule`` against fla's
``chunk_gated_delta_rule`` on one GPU, and fla's own context parallelism, row ``fla-cp``:
``fla.ops.cp.build_cp_context`` over the same group and layout; part ``op`` only, eager and steady
modes); ``--forward-only`` times the forward alone (where fla refuses the gated delta rule's
backward: Hopper with Triton 3.4 - 3.7.0, fla's issue #640).

``--op kda`` times Kimi Delta Attention the same way (``zeco_kda`` against fla's ``chunk_kda`` on one
GPU and fla's KDA context parallelism, row ``fla-cp``; g a log decay per key channel in float32).

``--op gdn --piece`` and ``--op kda --piece`` run on one GPU without torchrun: one rank's local work
with the exchange stubbed (a piece first, middle and last in the chain, and strategy a2a at a group of
one with the all-to-alls a device copy or nothing) against fla's op on the same tokens, kernel by
kernel, GPU time and host issue time: ``benchmarks/profile_piece.py``'s cases, whose table gives each
case's ratio to fla's op.

Four parts (``--parts``), all in one run so that the figures compare side by side:

1. ``op``: forward + backward of the GLA operator at T tokens per GPU (H heads of D, bf16):
   ``fla`` (fla's chunk_gla called directly), ``none`` (zeco_gla with no group), ``zeco`` at
   CP=1 (a group of one), and ``zeco``, ``lasp1``, ``lasp2``, ``a2a`` at CP=P in both layouts
   (``zeco+overlap`` / ``zeco-overlap``: zeco with ``overlap=True`` / ``False``: sends or the scan on a
   side stream, or not; plain ``zeco`` lets the op choose (on over peer memory); ``zeco@send_recv``:
   zeco with All-Scan over NCCL messages instead of peer memory (the default on one node);
   ``zeco:s``: each piece run as s sub-pieces, ``piece_split=s``; plain ``zeco`` lets the op
   choose: 2 for contiguous, 1 for zigzag).
   Each row: median over iterations of the slowest rank's time (a step waits for the slowest).
   ``--modes``: ``eager`` issues the op's kernels from Python every iteration and times each from
   an empty queue (the row also gives the host's time to issue one call, measured while the GPU
   is busy: where it exceeds the GPU time, it is what an empty queue measures); ``steady``
   issues ``--iters`` iterations back to back and takes their mean (a training loop's view: the
   host runs ahead where its issue time is below the GPU's); ``graph``
   replays them from one CUDA graph captured after warm-up (``fla``, ``none`` and ``zeco`` over
   peer memory), which takes the host's issue time out: the GPU cost of each strategy.
2. ``scan``: All-Scan of one state alone (K blocks) over peer memory and over NCCL messages,
   against the all-gather scan (LASP-2), a raw NCCL all-gather of the state, one send/recv
   hop, and a plain device copy of the state into the peer's memory (the link's pace), for
   fp32 states of 0.25-4 MiB; also the zigzag chain over peer memory (two states per rank, as a
   zigzag rank or the per-document packed split passes). At P = 2 (contiguous) All-Scan is one hop. Each is timed
   twice: from an empty queue (host issue time included) and behind a GPU sleep (GPU time only).
3. ``accuracy``: outputs and gradients of each strategy (bf16, CP=P) and of fla's bf16 chunk_gla on
   one GPU, against an fp32 one-GPU reference over the whole sequence (this package's PyTorch
   chunked GLA, TF32 off), as ||x - ref|| / ||ref||. Gates have per-channel time scales from 1 to
   the whole sequence, so states matter across the rank boundary.
4. ``packed``: ``zeco`` at CP=P on a packed sequence (THD, ``cu_seqlens``) of documents with
   random lengths (exponential, mean ``--doc-tokens``), split as a whole sequence (both layouts)
   and document by document (zigzag, Megatron's THD split), against the same tokens unpacked
   (plain ``zeco``), in the modes of ``--modes`` (``graph``: the GPU's cost alone, the documents
   fixed at capture); packed rows for each of ``--packed-strategies`` (row names as in part 1).
   Rows ``none`` (CP=1) run each rank's segments of every split on its GPU alone, with no
   state entering, against its tokens unpacked: what the local varlen kernels cost on those
   segments (each ends in a partial chunk), apart from what CP adds.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_zeco import zeco_gated_delta_rule, zeco_gla, zeco_kda
from megatron_zeco.cost_model import BUILD
from megatron_zeco.comm import Layout, Route, all_scan, as_layout, gather_scan
from megatron_zeco.comm.symmetric import PeerBuffers

from megatron_zeco.comm.transport import CHOICES as TRANSPORTS
# What the zeco/lasp2/a2a rows time: the public op as a user calls it (its cross-rank check and plan made at the
# first call of each shape, in the warm-up, and reused), the same path a layer takes after its first step.
PATH = "public op, default validate (checked and planned once per shape; reused)"
from megatron_zeco.cp.packed import Packing
from megatron_zeco.gla.kernels import chunk_dqkg_with_state, chunk_dv_with_state, chunk_o_with_state
from megatron_zeco.gla import chunk_gla


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768], help="tokens per GPU")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--strategies", nargs="+", default=None,
                   help="strategy[+overlap][@transport][:piece_split]; default: zeco zeco:1 zeco@send_recv "
                        "zeco+overlap lasp1 lasp2 a2a (--op gdn: zeco zeco@peer_memory lasp2 a2a)")
    p.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag"])
    p.add_argument("--modes", nargs="+", default=["eager", "steady", "graph"], choices=["eager", "steady", "graph"],
                   help="op part: issue from Python (each iteration from an empty queue, or back to back), "
                        "or replay one captured CUDA graph")
    p.add_argument("--op", choices=["gla", "gdn", "kda"], default="gla",
                   help="gla: gated linear attention; gdn: the gated delta rule; kda: Kimi Delta Attention "
                        "(gdn and kda: part op only)")
    p.add_argument("--forward-only", action="store_true", help="op part: time the forward alone")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--scan-mib", type=float, nargs="+", default=[0.25, 0.5, 1, 2, 4])
    p.add_argument("--scan-blocks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--accuracy-tokens", type=int, default=16384, help="tokens per GPU for part 3")
    p.add_argument("--doc-tokens", type=int, default=2048, help="mean document length for part 4")
    p.add_argument("--packed-strategies", nargs="+", default=["zeco"], help="part 4's packed rows, as --strategies")
    p.add_argument("--parts", nargs="+", default=None, choices=["op", "scan", "accuracy", "packed"],
                   help="default: all four (--op gdn: op)")
    p.add_argument("--piece", action="store_true",
                   help="--op gdn or kda on one GPU, no torchrun: one rank's local work (the exchange stubbed) "
                        "against fla's op")
    p.add_argument("--autotune", action="store_true",
                   help="autotune every kernel; by default the configs recorded for this GPU are replayed "
                        "(megatron_zeco/common/tuning.py) where $MEGATRON_ZECO_TUNED_CONFIGS does not say otherwise")
    p.add_argument("--out", default="op.json")
    args = p.parse_args()
    if args.piece and args.op == "gla":
        p.error("--piece times a delta rule's piece: add --op gdn or --op kda")
    if args.strategies is None:
        args.strategies = (["fla-cp", "zeco", "zeco@peer_memory", "lasp2", "a2a"] if args.op != "gla" else
                           ["zeco", "zeco:1", "zeco@send_recv", "zeco+overlap", "lasp1", "lasp2", "a2a"])
    if args.parts is None:
        args.parts = ["op"] if args.op != "gla" else ["op", "scan", "accuracy", "packed"]
    if args.op != "gla" and set(args.parts) != {"op"}:
        p.error(f"--op {args.op} times part op only: add --parts op")
    delta_rows = {"fla-cp", "lasp2", "a2a"} | {f"zeco{o}{t}" for o in ("", "+overlap", "-overlap")
                                               for t in ("", *(f"@{t}" for t in TRANSPORTS))}
    if args.op != "gla" and not set(args.strategies) <= delta_rows:
        p.error(f"--op {args.op}: --strategies from fla-cp, zeco[+overlap|-overlap][@<transport>], lasp2, a2a")
    if args.op == "gla" and "fla-cp" in args.strategies:
        p.error("fla-cp: fla's context parallelism is timed for --op gdn and kda")
    return args


def log(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def timed(fn, iters, warmup, gpu_only=False, steady=False):
    """Median over iterations of the slowest rank's CUDA time of ``fn`` in ms. ``gpu_only``: the
    GPU first sleeps ~1 ms, so the host has issued ``fn``'s work before the timed region starts
    (what is left is GPU time, and waiting for the peer). ``steady``: each sample is the mean of
    ``iters`` calls issued back to back, as in training (the host runs ahead where it can); five samples."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(5 if steady else iters):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if gpu_only:
            torch.cuda._sleep(2_000_000)
        start.record()
        for _ in range(iters if steady else 1):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (iters if steady else 1))
    t = torch.tensor(times, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def host_ms(fn, iters):
    """Median host time of issuing one ``fn`` (ms), the GPU held busy by a sleep so that nothing
    waits on it: what an empty queue waits for where it exceeds the GPU time."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def graphed(fn, warmup=3):
    """``fn`` captured in a CUDA graph (after ``warmup`` calls on a side stream, which also autotune):
    returns the graph's replay. ``fn``'s inputs and outputs stay where the capture put them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def capturable(strategy, P):
    """Strategies whose op ``graphed`` can capture: no NCCL call and no host synchronisation."""
    opts = options(strategy)
    return strategy in ("fla", "none") or (opts["strategy"] == "zeco" and (P == 1 or opts["transport"] != "send_recv"))


def gates(B, N, H, K, device, generator):
    """Log-gates with per-channel time scales log-spaced from 1 token to the whole sequence."""
    rate = torch.exp(torch.empty(H, K, device=device).uniform_(-torch.log(torch.tensor(float(N))).item(), 0,
                                                                 generator=generator))
    noise = torch.randn(B, N, H, K, device=device, generator=generator).mul(0.3).exp()
    return -(rate * noise)


def inputs(B, N, H, D, seed, dtype=torch.bfloat16, op="gla"):
    """q, k, v, the gates and the output gradient ``o``; for the gated delta rule a gate per head (log
    decay, time scales from 1 token to the sequence) and ``beta`` in (0, 1), as fla's tests draw them;
    for KDA a gate per head and key channel (float32) and ``beta``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(B, N, H, D, device="cuda", generator=gen) for _ in range(4))
    k = F.normalize(k, dim=-1)  # fla's convention in its tests: bounded key norms
    if op == "gdn":
        g = gates(B, N, 1, H, "cuda", gen)[:, :, 0]
        beta = torch.rand(B, N, H, device="cuda", generator=gen).sigmoid()
        return {n: x.to(dtype) for n, x in zip(("q", "k", "v", "g", "beta", "o"), (q, k, v, g, beta, do))}
    g = gates(B, N, H, D, "cuda", gen)
    if op == "kda":
        beta = torch.rand(B, N, H, device="cuda", generator=gen).sigmoid()
        out = {n: x.to(dtype) for n, x in zip(("q", "k", "v", "beta", "o"), (q, k, v, beta, do))}
        return dict(out, g=g)
    return {n: x.to(dtype) for n, x in zip("qkvgo", (q, k, v, g, do))}


def options(strategy):
    """``zeco_gla`` keywords of a row name ``strategy[+overlap|-overlap][@transport][:piece_split]``."""
    strategy, _, split = strategy.partition(":")
    name, _, transport = strategy.partition("@")
    overlap = {"+": True, "-": False}.get(name[-8]) if name.endswith("overlap") else None
    return dict(strategy=name.removesuffix("+overlap").removesuffix("-overlap"), overlap=overlap,
                transport=transport or "auto", piece_split=int(split) if split else None)


def op_fn(x, strategy, group, layout, cu_seqlens=None, per_document=False, op="gla", backward=True):
    """fwd + bwd (or fwd alone) of one row's op on ``x`` (a packed sequence of documents with ``cu_seqlens``)."""
    leaves = [x[n].detach().requires_grad_(backward) for n in ("q", "k", "v", "g", "beta")[:4 if op == "gla" else 5]]
    if strategy == "fla" and op == "gla":
        from fla.ops.gla import chunk_gla as fla_op
    elif strategy in ("fla", "fla-cp") and op == "kda":
        from fla.ops.kda import chunk_kda as fla_op
    elif strategy in ("fla", "fla-cp"):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_op
    zeco_op = {"gla": zeco_gla, "gdn": zeco_gated_delta_rule, "kda": zeco_kda}[op]
    kw = {} if strategy == "fla-cp" else options(strategy)
    if op != "gla":  # the delta rules' operators have no piece split
        kw = {k: v for k, v in kw.items() if k in ("strategy", "transport", "overlap")}
    if strategy == "fla-cp":  # this rank's tokens of one sequence over the group, as fla lays them out
        from fla.ops.cp import build_cp_context

        whole = leaves[0].shape[1] * dist.get_world_size(group)
        context = build_cp_context(torch.tensor([0, whole], device=leaves[0].device), group=group,
                                   cu_seqlens_cpu=torch.tensor([0, whole]), layout=layout)

    def run():
        if strategy == "fla":
            o, _ = fla_op(*leaves)
        elif strategy == "fla-cp":
            o, _ = fla_op(*leaves, cp_context=context)
        else:
            o, _ = zeco_op(*leaves, group=group, layout=layout, cu_seqlens=cu_seqlens, per_document=per_document,
                           **kw)
        return torch.autograd.grad(o, leaves, x["o"]) if backward else o

    return run


def bench_op(args, world, me, cp_group, self_group, rows):
    for T in args.tokens:
        x = inputs(1, T, args.heads, args.dim, seed=1000 + me, op=args.op)
        cases = [("fla", None, "contiguous", 1), ("none", None, "contiguous", 1), ("zeco", self_group, "contiguous", 1)]
        cases += [(s, cp_group, lay, world) for s in args.strategies for lay in args.layouts]
        base = {}
        for mode in args.modes:
            for strategy, group, layout, P in cases:
                if mode == "graph" and not capturable(strategy, P):
                    continue
                fn = op_fn(x, strategy, group, layout, op=args.op, backward=not args.forward_only)
                if mode == "graph":
                    try:
                        fn = graphed(fn)
                    except Exception as e:  # noqa: BLE001 -- a row that cannot be captured says why
                        torch.cuda.synchronize()
                        rows.append({"part": "op", "op": args.op, "mode": mode, "tokens_per_gpu": T,
                                     "strategy": strategy, "cp": P, "layout": layout, "ms": None,
                                     "error": f"{type(e).__name__}: {e}"[:300]})
                        log(f"op  {mode:5s} T/GPU={T:6d} {strategy:14s} CP={P} {layout:10s} cannot be captured: "
                            f"{type(e).__name__}: {str(e)[:200]}")
                        continue
                ms = timed(fn, args.iters, args.warmup, steady=mode == "steady")
                host = host_ms(fn, args.iters) if mode == "eager" else None
                if strategy == "none":
                    base[mode] = ms
                vs_none = ms / base[mode] if mode in base else None
                rows.append({"part": "op", "op": args.op, "direction": "fwd" if args.forward_only else "fwd+bwd",
                             "mode": mode, "tokens_per_gpu": T, "heads": args.heads, "dim": args.dim,
                             "strategy": strategy, "cp": P, "layout": layout, "ms": ms, "vs_none": vs_none,
                             "host_ms": host})
                log(f"op  {mode:5s} T/GPU={T:6d} {strategy:14s} CP={P} {layout:10s} {ms:8.3f} ms"
                    + ("" if vs_none is None else f"  x{vs_none:.3f} of none")
                    + ("" if host is None else f"  (host issue {host:.3f} ms)"))
        if args.op == "gla":
            bench_kernels(args, x, T, rows)
        del x
        torch.cuda.empty_cache()


def bench_kernels(args, x, T, rows):
    """The three chunk kernels that read the states, fla's against this project's with the
    state term fused in (gla/kernels.py), on the same inputs: what the term costs."""
    from fla.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h
    from fla.ops.gla import chunk as gla
    from fla.ops.utils.constant import RCP_LN2
    from fla.ops.utils.cumsum import chunk_local_cumsum

    q, k, v, do = (x[n] for n in "qkvo")
    scale = args.dim ** -0.5
    g = chunk_local_cumsum(x["g"], 64, scale=RCP_LN2)
    A = gla.chunk_gla_fwd_intra_gk(q=q, k=k, g=g, scale=scale)
    h, _ = chunk_fwd_h(k=k, v=v, gk=g, h0=None)
    h32, _ = chunk_fwd_h(k=k, v=v, gk=g, h0=None, states_in_fp32=True)
    dh, _ = chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=None, dht=None, gk=g, scale=scale, states_in_fp32=True)
    dq, dk = gla.chunk_gla_bwd_dqk_intra(q=q, k=k, g=g, dA=gla.chunk_gla_bwd_dA(v=v, do=do, scale=scale))
    S = torch.zeros(1, args.heads, args.dim, args.dim, device="cuda")
    w = torch.zeros(h.shape[1] * h.shape[0], args.heads, args.dim, device="cuda")
    pairs = {
        "o": (lambda: gla.chunk_gla_fwd_o_gk(q=q, v=v, g=g, A=A, h=h, scale=scale),
              lambda: chunk_o_with_state(q, v, g, A, h, S, w, scale)),
        "dv": (lambda: gla.chunk_gla_bwd_dv(k=k, g=g, A=A, do=do, dh=dh),
               lambda: chunk_dv_with_state(k, g, A, do, dh, S, w)),
        "dqkg": (lambda: gla.chunk_gla_bwd_dqkg(q=q, k=k, v=v, h=h32, g=g, do=do, dh=dh, dq=dq, dk=dk, scale=scale),
                 lambda: chunk_dqkg_with_state(q, k, v, g, h32, do, dh, S, w, dq, dk, scale)),
    }
    for name, (fla_fn, ours) in pairs.items():
        for who, fn in (("fla", fla_fn), ("+state", ours)):
            ms = timed(fn, args.iters, args.warmup)
            rows.append({"part": "kernel", "tokens_per_gpu": T, "name": f"{name} {who}", "ms": ms})
            log(f"kernel T/GPU={T:6d} {name + ' ' + who:12s} {ms:8.3f} ms")


def scan_cases(E, gamma, blocks, me, group):
    """(name, fn) pairs passing the state ``E [1, H, 128, 128]`` from rank 0 onwards; and the
    zigzag chain (two such states per rank, 2P - 1 hops, P of them between ranks), and a plain
    device copy (cudaMemcpy) of E into rank 1's memory: one hop's bytes at the link's pace."""
    layout = as_layout("contiguous")
    gathered = torch.empty(group.size(), *E.shape, device=E.device)
    peer = PeerBuffers(group, E.numel() * E.element_size(), E.device)  # kept alive by the lambda below
    zigzag = Layout.ZIGZAG

    def hop():
        if me == 0:
            dist.send(E, 1, group=group)
        elif me == 1:
            dist.recv(E, 0, group=group)

    cases = [(f"all_scan {transport} K={b}",
              lambda b=b, t=transport: all_scan([gamma], [E], None, Route(layout, group, b, t)))
             for transport in ("peer_memory", "send_recv") for b in blocks]
    return cases + [
        ("all_scan peer_memory zigzag",
         lambda: all_scan([gamma, gamma], [E, E], None, Route(zigzag, group, transport="peer_memory"))),
        ("gather_scan", lambda: gather_scan([gamma], [E], None, Route(layout, group))),
        ("nccl all_gather", lambda: dist.all_gather_into_tensor(gathered, E, group=group)),
        ("nccl send/recv hop", hop),
        ("memcpy into peer memory", lambda: peer.of(1).view(E.dtype).copy_(E.view(-1)) if me == 0 else None),
    ]


def bench_scan(args, world, me, cp_group, rows):
    for mib in args.scan_mib:
        H = max(1, int(mib * 2 ** 20 / (128 * 128 * 4)))
        size = H * 128 * 128 * 4 / 2 ** 20
        E, gamma = torch.randn(1, H, 128, 128, device="cuda"), torch.rand(1, H, 128, device="cuda")
        for name, fn in scan_cases(E, gamma, args.scan_blocks, me, cp_group):
            ms = timed(fn, args.iters, args.warmup)
            gpu_ms = timed(fn, args.iters, 0, gpu_only=True)
            rows.append({"part": "scan", "state_mib": size, "cp": world, "method": name, "ms": ms, "gpu_ms": gpu_ms})
            log(f"scan {size:5.2f} MiB {name:28s} {ms * 1000:8.1f} us  (GPU only {gpu_ms * 1000:7.1f} us)")


def bench_accuracy(args, world, me, cp_group, rows):
    T = args.accuracy_tokens
    N, H, D = T * world, args.heads, args.dim
    x = inputs(1, N, H, D, seed=7)  # the same whole sequence on every rank
    names = ("o", "dq", "dk", "dv", "dg")

    def whole(fn, dtype):
        leaves = [x[n].to(dtype).requires_grad_() for n in "qkvg"]
        o = fn(*leaves)
        return [o.float(), *(d.float() for d in torch.autograd.grad(o, leaves, x["o"].to(dtype)))]

    torch.backends.cuda.matmul.allow_tf32 = False
    ref = whole(lambda q, k, v, g: chunk_gla(q, k, v, g)[0], torch.float32)

    def record(strategy, layout, got):
        errs = {n: float((a - b).norm() / b.norm()) for n, a, b in zip(names, got, ref)}
        rows.append(dict(part="accuracy", tokens_per_gpu=T, strategy=strategy, cp=1 if strategy == "fla" else world,
                         layout=layout, **errs))
        log(f"acc {strategy:6s} {layout:10s} " + " ".join(f"{n} {e:.2e}" for n, e in errs.items()))

    if me == 0:
        from fla.ops.gla import chunk_gla as fla_chunk_gla
        record("fla", "-", whole(lambda q, k, v, g: fla_chunk_gla(q, k, v, g)[0], torch.bfloat16))
    for strategy in args.strategies:
        for name in args.layouts:
            layout = as_layout(name)
            leaves = [layout.shard(x[n], me, world, dim=1).detach().requires_grad_() for n in "qkvg"]
            o, _ = zeco_gla(*leaves, group=cp_group, layout=layout, **options(strategy))
            local = [o, *torch.autograd.grad(o, leaves, layout.shard(x["o"], me, world, dim=1))]
            got = []
            for t in local:
                parts = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(parts, t.contiguous(), group=cp_group)
                got.append(layout.unshard(parts, dim=1).float())
            if me == 0:
                record(strategy, name, got)


def documents(total, mean, multiple, generator):
    """``cu_seqlens`` of documents with exponential lengths (rounded to a positive multiple of ``multiple``)
    filling ``total``."""
    cu = [0]
    while cu[-1] < total:
        length = -mean * torch.log(torch.rand(1, generator=generator)).item()
        cu.append(min(total, cu[-1] + multiple * max(1, round(length / multiple))))
    return torch.tensor(cu, dtype=torch.int32)


def bench_packed(args, world, me, cp_group, rows):
    gen = torch.Generator().manual_seed(11)  # the same documents on every rank
    for T in args.tokens:
        x = inputs(1, T, args.heads, args.dim, seed=2000 + me)
        packs = [("sequence", lay, documents(world * T, args.doc_tokens, 1, gen), False) for lay in args.layouts]
        packs.append(("document", "zigzag", documents(world * T, args.doc_tokens, 2 * world, gen), True))
        cases = [("zeco", "unpacked", lay, None, False) for lay in args.layouts]
        cases += [(strategy, *pack) for pack in packs for strategy in args.packed_strategies]
        cases += [("none", "unpacked", "-", None, False)] + [("none", *pack) for pack in packs]
        base = {}
        for mode in args.modes:
            for strategy, split, layout, cu, per_document in cases:
                if mode == "graph" and not capturable(strategy, world):
                    continue
                P = 1 if strategy == "none" else world
                if strategy == "none":  # one GPU alone on this rank's segments of the split: packing's own cost
                    if cu is not None:
                        cu = Packing(cu, as_layout(layout), world, me, T, per_document, "cpu").cu_cpu
                    fn = op_fn(x, strategy, None, "contiguous", cu)
                else:
                    fn = op_fn(x, strategy, cp_group, layout, cu, per_document)
                ms = timed(graphed(fn) if mode == "graph" else fn, args.iters, args.warmup, steady=mode == "steady")
                host = host_ms(fn, args.iters) if mode == "eager" else None
                key = (mode, "-" if P == 1 else layout)
                base.setdefault(key, ms)
                row = {"part": "packed", "mode": mode, "tokens_per_gpu": T, "heads": args.heads, "dim": args.dim,
                       "cp": P, "strategy": strategy, "split": split, "layout": layout,
                       "documents": 1 if cu is None else len(cu) - 1, "ms": ms, "vs_unpacked": ms / base[key],
                       "host_ms": host}
                rows.append(row)
                log(f"packed {mode:6s} T/GPU={T:6d} {strategy:12s} CP={P} {split:8s} {layout:10s} "
                    f"{row['documents']:4d} {'segments' if P == 1 else 'documents'} {ms:8.3f} ms  "
                    f"x{row['vs_unpacked']:.3f} of unpacked" + ("" if host is None else f"  (host issue {host:.3f} ms)"))
        del x
        torch.cuda.empty_cache()


def code_version():
    """The checkout's commit (``git describe --always --dirty``), or None outside a git checkout."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=os.path.dirname(os.path.abspath(__file__)),
                              capture_output=True, text=True, check=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def write(args, world, rows, script="bench_op.py", **extra):
    """``{"meta": ..., "rows": rows}`` to ``args.out``: the command, device, date and versions (+ ``extra``)."""
    import triton
    try:
        import fla
        fla_version = fla.__version__
    except ImportError:
        fla_version = None
    from megatron_zeco.comm.all_scan import SHAPE_ENV
    from megatron_zeco.comm.nodes import NODE_SIZE_ENV

    # the scan's shape and nodes where the environment forces them (the command line does not show it)
    forced = {name: os.environ[env] for name, env in (("scan_shape", SHAPE_ENV), ("node_size", NODE_SIZE_ENV))
              if os.environ.get(env)}
    prefix = "".join(f"{env}={os.environ[env]} " for env in (SHAPE_ENV, NODE_SIZE_ENV) if os.environ.get(env))
    meta = {"command": f"{prefix}torchrun --nproc-per-node {world} benchmarks/{script} {' '.join(sys.argv[1:])}",
            "device": f"{torch.cuda.get_device_name()} x{world}", "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": triton.__version__, "fla": fla_version,
            "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())), "build": BUILD,
            "path": PATH, "code": code_version(), **forced, **extra}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def tuned_configs(autotune):
    """Replay the autotuned configs recorded for this GPU (unless ``autotune`` or the environment says
    otherwise) before the first kernel call: a cold machine compiles one config per kernel."""
    from megatron_zeco.common.tuning import ENV, configure

    os.environ.setdefault(ENV, "off" if autotune else "auto")
    return configure()


def main():
    args = parse_args()
    if args.piece:
        import profile_piece  # this folder's

        return profile_piece.main([
            "--op", args.op, "--tokens", *map(str, args.tokens), "--heads", str(args.heads), "--dim", str(args.dim),
            "--a2a-world", "1", "--cases", "fla", "piece", "a2a P=1", "--iters", str(args.iters),
            "--warmup", str(args.warmup), "--out", args.out] + (["--forward-only"] if args.forward_only else [])
            + (["--autotune"] if args.autotune else []))
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    configs = tuned_configs(args.autotune)
    dist.init_process_group("nccl")
    world, me = dist.get_world_size(), dist.get_rank()
    cp_group = dist.new_group(list(range(world)))
    self_groups = [dist.new_group([r]) for r in range(world)]
    rows = []
    log(f"{torch.cuda.get_device_name()} x{world}, torch {torch.__version__}; kernel configs: {configs}")
    parts = {"op": lambda: bench_op(args, world, me, cp_group, self_groups[me], rows),
             "scan": lambda: bench_scan(args, world, me, cp_group, rows),
             "accuracy": lambda: bench_accuracy(args, world, me, cp_group, rows),
             "packed": lambda: bench_packed(args, world, me, cp_group, rows)}
    for name in args.parts:
        parts[name]()
        if me == 0:  # after each part: a run cut short keeps what it measured
            write(args, world, rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
