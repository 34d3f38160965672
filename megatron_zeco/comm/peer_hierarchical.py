"""The hierarchical All-Scan over the device transports: its messages are hop kernels, not NCCL calls.

The shape is ``hierarchical.py``'s (read it first): the walk cut into segments, one per node's run of
pieces; A, a chain of prefix maps inside each segment; B, a Kogge-Stone scan of the segments' maps among
their leaders in ceil(log2(M - 1)) rounds; C, the state leaving each segment into the next one. Over
send/recv every step is a host-issued NCCL call, whose cost lands on the critical path at every step;
here every message is a launch of the chain's hop kernels (``kernels/scan_hop.py``), ordered on the
stream, its tiles moved by stores into the peer's memory or by NVSHMEM puts, with the chain's flags,
acknowledgements, call counters and bounded waits (``peer.py``):

* **A** is the chain of ``peer.py`` over each segment's pieces, of *augmented* states ``[S | T]`` (the
  state and the transition's columns, ``Kind.pack``): a piece's hop with delta ``[d | 0]`` maps
  ``[S | T]`` to ``[t S + d | t T]``, the piece composed after the prefix. Segment 0 starts from
  ``[init | I]``, the others from ``[0 | I]``; each piece keeps the prefix entering it, the segment's
  leader the map leaving it.
* **B**: in round r the leader of segment j passes its map on, unchanged, to the leader of segment
  j + 2^r (a pass-through hop), and composes the one from j - 2^r into its own: a hop whose piece is its
  own map ``(T_j, E_j)``, applied to the map received, ``[E_j | 0] + T_j [E | T]``.
* **C**: the state leaving segment j (its leader's map, whose state it is) goes into segment j + 1 and to
  every rank of it; each piece's entering state is then ``T_i X + S_i`` from its prefix (one local product):
  each lane's part to the rank of segment j + 1 that takes it (``comm.shape.takers``), which passes it to the
  segment's other ranks, all in one launch a rank (an all-gather in one step).
* **Lanes** (``comm.shape.lanes``): a map composes state by state (a head, or a document's head), so B and
  C run in L lanes, L the fewest ranks of a segment whose map goes on. After A the leader hands lane g
  (g = 1 .. L - 1: the segment's other ranks) its states g, g + L, ... of the map, inside the node; lane g
  of every segment then runs B's rounds among themselves and sends its part of C into the next segment (a
  region there takes every lane's tiles). Between nodes each GPU's link then carries 1/L of
  every map where the leader's would carry all of them, one per round and C's. A lane holding no state
  (fewer states than lanes) launches nothing, on both sides.

A map a rank makes and sends on (the prefix hop ending a segment, a round's compose) leaves from the launch
that makes it, tile by tile (``_fused``): a launch fewer per message, and the next rank's wait starts as
the first tile is made. A rank's run of steps passing one map on is one launch (``_rounds``): the leader's
lanes handed out (and, diagonal maps, its rounds of B), C's parts taken in and passed on.

Every pair of ranks that meet in a step has a region of its own on both sides, per direction, phase,
round or step and local slot (``_Channel``), so the chain's protocol holds unchanged: each region is
written by one peer and read by one, once per call, and its call counters agree with the peer's. In each
step a rank issues its sends before its receives (a send waits only for the acknowledgement of the previous
call), so no send queues behind a receive that waits for it, on any rank. Exact: the compositions of
``hierarchical.py`` (rounding aside).
"""

import contextlib
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..kernels import dense_precision
from . import inject
from .failures import naming_failures
from .hierarchical import Walk
from .nodes import group_nodes
from .peer import ASIDE_PROGRAMS, capacity, describe_launch, region_bytes, tiles_per_state
from .shape import lanes as shape_lanes
from .shape import takers as shape_takers
from .symmetric import PeerBuffers
from .transition import Dense, Diagonal, Kind, transition_of
from .transport import Transport
from .watch import watch

Tensor = torch.Tensor

# The regions of one direction, per local slot: phase A's chain; a lane's part of its segment's map, received
# and sent (one region for all the leader's lanes: their tiles are apart); per round of B, the maps received and
# sent; C's state into the next segment, received and sent; inside a segment, the all-gather's parts received (one
# region: their tiles are apart) and sent, a region per other rank of the segment. (Role, index) -> position: _roles.
_SEND, _RECEIVE = "send", "receive"


