"""Cost model of GLA context parallelism: time of one layer per strategy as P grows.

Times are seconds of one GLA layer, forward + backward, on each of P GPUs holding ``tokens``
tokens each (weak scaling). Efficiency is ``t(none) / t(strategy)`` at the same tokens per GPU.
The equations, the stated figures and their sources are in ``docs/scaling.md``; in short:

* ``none``:  ``t_op``, the measured one-GPU time of the local op (an input).
* ``zeco``:  ``t_op (1 + extra) + passes + sum over fwd/bwd of max(0, chain - overlap * t_dir)``;
  the All-Scan chain of K blocks over hops with per-hop times ``tau_i`` takes
  ``scan_call + sum_i tau_i + (K - 1) max(message, max_i tau_i)`` (the paper's
  ``tau(S) + (P-1) tau(S)/K`` up to one block stage), ``tau = hop + latency + (S / K) / bandwidth``:
  ``hop`` is the critical path of one rank's receive -> combine -> send, ``message`` what each
  rank spends issuing one block (ranks issue theirs at the same time, so it paces the blocks,
  not the hops).
* ``lasp2``: as zeco with an all-gather of every piece's state, ``(P-1)(latency + S/bandwidth)``
  on the slowest link, and a local fold over all pieces.
* ``lasp1``: the ranks run one after another: ``P t_op`` plus two K=1 chains.
* ``a2a``:   all-to-all of q, k, v, g and o (and their gradients) plus the copies around it.

Two sets of implementation costs (:class:`Software`): the code as built, fitted to the measured
points by :func:`calibrate` (``docs/results/*.json``; a new measured point is a new JSON row),
and :func:`target`, the overlapped design (device-side All-Scan, state passes fused into
the chunk kernels, scan overlapped with the local op), with stated figures.

Standard library only: this module needs no torch and no GPU.
"""

import glob
import json
import math
import os
import re
from dataclasses import dataclass, replace

STRATEGIES = ("none", "zeco", "lasp2", "lasp1", "a2a")

# Stated hardware figures (docs/scaling.md says why).
HBM_BANDWIDTH = 4.8e12  # B/s, H200 HBM3e (NVIDIA spec)
FWD_FRACTION = 0.80 / 3.44  # forward share of fla chunk_gla fwd+bwd (ms), 16K tokens, H200
ACT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FOLD_LAUNCH_BUILT = 10e-6  # as built, per folded piece: two eager kernels (multiply, add), ~5 us each
CHUNK = 64  # tokens per chunk of the local op (fla's and chunk.py's)

# ZeCO's passes beyond the local op in each build of the GPU path: the (forward, backward) kernel
# rows bench_op measures and what each is charged per byte of, or None where the build has no
# such pass. A result file names its build in ``meta["build"]``; files from before that key
# are "state passes". BUILD is the code as it is now.
BUILDS = {
    "state passes": (("gla_state", "gla_state_grad"), "pass_bytes"),  # own kernels re-read k, v, g / q, g, dO
    "fla piece": (("add_state h", "add_state dh"), "chunk_state_bytes"),  # decayed S_in added to each chunk's state
    "fused": None,  # the state term inside the output and gradient kernels (kernels/chunk_state.py)
    "peer memory": None,  # fused, and All-Scan through peer memory by default on one node (comm/peer.py)
}
BUILD = "peer memory"
# The version of the scan code each build's zeco ran: the scans' call and per-message costs are
# fitted per version (v1, v2: host-issued NCCL messages, v2 with one block without concatenation
# and one addcmul; v3: one Triton kernel per piece storing into peer memory). A scan row naming
# its transport (``all_scan send_recv K=4``) ran the code of that transport.
SCAN_CODE = {"state passes": "v1", "fla piece": "v1", "fused": "v2", "peer memory": "v3"}
TRANSPORT_CODE = {"send_recv": "v2", "peer_memory": "v3"}
_CHAIN = re.compile(r"all_scan(?: (\w+))? K=(\d+)$")


@dataclass(frozen=True)
class Link:
    """One direction of one GPU's link: a message of n bytes takes ``latency + n / bandwidth``."""

    latency: float  # s
    bandwidth: float  # B/s

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


