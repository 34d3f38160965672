"""Where one GPU's time goes in a delta rule's ZeCO piece and in strategy a2a, against fla.

    python benchmarks/profile_piece.py --tokens 16384 32768 --out results/profile-gdn-piece.json
    python benchmarks/profile_piece.py --op kda --tokens 16384 32768 65536 --out results/profile-kda-piece.json
    python benchmarks/profile_piece.py --a2a-world 2 --cases fla "a2a P=2" --out results/a2a.json

(Results: docs/results/profile-*-piece-*.json, each with the package's commit; docs/gated-deltanet.md and
docs/kda.md say what they show.)

``--op gdn`` (default): the gated delta rule; ``--op kda``: Kimi Delta Attention. One GPU, no process
group; B = 1 sequence of T tokens, H heads of K = V = ``--dim``; q, k, v, beta in bf16, g in float32
(``logsigmoid(randn) / 16``: one per head and token for gdn, per head, token and key channel for kda),
k L2-normalised, beta = sigmoid. Cases, each forward alone (``fwd``) and forward + backward
(``fwd+bwd``):

* ``fla``: fla's op (``chunk_gated_delta_rule``, ``chunk_kda``; no initial state, no final state), dense
  inputs; ``fla varlen``: the same tokens as one segment (``cu_seqlens = [0, T]``).
* ``piece first|middle|last``: one ZeCO piece on fla's kernels (``gated_delta_rule/fla_piece.py``,
  ``kda/fla_piece.py``) with the exchange between ranks stubbed: forward = the constructor (the summary
  ``(E, M)``) + ``output(S_in)``; backward = ``entering_grad(do)`` + ``grads(D)``. First: ``S_in = 0``,
  ``D`` random; middle: both random; last: ``S_in`` random, ``D = 0`` (what the scan hands the piece:
  a zero tensor, not None). ``piece middle, K1 inside K2``: the middle piece with Qt formed chunk by chunk
  inside K2 (``fused_maps``), where the pieces make it with a kernel of its own (K1) that K2 reads.
  ``piece middle, one stream``: the middle piece with its maps after fla's state pass on the current
  stream rather than beside it on a second one (what the side stream buys). ``piece middle, state pass
  not urgent`` (gdn): fla's state pass on the current stream rather than on one of the highest priority
  (``urgent_state_pass``).
* ``a2a P=p``: one rank's work in strategy a2a at CP=p (``cp/a2a.py: head_all_to_all`` around the
  operator's local op) with each all-to-all replaced by a same-size device copy
  (``x.contiguous()`` then a copy into ``torch.empty_like``, as ``comm.functional._AllToAll`` feeds
  NCCL): this rank's T tokens in, fla's op over p*T tokens of H/p heads, T tokens out.
  ``a2a P=1 stubbed``: the exchange a no-op (what the code around the all-to-alls costs).
  ``a2a P=p g=bf16`` draws g in bf16, as ``bench_op.py --op gdn`` does.
* ``fla H/p x pT``: fla's op alone on the shape a2a's local op runs (contiguous inputs): what
  trading heads for tokens costs apart from the all-to-alls and casts around it.

Each case is timed four ways: ``gpu`` (median of ``--iters`` single iterations, each issued
behind a GPU sleep long enough for the host to queue all of it: GPU time, no host gaps), ``steady``
(mean of ``--iters`` iterations back to back, median of 3: a training loop's view, as bench_op's
steady mode), ``graph`` (median replay of one iteration captured in a CUDA graph: the GPU's cost
with no host issue at all; where capture fails, why) and ``host`` (median host time to issue one
iteration while the GPU is busy with a 50 ms sleep: a host time of about 50 ms or more means the
case synchronises with the GPU). The
``gpu`` loop also times each case's stages (a piece: summary, output, entering_grad, grads;
fla and a2a: forward, backward). ``--host-profile`` calls run under cProfile, the host's issue time by
package (fla, megatron_zeco, triton, torch, other Python, C builtins) and its costliest functions. Then ``--profile-iters``
iterations run under torch.profiler:
CUDA time and launches per kernel name per iteration, and each kernel's grid and block (the
number of programs of fla's sequential state passes). The autotuned config of every fla kernel
that ran is recorded too. With ``--timeline`` one more iteration, issued behind a GPU sleep, is traced:
each kernel's stream, start and end (µs from the first kernel's start), which shows what runs beside
what. Prints tables as it goes and rewrites ``--out`` (JSON) after each case.

fla 0.6 refuses the gated delta rule's backward on Hopper with Triton 3.4 - 3.7.0 (its issue
#640): use Triton >= 3.7.1, or ``--forward-only``.
"""