class _Hop(NamedTuple):
    """One launch of a rank's part of the scan, or a step it does alone.

    ``kind``: ``prefix`` (phase A: the pieces at walk indices ``at``, one or two in a row on this rank),
    ``send`` (a map passed on unchanged), ``lane`` (a lane's part of segment ``segment``'s map, from its
    leader), ``compose`` (a map received and composed into the map of segment
    ``segment``), ``receive`` (the map whose state enters segment ``segment``); with no peer, ``keep`` and
    ``fold`` (B between two segments this rank leads) and ``carry`` (C into a segment this rank starts).
    ``regions``: ``(here, sent, src, dst)`` addresses (0 where unused); ``peers``: the group ranks it may
    wait for (whose data it receives, whose acknowledgement it needs), None where none; ``label``: what it
    moves, for errors; ``what``: what a send passes on (``map``: the segment's map, ``entering``: the map
    whose state enters the segment); ``carries``: the phase of what it sends (``A``, ``B``, ``C``)."""

    kind: str
    segment: int
    at: Tuple[int, ...]
    regions: Tuple[int, int, int, int]
    peers: Tuple[Optional[int], Optional[int]]
    label: str
    what: str = "map"
    carries: str = ""
    steps: Tuple["_Hop", ...] = ()  # ``rounds``: the launches it stands for, in order
    lane: Optional[Tuple[int, int]] = None  # ``(g, L)``: only lane g's states (of L lanes); None: every state

    @property
    def waits(self) -> bool:
        return self.peers[0] is not None


def messages(plan: Sequence[_Hop]) -> List[_Hop]:
    """``plan``'s launches with each ``rounds`` launch replaced by the steps it stands for: every message a
    rank sends and receives, in its issue order."""
    return [step for hop in plan for step in (hop.steps or (hop,))]


def _roles(rounds: int, peers: int) -> List[Tuple[str, int]]:
    return ([("A", 0)] + [(f"lane {way}", 0) for way in (_RECEIVE, _SEND)]
            + [(f"B {way}", r) for r in range(rounds) for way in (_RECEIVE, _SEND)]
            + [(f"C {way}", 0) for way in (_RECEIVE, _SEND)]
            + ([(f"gather {_RECEIVE}", 0)] if peers else [])
            + [(f"gather {_SEND}", k) for k in range(peers)])


class _Segments:
    """What a rank's plan reads off the walk: the ranks and slots of each segment."""

    def __init__(self, walk: Walk):
        self.walk = walk
        self.M = len(walk.segments)

    def slot(self, i: int) -> int:
        return self.walk.owners[i][1]

    def ranks(self, j: int) -> List[int]:
        """The distinct ranks of segment j in walk order (its first piece's rank first)."""
        out: List[int] = []
        for i in self.walk.segments[j]:
            if self.walk.rank(i) not in out:
                out.append(self.walk.rank(i))
        return out

    def slot_of(self, j: int, rank: int) -> int:
        """The slot of ``rank``'s first piece in segment j."""
        return self.slot(next(i for i in self.walk.segments[j] if self.walk.rank(i) == rank))