NVLINK = Link(latency=1e-6, bandwidth=268e9)  # bandwidth: NCCL all-to-all measured on the 2 H200 (docs/scaling.md)
INFINIBAND = Link(latency=5e-6, bandwidth=50e9)  # NDR 400 Gb/s, one NIC per GPU


@dataclass(frozen=True)
class Cluster:
    """Ranks placed node-major: rank r on node r // gpus_per_node."""

    intra: Link = NVLINK
    inter: Link = INFINIBAND
    gpus_per_node: int = 8

    def chain_hops(self, P: int, layout: str) -> tuple[int, int, int]:
        """(intra-node, inter-node, same-rank) hops of the chain visiting every piece in order."""
        inter = math.ceil(P / self.gpus_per_node) - 1
        if layout == "contiguous":
            return P - 1 - inter, inter, 0
        if layout == "zigzag":  # up the ranks, turn on the last one, back down
            return 2 * (P - 1 - inter), 2 * inter, 1
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")

    def slowest(self, P: int) -> Link:
        return self.inter if P > self.gpus_per_node else self.intra


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
    """Costs of an implementation beyond the wire: seconds, seconds per byte (passes, copies), shares."""

    message: float  # per block on each rank: issue, slicing, combine (paces the pipeline's blocks)
    scan_call: float  # fixed per All-Scan (or ring) call
    gather_call: float  # fixed per all-gather scan call, the collective's own call included
    fold_launch: float  # per piece folded after the all-gather, beyond reading its state
    state_pass: float  # per byte of the build's forward pass beyond the local op (0: fused into it)
    state_grad_pass: float  # per byte of its backward pass
    a2a_copy: float  # per byte of Workload.a2a_bytes: packing and unpacking around the all-to-all
    a2a_wire: float = 1.0  # NCCL's all-to-all time over the stated links' (1: at their bandwidth)
    hop: float = 0.0  # per hop beyond the wire: one rank's receive -> combine -> send turnaround
    overlap: float = 0.0  # share of each direction's local op that runs while the scan is in flight
    extra: float = 0.0  # share of t_op added by the output/gradient corrections (correction form)
    build: str = BUILD  # which BUILDS entry the passes are (what they are charged per byte of)


def chain_time(w: Workload, c: Cluster, sw: Software, K: int) -> float:
    """One pipelined chain (forward or backward) over every piece, the state in K blocks."""
    taus = _hop_times(w, c, sw, K)
    return sw.scan_call + sum(n * tau for n, tau in taus) + (K - 1) * max(sw.message, *(tau for _, tau in taus))


def _hop_times(w: Workload, c: Cluster, sw: Software, K: int) -> list[tuple[int, float]]:
    """(number, seconds) of the chain's hops of each kind (NVLink, InfiniBand, same rank) for one block."""
    intra, inter, local = c.chain_hops(w.P, w.layout)
    block = w.state_bytes / K
    taus = [(intra, sw.hop + c.intra.time(block)), (inter, sw.hop + c.inter.time(block)), (local, sw.hop)]
    return [(n, tau) for n, tau in taus if n]


# Per-hop software cost of a scan hop beyond the wire, by transport (docs/scaling.md): a host-issued
# message (send/recv), a device-side flag wait and combine (peer memory).
HOP_COST = {"send_recv": 60e-6, "peer_memory": 3e-6}


def scan_path(hops: tuple[int, int], state_bytes: float, transport: str, cluster: Cluster = Cluster()) -> float:
    """Seconds on the critical path of ``hops`` = (inside nodes, between nodes) hops of one state."""
    intra, inter = hops
    hop = HOP_COST[transport]
    return intra * (hop + cluster.intra.time(state_bytes)) + inter * (hop + cluster.inter.time(state_bytes))


def prefer_hierarchical(chain_hops: tuple[int, int], tree_hops: tuple[int, int], state_bytes: float,
                        transport: str) -> bool:
    """Whether the hierarchical All-Scan (``comm/hierarchical.py``) beats the chain for these hop counts."""
    return scan_path(tree_hops, state_bytes, transport) < scan_path(chain_hops, state_bytes, transport)


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


