"""Projections of the calibrated model to P GPUs (:func:`project`) and the command line
(:func:`main`, ``python -m megatron_zeco.cost_model``)."""

import argparse
import math
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

from ..comm.shape import INFINIBAND, TRANSPORTS, Cluster, Link
from ..comm.transport import Transport
from ..cp.config import RULES
from .calibration import Calibration, calibrate, default_rows, load_rows
from .model import (DEVICE, FP32_FLOPS, GLA, LAYOUTS, OPERATORS, REGIMES, SHAPES, Dense, Operator, Workload,
                    best_blocks, layer_time)


@dataclass(frozen=True)
class Choice:
    """A strategy's projected layer: for zeco, the All-Scan's transport, shape and blocks."""

    strategy: str
    seconds: float
    efficiency: float
    transport: str = ""
    shape: str = ""
    K: int = 0
    projected: bool = False  # rests on projected (not measured) transport costs or hop kernels
    why_not: str = ""  # set where the strategy cannot run this workload (seconds = inf)


def projection_workload(cal: Calibration, P: int, tokens: int, layout: str = "contiguous", heads: int = 16,
                        head_dim: int = 128, regime: str = "steady", op: Operator = GLA) -> Workload:
    """A layer of ``op`` at ``tokens`` per GPU: its one-GPU op time measured in ``regime`` at the fewest tokens
    with this head dim, scaled linearly in tokens and heads (docs/scaling.md, "Limits"), and the share a ZeCO
    piece's own work adds to it where measured (the delta rules'), at the measured tokens nearest ``tokens``, and
    its dense hop kernel's time where timed at these heads and dims (``Calibration.dense_hop``)."""
    times = cal.one_gpu.get(op.name, {}).get(regime, {})
    if not times:
        raise ValueError(f"no measured one-GPU {regime} op time of {op.name} on the {DEVICE} in the calibration "
                         f"data (measured: {', '.join(sorted(k for k, v in cal.one_gpu.items() if regime in v))}): "
                         f"bench_op.py --op {op.name} --modes {regime} rows would give it (docs/scaling.md, "
                         f"'Adding a measured point')")
    measured = {(t, h): ms for (t, h, d), ms in times.items() if d == head_dim}
    if not measured:
        raise ValueError(f"no measured one-GPU op time of {op.name} with head dim {head_dim} (measured: "
                         f"{sorted({d for *_, d in times})}); choose --head-dim among them")
    t0, h0 = min(measured)
    op_ms = measured[t0, h0] * tokens / t0 * heads / h0
    fwd, bwd, _ = overlap_shares(cal, op, tokens, head_dim)[0]
    return Workload(P=P, tokens=tokens, heads=heads, k_dim=head_dim, v_dim=head_dim, op_ms=op_ms, layout=layout, op=op,
                    piece_share=piece_share(cal, op, tokens, head_dim)[0], hidden=(fwd[0], bwd[0]),
                    spin=(fwd[1], bwd[1]), aside=(fwd[2], bwd[2]),
                    dense_hop=cal.dense_hop.get((heads, head_dim), ()) if op.transition is Dense else ())


def overlap_shares(cal: Calibration, op: Operator, tokens: int, head_dim: int) -> tuple[tuple, Optional[int]]:
    """(((hidden, spin, aside) forward, (hidden, spin, aside) backward, priority), tokens they were measured
    at): what the scan's overlap hides of ``op``'s local op, what its spinning hops cost it, how much slower a
    hop runs beside it and the side stream's priority then (``Calibration.overlap``), at the tokens nearest
    ``tokens`` with this head dim; nothing hidden, (((0, 0, 1), (0, 0, 1), None), None), where not measured."""
    shares = {t: v for (t, _, d), v in cal.overlap.get(op.name, {}).items() if d == head_dim}
    if not shares:
        return ((0.0, 0.0, 1.0), (0.0, 0.0, 1.0), None), None
    nearest = min(shares, key=lambda t: (abs(math.log(t / tokens)), t))
    return shares[nearest], nearest


