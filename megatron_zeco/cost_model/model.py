"""The time of one linear-attention layer, forward + backward, under each context-parallel strategy:
a :class:`Workload` of an :class:`Operator` on a :class:`~megatron_zeco.comm.shape.Cluster`, at the
costs of an implementation beyond the wire (:class:`Software`). The equations are summed up in the
package's docstring and set out in ``docs/scaling.md``."""

import math
from collections import Counter
from dataclasses import dataclass, replace

from ..comm.shape import TRANSPORTS, Cluster, chain_hops, critical_path, hierarchical_steps, message_share
from ..comm.transport import Transport
from ..cp.config import RULES

STRATEGIES = ("none", "zeco", "lasp2", "lasp1", "a2a")
SHAPES = ("chain", "hierarchical")
LAYOUTS = ("contiguous", "zigzag")
REGIMES = ("steady", "eager")

# Stated hardware figures (docs/scaling.md says why).
DEVICE = "H200"  # the GPU the model describes: result files measured on another are not read
HBM_BANDWIDTH = 4.8e12  # B/s, H200 HBM3e (NVIDIA spec)
FWD_FRACTION = 0.80 / 3.44  # forward share of fla chunk_gla fwd+bwd, 16K tokens, H200
ACT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FOLD_LAUNCH = {"eager": 10e-6, "steady": 4e-6}  # per folded piece: two elementwise kernels (host ~5 us, GPU ~2 us each)
CHUNK = 64  # tokens per chunk of the local op (fla's and chunk.py's)
FP32_FLOPS = 67e12  # flop/s, H200 FP32 without tensor cores (NVIDIA spec): what dense products are charged untimed


# ---------------------------------------------------------------------------------------------- operators

class Diagonal:
    """The linear part of GLA's piece map ``S -> Diag(gamma) S + E``: a K-vector per head.

    Applying and composing it are elementwise, memory-bound work inside a hop whose cost is measured
    (the fitted per-hop cost): no matrix product is charged beyond it. Blocks of the state's rows are
    independent, and a zigzag walk over device transports runs as two legs (``comm/all_scan.py``)."""

    block_dim = "k_dim"
    two_legs = True
    hop_timed = True  # the device transports' hop kernels ran with these maps (scan rows)
    tiled_rounds = True  # over the device transports a rank's steps of B and C run tile by tile in one launch

    @staticmethod
    def entries(k: int) -> int:
        """Entries of the transition per head."""
        return k

    @staticmethod
    def apply_macs(k: int, v: int) -> int:
        """Multiply-adds of matrix products applying the transition to a K x V state: none (elementwise)."""
        return 0

    @staticmethod
    def compose_macs(k: int) -> int:
        """Multiply-adds of matrix products composing two transitions: none (elementwise)."""
        return 0


class Dense:
    """The linear part of the delta rules' piece map ``S -> M S + E``: a K x K matrix per head.

    Applying it to a state block of c columns is a K x K by K x c product, composing two a K x K by
    K x K product (``comm/transition.py``); both are charged at :data:`FP32_FLOPS`, or, in the device transports'
    hop kernels where one was timed, at the measured time beyond a diagonal hop's (``Workload.dense_hop``).
    Blocks of columns are independent; a zigzag walk runs as one chain (the return leg's composed maps would
    carry K x K more per message)."""

    block_dim = "v_dim"
    two_legs = False
    hop_timed = False  # the device transports' scans ran GLA's maps only (their dense hop kernel: Workload.dense_hop)
    tiled_rounds = False  # a column tile of T_j T reads all of T_j: each round waits for the whole previous one

    @staticmethod
    def entries(k: int) -> int:
        return k * k

    @staticmethod
    def apply_macs(k: int, v: int) -> int:
        return k * k * v

    @staticmethod
    def compose_macs(k: int) -> int:
        return k ** 3


