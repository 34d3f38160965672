"""All-Scan: the only communication ZeCO needs.

Each piece p of the sequence maps the state entering it to the state leaving it,
``S_out = Diag(gamma_p) S_in + delta_p`` (delta = E in the forward pass, the local
state gradient in the backward pass, which walks the pieces in reverse). The
scan gives every piece its ``S_in``. The gated delta rule's pieces map states by a
dense matrix, ``S_out = M_p S_in + delta_p`` (``transition.py``; the backward pass scans
``M_p^T``): the same scans, with blocks of columns where a diagonal has blocks of rows.

:func:`all_scan` is the pipelined chain of the ZeCO paper: the state is cut into
``num_blocks`` blocks of rows (the decay acts row by row, so blocks are
independent; blocks of columns for a dense transition); block b is received from
the rank holding the previous piece, combined, and sent on at once, so block b+1
is still in flight while the next rank already works on block b. Every rank sends
and receives one state per piece it holds: the least any exact method can move.

:func:`gather_scan` is LASP-2's alternative: all-gather every piece's
``(gamma, delta)`` and fold the prefix locally (P states per rank received).

:func:`all_scan` passes its blocks as the group's point-to-point messages, or, on one
node, by one-sided stores into the peers' memory with device-side flags (``peer.py``).
Over peer memory a zigzag scan runs as two legs at once instead of one chain of 2P - 1
pieces: states go up the ranks, maps (composed pieces) come down from the turn-around
rank, and each rank applies the map it receives to its own state: the same volume, half
the waits. Dense transitions take the chain over peer memory too (a dense map would carry
K x K more per message).

Both take the group explicitly and address peers through it (global ranks from
``dist.get_global_rank``), so any Megatron context-parallel group works.
"""

import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..kernels import MAP_PRECISIONS
from . import inject
from .failures import naming_failures as _naming_failures
from .hierarchical import Walk, hierarchical_scan
from .layout import ChainLink, Layout
from .nodes import group_nodes
from .peer import peer_all_scan
from .peer_hierarchical import peer_hierarchical_scan
from .shape import scan_choice
from .transition import transition_of
from .transport import TRANSPORTS, Transport

Tensor = torch.Tensor
SHAPES = ("auto", "chain", "hierarchical")
SHAPE_ENV = "MEGATRON_ZECO_SCAN_SHAPE"


@dataclass(frozen=True)
class Route:
    """Where a scan runs and how its states travel (a layer's comes from its ``CPPlan``): the transport
    resolved; ``shape`` may be ``auto`` and ``node_size`` None, looked up per group when the scan runs.

    Attributes:
        layout: which pieces each rank holds.
        group: the process group the pieces are spread over.
        num_blocks: blocks the state is sent in (a divisor of the state's rows, or of its columns for a
            dense transition).
        transport: the :class:`~megatron_zeco.comm.transport.Transport` (or its name): ``send_recv``
            (the group's point-to-point messages), ``peer_memory`` (one-sided stores into the peers'
            memory, one kernel per piece: ``peer.py``) or ``nvshmem``.
        node_size: ranks per node, consecutive in group rank order (None: from the hosts, or
            ``$MEGATRON_ZECO_NODE_SIZE``; ``comm.nodes``).
        shape: ``chain`` (the pipelined chain through every piece), ``hierarchical`` (chains inside
            nodes, a log-depth scan between them: ``hierarchical.py``; send/recv), or ``auto``:
            ``$MEGATRON_ZECO_SCAN_SHAPE`` if set, else the one the cost model finds faster for this
            group's nodes and transport (the chain on one node).
        what: names the scan in errors (a failed or timed-out transfer raises naming it, the rank,
            the peer and the piece).
        precision: how the device transports' hops round the products that apply and compose dense maps:
            the pieces' own map precision (``megatron_zeco.kernels.map_precision`` of their inputs' dtype),
            ``tf32x3`` (float32 accuracy) or ``input`` (one TF32 pass, as the maps of 16-bit pieces are
            made). Diagonal maps and the send/recv transport's combines (``transition.py``) do not read it.
    """

    layout: Layout
    group: object
    num_blocks: int = 1
    transport: Transport = Transport.SEND_RECV
    node_size: Optional[int] = None
    shape: str = "auto"
    what: str = "All-Scan"
    precision: str = "tf32x3"

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"{self.what}: a scan's transport is one of {', '.join(TRANSPORTS)} (resolved by the CP "
                             f"plan), got {self.transport!r}")
        if self.precision not in MAP_PRECISIONS:
            raise ValueError(f"{self.what}: a scan's precision is one of {', '.join(MAP_PRECISIONS)} (the pieces' "
                             f"map precision), got {self.precision!r}")
        object.__setattr__(self, "transport", Transport(self.transport))


