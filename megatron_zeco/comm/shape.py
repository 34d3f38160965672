"""Which shape an All-Scan takes: the chain or the hierarchical scan, by their critical paths.

An All-Scan whose ``Route.shape`` is ``auto`` asks :func:`scan_choice` which shape has the shorter critical path for
the group's nodes. This module replays both shapes as built: the chain's hops through every piece
(:func:`chain_hops`, as ``all_scan`` walks them) and the hierarchical scan's messages step by step
(:func:`hierarchical_steps`, as ``comm.hierarchical`` sends them), and times a path of messages
(:func:`critical_path`) on stated links (:class:`Link`, :class:`Cluster`) and a per-hop cost per
transport (its ``hop_cost``, :data:`HOP_COST`; the transports: ``transport.py``). The cost model
(``megatron_zeco.cost_model``) times a whole layer with the same functions.

Standard library only: the choice needs no result files, and this file loads without torch.
"""

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence, Tuple, Union

from .transport import TRANSPORTS


@dataclass(frozen=True)
class Link:
    """One direction of one GPU's link: a message of n bytes takes ``latency + n / bandwidth``."""

    latency: float  # s
    bandwidth: float  # B/s

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


# Stated link figures (docs/scaling.md, "What each transport's numbers rest on"):
NVLINK = Link(latency=1e-6, bandwidth=268e9)  # bandwidth: what NCCL's all-to-all reached on 2 H200
INFINIBAND = Link(latency=5e-6, bandwidth=50e9)  # NDR 400 Gb/s, one NIC per GPU


@dataclass(frozen=True)
class Cluster:
    """Ranks placed node-major: rank r on node r // gpus_per_node (the last node may hold fewer)."""

    intra: Link = NVLINK
    inter: Link = INFINIBAND
    gpus_per_node: int = 8

    def link(self, a: int, b: int) -> Link:
        return self.intra if a // self.gpus_per_node == b // self.gpus_per_node else self.inter

    def slowest(self, P: int) -> Link:
        return self.inter if P > self.gpus_per_node else self.intra


# Per-hop cost beyond the wire, by transport (its ``hop_cost``), for the choice at run time.
HOP_COST = {name: transport.hop_cost for name, transport in TRANSPORTS.items()}

Nodes = Union[int, Sequence[int]]


def walk_ranks(P: int, layout: str) -> list[int]:
    """The rank holding each piece, in scan order (``comm.Layout``): contiguous 0..P-1; zigzag up
    the ranks and back down."""
    if layout == "contiguous":
        return list(range(P))
    if layout == "zigzag":
        return list(range(P)) + list(range(P - 1, -1, -1))
    raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")


def _node_of(nodes: Nodes) -> Callable[[int], int]:
    """Rank -> node: ``nodes`` is a node size (consecutive ranks) or each rank's node."""
    if isinstance(nodes, int):
        return lambda r: r // nodes
    return lambda r: nodes[r]


def chain_hops(P: int, layout: str, nodes: Nodes, two_legs: bool = False) -> Tuple[int, int, int]:
    """(inside nodes, between nodes, same rank) hops of the chain through every piece: the
    ``_chain_hops`` of ``comm.all_scan``. ``nodes``: ranks per node (consecutive), or each rank's
    node. ``two_legs``: a zigzag walk's two legs run at once, so a rank waits for P - 1 hops (the
    contiguous walk's)."""
    node = _node_of(nodes)
    ranks = walk_ranks(P, "contiguous" if two_legs else layout)
    pairs = list(zip(ranks, ranks[1:]))
    inter = sum(node(a) != node(b) for a, b in pairs)
    same = sum(a == b for a, b in pairs)
    return len(pairs) - inter - same, inter, same


