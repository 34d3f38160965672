"""Cost model of GLA context parallelism as built: the time of one layer per strategy as P grows.

Times are seconds of one GLA layer, forward + backward, on each of P GPUs holding ``tokens``
tokens each (weak scaling). Efficiency is ``t(none) / t(strategy)`` at the same tokens per GPU.
The equations, the figures and their sources are in ``docs/scaling.md``; in short:

* ``none``:  ``t_op``, the measured one-GPU time of the local op (an input).
* ``zeco``:  ``t_op (1 + extra) + passes + sum over fwd/bwd of max(0, scan - overlap * t_dir)``,
  the scan one All-Scan of a *shape* over a *transport* (both as built, ``comm/``):

  - ``chain`` (``all_scan``): the K blocks of the state walk every piece;
    ``call + sum_i tau_i + (K - 1) pace`` with ``tau = hop + latency + (S / K) / bandwidth``
    per hop of the walk (``chain_hops``) and ``pace = max(message, (S / K) / bandwidth)``: a
    block follows the previous one at the pace of its issue or its transfer; the latency is
    paid once per hop. Over peer memory a zigzag walk runs as two legs of P - 1 hops at once.
  - ``hierarchical`` (``comm/hierarchical.py``): its schedule of messages step by step (prefix
    maps along each node's run of pieces, a Kogge-Stone scan of the runs' maps between nodes,
    the state into each run), replayed (``hierarchical_steps``) and timed along its critical
    path (``critical_path``); over send/recv one message per step carries every block.

  The hop counts, the replayed schedule, the links and the transports' structure are those the
  run-time choice of shape uses: ``megatron_zeco.comm.shape`` (re-exported here).

  Transports (``TRANSPORTS``): ``send_recv`` (the group's messages, host-issued NCCL),
  ``peer_memory`` (one-sided stores and device flags, one node), ``nvshmem`` (device-initiated
  puts across nodes: *projected*, see ``NVSHMEM_PROJECTION``).
* ``lasp2``: as zeco with an all-gather of every piece's state, ``(P-1)(latency + S/bandwidth)``
  on the slowest link, and a local fold over all pieces.
* ``lasp1``: the ranks run one after another: ``P t_op`` plus two K=1 chains.
* ``a2a``:   all-to-all of q, k, v, g and o (and their gradients) plus the copies around it.

Two regimes. ``eager``: a layer issued from Python and timed from an empty queue (what
``benchmarks/bench_op.py``'s eager rows measure); the host's per-call and per-message costs are
fitted on those rows' ``ms``. ``steady``: layers issued back to back as in training, the host
ahead of the GPU (bench_op's steady rows); only what the devices do counts, fitted on the scan
rows' ``gpu_ms``. Each calibration row is modelled in its regime (:func:`calibrate`).

Run ``python -m megatron_zeco.cost_model --help`` for the command line. Standard library only:
this module needs no torch and no GPU.
"""

import argparse
import glob
import json
import math
import os
import re
from importlib import resources
from dataclasses import dataclass, replace

from ..comm.shape import (HOP_COST, INFINIBAND, NVLINK, TRANSPORTS, Cluster, Link, Transport, chain_hops,  # noqa: F401
                         critical_path, hierarchical_steps, prefer_hierarchical, scan_choice, scan_path, walk_ranks)

STRATEGIES = ("none", "zeco", "lasp2", "lasp1", "a2a")
SHAPES = ("chain", "hierarchical")
LAYOUTS = ("contiguous", "zigzag")
REGIMES = ("steady", "eager")

# Stated hardware figures (docs/scaling.md says why).
HBM_BANDWIDTH = 4.8e12  # B/s, H200 HBM3e (NVIDIA spec)
FWD_FRACTION = 0.80 / 3.44  # forward share of fla chunk_gla fwd+bwd, 16K tokens, H200
ACT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FOLD_LAUNCH = {"eager": 10e-6, "steady": 4e-6}  # per folded piece: two elementwise kernels (host ~5 us, GPU ~2 us each)
CHUNK = 64  # tokens per chunk of the local op (fla's and chunk.py's)

# What a result file measured, in its ``meta`` (the calibration reads it there, row by row):
#   build      the build of the package it measured: a name (runs of one build are averaged together)
#   transport  the All-Scan's transport of its zeco op and model rows (TRANSPORTS)
#   scan_code  {transport: version}: the version of the scan code each transport ran; the scans' call,
#              per-message and per-hop costs are fitted per version, over the scan rows of every file
#              (a row "all_scan <transport> K=*" ran that transport's code; the others, the file's
#              transport's). A transport the file does not list ran code of its own build.
#   passes     ZeCO's passes beyond the local op: {"forward": ..., "backward": ...} the kernel rows that
#              time them and "per_byte_of" what each is charged per byte of (PASS_UNITS); or null where
#              the build has none (the state term inside the output and gradient kernels).
META = ("build", "transport", "scan_code", "passes")
PASS_UNITS = ("pass_bytes", "chunk_state_bytes")  # Workload sizes a pass can be charged per byte of
# The build as it is now: what the benchmarks write in meta["build"], and what a result file of it
# measured where its meta says no more (the shipped calibration data say it all themselves).
BUILD = "peer memory"
BUILD_META = {"transport": "peer_memory", "scan_code": {"send_recv": "v2", "peer_memory": "v3"}, "passes": None}
PARTS = ("op", "kernel", "scan", "model")  # the rows a result file holds that the calibration reads
DATA = "data"  # the package's folder of calibration data: copies of the result files that hold such rows
_CHAIN = re.compile(r"all_scan(?: (\w+))? K=(\d+)$")


# NVSHMEM (device-initiated put + signal) is not measured yet: until scan rows named
# "all_scan nvshmem K=*" exist in docs/results (then they are fitted like the others), its costs are
# those of the transport named here, measured on one node (a device-side store and flag per hop,
# the same kind of work), and between nodes the Cluster's stated InfiniBand link (5 us, 50 GB/s).
NVSHMEM_PROJECTION = {"transport": "nvshmem", "priced_as": "peer_memory"}


