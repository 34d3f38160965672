"""The cost model's calibration: the costs of the implementation (:class:`~.model.Software`) fitted
on measured result files, every other measured point predicted (:func:`calibrate`), and the files'
rows (:func:`load_rows`, :func:`default_rows`: the data shipped with the package)."""

import glob
import json
import os
import re
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Optional

import torch

from ..comm.peer import ASIDE_PROGRAMS
from ..comm.shape import TRANSPORTS, Cluster, chain_hops
from ..kernels import dense_precision, map_precision
from .model import (ACT_BYTES, DEVICE, FOLD_LAUNCH, GLA, OPERATORS, REGIMES, STRATEGIES, Software, Workload,
                    _a2a_wire, _hop_times, chain_time, gather_time, layer_time)

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
ONE_GPU = "one_gpu"  # the part of another operator's one-GPU op time, as file_rows gives it
PIECE = "piece"  # the part of a delta rule's ZeCO piece against its one-GPU op, as file_rows gives it
OVERLAP = "overlap"  # the part of a piece's local work its scan can hide, as file_rows gives it (bench_overlap.py)
HOP = "hop"  # the part of a dense hop kernel's time beyond a diagonal one's, as file_rows gives it (bench_hop.py)
MIN_HIDDEN = 0.01  # in-chunk work below this share of a direction counts as none (overlap_rows)
# How the dense hops multiply for the 16-bit activations the model describes (``kernels.map_precision``): the rows
# of hop kernels and of their overlap that time the hops as built (bench_hop.py, bench_overlap.py: ``precision``)
DENSE_PRECISION = dense_precision(map_precision(torch.bfloat16))
PIECE_CASES = ("piece first", "piece middle", "piece last")  # profile_piece.py's cases of the piece as built
# A profile_piece.py file's meta key naming the cases that time the piece as built now, where the build changed
# after the file was written (its "piece" cases then timed another piece, one of its variants the current one);
# only the shipped calibration copies add it
PIECE_META = "piece_cases"
DATA = "data"  # the package's folder of calibration data: copies of the result files that hold such rows
_CHAIN = re.compile(r"all_scan(?: (\w+))? K=(\d+)$")


# NVSHMEM (device-initiated put + signal) is not measured yet: until scan rows named
# "all_scan nvshmem K=*" exist in the calibration data (then they are fitted like the others), its
# costs are those of the transport named here, measured on one node (a device-side store and flag
# per hop, the same kind of work), and between nodes the Cluster's stated InfiniBand link.
NVSHMEM_PROJECTION = {"transport": "nvshmem", "priced_as": "peer_memory"}


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
    # operator -> regime -> (tokens, heads, dim) -> one-GPU fwd+bwd ms: GLA's op_ms and the other
    # operators' measured op times (op_time_rows)
    one_gpu: dict[str, dict[str, dict[tuple[int, int, int], float]]]
    # operator -> (tokens, heads, dim) -> what a ZeCO piece's own work adds to the one-GPU op, as a share
    # of its GPU time, forward + backward (piece_rows; the delta rules')
    piece_share: dict[str, dict[tuple[int, int, int], float]] = field(default_factory=dict)
    # operator -> (tokens, heads, dim) -> ((hidden, spin, aside) forward, (hidden, spin, aside) backward,
    # priority): the share of each direction's local op that needs no scan result, how much slower it runs
    # beside a spinning hop, how many times longer a hop takes beside it than alone, and the side stream's
    # priority they were measured with (overlap_rows)
    overlap: dict[str, dict[tuple[int, int, int], tuple]] = field(default_factory=dict)
    # (heads, dim) -> (state, map): seconds a dense hop kernel takes beyond a diagonal one, combining a state
    # with a map, and composing two maps (hop_rows)
    dense_hop: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)

    def sw(self, transport: str, regime: str = "steady") -> Software:
        """The code as built with its All-Scan over ``transport``, in ``regime``."""
        if regime not in REGIMES:
            raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {tuple(TRANSPORTS)}, got {transport!r}")
        return self.transports[transport, regime]

    def with_hops_alone(self) -> "Calibration":
        """A what-if: this calibration with the scan's hops as fast beside the local op as alone (``aside``
        1 in every overlap measurement), all else as measured (``--hop-pace alone``)."""
        alone = {op: {shape: (*((hidden, spin, 1.0) for hidden, spin, _ in (fwd, bwd)), priority)
                      for shape, (fwd, bwd, priority) in shapes.items()}
                 for op, shapes in self.overlap.items()}
        return replace(self, overlap=alone)

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
    accuracy, memory or profile rows), :func:`op_time_rows`, and the :data:`OVERLAP` and :data:`HOP` rows of the
    device the model describes (``bench_overlap.py``'s and ``bench_hop.py``'s, read by :func:`overlap_rows` and
    :func:`hop_rows`). None of a file whose scan shape was forced (``meta["scan_shape"]``: ``bench_op.py``
    under ``$MEGATRON_ZECO_SCAN_SHAPE``): such a file compares the shapes side by side; the calibration's
    points are runs in the shape ``auto`` takes.
    None either of a file that reruns an earlier version of the code beside the current one
    (``meta["rerun_of"]``: its commit): it compares versions on one machine."""
    if "scan_shape" in data.get("meta", {}) or "rerun_of" in data.get("meta", {}):
        return []
    gla = [r for r in data.get("rows", []) if r.get("part") in PARTS and r.get("op", "gla") == "gla"]
    here = DEVICE in data.get("meta", {}).get("device", "")
    overlap = [r for r in data.get("rows", []) if here and _overlap_as_built(r)]
    hops = [r for r in data.get("rows", []) if here and _hop_as_built(r)]
    if all(r.get("kind") == "diagonal" for r in hops):  # no dense hop as built to set beside the diagonal one
        hops = []
    return gla + op_time_rows(data) + overlap + hops


def op_time_rows(data: dict) -> list[dict]:
    """The rows of a result file that measured another operator's one-GPU op time (forward + backward)
    on the device the model describes (:data:`DEVICE`), as written: ``bench_op.py --op <op>``'s
    ``none`` op rows and ``profile_piece.py``'s rows of fla's own op (case ``fla``, ``fwd+bwd``).
    The delta rules' scans are not timed; only their local op is."""
    if DEVICE not in data.get("meta", {}).get("device", ""):
        return []
    return [r for r in data.get("rows", []) if r.get("op", "gla") != "gla" and r.get("op") in OPERATORS and (
        (r.get("part") == "op" and r.get("strategy") == "none" and r.get("cp") == 1)
        or (r.get("part") == "profile" and r.get("case") == "fla" and r.get("direction") == "fwd+bwd"))]