import argparse
import collections
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

NAMES = ("q", "k", "v", "g", "beta")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=["gdn", "kda"], default="gdn",
                   help="gdn: the gated delta rule; kda: Kimi Delta Attention")
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768], help="tokens of the piece (per rank)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128, help="K = V")
    p.add_argument("--a2a-world", type=int, nargs="+", default=[1, 2],
                   help="CP sizes whose a2a rank work is simulated (divisors of --heads)")
    p.add_argument("--cases", nargs="+", default=None,
                   help="run only cases whose name starts with one of these (e.g. fla piece 'a2a P=2')")
    p.add_argument("--forward-only", action="store_true", help="time the forward alone (fla refuses its backward)")
    p.add_argument("--iters", type=int, default=25)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-iters", type=int, default=10)
    p.add_argument("--top", type=int, default=14, help="kernels printed per case")
    p.add_argument("--host-profile", type=int, default=5, metavar="N",
                   help="calls per case under cProfile: the host's issue time by package and function (0: off)")
    p.add_argument("--timeline", action="store_true",
                   help="trace one iteration per case: each kernel's stream, start and end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--autotune", action="store_true",
                   help="autotune every kernel instead of replaying the configs recorded for this GPU")
    p.add_argument("--out", default=None, help="default: profile-<op>-piece.json")
    args = p.parse_args(argv)
    args.out = args.out or f"profile-{args.op}-piece.json"
    bad = [P for P in args.a2a_world if P < 1 or args.heads % P]
    if bad:
        p.error(f"--a2a-world {bad}: each must divide --heads {args.heads}")
    return args


# ---------------------------------------------------------------------------------------------
# inputs and cases


def make_inputs(T, H, D, seed, device, op="gdn", g_dtype=torch.float32, dtype=torch.bfloat16):
    """q, k, v, g, beta ``[1, T, H(, D)]`` (g ``[1, T, H]`` for gdn, ``[1, T, H, D]`` for kda), the output
    gradient ``do``, and random float32 states ``S`` (an entering state) and ``D`` (a leaving-state
    gradient) ``[1, H, D, D]``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (torch.randn(1, T, H, D, device=device, generator=gen) for _ in range(4))
    g = F.logsigmoid(torch.randn(1, T, H, *((D,) if op == "kda" else ()), device=device, generator=gen)) / 16
    beta = torch.randn(1, T, H, device=device, generator=gen).sigmoid()
    S, dS = (torch.randn(1, H, D, D, device=device, generator=gen) for _ in range(2))
    x = dict(q=q, k=F.normalize(k, dim=-1), v=v, beta=beta, do=do)
    x = {n: t.to(dtype) for n, t in x.items()}
    return dict(x, g=g.to(g_dtype), S=S, D=dS, scale=D ** -0.5)


def _unmarked(_name):
    pass


def fla_case(ops, x, backward, varlen=False):
    """fla's op on ``x`` (as one segment of a packed row with ``varlen``)."""
    leaves = [x[n].detach().requires_grad_(backward) for n in NAMES]
    kw = {}
    if varlen:
        T = x["q"].shape[1]
        kw = dict(cu_seqlens=torch.tensor([0, T], device=x["q"].device), cu_seqlens_cpu=torch.tensor([0, T]))

    def run(mark=_unmarked):
        o, _ = ops.fla(*leaves, scale=x["scale"], initial_state=None, output_final_state=False, **kw)
        mark("forward")
        if not backward:
            return o
        grads = torch.autograd.grad(o, leaves, x["do"])
        mark("backward")
        return grads

    return run


def piece_case(ops, x, where, backward, **built):
    """One ZeCO piece (``where``: first, middle or last) with the scans' results given; ``built``: the piece
    class's attributes changed from what is built (``side_stream=False``: its maps after fla's state pass on
    one stream rather than beside it on a second; ``fused_maps=True``: K1 inside K2)."""
    S_in = torch.zeros_like(x["S"]) if where == "first" else x["S"]
    D = torch.zeros_like(x["D"]) if where == "last" else x["D"]
    inputs = [x[n] for n in NAMES]

    make = type("Variant", (ops.piece,), built) if built else ops.piece

    def run(mark=_unmarked):
        piece = make(*inputs, x["scale"])
        mark("summary (E, M)")
        o = piece.output(S_in)
        mark("output(S_in)")
        if not backward:
            return o
        A = piece.entering_grad(x["do"])
        mark("entering_grad(do)")
        grads = piece.grads(D)
        mark("grads(D)")
        return o, A, grads

    return run