@dataclass(frozen=True)
class Operator:
    """A linear-attention operator as its context parallelism sees it: the kind of its piece maps'
    transition (:class:`Diagonal` or :class:`Dense`), from which every size and product of the scans
    follows, the gates its all-to-all moves and the strategies built for it (its entry of
    ``megatron_zeco.cp.config.RULES``). Its one-GPU op time is measured (the calibration's ``one_gpu``)."""

    name: str
    title: str
    transition: type
    key_gates: bool  # a decay per key channel ([tokens, heads, k_dim]) rather than one per head
    beta: bool  # a write strength per head and token (the delta rules')
    rules: str  # its key in megatron_zeco.cp.config.RULES

    @property
    def strategies(self) -> tuple:
        """The context-parallel strategies built for it (``none`` always)."""
        return ("none", *RULES[self.rules].strategies)

    def state_bytes(self, heads: int, k: int, v: int) -> int:
        """One fp32 state: what a chain hop carries."""
        return heads * k * v * 4

    def map_bytes(self, heads: int, k: int, v: int) -> int:
        """One fp32 map (state and transition): what the hierarchical scan and LASP-2's all-gather move."""
        return heads * (k * v + self.transition.entries(k)) * 4

    def apply_flops(self, heads: int, k: int, v: int) -> int:
        """Matrix-product flops of combining an entering state (or block of ``v`` columns) with a map."""
        return 2 * heads * self.transition.apply_macs(k, v)

    def compose_flops(self, heads: int, k: int, v: int) -> int:
        """Matrix-product flops of composing two maps, ``(T2, d2) o (T1, d1) = (T2 T1, T2 d1 + d2)``."""
        return 2 * heads * (self.transition.compose_macs(k) + self.transition.apply_macs(k, v))

    def gate_width(self, k: int) -> int:
        """Gate entries per head and token besides q, k, v: the decay (per key or per head) and beta."""
        return (k if self.key_gates else 1) + (1 if self.beta else 0)


GLA = Operator("gla", "gated linear attention", Diagonal, key_gates=True, beta=False, rules="gla")
GDN = Operator("gdn", "Gated DeltaNet's gated delta rule", Dense, key_gates=False, beta=True, rules="gated_delta_rule")
KDA = Operator("kda", "Kimi Delta Attention", Dense, key_gates=True, beta=True, rules="kda")
OPERATORS = {op.name: op for op in (GLA, GDN, KDA)}