def piece_rows(name: str, data: dict) -> list[dict]:
    """What a delta rule's ZeCO piece adds to one GPU's work, from ``profile_piece.py``'s rows on the device
    the model describes: per operator and tokens, the mean GPU time of its pieces (first, middle, last: the
    exchange stubbed; the cases ``meta[PIECE_META]`` names where present) over fla's op on the same tokens,
    forward + backward. Part :data:`PIECE`, ``share`` the piece's time over the op's less one, ``date`` the
    file's."""
    meta = data.get("meta", {})
    if DEVICE not in meta.get("device", ""):
        return []
    rows = [r for r in data.get("rows", []) if r.get("part") == "profile" and r.get("direction") == "fwd+bwd"
            and r.get("op") in OPERATORS]
    cases = tuple(meta.get(PIECE_META, PIECE_CASES))
    out = []
    for op, tokens in sorted({(r["op"], r["tokens"]) for r in rows}):
        fla = [r["gpu_ms"] for r in rows if (r["op"], r["tokens"], r["case"]) == (op, tokens, "fla")]
        pieces = [r["gpu_ms"] for r in rows if (r["op"], r["tokens"]) == (op, tokens) and r["case"] in cases]
        if fla and pieces:
            share = (sum(pieces) / len(pieces)) / (sum(fla) / len(fla)) - 1
            out.append(dict(part=PIECE, op=op, tokens_per_gpu=tokens, heads=meta["heads"], dim=meta["dim"],
                            share=share, date=meta.get("date", ""), file=name))
    return out


def _dense_as_built(row: dict) -> bool:
    """Whether a dense hop of ``row`` multiplied as the scans of the model's 16-bit pieces do
    (:data:`DENSE_PRECISION`; rows without ``precision`` predate the option and ran three TF32 passes)."""
    return row.get("precision", "tf32x3") == DENSE_PRECISION


def _overlap_as_built(row: dict) -> bool:
    """Whether ``row`` is a :data:`OVERLAP` row of the hops as built: on ``comm.peer.ASIDE_PROGRAMS``
    programs (rows without the field predate the option and ran so), the delta rules' in the products as built."""
    return (row.get("part") == OVERLAP and row.get("aside_programs", ASIDE_PROGRAMS) == ASIDE_PROGRAMS
            and (row.get("op") == "gla" or _dense_as_built(row)))


def _hop_as_built(row: dict) -> bool:
    """Whether ``row`` is a ``bench_hop.py`` row of a hop kernel as the chain runs it: on every program, the dense
    hops with the rows per product and the products as built."""
    return (row.get("part") == HOP and not row.get("aside") and row.get("as_built", True)
            and (row.get("kind") == "diagonal" or _dense_as_built(row)))