def _plan(walk: Walk, me: int, region: Callable[[Optional[int], str, int, int], int],
          dense: bool = False) -> List[_Hop]:
    """Rank ``me``'s launches in issue order; ``region(rank, role, index, slot)``: the address of a region
    (0 for no rank); ``dense``: dense maps, whose composes are launches of their own (:func:`_rounds`)."""
    seg = _Segments(walk)
    M = seg.M
    hops: List[_Hop] = []
    # A: the chain of prefix maps along each segment (two pieces of this rank in a row: one launch)
    for j, indices in enumerate(walk.segments):
        groups: List[List[int]] = []
        for i in indices:
            if groups and walk.rank(groups[-1][-1]) == walk.rank(i):
                groups[-1].append(i)
            else:
                groups.append([i])
        for g, group in enumerate(groups):
            if walk.rank(group[0]) != me:
                continue
            a, b = group[0], group[-1]
            src = walk.rank(a - 1) if g > 0 else None
            dst = walk.rank(b + 1) if g + 1 < len(groups) else None
            if j > 0 and j == M - 1 and len(indices) == 1:
                # the last segment's one piece: it enters with C's state as it is (a prefix of the identity)
                # and its map goes nowhere: nothing to launch
                continue
            hops.append(_Hop("prefix", j, tuple(group),
                             (region(me, "A", 0, seg.slot(a)), region(me, "A", 0, seg.slot(b)),
                              region(src, "A", 0, seg.slot(a - 1)) if src is not None else 0,
                              region(dst, "A", 0, seg.slot(b + 1)) if dst is not None else 0),
                             (src, dst), f"the prefix map entering piece step {a}", carries="A"))
    # B: Kogge-Stone over the maps of the segments but the last, in lanes (comm.shape.lanes): the leader
    # hands lane g of its segment its part of the map, then lane g's ranks run the rounds among themselves
    # (a map between two segments one rank holds the lane of stays here: ``keep``, then ``fold``)
    lanes = shape_lanes([seg.ranks(j) for j in range(M)])
    L = len(lanes[0])
    part = (lambda g: None) if L == 1 else (lambda g: (g, L))  # noqa: E731
    none = (0, 0, 0, 0)
    for way in (_SEND, _RECEIVE):
        for j in range(M - 1):
            leader = lanes[j][0]
            for g in range(1, L):
                to, label = lanes[j][g], f"lane {g}'s part of segment {j}'s map, from its leader"
                here = region(leader, f"lane {_SEND}", 0, seg.slot_of(j, leader))
                into = region(to, f"lane {_RECEIVE}", 0, seg.slot_of(j, to))
                if way == _SEND and leader == me:
                    hops.append(_Hop("send", j, (), (here, here, 0, into), (None, to), label, carries="B",
                                     lane=part(g)))
                elif way == _RECEIVE and to == me:
                    hops.append(_Hop("lane", j, (), (into, 0, here, 0), (leader, None), label, lane=part(g)))
    for r in range(walk.rounds):
        d = 1 << r
        for g in range(L):
            for j in range(M - 1 - d):
                if lanes[j][g] != me:
                    continue
                to = lanes[j + d][g]
                label = f"segment {j}'s map to segment {j + d}'s lane {g} (round {r})" if L > 1 else \
                    f"segment {j}'s map to segment {j + d}'s leader (round {r})"
                if to == me:
                    hops.append(_Hop("keep", j, (j + d,), none, (None, None), label, lane=part(g)))
                    continue
                here = region(me, f"B {_SEND}", r, seg.slot_of(j, me))
                into = region(to, f"B {_RECEIVE}", r, seg.slot_of(j + d, to))
                hops.append(_Hop("send", j, (), (here, here, 0, into), (None, to), label, carries="B", lane=part(g)))
        for g in range(L):
            for j in range(d, M - 1):
                if lanes[j][g] != me:
                    continue
                frm = lanes[j - d][g]
                label = f"segment {j - d}'s map into segment {j}'s (round {r}{f', lane {g}' if L > 1 else ''})"
                if frm == me:
                    hops.append(_Hop("fold", j, (), none, (None, None), label, lane=part(g)))
                    continue
                here = region(me, f"B {_RECEIVE}", r, seg.slot_of(j, me))
                out = region(frm, f"B {_SEND}", r, seg.slot_of(j - d, frm))
                hops.append(_Hop("compose", j, (), (here, 0, out, 0), (frm, None), label, lane=part(g)))
    # C in one launch a rank: lanes into the next segment, then an all-gather inside it
    hops.extend(_gathered(walk, seg, lanes, me, region))
    return _rounds(_fused(hops, walk), composes=not dense)


def _gathered(walk: Walk, seg: "_Segments", lanes: List[List[int]], me: int,
              region: Callable[[Optional[int], str, int, int], int]) -> List[_Hop]:
    """Rank ``me``'s hops of phase C, each rank's run of steps one launch (:func:`_rounds`): lane g's part
    of the state leaving segment j goes to the rank of segment j + 1 that takes it (``comm.shape.takers``; kept
    where that is the lane's own rank), which passes it to each other rank of that segment (an all-gather:
    every rank receives the parts it does not take, each from its taker). A rank issues its sends of C, then
    per segment it has pieces in (in walk order) its receipts of the parts it takes, its sends of them and its
    receipts of the others: one launch, each step moving its lane's tiles only."""
    hops: List[_Hop] = []
    M, L = seg.M, len(lanes[0])
    part = (lambda g: None) if L == 1 else (lambda g: (g, L))  # noqa: E731
    taker = shape_takers([seg.ranks(j) for j in range(M)], lanes)
    none = (0, 0, 0, 0)
    lane = lambda g: f" (lane {g})" if L > 1 else ""  # noqa: E731
    for j in range(M - 1):
        for g in range(L):
            src, to = lanes[j][g], taker[j][g]
            if src != me:
                continue
            label = f"the state entering segment {j + 1}{lane(g)}"
            if to == me:
                hops.append(_Hop("carry", j, (), none, (None, None), label, lane=part(g)))
                continue
            out = region(me, f"C {_SEND}", 0, seg.slot_of(j, me))
            into = region(to, f"C {_RECEIVE}", 0, seg.slot_of(j + 1, to))
            hops.append(_Hop("send", j, (), (out, out, 0, into), (None, to), label, carries="C", lane=part(g)))
    for j in range(1, M):
        ranks = seg.ranks(j)
        if me not in ranks:
            continue
        here = region(me, f"gather {_RECEIVE}", 0, seg.slot_of(j, me))
        mine = [g for g in range(L) if taker[j - 1][g] == me]
        for g in mine:
            src = lanes[j - 1][g]
            if src != me:
                out = region(src, f"C {_SEND}", 0, seg.slot_of(j - 1, src))
                hops.append(_Hop("receive", j, (), (region(me, f"C {_RECEIVE}", 0, seg.slot_of(j, me)), 0, out, 0),
                                 (src, None), f"the state entering segment {j}{lane(g)}", lane=part(g)))
        for g in mine:
            for k, other in enumerate(ranks):
                if other == me:
                    continue
                sent = region(me, f"gather {_SEND}", k, seg.slot_of(j, me))
                into = region(other, f"gather {_RECEIVE}", 0, seg.slot_of(j, other))
                hops.append(_Hop("send", j, (), (sent, sent, 0, into), (None, other),
                                 f"the state entering segment {j} (inside its node){lane(g)}", "entering", "C",
                                 lane=part(g)))
        for g in range(L):
            src = taker[j - 1][g]
            if src == me:
                continue
            sent = region(src, f"gather {_SEND}", ranks.index(me), seg.slot_of(j, src))
            hops.append(_Hop("receive", j, (), (here, 0, sent, 0), (src, None),
                             f"the state entering segment {j} (inside its node){lane(g)}", lane=part(g)))
    return hops


