"""What the scan's overlap buys on one GPU: a piece's in-chunk work beside the hop that waits for its peer.

    python benchmarks/bench_overlap.py --op gla gdn --tokens 16384 32768 --out results/overlap.json

At CP >= 2 a rank's hop kernel waits until its predecessor's state arrives (its successor's gradient in
backward). With the overlap (``cp_overlap_scan``, on by default over peer memory and NVSHMEM) the rank's
hops are issued on a side stream on a few programs (``comm/peer.py: ASIDE_PROGRAMS``) before the
in-chunk work that needs no entering state (``Piece.before_output``, ``Piece.before_grads``), and spin
beside it; without, that work is issued first and the hop after it, on the current stream.

One process plays both ends of one link. The predecessor's hop (the real ``all_scan_hop``, or
``all_scan_dense_hop`` for the delta rules, storing into this rank's receive buffer and raising its
flags, in device memory) runs on a stream of its own, of the highest priority (on its own GPU it would not
queue behind this rank's work), behind a GPU sleep of ``--arrival`` microseconds,
counted from the end of the piece's summary (forward) or of ``entering_grad`` (backward): when the state
reaches this rank. This rank's piece (``gla/fla_piece.py``, ``gated_delta_rule/fla_piece.py``,
``kda/fla_piece.py``; B = 1, H heads of K = V = ``--dim``, bf16) then runs as ``cp/scan.py`` runs it, its
scan in each direction the one hop that waits:

* ``serial``: the in-chunk work, then the waiting hop on the current stream (overlap off);
* ``overlap``: the waiting hop on the side stream on ``ASIDE_PROGRAMS`` programs (``--aside-programs``), the
  in-chunk work on the current stream beside it (as built with ``cp_overlap_scan=True``, GLA's default: the
  side stream of the highest priority, ``--side-priority normal`` for the default one; a direction whose
  piece has no such work runs as ``serial``, as built too);
* ``partition`` (with ``--scan-sms N``): as ``overlap``, but the waiting hop on a green context of N SMs of
  its own and the in-chunk work on another of the SMs left (``green_context.py``), so that neither shares an SM
  with the other; each emulated peer then spins on N SMs of its own too (not built: the question is whether SMs
  of its own keep the hop at its pace alone);
* ``after`` (with ``--after``): the in-chunk work, then the waiting hop on the side stream on
  ``ASIDE_PROGRAMS`` programs: the hop on as few programs as beside the work, but alone, so that against
  ``serial`` and ``overlap`` it tells what the program count costs the hop from what the work beside it does;
* ``chain`` (with ``--chain``): as ``overlap``, but the predecessor's hop too is launched before the in-chunk
  work and waits on its SMs for the state of the rank before it, which a pass-through hop stores behind the
  sleep (elsewhere the predecessor's hop is launched behind the sleep, so it is placed while the work holds
  the SMs): every hop of the chain waiting on its SMs when its state lands, as one launch a rank per scan
  would keep them (not built: the hierarchical scan launches again after its first hop). Its arrival is when
  the state reaches the predecessor (one hop earlier than in the other modes).

This rank's hop sends on to a successor, whose receiving hop spins on its own stream. Per op, tokens,
arrival and mode: the GPU time of the forward (summary to output) and of the backward (``entering_grad``
to ``grads``), of the in-chunk work inside them, and from the scan's start until the successor holds this
rank's state (``departure``: what a chain's critical path sees at every rank that waits, the in-chunk
work's time under ``serial`` wherever the state arrives before that work ends) and until the predecessor's
state has landed in this rank's buffer (``arrived``: its hop done); medians of ``--iters``,
each iteration queued behind a GPU sleep so that no host gap counts. ``in-chunk`` under ``overlap`` against
``serial`` is what the spinning programs take from that work. The received states are checked against the
link's formula first.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", nargs="+", default=["gla", "gdn"], choices=["gla", "gdn", "kda"])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--arrival", type=float, nargs="+", default=[0, 250, 500, 1000],
                   help="microseconds from the end of the summary (entering_grad) to the predecessor's send")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--aside-programs", type=int, default=None,
                   help="programs of the hops on the side stream (default: as built, comm/peer.py)")
    p.add_argument("--side-priority", choices=["high", "normal"], default="high",
                   help="the side stream's priority (high: as built, cp/scan.py: scan_stream)")
    p.add_argument("--scan-sms", type=int, default=None,
                   help="also time mode 'partition': the hop on a green context of this many SMs, the in-chunk "
                        "work on the others (green_context.py), each emulated peer on as many of its own")
    p.add_argument("--after", action="store_true",
                   help="also time mode 'after': the hop on the side stream's programs after the in-chunk work")
    p.add_argument("--chain", action="store_true",
                   help="also time mode 'chain': the predecessor's hop too waits on its SMs from before the work")
    p.add_argument("--dense-precision", nargs="+", default=None, choices=["tf32x3", "tf32"],
                   help="the delta rules' hops' products, each a set of rows (default: as built for the piece's "
                        "bf16 inputs, kernels/scan_hop.py: dense_precision)")
    p.add_argument("--out", default="results/overlap.json")
    return p.parse_args(argv)


class Link:
    """Three regions of a channel in one buffer: the predecessor's, this rank's and the successor's
    (``comm/peer.py``'s layout: receive buffer, arrival flags, acknowledgements, call counters), and the
    hops of the two links between them; ``fed``: a fourth before them, the region of the rank before the
    predecessor, whose state a pass-through hop stores into the predecessor's (:meth:`feed`), the predecessor's
    hop then waiting for it."""

    def __init__(self, like, dense, device, aside_programs=None, precision="tf32x3", fed=False):
        from megatron_zeco.comm import peer
        from megatron_zeco.comm.watch import watch
        from megatron_zeco.kernels import scan_hop

        K, V = like.shape[-2:]
        self.N, self.K, self.V, self.dense, self.scan_hop = like.numel() // (K * V), K, V, dense, scan_hop
        self.tiles = peer.tiles_per_state(K, V, dense, num_blocks=1)
        # states of up to 32 bits (either direction's), over peer memory
        self.data, self.flags, size = peer.region_bytes(self.N, K, V, torch.float32, self.tiles, nvshmem=False)
        regions = 4 if fed else 3
        self.buffer = torch.zeros(regions * size, dtype=torch.uint8, device=device)
        *top, self.up, self.me, self.down = (self.buffer.data_ptr() + i * size for i in range(regions))
        self.top = top[0] if fed else None
        w = watch(device)
        self.watcher = w
        self.bounded = {who: w.arguments(w.launch_id(("bench_overlap", who), lambda who=who: (who, (None, None))), 60.0)
                        for who in ("feed", "send", "hop", "receive")}
        self.aside_programs = aside_programs or peer.ASIDE_PROGRAMS
        self.products = dict(precision=precision) if dense else {}

    def _hop(self, x_init, gamma, delta, s_in, regions, who, programs=None, **flags):
        g_stride = self.K * (self.K if self.dense else 1)
        hop = self.scan_hop.all_scan_dense_hop if self.dense else self.scan_hop.all_scan_hop
        hop(x_init, [gamma], [delta], [s_in], None, regions, g_stride, self.K * self.V, self.tiles, self.data,
            self.flags, watch=self.bounded[who], programs=programs, **self.products, **flags)

    def send(self, x, gamma, delta, s_in):
        """The predecessor's hop: ``gamma x + delta`` (``M x + delta``) into this rank's buffer, ``x`` read
        from memory, or with ``fed`` the state :meth:`feed` stores (waited for). On few programs, as the
        successor's receive: one GPU holds what three ranks' GPUs would, and a program that waits must stay
        resident until the one it waits for has run (this rank's hop, on every program without the overlap,
        and the emulated peers fit on the SMs together)."""
        if self.top is None:
            self._hop(x.data_ptr(), gamma, delta, s_in, (self.up, self.up, 0, self.me), "send",
                      programs=self.aside_programs, has_src=False, has_init=True, has_dst=True)
        else:
            self._hop(0, gamma, delta, s_in, (self.up, self.up, self.top, self.me), "send",
                      programs=self.aside_programs, has_src=True, has_init=False, has_dst=True)

    def feed(self, x, gamma, delta, s_in):
        """With ``fed``: ``x`` as it is into the predecessor's buffer (a pass-through hop: the rank before it
        passing its state on)."""
        self._hop(x.data_ptr(), gamma, delta, s_in, (self.top, self.top, 0, self.up), "feed",
                  programs=self.aside_programs, has_src=False, has_init=True, has_dst=True, pass_through=True)

    def hop(self, gamma, delta, s_in, programs=None):
        """This rank's hop: waits for the predecessor's state, writes it into ``s_in`` and sends
        ``gamma s_in + delta`` on to the successor."""
        self._hop(0, gamma, delta, s_in, (self.me, self.me, self.up, self.down), "hop", programs=programs,
                  has_src=True, has_init=False, has_dst=True)

    def receive(self, gamma, delta, s_in, programs=None):
        """The successor's hop: waits for this rank's state, writes it into ``s_in``."""
        self._hop(0, gamma, delta, s_in, (self.down, self.down, self.me, 0), "receive", programs=programs,
                  has_src=True, has_init=False, has_dst=False)


def make_piece(op, T, H, D, device, seed):
    import profile_piece  # this folder's

    import importlib

    x = profile_piece.make_inputs(T, H, D, seed, device, op="gdn" if op == "gdn" else "kda")  # gla: gates per channel
    package = {"gla": "gla", "gdn": "gated_delta_rule", "kda": "kda"}[op]
    FlaPiece = importlib.import_module(f"megatron_zeco.{package}.fla_piece").FlaPiece
    inputs = [x[n] for n in ("q", "k", "v", "g", *(() if op == "gla" else ("beta",)))]
    return (lambda: FlaPiece(*inputs, x["scale"])), x


def run_case(op, T, args, cycles_per_ms, device, precision=None):
    """Rows of one op and length: every arrival, both modes; ``precision``: the dense hops' products (the delta
    rules'; None for GLA's)."""
    from megatron_zeco.cp.scan import scan_stream

    print(f"{op} T={T}: building the piece (the first call compiles fla's kernels)", flush=True)
    make, x = make_piece(op, T, args.heads, args.dim, device, seed=T)
    piece = make()
    E = piece.E.reshape(-1, args.dim, args.dim)  # the states in the piece's dtype, as the scan moves them
    dense = op != "gla"  # the delta rules' K x K maps
    link = Link(E, dense, device, args.aside_programs, precision)
    # mode 'chain': regions of their own, so that each region's calls (and flags) stay in step with its peers'
    chained = Link(E, dense, device, args.aside_programs, precision, fed=True) if args.chain else None
    trans = piece.transition.reshape(E.shape[0], args.dim, *((args.dim,) if dense else ())).contiguous()
    # the predecessor's own summary and entering state (random: only its arrival time matters here)
    gen = torch.Generator(device=device).manual_seed(T + 1)
    x_up, E_up = (torch.randn(E.shape, device=device, generator=gen) for _ in range(2))
    T_up = (torch.randn(trans.shape, device=device, generator=gen) / args.dim if dense
            else torch.rand(trans.shape, device=device, generator=gen)).to(trans.dtype)
    up = {}  # per state dtype: the predecessor's entering state, summary and its own S_in

    def upstream(dtype):
        if dtype not in up:
            up[dtype] = x_up.to(dtype), E_up.to(dtype), torch.empty(E.shape, dtype=dtype, device=device)
        return up[dtype]

    x64, T64 = x_up.to(E.dtype).double(), T_up.double()
    want = (T64 @ x64 if dense else T64.unsqueeze(-1) * x64) + E_up.to(E.dtype).double()
    side = torch.cuda.Stream(device) if args.side_priority == "normal" else scan_stream(device)
    part = None  # mode 'partition': (the hop's stream, the in-chunk work's)
    if args.scan_sms:
        from green_context import green_stream, split_sms  # this folder's

        # each emulated peer on SMs of its own, as many as the hop's: on the work's their hops would queue
        # behind its programs, and where a spinning program of one could hold the SMs another needs to run (the
        # hop's, or the other peer's) the three would wait on each other (on their own GPUs they do not)
        (scan, scan_sms), (fed, _), (fwd_to, _), (work, work_sms) = split_sms(device, args.scan_sms, groups=3)
        part = green_stream(scan, device), green_stream(work, device)
        peers = green_stream(fed, device), green_stream(fwd_to, device)
        print(f"partition: the hop on {scan_sms} SMs, the in-chunk work on {work_sms}, each emulated peer on "
              f"{scan_sms}", flush=True)
    # the emulated peers' streams at the highest priority (lower is higher; torch clamps to the range): on
    # their own GPUs they would not queue behind this rank's work
    feeder, successor, source = (torch.cuda.Stream(device, priority=-1) for _ in range(3))
    succ_in = {}  # per state dtype: where the successor's hop writes this rank's state

    def downstream(dtype):
        if dtype not in succ_in:
            succ_in[dtype] = torch.empty(E.shape, dtype=dtype, device=device)
        return succ_in[dtype]
    main = torch.cuda.current_stream(device)
    S_in = torch.empty_like(E)

    def scan(mode, arrival_us, transition, delta, out, local, events, left, prime=False):
        """One direction's scan around ``local`` (the in-chunk work, or None: the piece has none, and its scan
        stays on the current stream as built); ``events``: (start, end) of it; ``left``: (start, end, arrived)
        from the scan's start to the successor holding this rank's state, and to the predecessor's state having
        landed in this rank's buffer (its hop done). ``prime``: each launch once, one after another (below)."""
        fd, sc = peers if mode == "partition" else (feeder, successor)
        lk = chained if mode == "chain" else link
        if prime:
            if mode == "chain":  # the state the predecessor waits for, there before it is launched
                with torch.cuda.stream(source):
                    lk.feed(upstream(delta.dtype)[0], T_up, *upstream(delta.dtype)[1:])
                torch.cuda.synchronize()
            with torch.cuda.stream(fd):
                torch.cuda._sleep(0)
                lk.send(upstream(delta.dtype)[0], T_up, *upstream(delta.dtype)[1:])
            torch.cuda.synchronize()
            hop_stream, work = part if mode == "partition" else (main, main)
            for stream in {hop_stream, work}:
                stream.wait_stream(main)
            if local is not None:
                with torch.cuda.stream(work):
                    local()
            torch.cuda.synchronize()
            programs = link.aside_programs if mode == "partition" else None
            with torch.cuda.stream(hop_stream):
                lk.hop(transition, delta, out, programs=programs)
            torch.cuda.synchronize()
            with torch.cuda.stream(sc):
                lk.receive(T_up, upstream(delta.dtype)[1], downstream(delta.dtype), programs=programs)
            torch.cuda.synchronize()
            return
        left[0].record()
        fd.wait_stream(main)
        sc.wait_stream(main)
        sleep = max(0, int(arrival_us * 1e-3 * cycles_per_ms))
        if mode == "chain":  # the rank before the predecessor passes its state on behind the sleep
            source.wait_stream(main)
            with torch.cuda.stream(source):
                torch.cuda._sleep(sleep)
                lk.feed(upstream(delta.dtype)[0], T_up, *upstream(delta.dtype)[1:])
        with torch.cuda.stream(fd):
            if mode != "chain":
                torch.cuda._sleep(sleep)
            lk.send(upstream(delta.dtype)[0], T_up, *upstream(delta.dtype)[1:])
            left[2].record()
        with torch.cuda.stream(sc):  # the successor spins on few programs, as with the overlap
            lk.receive(T_up, upstream(delta.dtype)[1], downstream(delta.dtype), programs=lk.aside_programs)
            left[1].record()
        # as built: with nothing to hide, nothing goes aside
        aside = mode in ("overlap", "partition", "chain") and local is not None
        after = mode == "after" and local is not None
        hop_stream, work = part if mode == "partition" else (side, main)
        if aside:
            hop_stream.wait_stream(main)
            with torch.cuda.stream(hop_stream):
                lk.hop(transition, delta, out, programs=lk.aside_programs)
        work.wait_stream(main)
        with torch.cuda.stream(work):
            events[0].record()
            if local is not None:
                local()
            events[1].record()
        main.wait_stream(work)
        if aside:
            main.wait_stream(hop_stream)
        elif after:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                lk.hop(transition, delta, out, programs=lk.aside_programs)
            main.wait_stream(side)
        else:
            lk.hop(transition, delta, out)
        for peer in (fd, sc, source) if mode == "chain" else (fd, sc):
            main.wait_stream(peer)

    from megatron_zeco.cp.piece import local_work

    def iteration(mode, arrival_us, ev, prime=False):
        ev["fwd"][0].record()
        p = make()
        e = p.E.reshape(E.shape)
        t = p.transition.reshape(trans.shape).contiguous()
        scan(mode, arrival_us, t, e, S_in, local_work(p, "before_output"), ev["fwd local"], ev["fwd departure"],
             prime)
        o = p.output(S_in.reshape(p.E.shape))
        ev["fwd"][1].record()
        ev["bwd"][0].record()
        A = p.entering_grad(x["do"])
        A = A.reshape(-1, *A.shape[-2:])
        D = torch.empty_like(A)
        t_t = t.transpose(-1, -2).contiguous() if dense else t
        scan(mode, arrival_us, t_t, A, D, local_work(p, "before_grads"), ev["bwd local"], ev["bwd departure"],
             prime)
        grads = p.grads(D.reshape(p.E.shape))
        ev["bwd"][1].record()
        return o, grads

    # One process holds the three ranks' kernels, and the successor's spins until this rank's hop runs. A
    # kernel's first launch may load its module under a context synchronisation (CUDA's lazy loading), which
    # would wait for the spinning kernel, itself waiting for that launch: every kernel of an iteration (the
    # piece's, the three hops', torch's) is launched once first, one after another.
    def timed():  # (start, end) events of each span an iteration times; a departure's third: the state arrived
        return {k: [torch.cuda.Event(enable_timing=True) for _ in range(3 if k.endswith("departure") else 2)]
                for k in ("fwd", "fwd local", "fwd departure", "bwd", "bwd local", "bwd departure")}

    iteration("serial", 0, timed(), prime=True)
    if part is not None:  # a green context loads a kernel's module on its first launch there too
        iteration("partition", 0, timed(), prime=True)
    if chained is not None:  # the pass-through hop and the waiting predecessor are launches of their own
        iteration("chain", 0, timed(), prime=True)
    # the link delivers: what arrived is the predecessor's map applied to its entering state
    modes = (("serial", "overlap") + (("partition",) if args.scan_sms else ()) + (("after",) if args.after else ())
             + (("chain",) if args.chain else ()))
    for mode in modes:
        S_in.fill_(float("nan"))
        scan(mode, 0, trans, E, S_in, lambda: None, [torch.cuda.Event() for _ in range(2)],
             [torch.cuda.Event() for _ in range(3)])
        torch.cuda.synchronize()
        link.watcher.check()
        err = ((S_in.double() - want).norm() / want.norm()).item()
        # one TF32 pass rounds each operand to 2^-11 of itself
        if not err < (1e-5 if E.dtype == torch.float32 and precision != "tf32" else 1e-2):
            raise AssertionError(f"{op} T={T} {mode}: the state received differs from the link's ({err:.2e})")
    print(f"{op} T={T}: the link delivers; timing", flush=True)
    rows = []
    for arrival in args.arrival:
        for mode in modes:
            ev = timed()
            for _ in range(args.warmup):
                iteration(mode, arrival, ev)
            times = {k: [] for k in ev}
            for _ in range(args.iters):
                torch.cuda.synchronize()
                torch.cuda._sleep(int(20 * cycles_per_ms))  # the host queues the whole iteration meanwhile
                iteration(mode, arrival, ev)
                torch.cuda.synchronize()
                for k, (a, b, *arrived) in ev.items():
                    times[k].append(a.elapsed_time(b))
                    if arrived:
                        times.setdefault(k.replace("departure", "arrived"), []).append(a.elapsed_time(arrived[0]))
            link.watcher.check()
            row = dict(part="overlap", op=op, tokens=T, arrival_us=arrival, mode=mode,
                       aside_programs=link.aside_programs, side_priority=args.side_priority,
                       **({"precision": precision} if dense else {}),
                       **({"scan_sms": scan_sms, "work_sms": work_sms} if mode == "partition" else {}),
                       **{f"{k} ms".replace(" ", "_"): statistics.median(v) for k, v in times.items()})
            rows.append(row)
            print(f"{op:4s} {precision or '':6s} T={T:6d} arrival {arrival:6.0f} us {mode:9s} fwd {row['fwd_ms']:7.3f} "
                  f"ms (in-chunk {row['fwd_local_ms']:6.3f}, arrived {row['fwd_arrived_ms']:6.3f}, sent on "
                  f"{row['fwd_departure_ms']:6.3f})  bwd {row['bwd_ms']:7.3f} ms (in-chunk {row['bwd_local_ms']:6.3f}, "
                  f"arrived {row['bwd_arrived_ms']:6.3f}, sent on {row['bwd_departure_ms']:6.3f})", flush=True)
    return rows


def meta(args):
    def commit():
        try:
            return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                           stderr=subprocess.DEVNULL).strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    import triton

    versions = {"torch": torch.__version__, "triton": triton.__version__}
    try:
        import fla

        versions["fla"] = fla.__version__
    except ImportError:
        pass
    return {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "commit": commit(),
            "versions": versions, "command": " ".join(sys.argv), "heads": args.heads, "dim": args.dim}


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_overlap.py needs a CUDA GPU (fla's kernels)")
    import profile_piece  # this folder's
    from megatron_zeco.common.tuning import ENV, configure
    from megatron_zeco.kernels import dense_precision, map_precision

    os.environ.setdefault(ENV, "auto")
    configure()
    device = torch.device("cuda")
    cycles = profile_piece.sleep_cycles_per_ms()
    built = dense_precision(map_precision(torch.bfloat16))  # the pieces here take bf16 inputs
    rows = []
    for op in args.op:
        for T in args.tokens:
            for precision in ([None] if op == "gla" else args.dense_precision or [built]):
                rows += run_case(op, T, args, cycles, device, precision)
            torch.cuda.empty_cache()
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"meta": meta(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