def hop_rows(name: str, data: dict) -> list[dict]:
    """What a dense hop kernel costs beyond a diagonal one, from ``bench_hop.py``'s rows on the device the model
    describes: per heads and dim, the GPU time of ``all_scan_dense_hop`` combining a state with a map (``state``)
    and composing two maps (``map``), less that of GLA's ``all_scan_hop`` on the same state, at one All-Scan
    block (the whole state in one launch, as a chain hop takes it), each on every program. Part :data:`HOP`,
    ``seconds``, ``date`` the file's."""
    meta = data.get("meta", {})
    if DEVICE not in meta.get("device", ""):
        return []
    us = {r["kind"]: r["us"] for r in data.get("rows", []) if _hop_as_built(r) and r.get("blocks") == 1}
    if "diagonal" not in us:
        return []
    return [dict(part=HOP, what=what, heads=meta["heads"], dim=meta["dim"],
                 seconds=max(0.0, us[kind] - us["diagonal"]) * 1e-6, date=meta.get("date", ""), file=name)
            for what, kind in (("state", "dense"), ("map", "dense map")) if kind in us]


def overlap_rows(name: str, data: dict) -> list[dict]:
    """What the scan's overlap hides and costs, from ``bench_overlap.py``'s rows on the device the model
    describes: per operator, tokens and direction (``fwd``, ``bwd``), ``hidden``, the GPU time of the in-chunk work
    (what needs no scan result) over the direction's, the state arriving at once, without the overlap; and ``spin``,
    how much slower that work runs beside a hop that spins through it (with the overlap, at the latest arrival,
    against without) less one; neither where the in-chunk work is under :data:`MIN_HIDDEN` of the direction (nothing
    to hide: a time there is the timer's); and ``aside``, how many times longer the hop takes beside that work than
    alone, the state arriving at once: from the scan's start until the successor holds the state (``departure``)
    with the overlap, against its time after the in-chunk work without (1 where the file has no departures). The
    rows with the side stream of the highest priority (as built), where the file has them, else those of the default
    priority (rows without ``side_priority`` ran so), which ``priority`` names. Part :data:`OVERLAP`, ``date`` the
    file's."""
    meta = data.get("meta", {})
    if DEVICE not in meta.get("device", ""):
        return []
    rows = [r for r in data.get("rows", []) if _overlap_as_built(r) and r.get("op") in OPERATORS]
    priority = "high" if any(r.get("side_priority") == "high" for r in rows) else "normal"
    rows = [r for r in rows if r.get("side_priority", "normal") == priority]
    out = []
    for op, tokens in sorted({(r["op"], r["tokens"]) for r in rows}):
        mine = [r for r in rows if (r["op"], r["tokens"]) == (op, tokens)]
        first, last = min(r["arrival_us"] for r in mine), max(r["arrival_us"] for r in mine)
        at = {(r["arrival_us"], r["mode"]): r for r in mine}
        if not all((a, m) in at for a in (first, last) for m in ("serial", "overlap")):
            continue
        for d in ("fwd", "bwd"):
            local, whole = at[first, "serial"][f"{d}_local_ms"], at[first, "serial"][f"{d}_ms"]
            spun = at[last, "overlap"][f"{d}_local_ms"] / at[last, "serial"][f"{d}_local_ms"] - 1
            hidden = local / whole if local / whole >= MIN_HIDDEN else 0.0
            aside = 1.0
            if hidden and f"{d}_departure_ms" in at[first, "serial"]:
                alone = at[first, "serial"][f"{d}_departure_ms"] - local
                beside = at[first, "overlap"][f"{d}_departure_ms"] - first * 1e-3
                aside = max(1.0, beside / alone)
            out.append(dict(part=OVERLAP, op=op, tokens_per_gpu=tokens, heads=meta["heads"], dim=meta["dim"],
                            direction=d, hidden=hidden, spin=max(0.0, spun) if hidden else 0.0, aside=aside,
                            priority=priority, date=meta.get("date", ""), file=name))
    return out