@dataclass(frozen=True)
class Workload:
    """One GLA layer on each of P GPUs: q, k, g [tokens, heads, k_dim], v [tokens, heads, v_dim]."""

    P: int
    tokens: int  # per GPU
    heads: int
    k_dim: int
    v_dim: int
    op_ms: float  # measured one-GPU fwd+bwd of the local op at these tokens, heads and dims
    act_bytes: int = 2
    layout: str = "contiguous"
    other_ms: float = 0.0  # per-layer time outside GLA (model level); 0 = the operator alone

    @property
    def pieces(self) -> int:
        return 1 if self.layout == "contiguous" else 2

    @property
    def state_bytes(self) -> int:  # one fp32 state
        return self.heads * self.k_dim * self.v_dim * 4

    @property
    def map_bytes(self) -> int:  # one fp32 map (state and decays): what the hierarchical scan moves
        return self.heads * self.k_dim * (self.v_dim + 1) * 4

    @property
    def pass_bytes(self) -> int:  # read by one state pass: k, v, g (or q, g, dO)
        return self.tokens * self.heads * (2 * self.k_dim + self.v_dim) * self.act_bytes

    @property
    def chunk_state_bytes(self) -> int:  # one fp32 state per chunk: what the add_state passes update
        return math.ceil(self.tokens / CHUNK) * self.state_bytes

    @property
    def a2a_bytes(self) -> int:  # q, k, v, g, o and their gradients: what a2a reorders
        return 2 * self.tokens * self.heads * (3 * self.k_dim + 2 * self.v_dim) * self.act_bytes


@dataclass(frozen=True)
class Software:
    """Costs of an implementation beyond the wire, in one regime: seconds, seconds per byte, shares."""

    message: float  # per message a rank issues (a chain block; a hierarchical step): paces the blocks
    scan_call: float  # fixed per All-Scan (or ring) call
    gather_call: float  # fixed per all-gather scan call, the collective's own call included
    fold_launch: float  # per piece folded after the all-gather, beyond reading its state
    state_pass: float  # per byte of the build's forward pass beyond the local op (0: fused into it)
    state_grad_pass: float  # per byte of its backward pass
    a2a_copy: float  # per byte of Workload.a2a_bytes: packing and unpacking around the all-to-all
    a2a_wire: float = 1.0  # NCCL's all-to-all time over the stated links' (1: at their bandwidth)
    hop: float = 0.0  # per hop beyond the wire on the critical path: receive -> combine -> send
    overlap: float = 0.0  # share of each direction's local op that runs while the scan is in flight
    extra: float = 0.0  # share of t_op added by the output/gradient corrections (correction form)
    pass_unit: str = ""  # what the passes are charged per byte of (PASS_UNITS); "" where there are none
    transport: str = "send_recv"  # the All-Scan's transport (TRANSPORTS)


# ---------------------------------------------------------------------------------------------- scan shapes

def chain_time(w: Workload, c: Cluster, sw: Software, K: int) -> float:
    """One pipelined chain (forward or backward) over every piece, the state in K blocks."""
    intra, inter, local = chain_hops(w.P, w.layout, c.gpus_per_node, TRANSPORTS[sw.transport].two_legs)
    block = w.state_bytes / K
    wires = [block / link.bandwidth for n, link in ((intra, c.intra), (inter, c.inter)) if n]
    return sw.scan_call + sum(n * tau for n, tau in _hop_times(w, c, sw, K)) + (K - 1) * max(sw.message, *wires, 0.0)


def _hop_times(w: Workload, c: Cluster, sw: Software, K: int) -> list[tuple[int, float]]:
    """(number, seconds) of the chain's hops inside nodes, between nodes and on the same rank, for one
    block (the same-rank turn of a zigzag chain: a combine, no wire)."""
    intra, inter, local = chain_hops(w.P, w.layout, c.gpus_per_node, TRANSPORTS[sw.transport].two_legs)
    block = w.state_bytes / K
    taus = [(intra, sw.hop + c.intra.time(block)), (inter, sw.hop + c.inter.time(block)), (local, sw.hop)]
    return [(n, tau) for n, tau in taus if n]


def _hierarchical_costs(w: Workload, c: Cluster, sw: Software, K: int, reverse: bool):
    """The hierarchical scan's steps, the cost of one of its hops and the pipeline's drain per phase
    (:func:`critical_path`'s inputs); over send/recv every message carries all blocks (K = 1)."""
    if TRANSPORTS[sw.transport].block_messages:
        K = 1
    steps = hierarchical_steps(w.P, w.layout, c.gpus_per_node, reverse)

    def cost(a, b, what, phase):
        nbytes = w.map_bytes if what == "map" else w.state_bytes
        return sw.hop + c.link(a, b).time(nbytes / K if phase == "A" else nbytes)

    drain = {"A": (K - 1) * max(sw.message, w.map_bytes / K / c.intra.bandwidth)}
    return steps, cost, drain


def hierarchical_time(w: Workload, c: Cluster, sw: Software, K: int = 1, reverse: bool = False) -> float:
    """One hierarchical All-Scan (``reverse``: the backward's, over the mirror walk). Over send/recv
    each step is one message carrying every block (K does not apply) and costs each rank taking
    part ``message``; over device transports the prefix maps inside nodes are pipelined in K
    blocks (the first block's path, then K - 1 blocks at the pace of their transfer)."""
    steps, cost, drain = _hierarchical_costs(w, c, sw, K, reverse)
    return sw.scan_call + (critical_path(steps, w.P, cost, sw.message, drain) if steps else 0.0)


def hierarchical_phases(w: Workload, c: Cluster, sw: Software, K: int = 1, reverse: bool = False) -> dict:
    """Seconds of :func:`hierarchical_time` by the end of each phase (``A``, ``B``, ``C``; the call
    counted in ``A``): where the scan's time goes."""
    steps, cost, drain = _hierarchical_costs(w, c, sw, K, reverse)
    ends, done = {}, 0.0
    for phase in "ABC":
        upto = tuple(s for s in steps if s[0][3] <= phase)
        done = critical_path(upto, w.P, cost, sw.message, drain) if upto else done
        ends[phase] = sw.scan_call + done
    return ends