def layer_time(strategy: str, w: Workload, c: Cluster, sw: Software, K: int = 1) -> float:
    """Seconds of one GLA layer, fwd + bwd, under ``strategy`` (K: All-Scan blocks, zeco only)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if w.k_dim % K:
        raise ValueError(f"K (All-Scan blocks, {K}) must divide k_dim ({w.k_dim})")
    t_op = w.op_ms * 1e-3
    if strategy == "none" or w.P == 1:
        return t_op
    if strategy == "lasp1":
        return w.P * t_op + 2 * chain_time(w, c, sw, 1)
    if strategy == "a2a":
        if w.heads % w.P:
            raise ValueError(f"a2a splits heads ({w.heads}) over P ({w.P}): P must divide heads")
        return t_op + w.a2a_bytes * sw.a2a_copy + sw.a2a_wire * _a2a_wire(w, c)
    passes = 0.0 if BUILDS[sw.build] is None else getattr(w, BUILDS[sw.build][1]) * (sw.state_pass + sw.state_grad_pass)
    comm, after = (chain_time(w, c, sw, K), 0.0) if strategy == "zeco" else gather_time(w, c, sw)
    exposed = sum(max(0.0, comm - sw.overlap * t) + after for t in (FWD_FRACTION * t_op, (1 - FWD_FRACTION) * t_op))
    return t_op * (1 + sw.extra) + passes + exposed


def best_blocks(w: Workload, c: Cluster, sw: Software) -> tuple[int, float]:
    """(K, seconds): the All-Scan block count (a divisor of k_dim) with the fastest zeco layer."""
    times = {K: layer_time("zeco", w, c, sw, K) for K in range(1, w.k_dim + 1) if w.k_dim % K == 0}
    K = min(times, key=times.get)
    return K, times[K]


def efficiency(strategy: str, w: Workload, c: Cluster, sw: Software) -> float:
    """``t(none) / t(strategy)`` at the same tokens per GPU (zeco at its best K), ``w.other_ms`` added to both."""
    t = best_blocks(w, c, sw)[1] if strategy == "zeco" else layer_time(strategy, w, c, sw)
    return (w.op_ms * 1e-3 + w.other_ms * 1e-3) / (t + w.other_ms * 1e-3)


# ---------------------------------------------------------------- calibration from measured JSON

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
    software: Software  # the code as built (BUILD)
    builds: dict[str, Software]  # each build measured, and BUILD, with its passes' and scan code's costs
    nccl_call: float  # NCCL's own all-gather call at P = 2 (used by :func:`target`'s lasp2)
    op_ms: dict[tuple[int, int, int], float]  # (tokens, heads, dim) -> one-GPU fwd+bwd of the local op
    other_ms: dict[tuple[int, int, int, int], float]  # (tokens, heads, dim, layers) -> per-layer non-GLA ms
    residuals: list[Residual]


def target(cal: Calibration, overlapped: bool = True, message: float = 2e-6, scan_call: float = 5e-6,
           overlap: float = 0.5, extra: float = 0.03) -> Software:
    """The overlapped design (not built): calibrated costs where unchanged, stated figures elsewhere.

    All-Scan on the device: ``message`` per block and per hop (a signal wait and the combine) and
    one launch (``scan_call``) instead of host-issued NCCL messages; the state passes fused into fla's chunk
    kernels (no extra pass). ``overlapped``: the correction form, the scan in flight while the
    ``overlap`` share of each direction's local op runs, corrections costing ``extra`` * t_op;
    else the initial-state form (nothing overlapped, no corrections). lasp2 gets the same fused
    passes, overlap and corrections, NCCL's own all-gather call and a fused fold; lasp1's ring the
    same device-side messages; a2a is unchanged.
    """
    return replace(cal.software, message=message, hop=message, scan_call=scan_call, gather_call=cal.nccl_call, fold_launch=0.0,
                   state_pass=0.0, state_grad_pass=0.0, overlap=overlap if overlapped else 0.0,
                   extra=extra if overlapped else 0.0)


def load_rows(pattern: str) -> list[dict]:
    """Rows of every JSON file matching ``pattern``, each with ``file`` and the file's defaults.

    Each row gets its file's ``build`` (see :data:`BUILDS`); ``kernel`` rows without heads/dim take them from the file's ``op`` rows; rows without
    ``dtype`` are bf16 (what ``benchmarks/bench_op.py`` measures). Op rows timed back to back or replayed
    from a CUDA graph (``mode`` ``steady`` or ``graph``) are left out: the model describes one layer
    issued from Python and timed from an empty queue.
    """
    rows = []
    for path in sorted(glob.glob(pattern)):
        with open(path) as f:
            data = json.load(f)
        file_rows, build = data["rows"], data["meta"].get("build", "state passes")
        if build not in BUILDS:
            raise ValueError(f"{path}: unknown build {build!r}; known: {', '.join(BUILDS)}")
        shapes = {(r["heads"], r["dim"]) for r in file_rows if "heads" in r}
        for r in file_rows:
            if r.get("mode", "eager") != "eager":  # op back to back or from a CUDA graph: not what the model describes
                continue
            if "heads" not in r and r["part"] == "kernel":
                if len(shapes) != 1:
                    raise ValueError(f"{path}: a {r['part']} row without heads/dim needs one op shape in its file")
                r = dict(r, heads=next(iter(shapes))[0], dim=next(iter(shapes))[1])
            rows.append(dict(r, file=os.path.basename(path), build=build))
    if not rows:
        raise ValueError(f"no measured rows in {pattern!r}")
    return rows


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


def calibrate(rows: list[dict], cluster: Cluster = Cluster(), build: str = BUILD) -> Calibration:
    """Fit the as-built costs on the measured rows; predict every other row; return both.
    ``build``: the build whose costs ``Calibration.software`` holds (the code as it is now).

    Fitted, each on its own rows: the state passes' cost per byte (``kernel`` rows), the All-Scan
    call and per-message costs (``scan`` rows ``all_scan K=*``), the all-gather scan's call
    (``gather_scan``), NCCL's all-gather call (``nccl all_gather``) and the a2a copies (``a2a`` op
    rows). Inputs: the ``none`` op rows (one-GPU op time per shape) and the CP = 1 ``model`` rows
    (per-layer time outside GLA). Predicted: the other ``op`` rows, the ``nccl send/recv hop``
    rows and the CP > 1 ``model`` rows.
    """
    def by(**kv):
        return [r for r in rows if all(r.get(k) == v for k, v in kv.items())]

    op_ms: dict[tuple[int, int, int], list[float]] = {}
    for r in by(part="op", strategy="none"):
        op_ms.setdefault(_shape(r), []).append(r["ms"])
    own = {(r["file"], *_shape(r)): r["ms"] for r in by(part="op", strategy="none")}
    op_ms = {k: sum(v) / len(v) for k, v in op_ms.items()}

    def t_op(r):  # the one-GPU op time of the row's own run (runs differ by up to ~15%), else the mean
        if _shape(r) not in op_ms:
            raise ValueError(f"{r['file']}: no 'none' op row at tokens/heads/dim {_shape(r)} to compare with")
        return own.get((r["file"], *_shape(r)), op_ms[_shape(r)])

    def fit_constant(rs, known):  # y = constant + known(row)
        return _weighted_fit([[1.0] for _ in rs], [r["ms"] * 1e-3 - known(r) for r in rs])[0]

    # The passes of each build measured, each fitted per byte of what it touches.
    kernels, passes = {}, {}
    for b, spec in BUILDS.items():
        if spec is None:  # no separate pass: its cost is inside the op rows
            passes[b] = dict(build=b, state_pass=0.0, state_grad_pass=0.0)
            continue
        (fwd, bwd), unit = spec
        rows_of = {name: by(part="kernel", name=name, build=b) for name in (fwd, bwd)}
        if not any(rows_of.values()):
            continue
        if not all(rows_of.values()):
            raise ValueError(f"calibration needs 'kernel' rows for both {fwd!r} and {bwd!r} (build {b!r})")
        per_byte = {name: _weighted_fit([[getattr(_workload(r, 0.0), unit)] for r in rs], [r["ms"] * 1e-3 for r in rs])[0]
                    for name, rs in rows_of.items()}
        passes[b] = dict(build=b, state_pass=per_byte[fwd], state_grad_pass=per_byte[bwd])
        kernels.update({(b, name): (rs, per_byte[name], unit) for name, rs in rows_of.items()})
    sw = Software(message=0.0, scan_call=0.0, gather_call=0.0, fold_launch=FOLD_LAUNCH_BUILT, a2a_copy=0.0,
                  **passes[build])

    # Per version of the scan code: All-Scan = scan_call + (K - 1) * message + hops * hop + wire
    # (stated links), hop >= 0; the all-gather scan = gather_call + its wire and fold.
    scan_fits, scans, gathers = {}, [], []
    def scan_code(r):
        m = _CHAIN.match(r["method"])
        return TRANSPORT_CODE[m.group(1)] if m and m.group(1) else SCAN_CODE.get(r["build"])

    def method(r):  # the same for one code's chain in every file: "all_scan K=4"
        m = _CHAIN.match(r["method"])
        return f"all_scan K={m.group(2)}" if m else r["method"]

    for version in dict.fromkeys(SCAN_CODE.values()):
        mine = _pooled([dict(r, method=method(r)) for r in by(part="scan") if scan_code(r) == version])
        chain = [(r, _scan_workload(r), int(_CHAIN.match(r["method"]).group(2)))
                 for r in mine if _CHAIN.match(r["method"])]
        gather = [r for r in mine if r["method"] == "gather_scan"]
        if not chain or not gather:
            continue
        xs = [[1.0, K - 1, sum(cluster.chain_hops(w.P, w.layout))] for _, w, K in chain]
        ys = [r["ms"] * 1e-3 - sum(n * tau for n, tau in _hop_times(w, cluster, sw, K)) for r, w, K in chain]
        # hop: only where rows differ in their hop count (several P); else, and where it fits < 0
        # (nothing measurable beyond the wire), 0 and the other two alone
        scan_call, message, hop = _weighted_fit(xs, ys) if len({x[2] for x in xs}) > 1 else (0.0, 0.0, -1.0)
        if hop < 0:
            (scan_call, message), hop = _weighted_fit([x[:2] for x in xs], ys), 0.0
        if message < 0:  # no per-block cost measurable (peer memory: blocks are tiles of one kernel)
            cols = [0, 2] if hop > 0 else [0]
            fitted = _weighted_fit([[x[c] for c in cols] for x in xs], ys)
            scan_call, message, hop = fitted[0], 0.0, (fitted[1] if hop > 0 else 0.0)
        fit = dict(scan_call=scan_call, message=message, hop=hop)
        fit["gather_call"] = fit_constant(gather, lambda r: sum(gather_time(_scan_workload(r), cluster,
                                                                             replace(sw, **fit))))
        scan_fits[version] = fit
        scans += [(r, w, K, version) for r, w, K in chain]
        gathers += [(r, version) for r in gather]
    if SCAN_CODE[build] not in scan_fits:
        raise ValueError(f"calibration needs 'scan' rows (all_scan K=*, gather_scan) of build {build!r}'s scan code")
    sw = replace(sw, **scan_fits[SCAN_CODE[build]])

    def built(r):  # the Software a row was measured with: shared costs, its build's passes and scan code
        if r["build"] not in passes:
            raise ValueError(f"{r['file']}: no 'kernel' rows of build {r['build']!r} to charge its passes")
        if SCAN_CODE[r["build"]] not in scan_fits:
            raise ValueError(f"{r['file']}: no 'scan' rows of scan code {SCAN_CODE[r['build']]!r} (build {r['build']!r})")
        return replace(sw, **passes[r["build"]], **scan_fits[SCAN_CODE[r["build"]]])

    ring = lambda r: (r["cp"] - 1) * cluster.slowest(r["cp"]).time(r["state_mib"] * 2 ** 20)
    nccl_gathers = _pooled(by(part="scan", method="nccl all_gather"))
    nccl_call = fit_constant(nccl_gathers, ring)
    a2a = [r for r in by(part="op", strategy="a2a") if r["cp"] > 1]
    if a2a:
        # copies (the same at every P) and the wire ((P - 1) / P of the bytes cross links): both fitted
        # where rows at two or more P allow it, else the wire at the stated bandwidth.
        xs = [[_workload(r, 0.0).a2a_bytes, _a2a_wire(_workload(r, 0.0), cluster)] for r in a2a]
        ys = [(r["ms"] - t_op(r)) * 1e-3 for r in a2a]
        fit = _weighted_fit(xs, ys) if len({r["cp"] for r in a2a}) > 1 else None
        if fit is None or min(fit) <= 0:
            fit = _weighted_fit([x[:1] for x in xs], [y - x[1] for x, y in zip(xs, ys)])[0], 1.0
        copy, wire = fit
        sw = replace(sw, a2a_copy=copy, a2a_wire=wire)

    res = [Residual(f"kernel {name} ({build}) T={r['tokens_per_gpu']}", r["ms"],
                    per_byte * getattr(_workload(r, 0.0), unit) * 1e3, True)
           for (build, name), (rs, per_byte, unit) in kernels.items() for r in rs]
    res += [Residual(f"scan P={w.P} {r['state_mib']:g} MiB all_scan K={K} (code {v})", r["ms"],
                     chain_time(w, cluster, replace(sw, **scan_fits[v]), K) * 1e3, True) for r, w, K, v in scans]
    res += [Residual(f"scan P={r['cp']} {r['state_mib']:g} MiB gather_scan (code {v})", r["ms"],
                     sum(gather_time(_scan_workload(r), cluster, replace(sw, **scan_fits[v]))) * 1e3, True)
            for r, v in gathers]
    res += [Residual(f"scan P={r['cp']} {r['state_mib']:g} MiB nccl all_gather", r["ms"], (nccl_call + ring(r)) * 1e3,
                     True) for r in nccl_gathers]
    # one hop: NCCL's call (as its all-gathers cost) + one message
    res += [Residual(f"scan P={r['cp']} {r['state_mib']:g} MiB nccl send/recv hop", r["ms"],
                     (nccl_call + cluster.intra.time(r["state_mib"] * 2 ** 20)) * 1e3, False)
            for r in _pooled(by(part="scan", method="nccl send/recv hop"))]
    # One point per configuration and build: the mean of its runs (files), each modelled from its own
    # run's one-GPU time, as the same configuration measured in separate runs differs by up to ~17%.
    # The build only changes the scan strategies (zeco, lasp2): lasp1's and a2a's runs pool across builds.
    runs: dict[tuple, list[dict]] = {}
    for r in by(part="op"):
        if r["strategy"] in STRATEGIES[1:]:
            build = r["build"] if r["strategy"] in ("zeco", "lasp2") else "any build"
            runs.setdefault((r["strategy"], r["cp"], _workload(r, 0.0).layout, build, *_shape(r)), []).append(r)
    for (strategy, P, layout, build, T, *_), rs in runs.items():
        n = len(rs)
        res.append(Residual(f"op {strategy} CP={P} {layout} T={T} ({build})" + (f" (mean of {n} runs)" if n > 1 else ""),
                            sum(x["ms"] for x in rs) / n,
                            sum(layer_time(strategy, _workload(x, t_op(x)), cluster, built(x)) for x in rs) / n * 1e3,
                            strategy == "a2a"))

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
                raise ValueError(f"{r['file']}: model row at CP={r['cp']} has no CP=1 row of the same shape in its file")
            model = r["layers"] * (per_file[key] + layer_time(r["strategy"], _workload(r, t_op(r)), cluster, built(r)) * 1e3)
            res.append(Residual(f"model {r['strategy']} CP={r['cp']} {_workload(r, 0.0).layout} "
                                f"T={r['tokens_per_gpu']} L={r['layers']} ({r['build']})", _model_ms(r), model, False))
    builds = {b: replace(sw, **p, **scan_fits.get(SCAN_CODE[b], {})) for b, p in passes.items()}
    return Calibration(sw, builds, nccl_call, op_ms, other_ms, res)


def _pooled(scan_rows: list[dict]) -> list[dict]:
    """One scan row per method, P and size: the mean of its runs. These micro-benchmarks are timed
    from an empty queue, so host jitter moves a point by up to 2x from run to run."""
    groups: dict[tuple, list[dict]] = {}
    for r in scan_rows:
        groups.setdefault((r["method"], r["cp"], r["state_mib"]), []).append(r)
    return [dict(rs[0], ms=sum(r["ms"] for r in rs) / len(rs), runs=len(rs)) for rs in groups.values()]


def _shape(r: dict) -> tuple[int, int, int]:
    return r["tokens_per_gpu"], r["heads"], r["dim"]


def _model_ms(r: dict) -> float:
    """ms per tokens_per_gpu tokens on one GPU, from a model row's measured tokens/s/GPU."""
    return r["tokens_per_gpu"] / r["tokens_per_s_per_gpu"] * 1e3


def default_rows() -> list[dict]:
    """Every measured row committed in ``docs/results/*.json``."""
    here = os.path.dirname(os.path.abspath(__file__))
    return load_rows(os.path.join(here, os.pardir, "docs", "results", "*.json"))