@functools.lru_cache(maxsize=256)
def hierarchical_steps(P: int, layout: str, nodes: Nodes, reverse: bool = False, tree: bool = False) -> tuple:
    """The messages of ``comm.hierarchical.hierarchical_scan`` over P ranks, step by step as every
    rank issues them (``nodes``: ranks per node, consecutive, or a tuple of each rank's node): a
    tuple of steps, each a tuple of ``(source rank, destination rank, what, phase)``, what =
    ``"map"`` (a state and its decays) or ``"state"``, phase ``"A"`` (along each node's run of
    pieces), ``"B"`` (between runs) or ``"C"`` (the state into each run). ``tree``: as
    ``comm.peer_hierarchical`` sends them over the device transports, where B and C go in lanes
    (:func:`lanes`): the leader hands each of its run's other lane ranks its lane's part of the map (phase
    B's first step, inside the node, one launch), each lane runs the rounds between its ranks, and each lane's
    part of the state leaving a run goes to the rank of the next run that takes it (:func:`takers`), which
    passes it to the run's other ranks (an all-gather in one step); a lane's message is ``what`` + ``/L``
    (``"map/8"``: the states of one lane of 8, :func:`message_share`)."""
    node = _node_of(nodes)
    ranks = walk_ranks(P, layout)
    if reverse:
        ranks = ranks[::-1]
    segments: list[list[int]] = []
    for i, r in enumerate(ranks):  # as comm.hierarchical.Walk cuts them: one node, each rank once
        if i == 0 or node(r) != node(ranks[i - 1]) or any(ranks[k] == r for k in segments[-1]):
            segments.append([])
        segments[-1].append(i)
    steps = []
    longest = max(len(s) for s in segments)
    for t in range(longest - 1):  # A: prefix maps along each run
        steps.append(tuple((ranks[s[t]], ranks[s[t + 1]], "map", "A") for s in segments
                           if t + 1 < len(s) and ranks[s[t]] != ranks[s[t + 1]]))
    M = len(segments)
    holders = [list(dict.fromkeys(ranks[i] for i in segments[j])) for j in range(M)]  # first rank first
    lane = lanes(holders) if tree else [[ranks[s[-1]]] for s in segments]
    L = len(lane[0])
    part = (lambda what: what) if L == 1 else (lambda what: f"{what}/{L}")  # noqa: E731
    first = [ranks[s[0]] for s in segments]
    if L > 1:  # the leader hands each lane its part of the map
        steps.append(tuple((lane[j][0], lane[j][g], part("map"), "B") for g in range(1, L) for j in range(M - 1)))
    for r in range(math.ceil(math.log2(M - 1)) if M > 2 else 0):  # B: Kogge-Stone of all runs' maps but the last
        d = 1 << r
        steps.append(tuple((lane[j][g], lane[j + d][g], part("map"), "B") for g in range(L) for j in range(M - 1 - d)
                           if lane[j][g] != lane[j + d][g]))
    if tree:  # C: each lane's part to the rank of the next run that takes it, then to the run's others
        taker = takers(holders, lane)
        steps.append(tuple((lane[j][g], taker[j][g], part("state"), "C") for j in range(M - 1) for g in range(L)
                           if lane[j][g] != taker[j][g]))
        steps.append(tuple((taker[j][g], other, part("state"), "C") for j in range(M - 1) for g in range(L)
                           for other in holders[j + 1] if other != taker[j][g]))
        return tuple(step for step in steps if step)
    steps.append(tuple((lane[j][0], first[j + 1], "state", "C") for j in range(M - 1) if lane[j][0] != first[j + 1]))
    steps.append(tuple((first[j], other, "state", "C") for j in range(1, M)
                       for other in sorted({ranks[i] for i in segments[j]} - {first[j]})))
    return tuple(step for step in steps if step)


def lanes(holders: Sequence[Sequence[int]]) -> list:
    """Each segment's lanes over the device transports: ``holders`` each segment's distinct ranks in walk
    order (its leader, the rank of its last piece, last). A segment's map composes state by state, so its
    states can go through B and C in L parts, each on ranks of its own: lane g of a segment is its leader
    (g = 0), then its other ranks in walk order; L is the fewest ranks of a segment whose map goes on (all
    but the last), so that lane g meets lane g in every segment. Lane g holds states g, g + L, ...: each
    link between nodes carries 1/L of every map, where one leader would carry it all. L = 1 (one lane, the
    leader's) where a segment has one rank, or there is one segment."""
    if len(holders) < 2:
        return [[h[-1]] for h in holders]
    L = min(len(h) for h in holders[:-1])
    return [_lane_order(h)[:L] for h in holders]


def _lane_order(holders: Sequence[int]) -> list:
    """A segment's distinct ranks (walk order) in lane order: its leader (the last), then the others."""
    return [holders[-1]] + [r for r in holders if r != holders[-1]]


def takers(holders: Sequence[Sequence[int]], lane: Sequence[Sequence[int]]) -> list:
    """``taker[j][g]``: the rank of segment j + 1 that takes lane g's part of the state leaving segment j, where
    the lanes' parts go straight into the next segment and through it in one all-gather (diagonal maps over
    the device transports): the lane's own rank where it has a piece in segment j + 1 too (a zigzag walk's
    turn: kept, no message), else that segment's lane g (its leader, then its other ranks in walk order,
    round again where it has fewer ranks than lanes). ``holders``, ``lane``: as :func:`lanes` takes and
    gives them."""
    out = []
    for j in range(len(holders) - 1):
        after = _lane_order(holders[j + 1])
        out.append([lane[j][g] if lane[j][g] in after else after[g % len(after)] for g in range(len(lane[j]))])
    return out