def scan_time(shape: str, w: Workload, c: Cluster, sw: Software, K: int = 1, reverse: bool = False) -> float:
    """One All-Scan of ``shape`` (forward, or the backward's mirror walk)."""
    if shape == "chain":
        return chain_time(w, c, sw, K)
    if shape == "hierarchical":
        return hierarchical_time(w, c, sw, K, reverse)
    raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")


# ---------------------------------------------------------------------------------------------- a layer

def gather_time(w: Workload, c: Cluster, sw: Software) -> tuple[float, float]:
    """(communication, fold) of LASP-2's all-gather scan: every piece's (state | gamma) to all."""
    nbytes = w.pieces * w.heads * w.k_dim * (w.v_dim + 1) * 4
    comm = sw.gather_call + (w.P - 1) * c.slowest(w.P).time(nbytes)
    fold = w.pieces * w.P * (sw.fold_launch + 3 * nbytes / w.pieces / HBM_BANDWIDTH)
    return comm, fold


def _a2a_wire(w: Workload, c: Cluster) -> float:
    """Four all-to-alls (q,k,v,g | o | dO | dq,dk,dv,dg); on- and off-node parts run together."""
    on_node = min(w.P, c.gpus_per_node)
    return 4 * c.slowest(w.P).latency + max((on_node - 1) / w.P * w.a2a_bytes / c.intra.bandwidth,
                                            (w.P - on_node) / w.P * w.a2a_bytes / c.inter.bandwidth)