class CopyAllToAll(torch.autograd.Function):
    """``comm.functional._AllToAll`` with the exchange replaced by a device copy of the same size:
    what rank r would send here lands in slot r (this rank's own part r stands in for it)."""

    @staticmethod
    def forward(ctx, *xs):
        ctx.shapes = [x.shape for x in xs]
        out = [torch.empty_like(x) for x in xs]
        for o, x in zip(out, xs):
            o.copy_(x.contiguous())
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        out = [torch.empty(s, dtype=grads[0].dtype, device=grads[0].device) for s in ctx.shapes]
        for o, g in zip(out, grads):
            o.copy_(g.contiguous())
        return tuple(out)


def copy_all_to_all(xs, group):
    return list(CopyAllToAll.apply(*xs))


def no_all_to_all(xs, group):
    """The exchange stubbed: every part stays where it is (what the code around an all-to-all costs)."""
    return list(xs)


def a2a_case(ops, x, world, backward, exchange=copy_all_to_all):
    """This rank's work in strategy a2a at CP=``world``: ``cp/a2a.py: head_all_to_all`` around the
    operator's local op, each all-to-all replaced by ``exchange`` (a copy of the same size, or nothing)."""
    from megatron_zeco.comm import as_layout
    from megatron_zeco.cp import a2a
    from megatron_zeco.cp.operator import Call

    group = SimpleNamespace(size=lambda: world, rank=lambda: 0)
    plan = SimpleNamespace(group=group, layout=as_layout("contiguous"), pieces_per_rank=1)
    call = Call(x["scale"])
    leaves = [x[n].detach().requires_grad_(backward) for n in NAMES]

    def run(mark=_unmarked):
        real, a2a.all_to_all = a2a.all_to_all, exchange
        try:
            o, _ = a2a.head_all_to_all(ops.operator, plan, call, tuple(leaves), None)
        finally:
            a2a.all_to_all = real
        mark("forward")
        if not backward:
            return o
        grads = torch.autograd.grad(o, leaves, x["do"])
        mark("backward")
        return grads

    return run


def cases_for(args, ops, T, device):
    """``[(group, name, direction, make_run)]``: the cases at T tokens, H = --heads heads first (one
    compile of each kernel covers every T), then the a2a shapes (H/p heads)."""
    H, D = args.heads, args.dim
    directions = [("fwd", False)] + ([] if args.forward_only else [("fwd+bwd", True)])
    x = lambda **kw: make_inputs(T, H, D, args.seed, device, args.op, **kw)  # noqa: E731
    out = []
    for direction, bwd in directions:
        out.append(("H", "fla", direction, lambda b=bwd: fla_case(ops, x(), b)))
        out.append(("H", "fla varlen", direction, lambda b=bwd: fla_case(ops, x(), b, varlen=True)))
        for where in ("first", "middle", "last"):
            out.append(("H", f"piece {where}", direction, lambda b=bwd, w=where: piece_case(ops, x(), w, b)))
        out.append(("H", "piece middle, one stream", direction,
                    lambda b=bwd: piece_case(ops, x(), "middle", b, side_stream=False)))
        out.append(("H", "piece middle, K1 inside K2", direction,
                    lambda b=bwd: piece_case(ops, x(), "middle", b, fused_maps=True)))
        if args.op == "gdn":
            out.append(("H", "piece middle, state pass not urgent", direction,
                        lambda b=bwd: piece_case(ops, x(), "middle", b, urgent_state_pass=False)))
    for P in args.a2a_world:
        for direction, bwd in directions:
            group = "H" if P == 1 else f"H/{P}"
            out.append((group, f"a2a P={P}", direction, lambda b=bwd, P=P: a2a_case(ops, x(), P, b)))
            if P == 1:
                out.append((group, "a2a P=1 stubbed", direction,
                            lambda b=bwd: a2a_case(ops, x(), 1, b, exchange=no_all_to_all)))
            if P > 1:
                out.append((group, f"a2a P={P} g=bf16", direction,
                            lambda b=bwd, P=P: a2a_case(ops, x(g_dtype=torch.bfloat16), P, b)))
                out.append((group, f"fla H/{P} x {P}T", direction,
                            lambda b=bwd, P=P: fla_case(ops, make_inputs(P * T, H // P, D, args.seed, device,
                                                                         args.op), b)))
    if args.cases:
        out = [c for c in out if any(c[1].startswith(s) for s in args.cases)]
    return out


