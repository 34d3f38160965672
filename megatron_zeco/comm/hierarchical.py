"""All-Scan across nodes in log depth: chains inside nodes, a Kogge-Stone scan between them.

A chain over P ranks puts P - 1 hops on the critical path, and across nodes those hops cost most.
The pieces' maps ``S -> Diag(gamma) S + delta`` compose associatively,
``(g2, d2) o (g1, d1) = (g2 g1, g2 d1 + d2)``, so the scan can take another shape:

* The walk (pieces in scan order) is cut into *segments*: maximal runs of pieces held by ranks of
  one node (``comm.nodes``), each rank at most once. Contiguous layout: one segment per node.
  Zigzag: the walk goes up the ranks and back down, so each node has a front and a back segment
  (on the last node, where the walk turns, the two meet and are cut at the turn: the chain along a
  segment is then never longer than a node's ranks; the state passes from one to the other on the
  turning rank).
* **A**, inside each segment, in parallel: a chain of *prefix maps*. Piece i gets the composite
  of the segment's pieces before it, ``(Gamma_i, S_i)``, and passes ``(g_i Gamma_i,
  g_i S_i + d_i)`` on; the last piece's owner (the segment's *leader*) holds the segment's map.
  The first segment starts from the scan's initial state, so its prefixes are states.
* **B**, between segments: a Kogge-Stone scan of the segments' maps among the leaders, over the
  M - 1 segments whose outgoing state another segment needs (the last one's is not): ceil(log2
  (M - 1)) rounds; in round r the leader of segment j sends its composite to the leader of
  j + 2^r and composes what it gets from j - 2^r. The leader of segment j then holds the state
  leaving it.
* **C**: that state goes to the first rank of segment j + 1 (one hop between nodes), which passes
  it to the segment's other ranks (inside the node); each piece's incoming state is then
  ``Gamma_i X + S_i``.

Dense transitions (the gated delta rule, ``S -> M S + delta``; ``transition.py``) take the same
steps, the maps composing as ``(M2, d2) o (M1, d1) = (M2 M1, M2 d1 + d2)``.

The critical path is about (segment length - 1) + ceil(log2 (M - 1)) + 2 hops (a segment no longer than
a node's ranks) instead of P - 1 (contiguous) or 2P - 1 (zigzag) (``cost_model.hierarchical_steps``
replays the schedule); a rank sends at most one map per round of B (ceil(log2 (M - 1)) states, against
the chain's one).
Backward is the same over the reversed walk. Exact: the same compositions in another order
(rounding aside).

This module moves the maps as the group's point-to-point messages, one grouped call
(``batch_isend_irecv``) per step, every block of rows in one message: the host work per step is
one call whatever the blocks (``num_blocks`` pipelines the device transports, where blocks are
cheap).
"""

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import inject
from .failures import naming_failures
from .layout import Layout
from .transition import Kind, transition_of

Tensor = torch.Tensor


class Walk:
    """The walk of a scan over ``layout``'s pieces on a group whose ranks sit on ``nodes``, cut into
    segments (see the module docstring). Every rank builds the same one."""

    def __init__(self, layout: Layout, world: int, nodes: Sequence[int], reverse: bool):
        n = layout.num_pieces(world)
        order = range(n - 1, -1, -1) if reverse else range(n)
        self.owners: List[Tuple[int, int]] = [layout.owner(p, world) for p in order]  # (rank, slot) per step
        self.segments: List[List[int]] = []  # walk indices of each segment
        for i, (rank, _) in enumerate(self.owners):
            if i == 0 or nodes[rank] != nodes[self.owners[i - 1][0]] \
                    or any(self.owners[k][0] == rank for k in self.segments[-1]):
                self.segments.append([])
            self.segments[-1].append(i)
        self.segment_of = [j for j, seg in enumerate(self.segments) for _ in seg]

    def rank(self, i: int) -> int:
        return self.owners[i][0]

    def leader(self, j: int) -> int:
        """The rank holding segment ``j``'s last piece."""
        return self.rank(self.segments[j][-1])

    @property
    def rounds(self) -> int:
        """Rounds of B: a Kogge-Stone scan over the segments but the last (whose map nobody needs)."""
        return math.ceil(math.log2(len(self.segments) - 1)) if len(self.segments) > 2 else 0

    def depth(self) -> Tuple[int, int]:
        """(hops inside nodes, hops between nodes) on the critical path: the longest segment's chain
        and the forwarding inside the receiving segment; the rounds of B and the hop of C."""
        longest = max(len(seg) for seg in self.segments)
        if len(self.segments) == 1:
            return longest - 1, 0
        return (longest - 1) + 1, self.rounds + 1