def piece_share(cal: Calibration, op: Operator, tokens: int, head_dim: int) -> tuple[float, Optional[int]]:
    """(share, tokens it was measured at): what a ZeCO piece of ``op`` adds to its one-GPU op, measured at
    the tokens nearest ``tokens`` with this head dim; (0.0, None) where not measured."""
    shares = {t: share for (t, _, d), share in cal.piece_share.get(op.name, {}).items() if d == head_dim}
    if not shares:
        return 0.0, None
    nearest = min(shares, key=lambda t: (abs(math.log(t / tokens)), t))
    return shares[nearest], nearest


def zeco_choices(w: Workload, c: Cluster, cal: Calibration, regime: str = "steady", shapes=SHAPES,
                 transports=None) -> list[Choice]:
    """ZeCO at its best K over each transport and shape that can run this group (peer memory on one
    node only), fastest first; projected where the transport's costs are (:meth:`Calibration.projected`)
    or its hop kernel has not been timed with the operator's maps (a dense one: ``Workload.dense_hop``)."""
    out = []
    for name in transports or TRANSPORTS:
        transport = TRANSPORTS[name]
        if transport.one_node and w.P > c.gpus_per_node:
            continue
        sw = cal.sw(name, regime)
        for shape in (s for s in shapes if s in transport.shapes):
            if shape == "hierarchical" and transport.block_messages:
                K, t = 1, layer_time("zeco", w, c, sw, 1, shape)  # one message per step: K does not apply
            else:
                K, t = best_blocks(w, c, sw, shape)
            timed = w.op.transition.hop_timed or bool(w.dense_hop)
            projected = cal.projected(name) or (transport.device and not timed)
            out.append(Choice("zeco", t, w.op_ms * 1e-3 / t, name, shape, K, projected))
    return sorted(out, key=lambda ch: ch.seconds)


class LayerShape(NamedTuple):
    """The layer a projection is for: its heads, their key and value dim, and its operator."""

    heads: int = 16
    head_dim: int = 128
    op: Operator = GLA


def project(cal: Calibration, P: int, tokens: int, layout: str, cluster: Cluster = Cluster(), regime: str = "steady",
            layer: tuple = LayerShape(), transports=None) -> list[Choice]:
    """One line per strategy: zeco (its best transport and shape), zeco-chain, zeco-hierarchical
    (each at its best transport), lasp2, lasp1, a2a, for a layer ``layer`` (a :class:`LayerShape`, or
    ``(heads, head dim)`` of a GLA layer) on ``cluster`` (its ``gpus_per_node`` consecutive ranks a node)."""
    heads, head_dim, op = LayerShape(*layer)
    w = projection_workload(cal, P, tokens, layout, heads, head_dim, regime, op)
    t_op = w.op_ms * 1e-3
    zeco = zeco_choices(w, cluster, cal, regime, transports=transports)
    out = [zeco[0]]
    for shape in SHAPES:
        best = [ch for ch in zeco if ch.shape == shape]
        out.append(replace(best[0], strategy=f"zeco-{shape}") if best else
                   Choice(f"zeco-{shape}", math.inf, 0.0, why_not="no transport runs it here"))
    sw = cal.sw(Transport.SEND_RECV, regime)
    for strategy in ("lasp2", "lasp1", "a2a"):
        if strategy not in op.strategies:
            out.append(Choice(strategy, math.inf, 0.0, why_not=f"not built for {op.name}"))
            continue
        if strategy == "a2a" and heads % P:
            out.append(Choice(strategy, math.inf, 0.0, why_not=f"needs the {heads} heads divisible by {P} GPUs"))
            continue
        t = layer_time(strategy, w, cluster, sw)
        out.append(Choice(strategy, t, t_op / t))
    return out