# ---------------------------------------------------------------------------------------------
# timing and profiling


def sleep_cycles_per_ms():
    """GPU clock cycles per ms of ``torch.cuda._sleep`` (to keep the GPU busy for a known time)."""
    torch.cuda._sleep(1_000_000)  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def host_ms(run, iters, cycles_per_ms):
    """Median host time (ms) to issue one ``run`` while the GPU is busy (nothing waits on it)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(50 * cycles_per_ms))
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def host_profile(run, iters, cycles_per_ms, top=15):
    """Where the host's issue time goes: ``iters`` calls of ``run`` under cProfile while the GPU is busy.
    ``({package: ms per call}, [[function, calls per call, own µs per call, cumulative µs per call], ...])``
    with packages fla, megatron_zeco, triton, torch, other (by the function's file) and C (builtins: torch's
    operators, Triton's launcher), own time only;
    the ``top`` functions by own time. cProfile's own cost inflates the times about alike, so read them as
    shares."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    torch.cuda._sleep(int(200 * iters * cycles_per_ms))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(iters):
        run()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats
    by_package = collections.Counter()
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.items():
        package = "C" if path == "~" else next(
            (p for p in ("fla", "megatron_zeco", "triton", "torch") if f"/{p}/" in path), "other")
        by_package[package] += own * 1e3 / iters
        where = name if path == "~" else f"{package}:{os.path.basename(path)}:{line}({name})"  # "~": builtins
        rows.append([where, calls / iters, own * 1e6 / iters, cumulative * 1e6 / iters])
    rows.sort(key=lambda r: -r[2])
    return dict(by_package.most_common()), [[w, round(c, 2), round(o, 1), round(u, 1)] for w, c, o, u in rows[:top]]


def gpu_ms(run, iters, sleep_ms, cycles_per_ms):
    """Median GPU time (ms) of one ``run`` and of each of its marked stages: each iteration is issued
    behind a GPU sleep of ``sleep_ms`` so that its kernels run back to back."""
    totals, stages = [], collections.defaultdict(list)
    for _ in range(iters):
        marks = []

        def mark(name):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append((name, event))

        torch.cuda.synchronize()
        torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        run(mark)
        torch.cuda.synchronize()
        prev = start
        for name, event in marks:
            stages[name].append(prev.elapsed_time(event))
            prev = event
        totals.append(start.elapsed_time(prev))
    return statistics.median(totals), {n: statistics.median(t) for n, t in stages.items()}


def graph_ms(run, iters):
    """(median GPU time in ms of one replay of ``run`` captured in a CUDA graph, None) -- the GPU's cost
    with the host's issue time taken out -- or (None, why) where ``run`` cannot be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # capture needs a warm call off the capturing stream first
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    except Exception as e:  # noqa: BLE001 -- a path that cannot be captured is a result, not a failure
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times), None


def steady_ms(run, iters, samples=3):
    """Mean time (ms) of ``iters`` iterations issued back to back; median of ``samples``."""
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def kernel_times(run, iters):
    """``({kernel: {"us": µs per iteration, "calls": launches per iteration}}, {kernel: [grid, block]
    of each distinct launch shape})`` of ``run``'s CUDA work under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    us, calls = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us[event.name] += event.device_time / iters
            calls[event.name] += 1 / iters
    table = {n: {"us": t, "calls": round(calls[n], 2)} for n, t in us.most_common()}
    launches = collections.defaultdict(list)
    for e in _trace(prof):  # grids live in the trace's kernel events only
        shape = [e.get("args", {}).get("grid"), e.get("args", {}).get("block")]
        if shape not in launches[e["name"]]:
            launches[e["name"]].append(shape)
    return table, dict(launches)


def _trace(prof):
    """The kernel events of a torch.profiler run's chrome trace."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"]


def timeline(run, cycles_per_ms):
    """``[[kernel, stream, start µs, end µs], ...]`` of one ``run`` issued behind a GPU sleep (so that
    the host is ahead of the GPU), in order of start, times from the first kernel's start."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(int(20 * cycles_per_ms))
        run()
        torch.cuda.synchronize()
    kernels = sorted((e for e in _trace(prof) if "spin_kernel" not in e["name"]), key=lambda e: e["ts"])
    t0 = kernels[0]["ts"] if kernels else 0.0
    return [[short(e["name"]), e.get("args", {}).get("stream"), round(e["ts"] - t0, 1),
             round(e["ts"] + e["dur"] - t0, 1)] for e in kernels]


# ---------------------------------------------------------------------------------------------
# reporting


def short(name, width=64):
    """A kernel name cut to ``width``; PyTorch's templated kernels by the functors they name."""
    parts = [p for p in re.findall(r"at::native::(?:\(anonymous namespace\)::)?(\w+)", name)
             if not p.startswith("gpu_kernel")]
    if parts:
        of = re.search(r"lambda\(([\w:]+)\)#", name)  # the element type of elementwise functors
        name = (parts[0] + (f"<{','.join(dict.fromkeys(parts[1:]))}>" if len(parts) > 1 else "")
                + (f"[{of.group(1).removeprefix('c10::')}]" if of else ""))
    return name if len(name) <= width else name[:width - 1] + "~"


def print_case(row, top):
    ks = row["kernels"]
    total = sum(k["us"] for k in ks.values())
    stages = ", ".join(f"{n} {t:.3f}" for n, t in row["stages_ms"].items())
    print(f"\n== T={row['tokens']} {row['case']} {row['direction']}: gpu {row['gpu_ms']:.3f} ms, steady "
          f"{row['steady_ms']:.3f} ms, host issue {row['host_ms']:.3f} ms; kernels {total / 1e3:.3f} ms "
          f"({stages})", flush=True)
    for name, k in list(ks.items())[:top]:
        grid = row["launches"].get(name, [])
        print(f"  {short(name):64s} {k['us']:9.1f} us {k['calls']:5.1f}x {100 * k['us'] / total:5.1f}%  "
              + " ".join(f"grid{tuple(s[0] or ())}" for s in grid[:2]), flush=True)
    if row.get("timeline"):
        print("  timeline (µs from the first kernel):", flush=True)
        for name, stream, start, end in row["timeline"]:
            print(f"    stream {stream!s:>4} {start:8.1f} .. {end:8.1f} ({end - start:7.1f})  {name}", flush=True)
    if row.get("host_by_package_ms"):
        print("  host issue by package (cProfile, ms per call): "
              + ", ".join(f"{p} {ms:.3f}" for p, ms in row["host_by_package_ms"].items()), flush=True)
        for where, calls, own, cumulative in row["host_top"][:6]:
            print(f"    {where[:80]:80s} {calls:6.1f}x own {own:8.1f} us cum {cumulative:8.1f} us", flush=True)


def summary(rows):
    """Timing table per T (ratios against fla's op on the same tokens) and a side-by-side kernel
    table per T and direction."""
    lines = []
    for T in sorted({r["tokens"] for r in rows}):
        at = [r for r in rows if r["tokens"] == T]
        base = {r["direction"]: r["gpu_ms"] for r in at if r["case"] == "fla"}
        lines.append(f"\n## T={T}: ms (gpu = each iteration from a full queue; steady = back to back)")
        lines.append(f"  {'case':22s} {'dir':8s} {'gpu':>8s} {'steady':>8s} {'graph':>8s} {'host':>7s} {'x fla':>6s}"
                     "  stages")
        for r in at:
            ratio = r["gpu_ms"] / base[r["direction"]] if r["direction"] in base else float("nan")
            stages = ", ".join(f"{n} {t:.3f}" for n, t in r["stages_ms"].items())
            graphed = "-" if r.get("graph_ms") is None else f"{r['graph_ms']:.3f}"
            lines.append(f"  {r['case']:22s} {r['direction']:8s} {r['gpu_ms']:8.3f} {r['steady_ms']:8.3f} "
                         f"{graphed:>8s} {r['host_ms']:7.3f} {ratio:6.2f}  {stages}")
        for direction in ("fwd", "fwd+bwd"):
            cols = [r for r in at if r["direction"] == direction]
            if not cols:
                continue
            names = []
            for r in cols:
                names += [n for n in r["kernels"] if n not in names]
            names.sort(key=lambda n: -max(r["kernels"].get(n, {"us": 0})["us"] for r in cols))
            lines.append(f"\n## T={T} {direction}: µs per iteration per kernel (calls per iteration)")
            lines.append(f"  {'kernel':56s} " + " ".join(f"{r['case'][:14]:>14s}" for r in cols))
            for n in names:
                if max(r["kernels"].get(n, {"us": 0})["us"] for r in cols) < 5:
                    continue
                cells = []
                for r in cols:
                    k = r["kernels"].get(n)
                    cells.append(f"{'-':>14s}" if k is None else f"{k['us']:9.1f} ({k['calls']:.0f})"[:14].rjust(14))
                lines.append(f"  {short(n, 56):56s} " + " ".join(cells))
            lines.append(f"  {'total':56s} " + " ".join(
                f"{sum(k['us'] for k in r['kernels'].values()):14.1f}" for r in cols))
    return "\n".join(lines)


def meta(args):
    import triton
    try:
        import fla
        fla_version = fla.__version__
    except ImportError:
        fla_version = None
    props = torch.cuda.get_device_properties(0)
    return {"command": "python benchmarks/profile_piece.py " + " ".join(sys.argv[1:]), "op": args.op,
            "device": f"{props.name} x1", "sms": props.multi_processor_count,
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__,
            "fla": fla_version, "cuda": torch.version.cuda, "heads": args.heads, "dim": args.dim,
            "dtypes": "q, k, v, beta bf16; g float32 (a2a g=bf16 rows: g bf16)"}


def write(args, rows, extra=None):
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta(args), "rows": rows, **(extra or {})}, f, indent=1)