def hierarchical_scan(
    gamma: Sequence[Tensor], delta: Sequence[Tensor], init: Optional[Tensor], route, nodes: Sequence[int], *,
    reverse: bool = False, out: Optional[Sequence[Tensor]] = None, while_waiting: Optional[Callable[[], None]] = None,
) -> Tuple[List[Tensor], Optional[Tensor]]:
    """:func:`~megatron_zeco.comm.all_scan` in the hierarchical shape (module docstring), over the
    group's point-to-point messages; the same arguments (``nodes``: the node of each group rank;
    of ``route``, the layout, the group and the name) and result."""
    group = route.group
    walk = Walk(route.layout, group.size(), nodes, reverse)
    steps = _Steps(group, route.what, while_waiting)
    scan = _RankScan(walk, group.rank(), gamma, delta, steps)
    prefix = scan.prefix_maps(init)
    composite = scan.segment_maps(prefix)
    entering = scan.into_next_node(composite)
    scan.inside_next_node(entering)
    steps.finish()
    return scan.results(prefix, entering, out)


class _RankScan:
    """One rank's part of a hierarchical scan over ``walk`` (``me``: its group rank): the steps A, B and C
    of the module docstring, each from what the one before gave this rank."""

    def __init__(self, walk: Walk, me: int, gamma: Sequence[Tensor], delta: Sequence[Tensor], steps: "_Steps"):
        self.walk, self.me, self.gamma, self.delta, self.steps = walk, me, gamma, delta, steps
        self.mine = [i for i, (rank, _) in enumerate(walk.owners) if rank == me]  # this rank's walk indices
        self.like = delta[0]
        self.kind = transition_of(gamma[0], self.like)

    def _piece_map(self, i: int) -> Tuple[Tensor, Tensor]:
        """The map of the piece at walk index ``i`` (this rank's)."""
        slot = self.walk.owners[i][1]
        return self.gamma[slot], self.delta[slot]

    def _receive_maps(self, recvs: List[Tuple[int, int]]) -> List[Tuple[int, Tensor]]:
        """Receive buffers for maps from the group ranks of ``recvs`` (``(rank, index)`` pairs)."""
        return [(src, _empty_map(self.kind, self.like)) for src, _ in recvs]

    def _receive_states(self, recvs: List[Tuple[int, int]]) -> List[Tuple[int, Tensor]]:
        """Receive buffers for states from the group ranks of ``recvs`` (``(rank, index)`` pairs)."""
        return [(src, self.like.new_empty(self.like.shape)) for src, _ in recvs]

    def prefix_maps(self, init: Optional[Tensor]) -> Dict[int, Tuple[Tensor, Tensor]]:
        """A: prefix maps inside each segment, ``(Gamma_i, S_i)`` for each of this rank's walk indices i,
        passed along the segment's chain (the first segment's start from ``init``: states)."""
        walk, me, kind, like = self.walk, self.me, self.kind, self.like
        prefix: Dict[int, Tuple[Tensor, Tensor]] = {}
        for i in self.mine:
            if walk.segments[walk.segment_of[i]][0] == i:
                if i == 0:  # the first segment starts from the initial state: its prefixes are states
                    state = like.new_zeros(like.shape) if init is None else init.to(like.dtype).expand(like.shape)
                    prefix[i] = (like.new_zeros(self.gamma[0].shape), state)
                else:
                    prefix[i] = (kind.identity(self.gamma[0]), like.new_zeros(like.shape))
        position = {i: i - walk.segments[walk.segment_of[i]][0] for i in range(len(walk.owners))}
        longest = max(len(seg) for seg in walk.segments)
        for t in range(longest - 1):
            sends, recvs = [], []
            for i in self.mine:
                if position[i] == t and i + 1 < len(walk.owners) and walk.segment_of[i + 1] == walk.segment_of[i]:
                    nxt = _compose(kind, *self._piece_map(i), *prefix[i])
                    if walk.rank(i + 1) == me:
                        prefix[i + 1] = nxt
                    else:
                        sends.append((walk.rank(i + 1), kind.pack(*nxt).contiguous(),
                                      f"the prefix map of piece step {i + 1}"))
                if position[i] == t + 1 and walk.rank(i - 1) != me:
                    recvs.append((walk.rank(i - 1), i))
            got = self.steps.run(sends, self._receive_maps(recvs), f"inside a node, step {t}")
            for (_, i), buffer in zip(recvs, got):
                prefix[i] = kind.unpack(buffer, like.shape[-1])
        return prefix

    def segment_maps(self, prefix: Dict[int, Tuple[Tensor, Tensor]]) -> Dict[int, Tuple[Tensor, Tensor]]:
        """B: Kogge-Stone over the segments' maps, among the leaders. For each segment j this rank leads,
        the composite of the segments up to j: its state is the one leaving segment j."""
        walk, me, kind, like = self.walk, self.me, self.kind, self.like
        M = len(walk.segments)
        led = [j for j in range(M) if walk.leader(j) == me]
        composite = {}
        for j in led:
            i = walk.segments[j][-1]
            composite[j] = _compose(kind, *self._piece_map(i), *prefix[i])
        for r in range(walk.rounds):
            d = 1 << r
            sends, recvs, local = [], [], {}
            for j in led:
                if j + d < M - 1:
                    if walk.leader(j + d) == me:
                        local[j + d] = composite[j]
                    else:
                        sends.append((walk.leader(j + d), kind.pack(*composite[j]).contiguous(),
                                      f"segment {j}'s map (round {r})"))
                if d <= j < M - 1 and walk.leader(j - d) != me:
                    recvs.append((walk.leader(j - d), j))
            got = self.steps.run(sends, self._receive_maps(recvs), f"between nodes, round {r}")
            earlier = {**local, **{j: kind.unpack(buffer, like.shape[-1]) for (_, j), buffer in zip(recvs, got)}}
            composite = {j: (_compose(kind, *composite[j], *earlier[j]) if j in earlier else composite[j])
                         for j in led}
        return composite

    def into_next_node(self, composite: Dict[int, Tuple[Tensor, Tensor]]) -> Dict[int, Tensor]:
        """C, first hop: the state leaving segment j (held by its leader) to the first rank of segment
        j + 1. Returns the states entering the segments this rank starts."""
        walk, me = self.walk, self.me
        entering: Dict[int, Tensor] = {}
        sends, recvs = [], []
        for j in range(len(walk.segments) - 1):
            first = walk.rank(walk.segments[j + 1][0])
            if walk.leader(j) == me:
                if first == me:  # the next segment starts on this rank (a zigzag walk's turn): sent on from here
                    entering[j + 1] = composite[j][1].contiguous()
                else:
                    sends.append((first, composite[j][1].contiguous(), f"the state entering segment {j + 1}"))
            elif first == me:
                recvs.append((walk.leader(j), j + 1))
        got = self.steps.run(sends, self._receive_states(recvs), "into the next node")
        entering.update({j: x for (_, j), x in zip(recvs, got)})
        return entering

    def inside_next_node(self, entering: Dict[int, Tensor]) -> None:
        """C, then: each segment's first rank passes the state entering it on to the segment's other
        ranks; adds the states this rank receives to ``entering``."""
        walk, me = self.walk, self.me
        sends, recvs = [], []
        for j in range(1, len(walk.segments)):
            first = walk.rank(walk.segments[j][0])
            others = sorted({walk.rank(i) for i in walk.segments[j]} - {first})
            if first == me:
                sends += [(rank, entering[j], f"the state entering segment {j}") for rank in others]
            elif me in others:
                recvs.append((first, j))
        got = self.steps.run(sends, self._receive_states(recvs), "inside the next node")
        entering.update({j: x for (_, j), x in zip(recvs, got)})

    def results(self, prefix: Dict[int, Tuple[Tensor, Tensor]], entering: Dict[int, Tensor],
                out: Optional[Sequence[Tensor]]) -> Tuple[List[Tensor], Optional[Tensor]]:
        """The state entering each local slot, ``Gamma_i X + S_i`` (into ``out`` if given), and the state
        leaving the walk's last piece on the rank holding it (None elsewhere)."""
        inputs: List[Optional[Tensor]] = [None] * len(self.delta)
        last = None
        for i in self.mine:
            slot, j = self.walk.owners[i][1], self.walk.segment_of[i]
            Gamma, S = prefix[i]
            x = S if j == 0 else self.kind.combine(Gamma, S, entering[j])
            inputs[slot] = x if out is None else out[slot].copy_(x)
            if i == len(self.walk.owners) - 1:
                last = self.kind.combine(self.gamma[slot], self.delta[slot], x)
        return inputs, last


