"""The GPU time of one All-Scan hop kernel alone: GLA's diagonal combine against the delta rules' dense one.

    python benchmarks/bench_hop.py --heads 16 --dim 128 --blocks 1 2 4 8 --out results/hop.json

A device transport's hop (``kernels/scan_hop.py``) waits for the previous rank's state, combines it with
its piece's map and sends the result on. Here the state is already there (``has_init``: read from memory,
no peer, no flags to wait for) and the result stays on this GPU (``KEEP_Y``), so what is timed is the
kernel's own work: its launch on the GPU, the loads of the map and the state, the combine and the stores.
Per kind and All-Scan block count ``K`` (the state cut into K blocks, each a launch as a pipelined chain
sends it; rows for the diagonal, value columns for the dense maps):

* ``diagonal``: ``all_scan_hop``, ``gamma * S + delta`` (GLA), a K x V state per head;
* ``dense``: ``all_scan_dense_hop``, ``M S + delta`` (the gated delta rule, KDA), ``M`` K x K;
* ``dense map``: ``all_scan_dense_hop`` over a map ``[S | T]`` (K x (V + K)): what the hierarchical scan's
  compose of two dense maps runs.

Each on every program (as the chain's hops run) and on ``comm/peer.py: ASIDE_PROGRAMS`` (beside the in-chunk
work, with the overlap); the dense hops with the rows of ``M`` a program multiplies at a time as built, or each
of ``--dense-block-rows``. GPU time per launch: the median kernel duration from the profiler over ``--iters``
launches issued back to back, float32 states. The cost model reads the dense hops' time beyond the
diagonal one's at the same blocks (``cost_model.calibration.hop_rows``).

Then a leader's hand-out of its dense map's lanes (``--lanes``, the hierarchical scan's phase B), looped back
through regions on this GPU: in one launch as built against a launch per lane's send and receive (``Handout``).
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

KINDS = ("diagonal", "dense", "dense map")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128, help="K = V")
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8], help="All-Scan block counts K")
    p.add_argument("--dense-block-rows", type=int, nargs="+", default=None,
                   help="rows of M the dense hops multiply at a time, each a row (default: as built, "
                        "kernels/scan_hop.py: dense_block_rows)")
    p.add_argument("--dense-precision", nargs="+", default=["tf32x3", "tf32"], choices=["tf32x3", "tf32"],
                   help="how the dense hops' float32 products round, each a row (kernels/scan_hop.py: "
                        "DENSE_PRECISIONS; tf32 for pieces of 16-bit inputs, tf32x3 for float32 ones)")
    p.add_argument("--lanes", type=int, default=8, help="lanes a leader hands its map out to (GPUs per node)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", default="results/hop.json")
    return p.parse_args(argv)


class Hop:
    """One hop of ``kind`` over H states (or maps), from memory into memory, on ``programs`` programs."""

    def __init__(self, kind, H, D, blocks, programs, device, block_rows=None, precision=None):
        from megatron_zeco.comm import peer
        from megatron_zeco.comm.watch import watch
        from megatron_zeco.kernels import scan_hop

        dense = kind != "diagonal"
        width = D + (D if kind == "dense map" else 0)
        g = torch.Generator(device=device).manual_seed(0)
        self.x = torch.randn(1, H, D, width, device=device, generator=g)
        self.delta = torch.randn(1, H, D, width, device=device, generator=g)
        self.s_in = torch.empty_like(self.x)
        self.y = torch.empty_like(self.x)
        if dense:
            self.t = torch.randn(1, H, D, D, device=device, generator=g) / D ** 0.5
        else:
            self.t = torch.rand(1, H, D, device=device, generator=g)
        self.tiles = peer.tiles_per_state(D, width, dense, blocks)
        data, flags, size = peer.region_bytes(H, D, width, torch.float32, self.tiles, nvshmem=False)
        self.region = torch.zeros(size, dtype=torch.uint8, device=device)
        w = watch(device)
        self.bounded = w.arguments(w.launch_id(("bench_hop", kind), lambda: ("bench_hop", (None, None))), 60.0)
        self.watcher = w
        self.launch = scan_hop.all_scan_dense_hop if dense else scan_hop.all_scan_hop
        self.stride = D * (D if dense else 1)
        self.data, self.flags, self.programs = data, flags, programs
        self.rows, self.as_built = {}, True
        if dense:
            built = scan_hop.dense_block_rows(D, width // self.tiles, torch.float32)
            self.rows, self.as_built = dict(block_rows=block_rows or built), block_rows in (None, built)
            self.rows["precision"] = precision or "tf32x3"

    def __call__(self):
        here = self.region.data_ptr()
        self.launch(self.x.data_ptr(), [self.t], [self.delta], [self.s_in], self.y, (here, here, 0, 0), self.stride,
                    self.x[0, 0].numel(), self.tiles, self.data, self.flags, has_src=False, has_init=True,
                    has_dst=False, watch=self.bounded, programs=self.programs, **self.rows)

    def expected(self):
        if self.t.dim() == 4:
            return self.t.double() @ self.x.double() + self.delta.double()
        return self.t.double()[..., None] * self.x.double() + self.delta.double()


class Handout:
    """A leader handing each of its node's other lane ranks its lane's part of a dense map ``[H, D, 2D]``
    (the hierarchical scan's phase B, ``comm/peer_hierarchical.py``), each part received too, looped back through
    regions on this GPU: in one ``all_scan_rounds`` launch (``launches`` 1, as built: a step per lane's send and
    receive, each taking its lane's tiles), or a pass-through ``all_scan_dense_hop`` launch per lane's send and
    per receive (the launch per lane the scan issued before)."""

    def __init__(self, H, D, lanes, one_launch, device):
        from megatron_zeco.comm import peer
        from megatron_zeco.comm.watch import watch
        from megatron_zeco.kernels import scan_hop

        self.scan_hop, self.lanes, self.one_launch = scan_hop, lanes, one_launch
        W = 2 * D
        self.own = torch.randn(H, D, W, device=device, generator=torch.Generator(device=device).manual_seed(0))
        self.y = torch.empty_like(self.own)
        self.parts = [torch.zeros_like(self.own) for _ in range(lanes)]
        self.tiles = peer.tiles_per_state(D, W, True, 1)
        self.data, self.flags, size = peer.region_bytes(H, D, W, torch.float32, self.tiles, nvshmem=False)
        self.regions = torch.zeros(2 * lanes * size, dtype=torch.uint8, device=device)
        base = self.regions.data_ptr()
        self.send = [base + 2 * g * size for g in range(lanes)]
        self.into = [base + (2 * g + 1) * size for g in range(lanes)]
        self.watcher = w = watch(device)
        steps = [(self.send[g], self.send[g], 0, self.into[g], -1, -1, 0, scan_hop.lane_part((g, lanes)))
                 for g in range(1, lanes)]
        steps = [row for send in steps for row in (send, (send[3], 0, send[0], 0, -1, -1, 0, send[7]))]
        self.table = torch.tensor(steps, dtype=torch.int64, device=device)
        ids = [w.launch_id(("bench_hop handout", one_launch, s), lambda s=s: (f"handout step {s}", (None, None)))
               for s in range(len(steps))]
        self.bounded = [w.arguments(who, 60.0) for who in ids]

    def __call__(self):
        if self.one_launch:
            self.scan_hop.all_scan_rounds(self.own, self.y, self.table, self.send[0], self.tiles, self.data,
                                          self.flags, watch=self.bounded[0], dense=True)
            return
        _, D, W = self.own.shape
        for g in range(1, self.lanes):
            x, part = self.own, self.parts[g]
            for regions, src, into, who in (((self.send[g], self.send[g], 0, self.into[g]), False, x, 2 * g - 2),
                                             ((self.into[g], 0, self.send[g], 0), True, part, 2 * g - 1)):
                self.scan_hop.all_scan_dense_hop(
                    0 if src else x.data_ptr(), [into], [into], [into], None, regions, 0, D * W, self.tiles,
                    self.data, self.flags, has_src=src, has_init=not src, has_dst=not src,
                    watch=self.bounded[who], pass_through=True, delta_layout=(D * W, W, W), m_row=1,
                    lane=(g, self.lanes))

    def delivered(self) -> bool:
        """Whether each lane's receiving region holds its lane's states of the map, tile by tile as the dense hop
        lays them out (and, a launch per lane, whether each receive took its part)."""
        H, D, W = self.own.shape
        tiles = self.own.reshape(H, D, self.tiles, W // self.tiles).permute(0, 2, 1, 3).reshape(H, D * W)
        base = self.regions.data_ptr()
        for g in range(1, self.lanes):
            at = self.into[g] - base
            got = self.regions[at:at + H * D * W * 4].view(torch.float32).reshape(H, D * W)
            if not torch.equal(got[g::self.lanes], tiles[g::self.lanes]):
                return False
            if not self.one_launch and not torch.equal(self.parts[g][g::self.lanes], self.own[g::self.lanes]):
                return False
        return True


def kernels_us(fn, iters):
    """Per call of ``fn``: the median over ``iters`` calls issued back to back of the sum of its kernels' GPU
    durations (from the profiler), and the median duration of each kernel (by name)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name].append(e.device_time)
    if not per_kernel or any(len(v) % iters for v in per_kernel.values()):
        raise RuntimeError(f"the profiler saw {sum(map(len, per_kernel.values()))} kernels over {iters} calls")
    calls = [sum(v[i * (len(v) // iters) + r] for v in per_kernel.values() for r in range(len(v) // iters))
             for i in range(iters)]
    return statistics.median(calls), {k: statistics.median(v) for k, v in per_kernel.items()}


def kernel_us(fn, iters):
    """Median GPU duration of the kernels ``fn`` launches, over ``iters`` calls issued back to back."""
    return kernels_us(fn, iters)[0]


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_hop.py needs a CUDA GPU")
    from megatron_zeco.comm.peer import ASIDE_PROGRAMS

    device = torch.device("cuda")
    rows = []
    cases = [("diagonal", None, None)] + [(kind, rows, precision) for kind in KINDS[1:]
                                          for rows in args.dense_block_rows or [None]
                                          for precision in args.dense_precision]
    for blocks in args.blocks:
        for programs in (None, ASIDE_PROGRAMS):
            for kind, block_rows, precision in cases:
                hop = Hop(kind, args.heads, args.dim, blocks, programs, device, block_rows, precision)
                hop()
                torch.cuda.synchronize()
                hop.watcher.check()
                err = (hop.y.double() - hop.expected()).abs().max().item()
                scale = hop.expected().abs().max().item()
                # one TF32 pass: each operand within 2^-11 of itself, D products summed
                if not err <= (1e-5 if precision in (None, "tf32x3") else 4e-3) * scale:
                    raise RuntimeError(f"{kind} hop, {blocks} blocks: off by {err:.3g} (scale {scale:.3g})")
                us = kernel_us(hop, args.iters)
                row = dict(part="hop", kind=kind, blocks=blocks, tiles=hop.tiles,
                           programs=programs or hop.tiles * args.heads, aside=programs is not None,
                           block_rows=hop.rows.get("block_rows"), precision=hop.rows.get("precision"),
                           as_built=hop.as_built, us=us)
                rows.append(row)
                print(f"{kind:10s} K={blocks:2d} tiles/state {hop.tiles:3d} programs {row['programs']:4d} rows "
                      f"{row['block_rows'] or '-':>3} {row['precision'] or '-':>6} {us:8.2f} us", flush=True)
    for one_launch in (True, False):
        hand = Handout(args.heads, args.dim, args.lanes, one_launch, device)
        hand()
        torch.cuda.synchronize()
        hand.watcher.check()
        if not hand.delivered():
            raise RuntimeError(f"handout ({'one launch' if one_launch else 'a launch per lane'}): a lane's part is wrong")
        us = kernel_us(hand, args.iters)
        launches = 1 if one_launch else 2 * (args.lanes - 1)
        rows.append(dict(part="handout", kind="dense map", lanes=args.lanes, launches=launches,
                         as_built=one_launch, us=us))
        print(f"handout of a dense map to {args.lanes - 1} lanes (sent and received) in {launches:2d} launches "
              f"{us:8.2f} us", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