def _format(ch: Choice, layout: str, hops_alone: bool = False) -> str:
    if ch.why_not:
        return f"{ch.strategy:<18} layout={layout:<10} cannot run: {ch.why_not} efficiency=0.000"
    scan = ""
    if ch.transport:
        what_if = " (what if: --hop-pace alone)" if hops_alone and TRANSPORTS[ch.transport].device else ""
        scan = (f" transport={ch.transport}{' (projected)' if ch.projected else ''}{what_if} shape={ch.shape} "
                f"K={ch.K}")
    return f"{ch.strategy:<18} layout={layout:<10}{scan} time_ms={ch.seconds * 1e3:.3f} efficiency={ch.efficiency:.3f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_zeco.cost_model",
        description="Projected efficiency t(one GPU) / t(strategy) of one linear-attention layer (forward + "
                    "backward) under each context-parallel strategy, from the measured points shipped with the "
                    "package (megatron_zeco/cost_model/data: the repository's docs/results files that hold them) "
                    "and the stated link figures (docs/scaling.md). Per operator a header line (# ...) saying what "
                    "its figures rest on, then one line per strategy and layout, ending in efficiency=. Transports "
                    "marked (projected) are not measured.")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the context-parallel group (P)")
    parser.add_argument("--op", choices=(*OPERATORS, "all"), action="append",
                        help="operator: gla (gated linear attention, default), gdn (the gated delta rule, Gated "
                             "DeltaNet), kda (Kimi Delta Attention) or all; repeat for several")
    parser.add_argument("--tokens-per-gpu", type=int, default=16384, help="tokens per GPU (default 16384)")
    parser.add_argument("--layout", choices=LAYOUTS, action="append",
                        help="sequence layout over the GPUs: contiguous or zigzag (Megatron's); repeat for both "
                             "(default: both)")
    parser.add_argument("--node-size", type=int, default=8, help="GPUs per node, consecutive in rank order (default 8)")
    parser.add_argument("--regime", choices=REGIMES, default="steady",
                        help="steady: layers issued back to back as in training, the host ahead of the GPU "
                             "(default); eager: each layer timed from an empty queue, host costs visible")
    parser.add_argument("--transport", choices=tuple(TRANSPORTS), action="append",
                        help="restrict zeco's All-Scan to this transport; repeat for several (default: all)")
    parser.add_argument("--heads", type=int, default=16, help="attention heads (default 16, GLA-1B)")
    parser.add_argument("--head-dim", type=int, default=128,
                        help="key and value head dim; needs a measured one-GPU op time at it (default 128)")
    parser.add_argument("--ib-latency-us", type=float, default=INFINIBAND.latency * 1e6,
                        help=f"latency of a message between nodes, us (default {INFINIBAND.latency * 1e6:g}, stated)")
    parser.add_argument("--ib-bandwidth-gbs", type=float, default=INFINIBAND.bandwidth / 1e9,
                        help=f"bandwidth per GPU between nodes, GB/s (default {INFINIBAND.bandwidth / 1e9:g}, stated)")
    parser.add_argument("--results", default=None,
                        help="glob of measured result files to calibrate on instead, e.g. 'docs/results/*.json' "
                             "of a checkout (default: the package's calibration data)")
    parser.add_argument("--hop-pace", choices=("measured", "alone"), default="measured",
                        help="measured: the scan's hops beside the local op at the pace measured there (default); "
                             "alone: what if they kept their pace alone (the local op still slowed beside them as "
                             "measured); not built")
    args = parser.parse_args(argv)
    hops_alone = args.hop_pace == "alone"
    for name, value in (("--gpus", args.gpus), ("--tokens-per-gpu", args.tokens_per_gpu),
                        ("--node-size", args.node_size), ("--heads", args.heads)):
        if value < 1:
            parser.error(f"{name} must be a positive integer, got {value}")
    ops = [OPERATORS[name] for name in dict.fromkeys(
        name for asked in args.op or [GLA.name] for name in (OPERATORS if asked == "all" else [asked]))]
    measured = calibrate(load_rows(args.results) if args.results else default_rows())
    cal = measured.with_hops_alone() if hops_alone else measured
    cluster = Cluster(inter=Link(args.ib_latency_us * 1e-6, args.ib_bandwidth_gbs * 1e9), gpus_per_node=args.node_size)
    for op in ops:
        try:
            w = projection_workload(cal, args.gpus, args.tokens_per_gpu, heads=args.heads, head_dim=args.head_dim,
                                    regime=args.regime, op=op)
        except ValueError as e:
            parser.error(f"--op {op.name}: {e}")
        print(f"# {_title(op)}{args.gpus} GPUs ({args.node_size} per node), {args.tokens_per_gpu} tokens per GPU, "
              f"{args.heads} heads of {args.head_dim}, {args.regime}: one GPU {w.op_ms:.3f} ms per layer (fwd+bwd"
              f"{_op_time_source(op)}); links: NVLink {cluster.intra.latency * 1e6:g} us "
              f"{cluster.intra.bandwidth / 1e9:g} GB/s, between nodes {cluster.inter.latency * 1e6:g} us "
              f"{cluster.inter.bandwidth / 1e9:g} GB/s")
        if not op.transition.hop_timed:
            print(_scan_source(w, piece_share(cal, op, args.tokens_per_gpu, args.head_dim)[1]))
        shares, measured_at = overlap_shares(measured, op, args.tokens_per_gpu, args.head_dim)
        print(_overlap_source(w, measured_at, shares, hops_alone))
        for layout in args.layout or LAYOUTS:
            for ch in project(cal, args.gpus, args.tokens_per_gpu, layout, cluster, args.regime,
                              LayerShape(args.heads, args.head_dim, op), args.transport):
                print(_format(ch, layout, hops_alone))