def file_rows(name: str, data: dict) -> list[dict]:
    """The calibration rows of one result file ``{"meta": {...}, "rows": [...]}``, each with ``file``
    (``name``) and the file's defaults.

    The rows are :func:`calibration_rows`; each gets its file's ``build`` and ``build_meta`` (what
    the file measured, :data:`META`: a file of :data:`BUILD` that says no more is :data:`BUILD_META`);
    ``kernel`` rows without heads/dim take them from the file's ``op`` rows; rows without ``dtype``
    are bf16 (what ``benchmarks/bench_op.py`` measures); op rows without ``mode`` are ``eager``
    (timed one call from an empty queue).
    """
    times = ([_one_gpu_row(name, data["meta"], r) for r in op_time_rows(data)] + piece_rows(name, data)
             + overlap_rows(name, data) + hop_rows(name, data))
    rows = [r for r in calibration_rows(data) if r.get("op", "gla") == "gla" and r["part"] in PARTS]
    if not rows:
        return times
    build, built = data["meta"].get("build"), _build_meta(name, data["meta"])
    shapes = {(r["heads"], r["dim"]) for r in rows if "heads" in r}
    out = []
    for r in rows:
        if "heads" not in r and r["part"] == "kernel":
            if len(shapes) != 1:
                raise ValueError(f"{name}: a {r['part']} row without heads/dim needs one op shape in its file")
            r = dict(r, heads=next(iter(shapes))[0], dim=next(iter(shapes))[1])
        out.append(dict(r, file=name, build=build, build_meta=built, mode=r.get("mode", "eager")))
    return out + times


def _one_gpu_row(name: str, meta: dict, r: dict) -> dict:
    """An :func:`op_time_rows` row as the calibration reads it: part :data:`ONE_GPU`, its op, regime
    (``mode``), shape and ``ms``. profile_piece.py's rows time fla's op back to back (``steady_ms``, as
    bench_op.py's steady rows) at the heads and dim of the file's meta."""
    if r["part"] == "profile":
        r = dict(mode="steady", tokens_per_gpu=r["tokens"], heads=meta["heads"], dim=meta["dim"], ms=r["steady_ms"],
                 op=r["op"])
    return dict(part=ONE_GPU, op=r["op"], mode=r.get("mode", "eager"), tokens_per_gpu=r["tokens_per_gpu"],
                heads=r["heads"], dim=r["dim"], ms=r["ms"], file=name)


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
    fit = _Fit([r for r in rows if r["part"] not in (ONE_GPU, PIECE, OVERLAP, HOP)], cluster, build)
    residuals = fit.kernel_residuals() + fit.scan_residuals() + fit.op_residuals()
    outside = fit.outside_ms()
    residuals += fit.model_residuals(outside)
    builds = fit.builds()
    return Calibration(builds[build], builds, fit.transports(), fit.nccl_call, fit.op_ms, _mean_per_shape(outside),
                       residuals, {GLA.name: fit.op_ms, **_one_gpu_times([r for r in rows if r["part"] == ONE_GPU])},
                       _piece_shares([r for r in rows if r["part"] == PIECE]),
                       _overlaps([r for r in rows if r["part"] == OVERLAP]),
                       _dense_hops([r for r in rows if r["part"] == HOP]))