@dataclass(frozen=True)
class Workload:
    """One layer of ``op`` on each of P GPUs: q, k [tokens, heads, k_dim], v [tokens, heads, v_dim] and
    the operator's gates."""

    P: int
    tokens: int  # per GPU
    heads: int
    k_dim: int
    v_dim: int
    op_ms: float  # measured one-GPU fwd+bwd of the local op at these tokens, heads and dims
    act_bytes: int = 2
    layout: str = "contiguous"
    other_ms: float = 0.0  # per-layer time outside GLA (model level); 0 = the operator alone
    op: Operator = GLA
    piece_share: float = 0.0  # share of op_ms a ZeCO piece's own work adds (the delta rules' correction; measured)
    # per direction (forward, backward): the share of its local op that needs no scan result (the in-chunk
    # work the device transports' hops run beside, as built), how much slower that work runs while a hop
    # spins beside it, and how many times longer a hop takes beside it than alone (measured: bench_overlap.py)
    hidden: tuple[float, float] = (0.0, 0.0)
    spin: tuple[float, float] = (0.0, 0.0)
    aside: tuple[float, float] = (1.0, 1.0)
    # seconds the device transports' dense hop kernel takes beyond a diagonal one's, combining a state with a map
    # and composing two maps (measured: bench_hop.py); () where not timed: its products at FP32_FLOPS
    dense_hop: tuple = ()

    @property
    def pieces(self) -> int:
        return 1 if self.layout == "contiguous" else 2

    @property
    def state_bytes(self) -> int:  # one fp32 state
        return self.op.state_bytes(self.heads, self.k_dim, self.v_dim)

    @property
    def map_bytes(self) -> int:  # one fp32 map (state and transition): what the hierarchical scan moves
        return self.op.map_bytes(self.heads, self.k_dim, self.v_dim)

    @property
    def block_dim(self) -> int:  # the state dim the All-Scan's blocks split
        return getattr(self, self.op.transition.block_dim)

    def apply_time(self, K: int = 1) -> float:
        """Seconds of the matrix products combining one of K blocks of the entering state with a map."""
        return self.op.apply_flops(self.heads, self.k_dim, self.v_dim) / K / FP32_FLOPS

    def compose_time(self, K: int = 1) -> float:
        """Seconds of the matrix products composing two maps (one of K blocks of their states)."""
        return self.op.compose_flops(self.heads, self.k_dim, self.v_dim) / K / FP32_FLOPS

    def hop_apply_time(self, device: bool, K: int = 1) -> float:
        """Seconds a hop's combine of one of K blocks adds to the measured per-hop cost: on a device transport
        the dense hop kernel's time beyond a diagonal one's where timed (:attr:`dense_hop`), else the
        products (:meth:`apply_time`; none for a diagonal)."""
        return self.dense_hop[0] / K if device and self.dense_hop else self.apply_time(K)

    def hop_compose_time(self, device: bool, K: int = 1) -> float:
        """:meth:`hop_apply_time` for the compose of two maps (:meth:`compose_time`)."""
        return self.dense_hop[1] / K if device and self.dense_hop else self.compose_time(K)

    @property
    def pass_bytes(self) -> int:  # read by one state pass: k, v, g (or q, g, dO)
        return self.tokens * self.heads * (2 * self.k_dim + self.v_dim) * self.act_bytes

    @property
    def chunk_state_bytes(self) -> int:  # one fp32 state per chunk: what the add_state passes update
        return math.ceil(self.tokens / CHUNK) * self.state_bytes

    @property
    def a2a_bytes(self) -> int:  # q, k, v, the gates, o and their gradients: what a2a reorders
        gates = self.op.gate_width(self.k_dim)
        return 2 * self.tokens * self.heads * (2 * self.k_dim + gates + 2 * self.v_dim) * self.act_bytes


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
    overlap: float = 0.0  # share of each direction's local op run beside the scan beyond what the build hides
    extra: float = 0.0  # share of t_op added by the output/gradient corrections (correction form)
    pass_unit: str = ""  # the Workload size the passes are charged per byte of ("pass_bytes", ...); "": none
    transport: str = Transport.SEND_RECV  # the All-Scan's transport (TRANSPORTS)


# ---------------------------------------------------------------------------------------------- scan shapes

def _chain_hops(w: Workload, c: Cluster, sw: Software) -> tuple[int, int, int]:
    """The chain's hops inside nodes, between nodes and on the same rank (two legs where both the
    transport and the operator's maps allow them)."""
    two_legs = TRANSPORTS[sw.transport].two_legs and w.op.transition.two_legs
    return chain_hops(w.P, w.layout, c.gpus_per_node, two_legs)


def chain_time(w: Workload, c: Cluster, sw: Software, K: int) -> float:
    """One pipelined chain (forward or backward) over every piece, the state in K blocks."""
    intra, inter, local = _chain_hops(w, c, sw)
    block = w.state_bytes / K
    wires = [block / link.bandwidth for n, link in ((intra, c.intra), (inter, c.inter)) if n]
    pace = max(sw.message, *wires, w.hop_apply_time(TRANSPORTS[sw.transport].device, K), 0.0)
    return sw.scan_call + sum(n * tau for n, tau in _hop_times(w, c, sw, K)) + (K - 1) * pace