def chain_scan(
    step: Callable[[int, slice, Tensor], Tensor],
    init: Optional[Tensor],
    like: Tensor,
    route: Route,
    *,
    reverse: bool = False,
    out: Optional[Sequence[Tensor]] = None,
    while_waiting: Optional[Callable[[], None]] = None,
    block_dim: int = -2,
) -> Tuple[List[Tensor], Optional[Tensor]]:
    """Walk the pieces in order, passing a state from each to the next, block by block, over the
    group's messages.

    Args:
        step: ``step(slot, block, x) -> y``: the state leaving local slot ``slot``
            for the block ``block`` (a slice of dim ``block_dim``) given that block entering it.
        init: the state entering the first piece (``[..., K, V]``), or None for
            zeros; read only on the rank holding that piece.
        like: a tensor with the state's shape, dtype and device.
        route: where the pieces live, the blocks (which must divide the state's size along
            ``block_dim``) and the scan's name in errors.
        reverse: walk from the last piece to the first.
        out: per local slot, a tensor to write the entering state into (views of one
            batch, say), or None.
        while_waiting: called once, with local work that needs no result of the scan: just
            before the rank first waits for a state from another rank (``Layout.first_wait``),
            after the walk where it never does.
        block_dim: ``-2``: blocks of rows; ``-1``: blocks of columns.

    Returns:
        The state entering each local slot (``out`` if given), and the state leaving the
        walk's last piece on the rank holding it (None elsewhere).
    """
    blocks = _Blocks(like, route, block_dim, reverse)
    walk = route.layout.links(dist.get_rank(route.group), dist.get_world_size(route.group), reverse)
    # Each receive is posted just before its block is needed. Backends that run point-to-point
    # operations in issue order (NCCL: one stream per communicator) would deadlock on receives
    # posted ahead of the sends a peer is waiting for (the zigzag chain goes both ways).
    inputs: List[Optional[Tensor]] = [None] * len(walk)
    sends, carried, last = [], None, None
    wait_at = Layout.first_wait(walk)
    for i, link in enumerate(walk):
        if i == wait_at and while_waiting is not None:
            while_waiting()
        xs, ys = [], []
        for b, r in enumerate(blocks.slices):
            x = blocks.entering(link, b, init, carried)
            y = step(link.slot, r, x)
            if link.dst is not None:
                sends.append(blocks.send(link, b, y))
            xs.append(x)
            ys.append(y)
        inputs[link.slot] = _join(xs, block_dim) if out is None else out[link.slot].copy_(_join(xs, block_dim))
        carried = ys
        if link.last:
            last = _join(ys, block_dim)
    if wait_at == len(walk) and while_waiting is not None:
        while_waiting()
    blocks.wait_for(sends)
    return inputs, last