def _fused(hops: List[_Hop], walk: Walk) -> List[_Hop]:
    """``hops`` with each send of a segment's map (B, and C's into the next segment) made by the launch that
    made that map on this rank (the prefix hop ending the segment, the round's compose, or the receive of a
    lane's part from the leader), where that launch sends nothing else and moves the same states (lane):
    one launch fewer, and the map leaves tile by tile as it is made. The send
    then goes out earlier in the rank's issue order, never later, and every launch still waits only for what
    launches of earlier steps send, so no wait closes a cycle."""
    out: List[_Hop] = []
    maker: Dict[int, Optional[int]] = {}  # segment -> position in out of the launch that made its map last
    for hop in hops:
        n = maker.get(hop.segment)
        if hop.kind == "send" and hop.what == "map" and n is not None and out[n].regions[3] == 0 \
                and out[n].lane == hop.lane:
            here, _, src, _ = out[n].regions
            out[n] = out[n]._replace(regions=(here, hop.regions[1], src, hop.regions[3]),
                                     peers=(out[n].peers[0], hop.peers[1]), carries=hop.carries,
                                     label=f"{out[n].label}; then {hop.label}")
            continue
        out.append(hop)
        if hop.kind in ("compose", "lane") or (hop.kind == "prefix" and hop.at[-1] == walk.segments[hop.segment][-1]):
            maker[hop.segment] = len(out) - 1
        elif hop.kind == "fold":  # made by a local product: sent by a launch of its own
            maker[hop.segment] = None
    return out


def _rounds(hops: List[_Hop], composes: bool = True) -> List[_Hop]:
    """``hops`` with each run of two or more launches in a row that pass on one map, one ``rounds`` launch
    (``kernels.scan_hop.all_scan_rounds``): a leader's B (its lanes handed out, its composes and sends of its
    segment's map; ``composes`` False, dense maps: its sends only, each compose a launch of its own) and C's
    send of that map; a rank's receipts of the parts of the map whose state enters its segment and its sends
    of them on (the all-gather). Its tiles go through every step in turn, so that a tile leaves as soon as the
    same tile of the earlier steps has arrived, where launches one per step would each wait for the whole
    of the previous one. The steps keep their order, so a rank's sends still come before its receives of
    a later step; a segment whose map is kept for another (``keep``, ``fold``) breaks the run. Steps of one lane
    make a launch of that lane's states; steps of several (a leader handing its lanes their parts, then its
    own lane's rounds; the lanes' parts of a state received, then passed on whole) a launch of every state,
    each step taking its own lane's tiles only (its ``part`` in the kernel's table)."""
    def run(hop: _Hop) -> Optional[tuple]:  # the map a launch passes on, where a run may hold it
        if (hop.kind == "send" or (hop.kind == "compose" and composes)) and hop.what == "map":
            return ("map", hop.segment)
        if hop.kind == "receive" or (hop.kind == "send" and hop.what == "entering"):
            return ("entering", hop.segment)
        return None

    def joins(hop: _Hop, steps: Tuple[_Hop, ...]) -> bool:
        # a receive starts a run (what it receives is the run's map), except the lanes' parts of one state: a
        # run of steps each on its own lane's tiles (the parts this rank takes, received then passed on, and the
        # others received), or of those receives then the sends of the whole state
        if hop.kind == "receive":
            return hop.lane is not None and all(h.lane is not None for h in steps)
        return True

    out: List[_Hop] = []
    for hop in hops:
        last = out[-1] if out else None
        steps = (last.steps or (last,)) if last is not None else ()
        if last is not None and run(hop) is not None and run(hop) == run(steps[0]) and joins(hop, steps):
            steps += (hop,)
            lane = steps[0].lane if len({h.lane for h in steps}) == 1 else None
            out[-1] = _Hop("rounds", hop.segment, (), steps[0].regions,
                           (next((h.peers[0] for h in steps if h.peers[0] is not None), None),
                            next((h.peers[1] for h in steps if h.peers[1] is not None), None)),
                           "; ".join(h.label for h in steps), steps[0].what, hop.carries, steps, lane)
            continue
        out.append(hop)
    return out