def _hop_times(w: Workload, c: Cluster, sw: Software, K: int) -> list[tuple[int, float]]:
    """(number, seconds) of the chain's hops inside nodes, between nodes and on the same rank, for one
    block (the same-rank turn of a zigzag chain: a combine, no wire)."""
    intra, inter, local = _chain_hops(w, c, sw)
    block, combine = w.state_bytes / K, sw.hop + w.hop_apply_time(TRANSPORTS[sw.transport].device, K)
    taus = [(intra, combine + c.intra.time(block)), (inter, combine + c.inter.time(block)), (local, combine)]
    return [(n, tau) for n, tau in taus if n]


def _hierarchical_costs(w: Workload, c: Cluster, sw: Software, K: int, reverse: bool):
    """The hierarchical scan's steps, the cost of one of its hops and the pipeline's drain per phase
    (:func:`critical_path`'s inputs); over send/recv every message carries all blocks (K = 1). Phase A's
    chains are pipelined in K blocks; so are B and C where their runs of steps go tile by tile in one launch
    per rank (diagonal maps over the device transports: ``comm/peer_hierarchical.py``'s ``rounds``), the
    pipeline drained once, at the end of C; else each of their steps waits for the whole previous message:
    dense maps (a round's compose reads the whole map received, a launch of its own; their steps that only pass a
    map on go in one launch too, counted as whole messages here), and a zigzag walk, which passes every rank
    twice, so that a rank's steps of its two runs interleave in its issue order, a launch each."""
    device = TRANSPORTS[sw.transport].device
    if TRANSPORTS[sw.transport].block_messages:
        K = 1
    steps = _sharing(hierarchical_steps(w.P, w.layout, c.gpus_per_node, reverse, device), c)
    tiled = device and w.op.transition.tiled_rounds and w.layout == "contiguous"
    piped = {"A", "B", "C"} if tiled else {"A"}

    def share(what):  # the part of a map or state a message carries: a lane's states (comm.shape.lanes)
        kind, lanes = message_share(what[0])
        return kind, math.ceil(w.heads / lanes) / w.heads

    def cost(a, b, what, phase):
        kind, part = share(what)
        nbytes, combine = ((w.map_bytes, w.hop_compose_time(device)) if kind == "map"
                           else (w.state_bytes, w.hop_apply_time(device)))
        blocks = K if phase in piped else 1
        # the last of the sender's messages of this step over this link arrives once all of them have left
        return sw.hop + part * combine / blocks + c.link(a, b).time(what[1] * part * nbytes / blocks)

    drain = {"A": (K - 1) * max(sw.message, w.map_bytes / K / c.intra.bandwidth, w.hop_compose_time(device, K))}
    if "C" in piped:
        # B and C tile by tile in one launch: a rank's rounds, its send into the next node and the all-gather
        # inside it run at once, so the pipeline's pace is that of the busiest link (a GPU's link between
        # nodes, or its NVLink), every tile of its messages through it (and its composes, and its messages'
        # costs, one after another), sending or receiving
        load = Counter()
        for step in steps:
            for a, b, what, phase in step:
                if phase in ("B", "C") and a != b:
                    part, link = share(what)[1], c.link(a, b)
                    tile = max(sw.message, part * w.map_bytes / K / link.bandwidth,
                               part * w.hop_compose_time(device, K))
                    for end in ((a, "out", link), (b, "in", link)):
                        load[end] += tile
        # a whole map's tile
        one = max(sw.message, w.map_bytes / K / c.inter.bandwidth, w.hop_compose_time(device, K))
        drain["C"] = (K - 1) * max(load.values(), default=one)
    return steps, cost, drain