class _Fit:
    """:func:`calibrate`'s fit of one set of rows. Built in steps, each reading what the ones before
    it found: the one-GPU op times, what each build measured, the passes of each build, the scan codes
    (each moves states over one transport), their fits per version and regime, NCCL's all-gather call,
    the a2a copies and wire. Then the residuals of each kind of row, the time outside GLA per layer,
    and the code as built, per build and per transport."""

    def __init__(self, rows: list[dict], cluster: Cluster, build: str):
        self.rows, self.cluster, self.build = rows, cluster, build
        self.op_ms, self._own_op_ms = self._one_gpu_op_times()
        self.measured = self._what_each_build_measured()
        self.passes, self.kernels = self._fit_passes()
        # per regime, the build's passes and no scan costs yet
        self.base = {regime: Software(message=0.0, scan_call=0.0, gather_call=0.0, fold_launch=FOLD_LAUNCH[regime],
                                      a2a_copy=0.0, **self.passes[build]) for regime in REGIMES}
        self.version_transport = self._scan_code_transports()
        self.scan_fits, self.gather_fits, self.scans, self.gathers = self._fit_scan_codes()
        self.build_code = self._build_scan_code()
        # the code as built, per regime
        self.software = {regime: replace(self.base[regime], **self.fits(self.build_code, regime)) for regime in REGIMES}
        self.nccl_gathers = _pooled(self.by(part="scan", method="nccl all_gather"), "ms")
        self.nccl_call = self._fit_nccl_call()
        a2a = self._fit_a2a()
        if a2a is not None:
            copy, wire = a2a
            self.software = {regime: replace(sw, a2a_copy=copy, a2a_wire=wire) for regime, sw in self.software.items()}

    def by(self, **kv) -> list[dict]:
        """The rows with these values."""
        return [r for r in self.rows if all(r.get(k) == v for k, v in kv.items())]

    def _one_gpu_op_times(self) -> tuple[dict[str, dict[tuple[int, int, int], float]], dict[tuple, float]]:
        """From the ``none`` op rows: per regime, the one-GPU op time per shape (the mean of its runs); and
        each run's own, by regime, file and shape."""
        op_ms: dict[str, dict[tuple[int, int, int], float]] = {}
        own: dict[tuple, float] = {}
        for regime in REGIMES:
            times: dict[tuple[int, int, int], list[float]] = {}
            for r in self.by(part="op", strategy="none", mode=regime):
                times.setdefault(_shape(r), []).append(r["ms"])
                own[(regime, r["file"], *_shape(r))] = r["ms"]
            op_ms[regime] = {k: sum(v) / len(v) for k, v in times.items()}
        return op_ms, own

    def op_time(self, r: dict, regime: str = "eager") -> float:
        """The one-GPU op time of the row's own run (runs differ by up to ~15%), else the mean."""
        if _shape(r) not in self.op_ms[regime]:
            raise ValueError(f"{r['file']}: no {regime} 'none' op row at tokens/heads/dim {_shape(r)} to compare with")
        return self._own_op_ms.get((regime, r["file"], *_shape(r)), self.op_ms[regime][_shape(r)])

    def _what_each_build_measured(self) -> dict[str, dict]:
        """What each build measured (its files' meta, the same in each); the build whose costs are wanted,
        if it has no rows, as it is now."""
        measured: dict[str, dict] = {}
        for r in self.rows:
            if measured.setdefault(r["build"], r["build_meta"]) != r["build_meta"]:
                raise ValueError(f"{r['file']}: build {r['build']!r} measured {r['build_meta']} here and "
                                 f"{measured[r['build']]} in another file: one build, one meta")
        if self.build not in measured:
            if self.build != BUILD:
                raise ValueError(f"no rows of build {self.build!r} (measured: {', '.join(measured)})")
            measured[self.build] = BUILD_META
        return measured

    def _fit_passes(self) -> tuple[dict[str, dict], dict[tuple[str, str], tuple]]:
        """The passes of each build measured, each fitted per byte of what it touches: per build, its
        :class:`Software` fields (a build whose kernel rows are missing has none); and per (build, kernel),
        its rows, cost per byte and unit."""
        kernels, passes = {}, {}
        for b, meta in self.measured.items():
            if meta["passes"] is None:  # no separate pass: its cost is inside the op rows
                passes[b] = dict(pass_unit="", state_pass=0.0, state_grad_pass=0.0)
                continue
            fwd, bwd, unit = meta["passes"]["forward"], meta["passes"]["backward"], meta["passes"]["per_byte_of"]
            rows_of = {name: self.by(part="kernel", name=name, build=b) for name in (fwd, bwd)}
            if not any(rows_of.values()):
                continue
            if not all(rows_of.values()):
                raise ValueError(f"calibration needs 'kernel' rows for both {fwd!r} and {bwd!r} (build {b!r})")
            per_byte = {name: _weighted_fit([[getattr(_workload(r, 0.0), unit)] for r in rs],
                                            [r["ms"] * 1e-3 for r in rs])[0] for name, rs in rows_of.items()}
            passes[b] = dict(pass_unit=unit, state_pass=per_byte[fwd], state_grad_pass=per_byte[bwd])
            kernels.update({(b, name): (rs, per_byte[name], unit) for name, rs in rows_of.items()})
        return passes, kernels

    def code_of(self, b: str, transport: str) -> str:
        """The version of the scan code build ``b`` ran over ``transport``."""
        return self.measured[b]["scan_code"].get(transport, f"{b}/{transport}")

    def scan_transport(self, r: dict) -> str:
        """A scan row's transport: the one its method names, else its file's."""
        m = _CHAIN.match(r["method"])
        if m and m.group(1) and m.group(1) not in TRANSPORTS:
            raise ValueError(f"{r['file']}: scan row {r['method']!r} names no transport among {', '.join(TRANSPORTS)}")
        return m.group(1) if m and m.group(1) else self.measured[r["build"]]["transport"]

    def scan_code(self, r: dict) -> str:
        """The version of the scan code a scan row ran."""
        return self.code_of(r["build"], self.scan_transport(r))

    def _scan_code_transports(self) -> dict[str, str]:
        """The transport each version of the scan code moves states over (one per version)."""
        version_transport = {}
        used = [(b, t) for b, meta in self.measured.items() for t in (meta["transport"], *meta["scan_code"])]
        for b, transport in used + [(r["build"], self.scan_transport(r)) for r in self.by(part="scan")]:
            version = self.code_of(b, transport)
            if version_transport.setdefault(version, transport) != transport:
                raise ValueError(f"scan code {version!r} runs over {version_transport[version]!r} and {transport!r}")
        return version_transport

    def _fit_scan_codes(self) -> tuple[dict, dict, list[tuple], list[tuple]]:
        """Per version of the scan code and regime: All-Scan = scan_call + (K - 1) * message + hops * hop
        + wire (stated links), the all-gather scan = gather_call + its wire and fold. Device costs
        (steady) first: a host-issued call's hops are the device's.

        Returns the chain's and the all-gather scan's costs by (version, regime), and the rows each was
        fitted on (with their workload, blocks, version, regime and time key for the chain's)."""
        scan_fits, gather_fits, scans, gathers = {}, {}, [], []
        for version in dict.fromkeys(self.scan_code(r) for r in self.by(part="scan")):
            mine = [dict(r, method=_code_method(r)) for r in self.by(part="scan") if self.scan_code(r) == version]
            hop = None
            for regime, key in (("steady", "gpu_ms"), ("eager", "ms")):
                pooled = _pooled(mine, key)
                chain = [(r, _scan_workload(r), int(_CHAIN.match(r["method"]).group(2)))
                         for r in pooled if _CHAIN.match(r["method"])]
                gather = [r for r in pooled if r["method"] == "gather_scan"]
                sw = replace(self.base[regime], transport=self.version_transport[version])
                if chain:
                    scan_fits[version, regime] = fit = _fit_scan(chain, self.cluster, sw, key, hop)
                    hop = fit["hop"] if regime == "steady" else hop
                    scans += [(r, w, K, version, regime, key) for r, w, K in chain]
                if gather:
                    gather_fits[version, regime] = _fit_gather(gather, self.cluster, sw, key)
                    gathers += [(r, version, regime, key) for r in gather]
        return scan_fits, gather_fits, scans, gathers

    def _build_scan_code(self) -> str:
        """The version of the scan code the build runs over its transport; checked to have scan rows."""
        code = self.code_of(self.build, self.measured[self.build]["transport"])
        if (code, "eager") not in self.scan_fits or (code, "eager") not in self.gather_fits:
            raise ValueError(f"calibration needs 'scan' rows (all_scan K=*, gather_scan) of build {self.build!r}'s "
                             f"scan code ({code!r})")
        return code

    def fits(self, version: str, regime: str) -> dict:
        """The scan code's chain and all-gather costs in ``regime``."""
        return {**self.scan_fits.get((version, regime), {}), **self.gather_fits.get((version, regime), {})}

    def built(self, r: dict, regime: str = "eager") -> Software:
        """The :class:`Software` a row was measured with: its build's passes and scan code."""
        if r["build"] not in self.passes:
            raise ValueError(f"{r['file']}: no 'kernel' rows of build {r['build']!r} to charge its passes")
        transport = self.measured[r["build"]]["transport"]
        code = self.code_of(r["build"], transport)
        if (code, regime) not in self.scan_fits or (code, regime) not in self.gather_fits:
            raise ValueError(f"{r['file']}: no {regime} 'scan' rows of scan code {code!r} (build {r['build']!r})")
        return replace(self.software[regime], **self.passes[r["build"]], **self.fits(code, regime), transport=transport)

    def ring(self, r: dict) -> float:
        """The wire time of a scan row's state all-gathered as a ring: P - 1 steps over the slowest link."""
        return (r["cp"] - 1) * self.cluster.slowest(r["cp"]).time(r["state_mib"] * 2 ** 20)

    def _fit_nccl_call(self) -> float:
        """NCCL's own all-gather call: what its rows take beyond the ring's wire."""
        rs = self.nccl_gathers
        return _weighted_fit([[1.0] for _ in rs], [r["ms"] * 1e-3 - self.ring(r) for r in rs])[0]

    def _fit_a2a(self) -> Optional[tuple[float, float]]:
        """``(a2a_copy, a2a_wire)`` from the eager CP > 1 ``a2a`` op rows, or None without any: the copies
        (the same at every P) and the wire ((P - 1) / P of the bytes cross links), both fitted where rows
        at two or more P allow it, else the wire at the stated bandwidth."""
        a2a = [r for r in self.by(part="op", strategy="a2a", mode="eager") if r["cp"] > 1]
        if not a2a:
            return None
        xs = [[_workload(r, 0.0).a2a_bytes, _a2a_wire(_workload(r, 0.0), self.cluster)] for r in a2a]
        ys = [(r["ms"] - self.op_time(r)) * 1e-3 for r in a2a]
        fit = _weighted_fit(xs, ys) if len({r["cp"] for r in a2a}) > 1 else None
        if fit is None or min(fit) <= 0:
            fit = _weighted_fit([x[:1] for x in xs], [y - x[1] for x, y in zip(xs, ys)])[0], 1.0
        return fit

    def kernel_residuals(self) -> list[Residual]:
        """The passes' kernel rows against their cost per byte (fitted)."""
        return [Residual(f"kernel {name} ({b}) T={r['tokens_per_gpu']}", r["ms"],
                         per_byte * getattr(_workload(r, 0.0), unit) * 1e3, True)
                for (b, name), (rs, per_byte, unit) in self.kernels.items() for r in rs]

    def scan_residuals(self) -> list[Residual]:
        """The scan rows: each scan code's chains and all-gather scans and NCCL's all-gathers (fitted), and
        NCCL's one hop (predicted: NCCL's call, as its all-gathers cost, plus one message)."""
        cluster, gpu = self.cluster, {"eager": "", "steady": ", GPU"}
        res = [Residual(f"scan P={w.P} {r['state_mib']:g} MiB all_scan K={K} (code {v}{gpu[regime]})", r[key],
                        chain_time(w, cluster, replace(self.software[regime], **self.scan_fits[v, regime],
                                                       transport=self.version_transport.get(v, "send_recv")), K) * 1e3,
                        True) for r, w, K, v, regime, key in self.scans]
        res += [Residual(f"scan P={r['cp']} {r['state_mib']:g} MiB gather_scan (code {v}{gpu[regime]})", r[key],
                         sum(gather_time(_scan_workload(r), cluster,
                                         replace(self.software[regime], **self.gather_fits[v, regime]))) * 1e3, True)
                for r, v, regime, key in self.gathers]
        res += [Residual(f"scan P={r['cp']} {r['state_mib']:g} MiB nccl all_gather", r["ms"],
                         (self.nccl_call + self.ring(r)) * 1e3, True) for r in self.nccl_gathers]
        res += [Residual(f"scan P={r['cp']} {r['state_mib']:g} MiB nccl send/recv hop", r["ms"],
                         (self.nccl_call + cluster.intra.time(r["state_mib"] * 2 ** 20)) * 1e3, False)
                for r in _pooled(self.by(part="scan", method="nccl send/recv hop"), "ms")]
        return res

    def op_residuals(self) -> list[Residual]:
        """The CP > 1 op rows (predicted, but the eager a2a rows, fitted).

        One point per configuration, regime and build: the mean of its runs (files), each modelled from
        its own run's one-GPU time, as the same configuration measured in separate runs differs by up
        to ~17%. The build only changes the scan strategies (zeco, lasp2): lasp1's and a2a's runs pool
        across builds. Eager rows from an empty queue; steady rows back to back (the host ahead)."""
        runs: dict[tuple, list[dict]] = {}
        for r in self.by(part="op"):
            if r["strategy"] in STRATEGIES[1:] and r["mode"] in REGIMES:
                if r["mode"] == "steady" and (_shape(r) not in self.op_ms["steady"] or r["build"] not in self.passes):
                    continue
                build_of = r["build"] if r["strategy"] in ("zeco", "lasp2") else "any build"
                runs.setdefault((r["strategy"], r["cp"], _workload(r, 0.0).layout, build_of, r["mode"], *_shape(r)),
                                []).append(r)
        res = []
        for (strategy, P, layout, build_of, regime, T, *_), rs in runs.items():
            n = len(rs)
            label = f"op {strategy} CP={P} {layout} T={T} ({build_of})" + (" steady" if regime == "steady" else "")
            res.append(Residual(label + (f" (mean of {n} runs)" if n > 1 else ""), sum(x["ms"] for x in rs) / n,
                                sum(layer_time(strategy, _workload(x, self.op_time(x, regime)), self.cluster,
                                               self.built(x, regime)) for x in rs) / n * 1e3,
                                strategy == "a2a" and regime == "eager"))
        return res

    def outside_ms(self) -> dict[tuple, float]:
        """Per-layer time outside GLA from each file's CP = 1 model row (its own GPUs and data-parallel
        size), by (file, tokens, heads, dim, layers)."""
        return {(r["file"], *_shape(r), r["layers"]): _model_ms(r) / r["layers"] - self.op_time(r)
                for r in self.by(part="model") if r["cp"] == 1}

    def model_residuals(self, outside: dict[tuple, float]) -> list[Residual]:
        """The CP > 1 model rows of the strategies modelled (predicted): per layer, the time outside GLA
        of the CP = 1 row of their file (``outside``) and the layer's modelled time."""
        res = []
        for r in self.by(part="model"):
            if r["cp"] > 1 and r["strategy"] in STRATEGIES:  # variants of a strategy are not modelled
                key = (r["file"], *_shape(r), r["layers"])
                if key not in outside:
                    raise ValueError(f"{r['file']}: model row at CP={r['cp']} has no CP=1 row of the same shape in "
                                     f"its file")
                layer = layer_time(r["strategy"], _workload(r, self.op_time(r)), self.cluster, self.built(r))
                model = r["layers"] * (outside[key] + layer * 1e3)
                res.append(Residual(f"model {r['strategy']} CP={r['cp']} {_workload(r, 0.0).layout} "
                                    f"T={r['tokens_per_gpu']} L={r['layers']} ({r['build']})", _model_ms(r), model,
                                    False))
        return res

    def builds(self) -> dict[str, Software]:
        """Each build whose passes are known, eager: its passes and the scan code over its transport."""
        return {b: replace(self.software["eager"], **p, **self.fits(self.code_of(b, self.measured[b]["transport"]),
                                                                      "eager"), transport=self.measured[b]["transport"])
                for b, p in self.passes.items()}

    def transports(self) -> dict[tuple[str, str], Software]:
        """The code as built over each transport, per regime: the scan code the build runs over it (over
        NVSHMEM until measured, the one over the transport it is priced as: :data:`NVSHMEM_PROJECTION`)."""
        transports = {}
        for name in TRANSPORTS:
            fitted = all((self.code_of(self.build, name), regime) in self.scan_fits for regime in REGIMES)
            projected = name == NVSHMEM_PROJECTION["transport"] and not fitted
            code = self.code_of(self.build, NVSHMEM_PROJECTION["priced_as"] if projected else name)
            for regime in REGIMES:
                if (code, regime) in self.scan_fits:
                    transports[name, regime] = replace(self.software[regime], **self.scan_fits[code, regime],
                                                       transport=name)
        return transports