class _ChannelKey(NamedTuple):
    group: object
    layout: object
    nodes: Tuple[int, ...]
    N: int
    K: int
    V: int
    dtype: torch.dtype
    num_blocks: int
    device: torch.device
    nvshmem: bool
    dense: bool


class _Channel:
    """The regions of hierarchical scans of up to N states of one shape over one group, layout and nodes, and
    each direction's plan (built once: a call only launches kernels and the local products). Every region
    is sized for a map (``[K, V + width]`` per state) in the most tiles a message takes."""

    def __init__(self, key: _ChannelKey):
        group, layout, nodes, N, K, V, dtype, num_blocks, device, nvshmem, dense = key
        kind = Dense if dense else Diagonal
        self.width = V + kind.width(K)  # every message is a map (C's: the one whose state enters a segment)
        self.tiles = _tiles(K, self.width, dense, num_blocks)
        self.data, self.flags, size = region_bytes(N, K, self.width, dtype, self.tiles, nvshmem)
        rank, world = group.rank(), group.size()
        walks = {reverse: Walk(layout, world, nodes, reverse) for reverse in (False, True)}
        rounds = max(w.rounds for w in walks.values())
        # C inside a segment: an all-gather whose sends from a rank each have a region of their own, one per other
        # rank of the segment
        peers = max((len(_Segments(w).ranks(j)) for w in walks.values() for j in range(1, len(w.segments))),
                    default=0)
        roles = {role: n for n, role in enumerate(_roles(rounds, peers))}
        buffers = PeerBuffers(group, 2 * len(roles) * 2 * size, device, nvshmem)
        self.nvshmem, self.dense = nvshmem, dense
        self._pe = [dist.get_global_rank(group, r) for r in range(world)] if nvshmem else None

        def region(reverse):
            def address(r, role, index, slot):
                if r is None:
                    return 0
                return buffers.of(r).data_ptr() + ((int(reverse) * len(roles) + roles[role, index]) * 2 + slot) * size
            return address

        self.walks = walks
        self._plans = {reverse: _plan(walks[reverse], rank, region(reverse), dense)
                       for reverse in (False, True)}
        # each rounds launch's steps (kernels.scan_hop.all_scan_rounds' table), on the device once: a graph
        # replays the address
        from ..kernels.scan_hop import lane_part

        self.tables: Dict[Tuple[bool, int], Tensor] = {
            (reverse, n): torch.tensor([(*step.regions, *self.pes(step), int(step.kind == "compose"),
                                         lane_part(step.lane if hop.lane is None else None))
                                        for step in hop.steps], dtype=torch.int64, device=device)
            for reverse, plan in self._plans.items() for n, hop in enumerate(plan) if hop.kind == "rounds"}
        self._buffers = buffers  # the plans hold raw addresses into them
        self._constants: Dict[tuple, Tensor] = {}

    def constant(self, name: str, make: Callable[[], Tensor], N: int) -> Tensor:
        """A tensor every call of N states reads and none writes (``[0 | I]``, a delta's zero columns), made
        once."""
        key = (name, N)
        if key not in self._constants:
            self._constants[key] = make()
        return self._constants[key]

    def plan(self, reverse: bool) -> List[_Hop]:
        return self._plans[reverse]

    def pes(self, hop: _Hop) -> Tuple[int, int]:
        if not self.nvshmem:
            return -1, -1
        return tuple(-1 if r is None else self._pe[r] for r in hop.peers)


def _tiles(K: int, width: int, dense: bool, num_blocks: int) -> int:
    """Tiles of a message ``[K, width]``: the chain's (``tiles_per_state``), in one block where
    ``num_blocks`` does not divide a map's columns."""
    blocks = num_blocks if (width if dense else K) % num_blocks == 0 else 1
    return tiles_per_state(K, width, dense, blocks)


_CHANNELS: Dict[_ChannelKey, _Channel] = {}


def _channel(route, nodes: Sequence[int], like: Tensor, dense: bool) -> _Channel:
    K, V = like.shape[-2:]
    N = like.numel() // (K * V)
    key = _ChannelKey(route.group, route.layout, tuple(nodes), capacity(N), K, V, like.dtype, route.num_blocks,
                      like.device, route.transport is Transport.NVSHMEM, dense)
    ch = _CHANNELS.get(key)
    if ch is None:
        with naming_failures(route.what, "setting up the hierarchical All-Scan's symmetric buffers with every "
                                         "rank of the group"):
            ch = _CHANNELS[key] = _Channel(key)
    return ch