def _compose(kind: Kind, g: Tensor, d: Tensor, Gamma: Tensor, S: Tensor) -> Tuple[Tensor, Tensor]:
    """The map ``(g, d) o (Gamma, S)``: a piece (or a later composite) applied after a prefix."""
    return kind.compose(g, Gamma), kind.combine(g, d, S)


def _empty_map(kind: Kind, like: Tensor) -> Tensor:
    """A receive buffer for a map (``kind.pack``: the state, then the transition's columns)."""
    return like.new_empty((*like.shape[:-1], like.shape[-1] + kind.width(like.shape[-2])))


class _Steps:
    """One grouped call of sends and receives per step; ``while_waiting`` before the first step that
    receives (the rank's first wait for a peer), else at the end."""

    def __init__(self, group, what: str, while_waiting: Optional[Callable[[], None]]):
        self.group, self.what, self.while_waiting = group, what, while_waiting
        self.pending: List[Tuple[str, object]] = []

    def run(self, sends: List[Tuple[int, Tensor, str]], recvs: List[Tuple[int, Tensor]], step: str) -> List[Tensor]:
        """Post ``sends`` (group rank, tensor, what it is) and ``recvs`` (group rank, buffer) as one
        grouped call; return the buffers once received (sends complete in :meth:`finish`)."""
        if recvs and self.while_waiting is not None:
            self.while_waiting()
            self.while_waiting = None
        device = (sends[0][1] if sends else recvs[0][1]).device if sends or recvs else None
        ops = []
        for rank, tensor, _ in sends:
            inject.delay(device)  # test hook: no-op unless a test sets delays or link latency
            ops.append(dist.P2POp(dist.isend, tensor, dist.get_global_rank(self.group, rank), self.group))
        ops += [dist.P2POp(dist.irecv, buffer, dist.get_global_rank(self.group, rank), self.group)
                for rank, buffer in recvs]
        if not ops:
            return []
        works = inject.batch_isend_irecv(ops)  # dist.batch_isend_irecv (+ latency test hook)
        for work, (rank, tensor, thing) in zip(works, sends):
            self.pending.append((f"sending {thing} to global rank {dist.get_global_rank(self.group, rank)}", work))
        peers = ", ".join(str(dist.get_global_rank(self.group, rank)) for rank, _ in recvs)
        with naming_failures(self.what, f"receiving ({step}) from global rank(s) {peers}"):
            for work in works[len(sends):]:
                work.wait()
        for _ in recvs:
            inject.delay(device)
        return [buffer for _, buffer in recvs]

    def finish(self) -> None:
        if self.while_waiting is not None:
            self.while_waiting()
            self.while_waiting = None
        for doing, work in self.pending:
            with naming_failures(self.what, doing):
                work.wait()