def _code_method(r: dict) -> str:
    """A scan row's method as one scan code's chain is named in every file: ``all_scan K=4``."""
    m = _CHAIN.match(r["method"])
    return f"all_scan K={m.group(2)}" if m else r["method"]


def _one_gpu_times(rows: list[dict]) -> dict[str, dict[str, dict[tuple[int, int, int], float]]]:
    """``Calibration.one_gpu`` of the operators besides GLA: per operator and regime, the mean of each
    shape's runs."""
    runs: dict[str, dict[str, dict[tuple[int, int, int], list[float]]]] = {}
    for r in rows:
        runs.setdefault(r["op"], {}).setdefault(r["mode"], {}).setdefault(_shape(r), []).append(r["ms"])
    return {op: {regime: {k: sum(v) / len(v) for k, v in shapes.items()} for regime, shapes in regimes.items()}
            for op, regimes in runs.items()}


def _piece_shares(rows: list[dict]) -> dict[str, dict[tuple[int, int, int], float]]:
    """``Calibration.piece_share``: per operator and shape, the newest file's share (by date, then name): the
    piece as built. Pieces change with the code, so older files time pieces since replaced (one GPU's op,
    fla's, does not change with the code: its times are averaged over the files)."""
    newest: dict[str, dict[tuple[int, int, int], dict]] = {}
    for r in sorted(rows, key=lambda r: (r["date"], r["file"])):
        newest.setdefault(r["op"], {})[_shape(r)] = r
    return {op: {k: r["share"] for k, r in shapes.items()} for op, shapes in newest.items()}