def _sharing(steps: tuple, c: Cluster) -> tuple:
    """``steps`` with each message's ``what`` made ``(what, n)``: n the messages its sender sends in that step
    over the same link (inside its node, or between nodes), which leave through it together."""
    out = []
    for step in steps:
        n = Counter((a, c.link(a, b)) for a, b, *_ in step)
        out.append(tuple((a, b, (what, n[a, c.link(a, b)]), phase) for a, b, what, phase in step))
    return tuple(out)


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
    """(communication, fold) of LASP-2's all-gather scan: every piece's map (state | transition) to all."""
    nbytes = w.pieces * w.map_bytes
    comm = sw.gather_call + (w.P - 1) * c.slowest(w.P).time(nbytes)
    fold = w.pieces * w.P * (sw.fold_launch + 3 * w.map_bytes / HBM_BANDWIDTH + w.apply_time())
    return comm, fold


def _a2a_wire(w: Workload, c: Cluster) -> float:
    """Four all-to-alls (q,k,v,g | o | dO | dq,dk,dv,dg); on- and off-node parts run together."""
    on_node = min(w.P, c.gpus_per_node)
    return 4 * c.slowest(w.P).latency + max((on_node - 1) / w.P * w.a2a_bytes / c.intra.bandwidth,
                                            (w.P - on_node) / w.P * w.a2a_bytes / c.inter.bandwidth)


def layer_time(strategy: str, w: Workload, c: Cluster, sw: Software, K: int = 1, shape: str = "chain") -> float:
    """Seconds of one layer of ``w.op``, fwd + bwd, under ``strategy`` (zeco: an All-Scan of ``shape``
    in K blocks over ``sw.transport``)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if w.block_dim % K:
        raise ValueError(f"K (All-Scan blocks, {K}) must divide {w.op.transition.block_dim} ({w.block_dim})")
    if w.layout not in LAYOUTS:
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {w.layout!r}")
    t_op = w.op_ms * 1e-3
    if strategy == "none" or w.P == 1:
        return t_op
    if strategy == "lasp1":  # its ring passes whole states over send/recv
        return w.P * t_op + 2 * chain_time(w, c, replace(sw, transport=Transport.SEND_RECV), 1)
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
    # as built, the device transports' hops run beside the in-chunk work (``w.hidden``) where the operator's
    # rules turn the overlap on (``Rules.auto_overlap``), slowing it while they spin (``w.spin``);
    # ``sw.overlap`` asks for a larger share
    built = strategy == "zeco" and TRANSPORTS[sw.transport].device and RULES[w.op.rules].auto_overlap
    exposed = 0.0
    # the scan advances 1 / aside as fast beside that work as alone
    for (scan, after), t, hidden, spin, aside in zip(comm, windows, w.hidden, w.spin, w.aside):
        covered = max(sw.overlap * t, hidden * t / aside if built else 0.0)
        slowed = spin * min(scan * aside, hidden * t) if built else 0.0
        exposed += max(0.0, scan - covered) + after + slowed
    return t_op * (1 + sw.extra + w.piece_share) + passes + exposed


def blocks(w: Workload) -> list[int]:
    """The All-Scan block counts a layer can take: the divisors of the state dim its blocks split
    (the key dim for diagonal maps, the value dim for dense ones)."""
    return [K for K in range(1, w.block_dim + 1) if w.block_dim % K == 0]


def best_blocks(w: Workload, c: Cluster, sw: Software, shape: str = "chain") -> tuple[int, float]:
    """(K, seconds): the All-Scan block count with the fastest zeco layer (the fewest where K does not matter)."""
    times = {K: layer_time("zeco", w, c, sw, K, shape) for K in blocks(w)}
    K = min(times, key=lambda k: (times[k] * (1 + 1e-12), k))
    return K, times[K]


def efficiency(strategy: str, w: Workload, c: Cluster, sw: Software, shape: str = "chain") -> float:
    """``t(none) / t(strategy)`` at the same tokens per GPU (zeco at its best K), ``w.other_ms`` added to both."""
    t = best_blocks(w, c, sw, shape)[1] if strategy == "zeco" else layer_time(strategy, w, c, sw)
    return (w.op_ms * 1e-3 + w.other_ms * 1e-3) / (t + w.other_ms * 1e-3)