def _scan_source(w: Workload, piece_tokens: Optional[int]) -> str:
    """The header's second line for an operator whose maps no measured scan ran: its sizes and products,
    what its scan costs rest on, and its piece's own work (measured at ``piece_tokens``, or not)."""
    piece = (f"the ZeCO piece {1 + w.piece_share:.3f}x the one-GPU op (measured, GPU time at {piece_tokens} tokens)"
             if piece_tokens else "the ZeCO piece's own work not measured (not counted)")
    products = (f"{w.apply_time() * 1e6:.2f} us per combine and {w.compose_time() * 1e6:.2f} us per compose at "
                f"{FP32_FLOPS / 1e12:g} TFLOP/s FP32 (stated)")
    if w.dense_hop:
        hop = (f"{products} over send_recv; the dense hop kernel (peer_memory, nvshmem) "
               f"{w.hop_apply_time(True) * 1e6:.2f} / {w.hop_compose_time(True) * 1e6:.2f} us beyond GLA's hop per "
               f"combine / compose (measured, one GPU)")
    else:
        hop = f"{products}; the dense hop kernel (peer_memory, nvshmem) not timed (projected)"
    return (f"# {w.op.name}: dense K x K maps: {w.state_bytes / 2 ** 20:g} MiB per state hop, "
            f"{w.map_bytes / 2 ** 20:g} MiB per map message; {hop}; scan costs otherwise measured with GLA's maps; "
            f"{piece}")


def _overlap_source(w: Workload, tokens: Optional[int], shares: tuple, hops_alone: bool = False) -> str:
    """The header's line on the scan's overlap as built: what its hops hide of each direction's local op and
    what they cost it (measured at ``tokens``, ``shares`` as :func:`overlap_shares` gives them), or that it is
    not measured; with ``hops_alone`` (``--hop-pace alone``) the hops' pace as measured and the what-if."""
    if tokens is None:
        return f"# overlap as built ({w.op.name}): not measured, nothing of the scan hidden"
    (hf, hb), (sf, sb) = w.hidden, w.spin
    af, ab = shares[0][2], shares[1][2]  # as measured (``w`` has them 1 under --hop-pace alone)
    measured = (f"measured, one GPU at {tokens} tokens, the side stream of "
                f"{'the highest' if shares[2] == 'high' else 'default'} priority")
    if not RULES[w.op.rules].auto_overlap:
        return (f"# overlap as built ({w.op.name}): off by default ({measured}: its hops would run beside "
                f"{hf:.0%} / {hb:.0%} of the forward / backward local op, {af:.1f}x / {ab:.1f}x as long as alone)")
    pace = f"each hop {af:.1f}x / {ab:.1f}x as long as alone"
    if hops_alone:
        pace += " there as measured, WHAT IF as fast as alone (--hop-pace alone)"
    return (f"# overlap as built ({w.op.name}): over peer_memory and nvshmem the hops run beside {hf:.0%} / {hb:.0%} "
            f"of the forward / backward local op, {sf:.0%} / {sb:.0%} slower beside them, {pace} ({measured})")


def _title(op: Operator) -> str:
    """The header's name of the operator: none for the default, GLA (its header as the model prints it alone)."""
    return "" if op is GLA else f"{op.name} ({op.title}): "


def _op_time_source(op: Operator) -> str:
    """What the one-GPU time of ``op`` rests on, for the header (for GLA, as :func:`_title`: the default)."""
    return "" if op is GLA else f", measured on the {DEVICE}"