class _Blocks:
    """The blocks a chain passes over the group's messages: the slices of the state they are (along
    ``block_dim``), and how block b of a piece's state enters it (from the scan's initial state, from
    the rank holding the previous piece, or from this rank's own previous piece) and leaves it."""

    def __init__(self, like: Tensor, route: Route, block_dim: int, reverse: bool):
        self.like, self.block_dim, self.group, self.what = like, block_dim, route.group, route.what
        self.num_blocks = num_blocks = route.num_blocks
        size = like.shape[block_dim]
        self.slices = [slice(b * size // num_blocks, (b + 1) * size // num_blocks) for b in range(num_blocks)]
        self.shape = list(like.shape)
        self.shape[block_dim] = size // num_blocks
        self.shift = -1 if reverse else 1

    def tag(self, piece: int, block: int) -> int:
        """The message tag of block ``block`` of the state leaving ``piece``."""
        return piece * self.num_blocks + block

    def entering(self, link: ChainLink, block: int, init: Optional[Tensor], carried: Optional[List[Tensor]]) -> Tensor:
        """Block ``block`` of the state entering ``link``'s piece: of ``init`` (None: zeros) for the first
        piece, else received from the rank holding the previous piece, or, where that piece is this
        rank's too, ``carried`` (its blocks leaving it)."""
        if link.first:
            if init is None:
                return self.like.new_zeros(self.shape)
            r = self.slices[block]
            return init.narrow(self.block_dim, r.start, r.stop - r.start)
        if link.src is not None:
            return self.receive(link, block)
        return carried[block]  # previous piece is ours (zigzag turn-around on the last rank)

    def receive(self, link: ChainLink, block: int) -> Tensor:
        """Block ``block`` of the state leaving the piece before ``link``'s, from the rank holding it."""
        x = self.like.new_empty(self.shape)
        src = dist.get_global_rank(self.group, link.src)
        inject.delay(x.device)  # test hook: no-op unless a stress test sets delays
        with _naming_failures(self.what, f"receiving block {block} of the state leaving piece "
                                         f"{link.piece - self.shift} from global rank {src}"):
            # dist.recv (+ latency test hook)
            inject.recv(x, src, self.group, self.tag(link.piece - self.shift, block))
        inject.delay(x.device)
        return x

    def send(self, link: ChainLink, block: int, y: Tensor) -> Tuple[ChainLink, int, object]:
        """Start sending block ``block`` of the state leaving ``link``'s piece, ``y``, to the rank holding the
        next piece: ``(link, its global rank, the pending send)``."""
        dst = dist.get_global_rank(self.group, link.dst)
        inject.delay(y.device)
        return link, dst, inject.isend(y.contiguous(), dst, self.group, self.tag(link.piece, block))

    def wait_for(self, sends: List[Tuple[ChainLink, int, object]]) -> None:
        """Wait for the sends (:meth:`send`) to complete, naming the one that fails."""
        for link, dst, work in sends:
            with _naming_failures(self.what, f"sending the state leaving piece {link.piece} to global rank {dst}"):
                work.wait()


def _join(blocks: List[Tensor], dim: int) -> Tensor:
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=dim)


def all_scan(
    gamma: Sequence[Tensor],
    delta: Sequence[Tensor],
    init: Optional[Tensor],
    route: Route,
    *,
    reverse: bool = False,
    out: Optional[Sequence[Tensor]] = None,
    while_waiting: Optional[Callable[[], None]] = None,
    aside=None,
) -> Tuple[List[Tensor], Optional[Tensor]]:
    """Pipelined All-Scan of ``S_out = Diag(gamma) S_in + delta`` (or ``M S_in + delta``) over the pieces.

    Args:
        gamma: per local slot, the transition: the decay ``[..., K]``, or a dense ``M [..., K, K]``
            (``transition.py``; blocks of columns; over the device transports always the chain).
        delta: per local slot, ``[..., K, V]``.
        init: state entering the first piece (last piece if ``reverse``) or None.
        route: where the pieces live and how states travel (:class:`Route`: its transport, shape,
            blocks and nodes).
        reverse: walk from the last piece to the first.
        out: per local slot, where ``S_in`` goes (e.g. the slots' views of one batch, which
            the peer-memory kernel writes in place), or None.
        while_waiting: as :func:`chain_scan`: local work issued before this rank first waits
            for another rank (after what it sends at once), else after the scan.
        aside: the device transports only: a CUDA stream on which this rank's hop kernels run, on
            few SMs, while ``while_waiting()`` runs on the current stream (which then waits for
            them), or None.

    Returns:
        As :func:`chain_scan`: ``S_in`` per local slot, and the state leaving the
        chain on the rank that ends it.
    """
    kind = transition_of(gamma[0], delta[0])
    if scan_shape(route, delta[0]) == "hierarchical":
        if route.transport.device:
            return peer_hierarchical_scan(gamma, delta, init, route, reverse=reverse, out=out,
                                          while_waiting=while_waiting, aside=aside)
        if aside is not None:
            raise ValueError("all_scan: aside (a side stream for the hops) applies to the device transports ("
                             + ", ".join(repr(t.value) for t in Transport if t.device) + ") only")
        return hierarchical_scan(gamma, delta, init, route, nodes=_nodes(route), reverse=reverse, out=out,
                                 while_waiting=while_waiting)
    if route.transport.device:
        return peer_all_scan(gamma, delta, init, route, reverse=reverse, out=out, while_waiting=while_waiting,
                             aside=aside)
    if aside is not None:
        raise ValueError("all_scan: aside (a side stream for the hops) applies to the device transports ("
                         + ", ".join(repr(t.value) for t in Transport if t.device) + ") only")

    def combine(slot: int, block: slice, x: Tensor) -> Tensor:
        return kind.combine(gamma[slot], delta[slot], x, block)

    return chain_scan(combine, init, delta[0], route, reverse=reverse, out=out, while_waiting=while_waiting,
                      block_dim=kind.block_dim)


def scan_shape(route: Route, like: Tensor) -> str:
    """``chain`` or ``hierarchical``: the shape an All-Scan of states like ``like`` takes on ``route`` (see
    :class:`Route`). Looks up the group's nodes (collective the first time per group) unless the
    shape is given."""
    shape = route.shape
    if shape == "auto":
        shape = os.environ.get(SHAPE_ENV) or "auto"
    if shape not in SHAPES:
        raise ValueError(f"unknown All-Scan shape {shape!r}; expected one of {', '.join(SHAPES)} "
                         f"(argument shape, or ${SHAPE_ENV})")
    if shape not in ("auto", *route.transport.shapes):
        over = ", ".join(repr(t.value) for t in Transport if shape in t.shapes)
        raise ValueError(f"All-Scan shape {shape!r} runs over transport {over}, not {route.transport.value!r}")
    if shape != "auto":
        return shape
    if route.group.size() < 3 or len(route.transport.shapes) == 1:
        return route.transport.shapes[0]
    return scan_choice(route.layout.value, tuple(_nodes(route)), like.numel() * like.element_size(), route.transport)


def _chain_hops(walk: "Walk", nodes: Sequence[int]) -> Tuple[int, int]:
    """(hops inside nodes, hops between nodes) of the chain through every piece of ``walk``."""
    ranks = [rank for rank, _ in walk.owners]
    pairs = [(a, b) for a, b in zip(ranks, ranks[1:]) if a != b]
    inter = sum(nodes[a] != nodes[b] for a, b in pairs)
    return len(pairs) - inter, inter


def _nodes(route: Route) -> Tuple[int, ...]:
    with _naming_failures(route.what, "agreeing on which ranks of the group share a node"):
        return group_nodes(route.group, route.node_size)


def gather_scan(
    gamma: Sequence[Tensor],
    delta: Sequence[Tensor],
    init: Optional[Tensor],
    route: Route,
    *,
    reverse: bool = False,
    out: Optional[Sequence[Tensor]] = None,
) -> Tuple[List[Tensor], Optional[Tensor]]:
    """Same result as :func:`all_scan` (and ``out``) by one all-gather and a local fold (LASP-2; for
    dense transitions, fla's all-gather of ``[h | M]``). Of ``route``, only the layout, the group and
    the name count."""
    layout, group, what = route.layout, route.group, route.what
    world, me = dist.get_world_size(group), dist.get_rank(group)
    n = layout.num_pieces(world)
    kind, V = transition_of(gamma[0], delta[0]), delta[0].shape[-1]
    first_piece, order = (n - 1, range(n - 1, -1, -1)) if reverse else (0, range(n))
    mine = []
    for slot, piece in enumerate(layout.pieces(me, world)):
        d = delta[slot]
        if piece == first_piece and init is not None:  # fold init into the first piece's summary
            d = kind.combine(gamma[slot], d, init)
        mine.append(kind.pack(gamma[slot], d))
    mine = torch.stack(mine)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    with _naming_failures(what, f"all-gathering the pieces' states over a group of {world}"):
        dist.all_gather(gathered, mine.contiguous(), group=group)

    zeros = torch.zeros_like(delta[0])
    inputs: List[Optional[Tensor]] = [None] * len(delta)
    x = zeros
    for piece in order:
        rank, slot = layout.owner(piece, world)
        if rank == me:
            inputs[slot] = init if (piece == first_piece and init is not None) else x
            if out is not None:
                inputs[slot] = out[slot].copy_(inputs[slot])
        x = kind.combine(*kind.unpack(gathered[rank][slot], V), x)
    last_owner = layout.owner(order[-1], world)[0]
    return inputs, (x if last_owner == me else None)