def default_ops(op):
    """The functions timed: fla's op, ZeCO's piece on fla's kernels, and the operator (for a2a)."""
    if op == "kda":
        from fla.ops.kda import chunk_kda

        from megatron_zeco.kda import KDA
        from megatron_zeco.kda.fla_piece import FlaPiece

        return SimpleNamespace(fla=chunk_kda, piece=FlaPiece, operator=KDA)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from megatron_zeco.gated_delta_rule import GATED_DELTA_RULE
    from megatron_zeco.gated_delta_rule.fla_piece import FlaPiece

    return SimpleNamespace(fla=chunk_gated_delta_rule, piece=FlaPiece, operator=GATED_DELTA_RULE)


def measure(args, make, cycles):
    """One case: warm-up (the first call compiles and autotunes), host issue time, GPU time and
    stages, steady time, then the kernel table under the profiler."""
    started = time.perf_counter()
    run = make()
    for _ in range(args.warmup):
        run()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - started
    host = host_ms(run, 5, cycles)
    ms, stages = gpu_ms(run, args.iters, max(1.0, 2 * host), cycles)
    graphed, why = graph_ms(run, args.iters)
    row = {"gpu_ms": ms, "stages_ms": stages, "steady_ms": steady_ms(run, args.iters), "host_ms": host,
           "graph_ms": graphed, "graph_error": why, "warmup_s": warm_s}
    row["kernels"], row["launches"] = kernel_times(run, args.profile_iters)
    if args.host_profile:
        row["host_by_package_ms"], row["host_top"] = host_profile(run, args.host_profile, cycles)
    if args.timeline:
        row["timeline"] = timeline(run, cycles)
    return row


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_piece.py needs a CUDA GPU (fla's kernels)")
    from megatron_zeco.common.tuning import ENV, configure

    os.environ.setdefault(ENV, "off" if args.autotune else "auto")
    configs = configure()
    ops = default_ops(args.op)
    device = torch.device("cuda")
    cycles = sleep_cycles_per_ms()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {cycles / 1e6:.2f} GHz sleep clock; "
          f"kernel configs: {configs}", flush=True)
    rows, failed = [], []
    groups = ["H"] + [f"H/{P}" for P in args.a2a_world if P > 1]
    for group in groups:  # H heads at every T first: the H/p shapes compile and autotune afresh
        for T in args.tokens:
            for g, name, direction, make in cases_for(args, ops, T, device):
                if g != group:
                    continue
                try:
                    row = measure(args, make, cycles)
                except Exception as e:  # noqa: BLE001 -- one case's failure (fla's refusal, memory) ends only it
                    print(f"\n== T={T} {name} {direction}: FAILED {type(e).__name__}: {e}", flush=True)
                    failed.append({"tokens": T, "case": name, "direction": direction, "error": f"{type(e).__name__}: {e}"})
                    continue
                finally:
                    torch.cuda.empty_cache()
                rows.append({"part": "profile", "op": args.op, "tokens": T, "case": name, "direction": direction,
                             **row})
                print_case(rows[-1], args.top)
                write(args, rows, {"failed": failed, "configs": configs})
            torch.cuda.empty_cache()
    print(summary(rows), flush=True)


if __name__ == "__main__":
    main()