def _overlaps(rows: list[dict]) -> dict[str, dict[tuple[int, int, int], tuple]]:
    """``Calibration.overlap``: per operator and shape, the newest file's (by date, then name): the pieces and
    hops as built."""
    newest: dict[tuple, dict] = {}
    by_date = sorted(rows, key=lambda r: (r["date"], r["file"]))
    for r in by_date:
        newest[r["op"], _shape(r), r["direction"]] = r
    out: dict[str, dict[tuple[int, int, int], tuple]] = {}
    for op, shape in {(op, shape) for op, shape, _ in newest}:
        fwd, bwd = (newest.get((op, shape, d)) for d in ("fwd", "bwd"))
        if fwd is not None and bwd is not None:
            out.setdefault(op, {})[shape] = (*((r["hidden"], r["spin"], r["aside"]) for r in (fwd, bwd)),
                                             fwd["priority"])
    return out


def _dense_hops(rows: list[dict]) -> dict[tuple[int, int], tuple[float, float]]:
    """``Calibration.dense_hop``: per heads and dim, the newest file's (by date, then name) state and map times,
    where it has both: the hop kernel as built."""
    newest = {(r["heads"], r["dim"], r["what"]): r for r in sorted(rows, key=lambda r: (r["date"], r["file"]))}
    return {(h, d): (newest[h, d, "state"]["seconds"], newest[h, d, "map"]["seconds"])
            for h, d, what in newest if what == "state" and (h, d, "map") in newest}


def _mean_per_shape(outside: dict[tuple, float]) -> dict[tuple[int, int, int, int], float]:
    """``Calibration.other_ms``: the time outside GLA per layer, the mean over files per (tokens, heads,
    dim, layers), for projections."""
    by_shape: dict[tuple[int, int, int, int], list[float]] = {}
    for (_, *key), ms in outside.items():
        by_shape.setdefault(tuple(key), []).append(ms)
    return {k: sum(v) / len(v) for k, v in by_shape.items()}


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