def peer_hierarchical_scan(gamma: Sequence[Tensor], delta: Sequence[Tensor], init: Optional[Tensor], route, *,
                           reverse: bool = False, out: Optional[Sequence[Tensor]] = None,
                           while_waiting: Optional[Callable[[], None]] = None,
                           aside=None) -> Tuple[List[Tensor], Optional[Tensor]]:
    """:func:`~megatron_zeco.comm.all_scan` in the hierarchical shape over a device transport (module
    docstring): the same arguments and result as ``peer.peer_all_scan`` (the nodes: ``route.node_size``,
    else as ``comm.nodes.group_nodes`` finds them). ``while_waiting()`` is issued where the rank first waits
    for a peer; with ``aside`` every launch and local product of the scan runs on that stream, on at most
    ``ASIDE_PROGRAMS`` programs a launch, the first that waits issued before ``while_waiting()``."""
    from ..kernels import scan_hop

    like = delta[0]
    kind = transition_of(gamma[0], like)
    with naming_failures(route.what, "agreeing on which ranks of the group share a node"):
        nodes = group_nodes(route.group, route.node_size)
    ch = _channel(route, nodes, like, kind is Dense)
    inputs = list(out) if out is not None else [torch.empty_like(d) for d in delta]
    run = _Run(scan_hop, ch, kind, gamma, delta, init, route, reverse)
    plan = ch.plan(reverse)
    # As peer.py issues the chain's: the local work where the rank first waits for a peer; with a side stream
    # just after that launch, and everything after it (launches, the local products) behind the local work,
    # so that nothing waiting on the side stream holds up the local work on a shared hardware queue.
    at = next((n for n, hop in enumerate(plan) if hop.waits), len(plan))
    main = None
    if aside is not None:
        at = min(at + 1, len(plan))
        main = torch.cuda.current_stream()
        aside.wait_stream(main)
    beside = (lambda: torch.cuda.stream(aside)) if aside is not None else contextlib.nullcontext
    for n, hop in enumerate(plan):
        if n == at and while_waiting is not None:
            while_waiting()
        with beside():
            run.issue(n, hop, aside is not None)
    if at == len(plan) and while_waiting is not None:
        while_waiting()
    with beside():
        run.finish(inputs)
    if main is not None:
        main.wait_stream(aside)
    rank, slot = ch.walks[reverse].owners[-1]  # the walk's last piece: the state leaving it, on its rank
    last = kind.combine(gamma[slot], delta[slot], inputs[slot]) if rank == route.group.rank() else None
    return inputs, last