def message_share(what: str) -> tuple:
    """``(kind, L)`` of a message of :func:`hierarchical_steps`: ``"map"`` -> ``("map", 1)``, a lane's part
    ``"map/8"`` -> ``("map", 8)`` (the states of one lane of 8)."""
    kind, _, L = what.partition("/")
    return kind, int(L) if L else 1


def critical_path(steps, P: int, cost, per_step: float = 0.0, drain=None) -> float:
    """Seconds until the last rank has what it waits for, ``steps`` issued in order by every rank
    (:func:`hierarchical_steps`): a rank sends a step's messages once it has received the earlier
    steps' and spent ``per_step`` on each step it takes part in; a message from a to b arrives
    ``cost(a, b, what, phase)`` later. ``drain``: ``{phase: seconds}`` added to every rank when a
    phase ends (a pipeline's last blocks)."""
    clock = [0.0] * P
    for n, step in enumerate(steps):
        start = list(clock)
        for r in {r for a, b, *_ in step for r in (a, b)}:
            clock[r] = start[r] + per_step
        for a, b, what, phase in step:
            clock[b] = max(clock[b], start[a] + per_step + cost(a, b, what, phase))
        ends = n + 1 == len(steps) or steps[n + 1][0][3] != step[0][3]
        if drain and ends and drain.get(step[0][3]):
            clock = [t + drain[step[0][3]] for t in clock]
    return max(clock)


@functools.lru_cache(maxsize=256)
def scan_choice(layout: str, nodes: tuple, state_bytes: float, transport: str, cluster: Cluster = Cluster()) -> str:
    """``chain`` or ``hierarchical``: the All-Scan shape with the shorter critical path (forward and
    backward) for a group whose ranks sit on ``nodes`` (each rank's node), at :data:`HOP_COST` and the
    cluster's links; the chain where both take as long (the same hops inside and between nodes: it
    sends fewer messages). What an All-Scan of shape ``auto`` runs over send/recv
    (remembered per arguments: a layer's scans ask the same question every step)."""
    P = len(nodes)
    node = _node_of(tuple(nodes))
    if len({node(r) for r in range(P)}) == 1:  # one node: the chain (no rounds between nodes to shorten)
        return "chain"
    link = lambda a, b: cluster.intra if node(a) == node(b) else cluster.inter  # noqa: E731
    hop = HOP_COST[transport]
    intra, inter, same = chain_hops(P, layout, tuple(nodes), TRANSPORTS[transport].two_legs)
    chain = 2 * (intra * (hop + cluster.intra.time(state_bytes)) + inter * (hop + cluster.inter.time(state_bytes)))
    # (a map is a state and one more column: counted as a state here)
    device = TRANSPORTS[transport].device
    tree = sum(critical_path(hierarchical_steps(P, layout, tuple(nodes), reverse, device), P,
                             lambda a, b, what, phase: hop + link(a, b).time(state_bytes / message_share(what)[1]))
               for reverse in (False, True))  # a lane's message: its lane's part of the state
    # equal paths add the same hop times in another order: they may differ in the last bits
    return "hierarchical" if tree < chain and not math.isclose(tree, chain, rel_tol=1e-9) else "chain"


def scan_path(hops: Tuple[int, int], state_bytes: float, transport: str, cluster: Cluster = Cluster()) -> float:
    """Seconds on the critical path of ``hops`` = (inside nodes, between nodes) hops of one state."""
    intra, inter = hops
    hop = HOP_COST[transport]
    return intra * (hop + cluster.intra.time(state_bytes)) + inter * (hop + cluster.inter.time(state_bytes))


def prefer_hierarchical(chain_hops: Tuple[int, int], tree_hops: Tuple[int, int], state_bytes: float,
                        transport: str) -> bool:
    """Whether the hierarchical All-Scan (``comm/hierarchical.py``) beats the chain for these hop counts
    (inside, between nodes; e.g. ``Walk.depth()``): the coarse form of :func:`scan_choice`, which
    replays the schedule."""
    return scan_path(tree_hops, state_bytes, transport) < scan_path(chain_hops, state_bytes, transport)