def layer_time(strategy: str, w: Workload, c: Cluster, sw: Software, K: int = 1, shape: str = "chain") -> float:
    """Seconds of one GLA layer, fwd + bwd, under ``strategy`` (zeco: an All-Scan of ``shape`` in K
    blocks over ``sw.transport``)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if w.k_dim % K:
        raise ValueError(f"K (All-Scan blocks, {K}) must divide k_dim ({w.k_dim})")
    if w.layout not in LAYOUTS:
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {w.layout!r}")
    t_op = w.op_ms * 1e-3
    if strategy == "none" or w.P == 1:
        return t_op
    if strategy == "lasp1":  # its ring passes whole states over send/recv
        return w.P * t_op + 2 * chain_time(w, c, replace(sw, transport="send_recv"), 1)
    if strategy == "a2a":
        if w.heads % w.P:
            raise ValueError(f"a2a splits heads ({w.heads}) over P ({w.P}): P must divide heads")
        return t_op + w.a2a_bytes * sw.a2a_copy + sw.a2a_wire * _a2a_wire(w, c)
    passes = getattr(w, sw.pass_unit) * (sw.state_pass + sw.state_grad_pass) if sw.pass_unit else 0.0
    if strategy == "zeco":
        transport = TRANSPORTS[sw.transport]
        if shape not in transport.shapes:
            raise ValueError(f"All-Scan shape {shape!r} does not run over transport {sw.transport!r}")
        if transport.one_node and w.P > c.gpus_per_node:
            raise ValueError(f"transport {sw.transport!r} needs the CP group on one node (P = {w.P} > "
                             f"{c.gpus_per_node} GPUs per node)")
        comm = [(scan_time(shape, w, c, sw, K, reverse), 0.0) for reverse in (False, True)]
    else:
        comm = [gather_time(w, c, sw)] * 2
    windows = (FWD_FRACTION * t_op, (1 - FWD_FRACTION) * t_op)
    exposed = sum(max(0.0, scan - sw.overlap * t) + after for (scan, after), t in zip(comm, windows))
    return t_op * (1 + sw.extra) + passes + exposed


def blocks(w: Workload) -> list[int]:
    """The All-Scan block counts a layer can take: the divisors of the key dim."""
    return [K for K in range(1, w.k_dim + 1) if w.k_dim % K == 0]


def best_blocks(w: Workload, c: Cluster, sw: Software, shape: str = "chain") -> tuple[int, float]:
    """(K, seconds): the All-Scan block count with the fastest zeco layer (the fewest where K does not matter)."""
    times = {K: layer_time("zeco", w, c, sw, K, shape) for K in blocks(w)}
    K = min(times, key=lambda k: (times[k] * (1 + 1e-12), k))
    return K, times[K]


def efficiency(strategy: str, w: Workload, c: Cluster, sw: Software, shape: str = "chain") -> float:
    """``t(none) / t(strategy)`` at the same tokens per GPU (zeco at its best K), ``w.other_ms`` added to both."""
    t = best_blocks(w, c, sw, shape)[1] if strategy == "zeco" else layer_time(strategy, w, c, sw)
    return (w.op_ms * 1e-3 + w.other_ms * 1e-3) / (t + w.other_ms * 1e-3)


# ---------------------------------------------------------------------------------------------- calibration

@dataclass(frozen=True)
class Residual:
    what: str
    measured_ms: float
    model_ms: float
    fitted: bool  # the row was used to fit a parameter (else it is a prediction)

    @property
    def rel(self) -> float:
        return self.model_ms / self.measured_ms - 1


@dataclass(frozen=True)
class Calibration:
    software: Software  # the code as built (BUILD), eager, over its default transport
    builds: dict[str, Software]  # each build measured (eager), with its passes' and scan code's costs
    transports: dict[tuple[str, str], Software]  # (transport, regime) -> the code as built over that transport
    nccl_call: float  # NCCL's own all-gather call at P = 2 (eager)
    op_ms: dict[str, dict[tuple[int, int, int], float]]  # regime -> (tokens, heads, dim) -> one-GPU fwd+bwd
    other_ms: dict[tuple[int, int, int, int], float]  # (tokens, heads, dim, layers) -> per-layer non-GLA ms
    residuals: list[Residual]

    def sw(self, transport: str, regime: str = "steady") -> Software:
        """The code as built with its All-Scan over ``transport``, in ``regime``."""
        if regime not in REGIMES:
            raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {tuple(TRANSPORTS)}, got {transport!r}")
        return self.transports[transport, regime]

    def projected(self, transport: str) -> bool:
        """Whether ``transport``'s costs are projected (priced from another transport's measurements)."""
        return transport == NVSHMEM_PROJECTION["transport"] and self.transports[transport, "steady"] == replace(
            self.transports.get((NVSHMEM_PROJECTION["priced_as"], "steady")), transport=transport)


def load_rows(pattern: str) -> list[dict]:
    """The calibration rows of every JSON result file matching ``pattern`` (see :func:`file_rows`)."""
    files = []
    for path in sorted(glob.glob(pattern)):
        with open(path) as f:
            files.append((os.path.basename(path), json.load(f)))
    rows = [r for name, data in files for r in file_rows(name, data)]
    if not rows:
        raise ValueError(f"no measured rows in {pattern!r}")
    return rows


def default_rows() -> list[dict]:
    """The calibration rows shipped with the package (``data/*.json``: copies of the result files in
    the repository's ``docs/results`` that hold such rows)."""
    data = resources.files(__package__).joinpath(DATA)
    files = sorted((p for p in data.iterdir() if p.name.endswith(".json")), key=lambda p: p.name)
    return [r for p in files for r in file_rows(p.name, json.loads(p.read_text(encoding="utf-8")))]


def calibration_rows(data: dict) -> list[dict]:
    """The rows of a result file ``{"meta": {...}, "rows": [...]}`` that the calibration reads, as
    written: those of :data:`PARTS` for GLA (not another operator's, ``bench_op.py --op gdn``, nor
    accuracy, memory or profile rows)."""
    return [r for r in data.get("rows", []) if r.get("part") in PARTS and r.get("op", "gla") == "gla"]


def file_rows(name: str, data: dict) -> list[dict]:
    """The calibration rows of one result file ``{"meta": {...}, "rows": [...]}``, each with ``file``
    (``name``) and the file's defaults.

    The rows are :func:`calibration_rows`; each gets its file's ``build`` and ``build_meta`` (what
    the file measured, :data:`META`: a file of :data:`BUILD` that says no more is :data:`BUILD_META`);
    ``kernel`` rows without heads/dim take them from the file's ``op`` rows; rows without ``dtype``
    are bf16 (what ``benchmarks/bench_op.py`` measures); op rows without ``mode`` are ``eager``
    (timed one call from an empty queue).
    """
    rows = calibration_rows(data)
    if not rows:
        return []
    build, built = data["meta"].get("build"), _build_meta(name, data["meta"])
    shapes = {(r["heads"], r["dim"]) for r in rows if "heads" in r}
    out = []
    for r in rows:
        if "heads" not in r and r["part"] == "kernel":
            if len(shapes) != 1:
                raise ValueError(f"{name}: a {r['part']} row without heads/dim needs one op shape in its file")
            r = dict(r, heads=next(iter(shapes))[0], dim=next(iter(shapes))[1])
        out.append(dict(r, file=name, build=build, build_meta=built, mode=r.get("mode", "eager")))
    return out


def _build_meta(name: str, meta: dict) -> dict:
    """What a result file measured (:data:`META` but the build), from its ``meta``; checked."""
    if not isinstance(meta.get("build"), str):
        raise ValueError(f"{name}: meta must name the build measured (meta['build']), and say what it measured: "
                         f"{', '.join(META)} (docs/scaling.md, 'Adding a measured point')")
    built = {k: meta[k] for k in META[1:] if k in meta}
    if meta["build"] == BUILD:
        built = {**BUILD_META, **built}
    missing = [k for k in META[1:] if k not in built]
    if missing:
        raise ValueError(f"{name}: meta of build {meta['build']!r} (not the current {BUILD!r}) must say what it "
                         f"measured: {', '.join(missing)} missing (docs/scaling.md, 'Adding a measured point')")
    transport, codes, passes = built["transport"], built["scan_code"], built["passes"]
    if transport not in TRANSPORTS or not isinstance(codes, dict) or not set(codes) <= set(TRANSPORTS):
        raise ValueError(f"{name}: meta transport {transport!r} and scan_code {codes!r} must name transports among "
                         f"{', '.join(TRANSPORTS)}")
    if passes is not None and (not isinstance(passes, dict) or set(passes) != {"forward", "backward", "per_byte_of"}
                               or passes["per_byte_of"] not in PASS_UNITS):
        raise ValueError(f"{name}: meta passes must be null or {{'forward': kernel row, 'backward': kernel row, "
                         f"'per_byte_of': one of {', '.join(PASS_UNITS)}}}, got {passes!r}")
    return built


def _workload(r: dict, op_ms: float) -> Workload:
    """The workload a measured row describes (its op time given)."""
    return Workload(P=r.get("cp", 1), tokens=r["tokens_per_gpu"], heads=r["heads"], k_dim=r["dim"],
                    v_dim=r["dim"], op_ms=op_ms, act_bytes=ACT_BYTES[r.get("dtype", "bf16")],
                    layout=r.get("layout", "contiguous"))


def _scan_workload(r: dict) -> Workload:
    """bench_op's scan part: one fp32 state [heads, 128, 128] of ``state_mib`` between ``cp`` ranks."""
    heads = round(r["state_mib"] * 2 ** 20 / (128 * 128 * 4))
    return Workload(P=r["cp"], tokens=0, heads=heads, k_dim=128, v_dim=128, op_ms=0.0)


def _weighted_fit(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares of ``y ~ sum_j p_j x_j`` in relative error (weights 1/y^2), by normal equations."""
    n = len(xs[0])
    a = [[sum(x[i] * x[j] / y ** 2 for x, y in zip(xs, ys)) for j in range(n)] for i in range(n)]
    b = [sum(x[i] * y / y ** 2 for x, y in zip(xs, ys)) for i in range(n)]
    for i in range(n):  # Gauss-Jordan; n <= 3
        for k in range(n):
            if k != i:
                f = a[k][i] / a[i][i]
                a[k] = [u - f * v for u, v in zip(a[k], a[i])]
                b[k] -= f * b[i]
    return [b[i] / a[i][i] for i in range(n)]


def _fit_scan(chain, cluster: Cluster, sw: Software, key: str, hop=None) -> dict:
    """The scan code's ``scan_call``, ``message`` and ``hop`` from its rows' ``key``.

    ``chain``: (row, workload, K) of ``all_scan`` rows; the model is ``scan_call + (K - 1) message
    + hops * hop + wire`` (stated links). The per-hop cost is identifiable only from rows at two
    or more P: otherwise it is ``hop`` if given (the device's hop under a host-issued call), or,
    for GPU time (``key="gpu_ms"``), what one hop takes beyond its fixed call (no call term).
    Costs that fit below 0 are set to 0 and the rest refitted.
    """
    two_legs = TRANSPORTS[sw.transport].two_legs
    xs = [[1.0, K - 1, sum(chain_hops(w.P, w.layout, cluster.gpus_per_node, two_legs)[:2])] for _, w, K in chain]
    ys = [r[key] * 1e-3 - sum(n * tau for n, tau in _hop_times(w, cluster, replace(sw, message=0.0, hop=0.0), K))
          for r, w, K in chain]
    several = len({x[2] for x in xs}) > 1
    if several:
        cols = [0, 1, 2]
    elif hop is not None:
        ys = [y - hop * x[2] for x, y in zip(xs, ys)]
        cols = [0, 1]
    elif key == "gpu_ms":
        cols = [2, 1]
    else:
        cols = [0, 1]
    fit = dict(zip(cols, _weighted_fit([[x[c] for c in cols] for x in xs], ys)))
    for c in (2, 1, 0):  # drop what fits below 0 (nothing measurable) and refit the rest
        if fit.get(c, 0.0) < 0 and len(fit) > 1:
            cols = [k for k in cols if k != c]
            fit = dict(zip(cols, _weighted_fit([[x[k] for k in cols] for x in xs], ys)))
    return dict(scan_call=max(fit.get(0, 0.0), 0.0), message=max(fit.get(1, 0.0), 0.0),
                hop=max(fit.get(2, 0.0), 0.0) if (several or hop is None) else hop)


def _fit_gather(gather, cluster: Cluster, sw: Software, key: str) -> dict:
    """The all-gather scan's ``gather_call`` from its rows' ``key`` (its wire and fold known)."""
    known = lambda r: sum(gather_time(_scan_workload(r), cluster, replace(sw, gather_call=0.0)))
    return dict(gather_call=_weighted_fit([[1.0] for _ in gather], [r[key] * 1e-3 - known(r) for r in gather])[0])


def calibrate(rows: list[dict], cluster: Cluster = Cluster(), build: str = BUILD) -> Calibration:
    """Fit the as-built costs on the measured rows; predict every other row; return both.
    ``build``: the build whose costs ``Calibration.software`` holds (the code as it is now).

    Fitted, each on its own rows: the state passes' cost per byte (``kernel`` rows), each scan
    code's call, per-message and per-hop costs (``scan`` rows ``all_scan K=*``: host-issued from
    ``ms``, device from ``gpu_ms``), the all-gather scan's call (``gather_scan``), NCCL's
    all-gather call (``nccl all_gather``) and the a2a copies (``a2a`` op rows). Inputs: the
    ``none`` op rows (one-GPU op time per shape and regime) and the CP = 1 ``model`` rows
    (per-layer time outside GLA). Predicted: the other ``op`` rows (eager, and steady: issued
    back to back), the ``nccl send/recv hop`` rows and the CP > 1 ``model`` rows. Each row is
    modelled as its file's meta says it was measured (:data:`META`): its build's passes, the
    version of the scan code over each transport, zeco's transport.
    """
    def by(**kv):
        return [r for r in rows if all(r.get(k) == v for k, v in kv.items())]

    op_ms: dict[str, dict[tuple[int, int, int], float]] = {}
    own: dict[tuple, float] = {}
    for regime in REGIMES:
        times: dict[tuple[int, int, int], list[float]] = {}
        for r in by(part="op", strategy="none", mode=regime):
            times.setdefault(_shape(r), []).append(r["ms"])
            own[(regime, r["file"], *_shape(r))] = r["ms"]
        op_ms[regime] = {k: sum(v) / len(v) for k, v in times.items()}

    def t_op(r, regime="eager"):  # the one-GPU op time of the row's own run (runs differ by up to ~15%), else the mean
        if _shape(r) not in op_ms[regime]:
            raise ValueError(f"{r['file']}: no {regime} 'none' op row at tokens/heads/dim {_shape(r)} to compare with")
        return own.get((regime, r["file"], *_shape(r)), op_ms[regime][_shape(r)])

    def fit_constant(rs, known):  # y = constant + known(row)
        return _weighted_fit([[1.0] for _ in rs], [r["ms"] * 1e-3 - known(r) for r in rs])[0]

    # What each build measured (its files' meta); the build whose costs are wanted, if it has no rows,
    # as it is now.
    measured: dict[str, dict] = {}
    for r in rows:
        if measured.setdefault(r["build"], r["build_meta"]) != r["build_meta"]:
            raise ValueError(f"{r['file']}: build {r['build']!r} measured {r['build_meta']} here and "
                             f"{measured[r['build']]} in another file: one build, one meta")
    if build not in measured:
        if build != BUILD:
            raise ValueError(f"no rows of build {build!r} (measured: {', '.join(measured)})")
        measured[build] = BUILD_META

    # The passes of each build measured, each fitted per byte of what it touches.
    kernels, passes = {}, {}
    for b, meta in measured.items():
        if meta["passes"] is None:  # no separate pass: its cost is inside the op rows
            passes[b] = dict(pass_unit="", state_pass=0.0, state_grad_pass=0.0)
            continue
        fwd, bwd, unit = meta["passes"]["forward"], meta["passes"]["backward"], meta["passes"]["per_byte_of"]
        rows_of = {name: by(part="kernel", name=name, build=b) for name in (fwd, bwd)}
        if not any(rows_of.values()):
            continue
        if not all(rows_of.values()):
            raise ValueError(f"calibration needs 'kernel' rows for both {fwd!r} and {bwd!r} (build {b!r})")
        per_byte = {name: _weighted_fit([[getattr(_workload(r, 0.0), unit)] for r in rs],
                                        [r["ms"] * 1e-3 for r in rs])[0] for name, rs in rows_of.items()}
        passes[b] = dict(pass_unit=unit, state_pass=per_byte[fwd], state_grad_pass=per_byte[bwd])
        kernels.update({(b, name): (rs, per_byte[name], unit) for name, rs in rows_of.items()})
    base = {regime: Software(message=0.0, scan_call=0.0, gather_call=0.0, fold_launch=FOLD_LAUNCH[regime],
                             a2a_copy=0.0, **passes[build]) for regime in REGIMES}

    # Per version of the scan code and regime: All-Scan = scan_call + (K - 1) * message + hops * hop
    # + wire (stated links), the all-gather scan = gather_call + its wire and fold. Device costs
    # (steady) first: a host-issued call's hops are the device's.
    def code_of(b, transport):  # the version of the scan code build b ran over transport
        return measured[b]["scan_code"].get(transport, f"{b}/{transport}")

    def scan_transport(r):  # a scan row's: the one its method names, else its file's
        m = _CHAIN.match(r["method"])
        if m and m.group(1) and m.group(1) not in TRANSPORTS:
            raise ValueError(f"{r['file']}: scan row {r['method']!r} names no transport among {', '.join(TRANSPORTS)}")
        return m.group(1) if m and m.group(1) else measured[r["build"]]["transport"]

    def scan_code(r):
        return code_of(r["build"], scan_transport(r))

    version_transport = {}  # the transport each version of the scan code moves states over
    used = [(b, t) for b, meta in measured.items() for t in (meta["transport"], *meta["scan_code"])]
    for b, transport in used + [(r["build"], scan_transport(r)) for r in by(part="scan")]:
        version = code_of(b, transport)
        if version_transport.setdefault(version, transport) != transport:
            raise ValueError(f"scan code {version!r} runs over {version_transport[version]!r} and {transport!r}")
    scan_fits, gather_fits, scans, gathers = {}, {}, [], []

    def method(r):  # the same for one code's chain in every file: "all_scan K=4"
        m = _CHAIN.match(r["method"])
        return f"all_scan K={m.group(2)}" if m else r["method"]

    for version in dict.fromkeys(scan_code(r) for r in by(part="scan")):
        mine = [dict(r, method=method(r)) for r in by(part="scan") if scan_code(r) == version]
        hop = None
        for regime, key in (("steady", "gpu_ms"), ("eager", "ms")):
            pooled = _pooled(mine, key)
            chain = [(r, _scan_workload(r), int(_CHAIN.match(r["method"]).group(2)))
                     for r in pooled if _CHAIN.match(r["method"])]
            gather = [r for r in pooled if r["method"] == "gather_scan"]
            sw = replace(base[regime], transport=version_transport[version])
            if chain:
                scan_fits[version, regime] = fit = _fit_scan(chain, cluster, sw, key, hop)
                hop = fit["hop"] if regime == "steady" else hop
                scans += [(r, w, K, version, regime, key) for r, w, K in chain]
            if gather:
                gather_fits[version, regime] = _fit_gather(gather, cluster, sw, key)
                gathers += [(r, version, regime, key) for r in gather]
    build_code = code_of(build, measured[build]["transport"])
    if (build_code, "eager") not in scan_fits or (build_code, "eager") not in gather_fits:
        raise ValueError(f"calibration needs 'scan' rows (all_scan K=*, gather_scan) of build {build!r}'s scan code "
                         f"({build_code!r})")

    def fits(version, regime):  # the scan code's chain and all-gather costs in regime
        return {**scan_fits.get((version, regime), {}), **gather_fits.get((version, regime), {})}

    def built(r, regime="eager"):  # the Software a row was measured with: its build's passes and scan code
        if r["build"] not in passes:
            raise ValueError(f"{r['file']}: no 'kernel' rows of build {r['build']!r} to charge its passes")
        transport = measured[r["build"]]["transport"]
        code = code_of(r["build"], transport)
        if (code, regime) not in scan_fits or (code, regime) not in gather_fits:
            raise ValueError(f"{r['file']}: no {regime} 'scan' rows of scan code {code!r} (build {r['build']!r})")
        return replace(sw_of[regime], **passes[r["build"]], **fits(code, regime), transport=transport)

    sw_of = {regime: replace(base[regime], **fits(build_code, regime)) for regime in REGIMES}
    ring = lambda r: (r["cp"] - 1) * cluster.slowest(r["cp"]).time(r["state_mib"] * 2 ** 20)
    nccl_gathers = _pooled(by(part="scan", method="nccl all_gather"), "ms")
    nccl_call = fit_constant(nccl_gathers, ring)
    a2a = [r for r in by(part="op", strategy="a2a", mode="eager") if r["cp"] > 1]
    if a2a:
        # copies (the same at every P) and the wire ((P - 1) / P of the bytes cross links): both fitted
        # where rows at two or more P allow it, else the wire at the stated bandwidth.
        xs = [[_workload(r, 0.0).a2a_bytes, _a2a_wire(_workload(r, 0.0), cluster)] for r in a2a]
        ys = [(r["ms"] - t_op(r)) * 1e-3 for r in a2a]
        fit = _weighted_fit(xs, ys) if len({r["cp"] for r in a2a}) > 1 else None
        if fit is None or min(fit) <= 0:
            fit = _weighted_fit([x[:1] for x in xs], [y - x[1] for x, y in zip(xs, ys)])[0], 1.0
        copy, wire = fit
        sw_of = {regime: replace(sw, a2a_copy=copy, a2a_wire=wire) for regime, sw in sw_of.items()}

    res = [Residual(f"kernel {name} ({build}) T={r['tokens_per_gpu']}", r["ms"],
                    per_byte * getattr(_workload(r, 0.0), unit) * 1e3, True)
           for (build, name), (rs, per_byte, unit) in kernels.items() for r in rs]
    gpu = {"eager": "", "steady": ", GPU"}
    res += [Residual(f"scan P={w.P} {r['state_mib']:g} MiB all_scan K={K} (code {v}{gpu[regime]})", r[key],
                     chain_time(w, cluster, replace(sw_of[regime], **scan_fits[v, regime],
                                                    transport=version_transport.get(v, "send_recv")), K) * 1e3,
                     True) for r, w, K, v, regime, key in scans]
    res += [Residual(f"scan P={r['cp']} {r['state_mib']:g} MiB gather_scan (code {v}{gpu[regime]})", r[key],
                     sum(gather_time(_scan_workload(r), cluster, replace(sw_of[regime], **gather_fits[v, regime])))
                     * 1e3, True) for r, v, regime, key in gathers]
    res += [Residual(f"scan P={r['cp']} {r['state_mib']:g} MiB nccl all_gather", r["ms"], (nccl_call + ring(r)) * 1e3,
                     True) for r in nccl_gathers]
    # one hop: NCCL's call (as its all-gathers cost) + one message
    res += [Residual(f"scan P={r['cp']} {r['state_mib']:g} MiB nccl send/recv hop", r["ms"],
                     (nccl_call + cluster.intra.time(r["state_mib"] * 2 ** 20)) * 1e3, False)
            for r in _pooled(by(part="scan", method="nccl send/recv hop"), "ms")]
    # One point per configuration, regime and build: the mean of its runs (files), each modelled from
    # its own run's one-GPU time, as the same configuration measured in separate runs differs by up
    # to ~17%. The build only changes the scan strategies (zeco, lasp2): lasp1's and a2a's runs pool
    # across builds. Eager rows from an empty queue; steady rows back to back (the host ahead).
    runs: dict[tuple, list[dict]] = {}
    for r in by(part="op"):
        if r["strategy"] in STRATEGIES[1:] and r["mode"] in REGIMES:
            if r["mode"] == "steady" and (_shape(r) not in op_ms["steady"] or r["build"] not in passes):
                continue
            build_of = r["build"] if r["strategy"] in ("zeco", "lasp2") else "any build"
            runs.setdefault((r["strategy"], r["cp"], _workload(r, 0.0).layout, build_of, r["mode"], *_shape(r)),
                            []).append(r)
    for (strategy, P, layout, build_of, regime, T, *_), rs in runs.items():
        n = len(rs)
        label = f"op {strategy} CP={P} {layout} T={T} ({build_of})" + (" steady" if regime == "steady" else "")
        res.append(Residual(label + (f" (mean of {n} runs)" if n > 1 else ""), sum(x["ms"] for x in rs) / n,
                            sum(layer_time(strategy, _workload(x, t_op(x, regime)), cluster, built(x, regime))
                                for x in rs) / n * 1e3,
                            strategy == "a2a" and regime == "eager"))

    # Per-layer time outside GLA from each file's CP = 1 run (its own GPUs and data-parallel size);
    # Calibration.other_ms is their mean per shape, for projections.
    models = by(part="model")
    per_file = {(r["file"], *_shape(r), r["layers"]): _model_ms(r) / r["layers"] - t_op(r)
                for r in models if r["cp"] == 1}
    by_shape: dict[tuple[int, int, int, int], list[float]] = {}
    for (_, *key), ms in per_file.items():
        by_shape.setdefault(tuple(key), []).append(ms)
    other_ms = {k: sum(v) / len(v) for k, v in by_shape.items()}
    for r in models:
        if r["cp"] > 1 and r["strategy"] in STRATEGIES:  # variants of a strategy are not modelled
            key = (r["file"], *_shape(r), r["layers"])
            if key not in per_file:
                raise ValueError(f"{r['file']}: model row at CP={r['cp']} has no CP=1 row of the same shape in "
                                 f"its file")
            layer = layer_time(r["strategy"], _workload(r, t_op(r)), cluster, built(r))
            model = r["layers"] * (per_file[key] + layer * 1e3)
            res.append(Residual(f"model {r['strategy']} CP={r['cp']} {_workload(r, 0.0).layout} "
                                f"T={r['tokens_per_gpu']} L={r['layers']} ({r['build']})", _model_ms(r), model, False))

    builds = {b: replace(sw_of["eager"], **p, **fits(code_of(b, measured[b]["transport"]), "eager"),
                         transport=measured[b]["transport"]) for b, p in passes.items()}
    transports = {}
    for name in TRANSPORTS:  # the code as built over each transport: the scan code build ``build`` runs over it
        fitted = all((code_of(build, name), regime) in scan_fits for regime in REGIMES)
        projected = name == NVSHMEM_PROJECTION["transport"] and not fitted
        code = code_of(build, NVSHMEM_PROJECTION["priced_as"] if projected else name)
        for regime in REGIMES:
            if (code, regime) in scan_fits:
                transports[name, regime] = replace(sw_of[regime], **scan_fits[code, regime], transport=name)
    return Calibration(builds[build], builds, transports, nccl_call, op_ms, other_ms, res)


def _pooled(scan_rows: list[dict], key: str) -> list[dict]:
    """One scan row per method, P and size with a ``key`` time: the mean of its runs."""
    # These micro-benchmarks are timed from an empty queue: host jitter moves a point by up to 2x from
    # run to run (docs/results).
    groups: dict[tuple, list[dict]] = {}
    for r in scan_rows:
        if key in r:
            groups.setdefault((r["method"], r["cp"], r["state_mib"]), []).append(r)
    return [dict(rs[0], **{key: sum(r[key] for r in rs) / len(rs)}, runs=len(rs)) for rs in groups.values()]


def _shape(r: dict) -> tuple[int, int, int]:
    return r["tokens_per_gpu"], r["heads"], r["dim"]


def _model_ms(r: dict) -> float:
    """ms per tokens_per_gpu tokens on one GPU, from a model row's measured tokens/s/GPU."""
    return r["tokens_per_gpu"] / r["tokens_per_s_per_gpu"] * 1e3


# ---------------------------------------------------------------------------------------------- projections

@dataclass(frozen=True)
class Choice:
    """A strategy's projected layer: for zeco, the All-Scan's transport, shape and blocks."""

    strategy: str
    seconds: float
    efficiency: float
    transport: str = ""
    shape: str = ""
    K: int = 0
    projected: bool = False  # rests on projected (not measured) transport costs
    why_not: str = ""  # set where the strategy cannot run this workload (seconds = inf)


def projection_workload(cal: Calibration, P: int, tokens: int, layout: str = "contiguous", heads: int = 16,
                        head_dim: int = 128, regime: str = "steady") -> Workload:
    """A layer at ``tokens`` per GPU: the one-GPU op time measured in ``regime`` at the fewest tokens
    with this head dim, scaled linearly in tokens and heads (docs/scaling.md, "Limits")."""
    measured = {(t, h): ms for (t, h, d), ms in cal.op_ms[regime].items() if d == head_dim}
    if not measured:
        raise ValueError(f"no measured one-GPU op time with head dim {head_dim} (measured: "
                         f"{sorted({d for *_, d in cal.op_ms[regime]})}); choose --head-dim among them")
    t0, h0 = min(measured)
    op_ms = measured[t0, h0] * tokens / t0 * heads / h0
    return Workload(P=P, tokens=tokens, heads=heads, k_dim=head_dim, v_dim=head_dim, op_ms=op_ms, layout=layout)


def zeco_choices(w: Workload, c: Cluster, cal: Calibration, regime: str = "steady", shapes=SHAPES,
                 transports=None) -> list[Choice]:
    """ZeCO at its best K over each transport and shape that can run this group (peer memory on one
    node only), fastest first."""
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
            out.append(Choice("zeco", t, w.op_ms * 1e-3 / t, name, shape, K, cal.projected(name)))
    return sorted(out, key=lambda ch: ch.seconds)


def project(cal: Calibration, P: int, tokens: int, layout: str, node_size: int = 8, regime: str = "steady",
            heads: int = 16, head_dim: int = 128, cluster: Cluster = Cluster(), transports=None) -> list[Choice]:
    """One line per strategy: zeco (its best transport and shape), zeco-chain, zeco-hierarchical
    (each at its best transport), lasp2, lasp1, a2a."""
    c = replace(cluster, gpus_per_node=node_size)
    w = projection_workload(cal, P, tokens, layout, heads, head_dim, regime)
    t_op = w.op_ms * 1e-3
    zeco = zeco_choices(w, c, cal, regime, transports=transports)
    out = [zeco[0]]
    for shape in SHAPES:
        best = [ch for ch in zeco if ch.shape == shape]
        out.append(replace(best[0], strategy=f"zeco-{shape}") if best else
                   Choice(f"zeco-{shape}", math.inf, 0.0, why_not="no transport runs it here"))
    sw = cal.sw("send_recv", regime)
    for strategy in ("lasp2", "lasp1", "a2a"):
        if strategy == "a2a" and heads % P:
            out.append(Choice(strategy, math.inf, 0.0, why_not=f"needs the {heads} heads divisible by {P} GPUs"))
            continue
        t = layer_time(strategy, w, c, sw)
        out.append(Choice(strategy, t, t_op / t))
    return out


def _format(ch: Choice, layout: str) -> str:
    if ch.why_not:
        return f"{ch.strategy:<18} layout={layout:<10} cannot run: {ch.why_not} efficiency=0.000"
    scan = ""
    if ch.transport:
        scan = (f" transport={ch.transport}{' (projected)' if ch.projected else ''} shape={ch.shape} "
                f"K={ch.K}")
    return f"{ch.strategy:<18} layout={layout:<10}{scan} time_ms={ch.seconds * 1e3:.3f} efficiency={ch.efficiency:.3f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_zeco.cost_model",
        description="Projected efficiency t(one GPU) / t(strategy) of one GLA layer (forward + backward) under "
                    "each context-parallel strategy, from the measured points shipped with the package "
                    "(megatron_zeco/cost_model/data: the repository's docs/results files that hold them) and the "
                    "stated link figures (docs/scaling.md). One line per strategy and layout, ending in "
                    "efficiency=. Transports marked (projected) are not measured.")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the context-parallel group (P)")
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
    args = parser.parse_args(argv)
    for name, value in (("--gpus", args.gpus), ("--tokens-per-gpu", args.tokens_per_gpu),
                        ("--node-size", args.node_size), ("--heads", args.heads)):
        if value < 1:
            parser.error(f"{name} must be a positive integer, got {value}")
    cal = calibrate(load_rows(args.results) if args.results else default_rows())
    cluster = Cluster(inter=Link(args.ib_latency_us * 1e-6, args.ib_bandwidth_gbs * 1e9), gpus_per_node=args.node_size)
    w = projection_workload(cal, args.gpus, args.tokens_per_gpu, heads=args.heads, head_dim=args.head_dim,
                            regime=args.regime)
    print(f"# {args.gpus} GPUs ({args.node_size} per node), {args.tokens_per_gpu} tokens per GPU, {args.heads} "
          f"heads of {args.head_dim}, {args.regime}: one GPU {w.op_ms:.3f} ms per layer (fwd+bwd); links: NVLink "
          f"{cluster.intra.latency * 1e6:g} us {cluster.intra.bandwidth / 1e9:g} GB/s, between nodes "
          f"{cluster.inter.latency * 1e6:g} us {cluster.inter.bandwidth / 1e9:g} GB/s")
    for layout in args.layout or LAYOUTS:
        for ch in project(cal, args.gpus, args.tokens_per_gpu, layout, args.node_size, args.regime, args.heads,
                          args.head_dim, cluster, args.transport):
            print(_format(ch, layout))