class _Run:
    """One call's tensors and launches over a channel: phase A's augmented operands, the maps of the
    segments this rank leads, the states entering the segments it has pieces in."""

    def __init__(self, scan_hop, ch: _Channel, kind: Kind, gamma, delta, init, route, reverse: bool):
        self.scan_hop, self.ch, self.kind, self.route, self.reverse = scan_hop, ch, kind, route, reverse
        like = delta[0]
        self.K, self.V = like.shape[-2:]
        self.N = like.numel() // (self.K * self.V)
        self.like, self.gamma, self.delta = like, gamma, delta
        self.prefix: Dict[int, Tensor] = {}  # slot -> the augmented state entering it (phase A's launches)
        self.init = None if init is None else init.to(like.dtype).reshape(self.N, self.K, self.V)
        self.maps: Dict[int, Tensor] = {}  # segment -> its map (composed so far), on its leader
        self.states: Dict[int, Tensor] = {}  # segment -> the map whose state enters it
        self.earlier: Dict[int, Tensor] = {}  # B: maps passed on between two segments this rank leads
        self.watcher = watch(like.device)
        self.timeout = self.watcher.timeout(route.group)
        self.watcher.check()  # a wait of an earlier scan gave up: fail before issuing more

    # -- the tensors of each kind of launch

    def _map(self) -> Tensor:
        """A new augmented state or map, ``[N, K, V + width]``."""
        return self.like.new_empty(self.N, self.K, self.ch.width)

    def _piece(self, slot: int) -> Tuple[Tensor, Tensor]:
        """Slot ``slot``'s transition and delta as phase A's launch reads them: ``[N, K(, K)]`` and ``[N, K, V]``,
        contiguous (a delta acts on the augmented state as ``[d | 0]``: the kernels read its V columns and
        the rest as zero)."""
        N, K, V = self.N, self.K, self.V
        tail = (K, K) if self.kind is Dense else (K,)
        return self.gamma[slot].reshape(N, *tail).contiguous(), self.delta[slot].reshape(N, K, V).contiguous()

    def _start(self, j: int) -> Tensor:
        """``[init | I]`` (segment 0) or ``[0 | I]``: the augmented state entering segment j."""
        N, K, V = self.N, self.K, self.V
        identity = lambda: self.kind.identity(self._piece(0)[0])  # noqa: E731
        if j == 0 and self.init is not None:
            return self.kind.pack(identity(), self.init).contiguous()
        return self.ch.constant("[0 | I]", lambda: self.kind.pack(identity(), self.like.new_zeros(N, K, V)), N)

    def _entering(self, j: int) -> Tensor:
        """The map whose state enters segment j, its lanes' parts written in as they come."""
        if j not in self.states:
            self.states[j] = self._map()
        return self.states[j]

    def _compose_local(self, later: Tensor, earlier: Tensor) -> Tensor:
        t2, e2 = self.kind.unpack(later, self.V)
        t1, e1 = self.kind.unpack(earlier, self.V)
        return self.kind.pack(self.kind.compose(t2, t1), self.kind.combine(t2, e2, e1)).contiguous()

    def issue(self, n: int, hop: _Hop, side: bool) -> None:
        """Launch ``hop`` (plan position ``n``), or do its local part where it has no peer."""
        walk, ch = self.ch.walks[self.reverse], self.ch
        if hop.kind == "prefix":
            slots = [walk.owners[i][1] for i in hop.at]
            first, last = hop.at[0], hop.at[-1]
            starts = walk.segments[hop.segment][0] == first
            ends = walk.segments[hop.segment][-1] == last
            x = self._start(hop.segment) if starts else None
            y = self._map() if ends else None
            pieces = [self._piece(s) for s in slots]
            for s in slots:
                self.prefix[s] = self._map()
            K, V = self.K, self.V
            self._launch(n, hop, side, x, ([g for g, _ in pieces], [d for _, d in pieces],
                                           [self.prefix[s] for s in slots]), y,
                         (K * K if ch.dense else K, K if ch.dense else 1, (K * V, V, V)))
            if ends:
                self.maps[hop.segment] = y
            return
        if hop.kind == "keep":  # B: a map for a later segment this rank leads too
            self.earlier[hop.at[0]] = self.maps[hop.segment]
            return
        if hop.kind == "fold":
            self.maps[hop.segment] = self._compose_local(self.maps[hop.segment], self.earlier.pop(hop.segment))
            return
        if hop.kind == "carry":  # C: the next segment starts on this rank
            if hop.lane is None:
                self.states[hop.segment + 1] = self.maps[hop.segment]
            else:  # this lane's part of it
                g, L = hop.lane
                self._entering(hop.segment + 1)[g::L].copy_(self.maps[hop.segment][g::L])
            return
        if hop.kind == "send":  # a segment's map (B, C), or the one whose state enters it (C, the all-gather)
            x = self.maps[hop.segment] if hop.what == "map" else self.states[hop.segment]
            self._launch(n, hop, side, x, ([x], [x], [x]), None)
            return
        if hop.kind == "lane":  # this rank's lane of the segment's map, from its leader
            into = self._map()
            self._launch(n, hop, side, None, ([into], [into], [into]), None)
            self.maps[hop.segment] = into
            return
        if hop.kind == "receive":  # the state entering the segment (a lane's part of it: into the same map)
            into = self._map() if hop.lane is None else self._entering(hop.segment)
            self._launch(n, hop, side, None, ([into], [into], [into]), None)
            self.states[hop.segment] = into
            return
        if hop.kind == "rounds":  # B and C's send of a segment this rank leads, or C's all-gather, in one launch
            y = self._map()
            first = hop.steps[0]
            if first.kind == "receive" or first.what == "entering":  # the state entering the segment, passed on
                if first.lane is not None:  # its lanes' parts (one may be here already: carried)
                    y = self._entering(hop.segment)
                self._launch_rounds(n, hop, side, y if first.kind == "receive" else self.states[hop.segment], y)
                self.states[hop.segment] = y
            else:
                self._launch_rounds(n, hop, side, self.maps[hop.segment], y)
                self.maps[hop.segment] = y
            return
        # compose: the map received, the earlier segments', into this segment's; the kernel reads this
        # segment's map (T, E) in place: T from its columns past V, E as a delta of V columns
        own = self.maps[hop.segment]
        K, V, W = self.K, self.V, ch.width
        t = self.kind.unpack(own, V)[0]
        scratch, y = self._map(), self._map()
        self._launch(n, hop, side, None, ([t], [own], [scratch]), y, (K * W, W, (K * W, W, V)))
        self.maps[hop.segment] = y

    def finish(self, inputs: Sequence[Tensor]) -> None:
        """The state entering each of this rank's pieces, into ``inputs`` (per slot): segment 0's from its
        prefix, a segment's first piece the state entering the segment, the others ``T_i X + S_i``."""
        walk = self.ch.walks[self.reverse]
        me, N, K, V = self.route.group.rank(), self.N, self.K, self.V
        for i, (rank, slot) in enumerate(walk.owners):
            if rank != me:
                continue
            j = walk.segment_of[i]
            target = inputs[slot]
            if j > 0 and walk.segments[j][0] == i:
                target.copy_(self.kind.unpack(self.states[j], V)[1].reshape(target.shape))
                continue
            t, s = self.kind.unpack(self.prefix[slot], V)
            if j == 0:
                target.copy_(s.reshape(target.shape))
                continue
            x = self.kind.unpack(self.states[j], V)[1]
            flat = _flat(target, N, K, V)
            if flat is None:
                target.copy_(self.kind.combine(t, s, x).reshape(target.shape))
            else:
                self.kind.combine(t, s, x, out=flat)

    def _launch(self, n: int, hop: _Hop, side: bool, x: Optional[Tensor], operands, y: Optional[Tensor],
                layout=None) -> None:
        """Launch ``hop`` (plan position ``n``, on the side stream if ``side``): ``x`` the map it starts from
        where no rank sends it, ``operands`` the kernel's ``(gammas, deltas, s_ins)`` (``s_ins`` contiguous
        ``[N, K, W]``), ``y`` where the map it makes goes (or None); ``layout``: the transitions' dim-0 and
        row strides and the deltas' ``(dim-0 stride, row stride, columns)`` (None: a pass-through hop, which
        reads neither). Sends and receives pass their map through unchanged."""
        gammas, deltas, s_ins = operands
        pass_through = hop.kind in ("send", "receive", "lane")
        ch, route, reverse = self.ch, self.route, self.reverse
        dense = ch.dense
        W = ch.width
        t_stride, t_row, delta_layout = layout if layout is not None else (0, 1, (self.K * W, W, W))
        describe = lambda: _describe(route, reverse, hop, ch.nvshmem)  # noqa: E731
        bounded = self.watcher.arguments(self.watcher.launch_id((id(ch), reverse, n, route.what), describe),
                                         self.timeout)
        kernel = self.scan_hop.all_scan_dense_hop if dense else self.scan_hop.all_scan_hop
        has_src, has_dst = hop.peers[0] is not None, hop.regions[3] != 0
        # a launch with no peer (a segment's piece on a node of its own) touches no remote memory: the plain
        # kernel (an NVSHMEM module must call into NVSHMEM to be initialised for it)
        nvshmem = ch.nvshmem and (has_src or has_dst)
        inject.delay(deltas[0].device)  # test hook: no-op unless a stress test sets delays
        rows = (dict(m_row=t_row, precision=dense_precision(route.precision)) if dense
                else dict(g_row=t_row))
        kernel(0 if x is None else x.data_ptr(), gammas, deltas, s_ins, y, hop.regions, t_stride, self.K * W,
               ch.tiles, ch.data, ch.flags, has_src=has_src, has_init=x is not None, has_dst=has_dst,
               watch=bounded, pes=ch.pes(hop), nvshmem=nvshmem, programs=ASIDE_PROGRAMS if side else None,
               pass_through=pass_through, delta_layout=delta_layout, lane=hop.lane or (0, 1), **rows)
        inject.delay(deltas[0].device)

    def _launch_rounds(self, n: int, hop: _Hop, side: bool, own: Tensor, y: Tensor) -> None:
        """Launch a ``rounds`` hop (plan position ``n``): its steps' regions and peers in the channel's device
        table, their launch ids consecutive from the first (each wait names its own step)."""
        ch, route, reverse = self.ch, self.route, self.reverse
        whos = [self.watcher.launch_id((id(ch), reverse, n, route.what, s),
                                       lambda step=step: _describe(route, reverse, step, ch.nvshmem))
                for s, step in enumerate(hop.steps)]
        if whos != list(range(whos[0], whos[0] + len(whos))):
            raise RuntimeError(f"{route.what}: the launch ids of a rounds launch's steps are not consecutive ({whos})")
        bounded = self.watcher.arguments(whos[0], self.timeout)  # the kernel's: the first step's
        for who in whos[1:]:  # each later step's limit, for its report
            self.watcher.arguments(who, self.timeout)
        inject.delay(own.device)  # test hook: no-op unless a stress test sets delays
        self.scan_hop.all_scan_rounds(own, y, ch.tables[reverse, n], hop.steps[0].regions[0], ch.tiles, ch.data,
                                      ch.flags, watch=bounded, nvshmem=ch.nvshmem,
                                      programs=ASIDE_PROGRAMS if side else None, lane=hop.lane or (0, 1),
                                      dense=ch.dense)
        inject.delay(own.device)


def _flat(target: Tensor, N: int, K: int, V: int) -> Optional[Tensor]:
    """``target`` as ``[N, K, V]`` sharing its memory, or None where it cannot be viewed so."""
    try:
        return target.view(N, K, V)
    except RuntimeError:
        return None


def _describe(route, reverse: bool, hop: _Hop, nvshmem: bool):
    """How a launch is named when one of its waits gives up, and the global ranks it waits for."""
    return describe_launch(route.what, reverse, route.layout, route.group, nvshmem, f"hierarchical: {hop.label}",
                           hop.peers)
