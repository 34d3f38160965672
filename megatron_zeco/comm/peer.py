"""All-Scan over the device transports: one-sided stores into the next rank's buffer, flags on the device.

A message through NCCL costs tens of microseconds of latency plus host work per block, more than a whole
1 MiB state takes over NVLink, so a pipelined chain of small blocks loses. On one node every GPU can map
every other GPU's memory (``symmetric.py``): a hop is one Triton kernel (``kernels/scan_hop.py``) that
waits for the previous rank's tiles, combines them and stores the result straight into the next rank's
buffer, tile by tile (over NVSHMEM: puts, across nodes). No host synchronisation, no NCCL call; the kernel
is ordered on the current stream like any other. Every wait is bounded (``watch.py``).
"""

import contextlib
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..kernels import dense_precision
from . import inject
from .failures import naming_failures
from .layout import ChainLink, Layout
from .symmetric import PeerBuffers
from .transition import Dense, transition_of
from .transport import Transport
from .watch import watch

Tensor = torch.Tensor
_ALIGN = 16
_TILE_ROWS = 32
# Programs of a launch beside the local work (``aside``): a program per tile would fill every SM
# (a hop waiting for its peer would hold them all while it spins) and the local work would run after
# the scan instead of beside it.
ASIDE_PROGRAMS = 16
_FLAG_BYTES = 8  # flags, acknowledgements and call counters: 64-bit words (NVSHMEM's signal width)


class _Launch(NamedTuple):
    """One kernel of a rank's part of a scan: ``hop`` (``all_scan_hop``: the links it walks, two at a
    zigzag turn-around), ``out`` (the same for a zigzag rank's outgoing piece a, keeping the state
    leaving it), ``map`` or ``close`` (the zigzag return leg: ``all_scan_map``, ``all_scan_close``;
    links = the rank's pieces a and b); the addresses of the regions it uses; whether it waits for
    another rank; the group ranks it may wait for (the one whose data it receives, the one whose
    acknowledgement it needs before sending again; None: no such wait), named when a wait times out."""

    kind: str
    links: List[ChainLink]
    regions: Tuple[int, ...]
    waits: bool
    peers: Tuple[Optional[int], Optional[int]]


class _ChannelKey(NamedTuple):
    """What a channel serves: scans over ``group`` and ``layout`` of up to ``N`` states ``[K, V]`` of
    ``dtype`` on ``device``, in ``tiles`` tiles, over NVSHMEM or peer memory, of dense transitions or
    diagonal ones."""

    group: object
    layout: Layout
    N: int
    K: int
    V: int
    dtype: torch.dtype
    tiles: int
    device: torch.device
    nvshmem: bool
    dense: bool


class _Channel:
    """Peer buffers for scans of up to N states of one shape, in ``tiles`` tiles of rows each, over one
    group and layout.

    Each rank has a region per direction and local slot (at most 2 pieces per rank): a receive
    buffer for the incoming state (or map: state and decays), its arrival flags, the
    acknowledgements of what the slot sends, and the slot's call counters (kept on the device:
    ``kernels/scan_hop.py``). ``plan(reverse)``: the rank's launches (``_Launch``) in issue order
    with the addresses of the regions each reads and writes, here and on its peers (built once; a
    call then only launches kernels, so a scan can be captured in a CUDA graph once the channel
    exists).

    Contiguous layout, and dense transitions (``dense``: the gated delta rule) under either layout:
    the chain, one hop per piece (two pieces of a rank in a row, at the zigzag turn-around, in one
    launch). Zigzag over two or more ranks with diagonal transitions: two legs that
    need nothing from each other run at once. The outgoing leg passes states up the ranks as the
    chain does (rank r's piece a = r); the return leg passes maps down from the turn-around rank,
    each rank's ``C_r = M_b o C_(r+1) o M_a`` over the pieces between its two (its piece b's
    incoming state is then ``C_(r+1)(S_out(a))``). The states moved are those of the chain (one
    per rank and direction, plus a row of decays per map); the waits halve: a zigzag chain of
    2P - 1 pieces becomes two legs of P.
    """

    def __init__(self, key: "_ChannelKey"):
        group, layout, N, K, V, dtype, tiles, device, nvshmem, dense = key
        self.data, self.flags, size = region_bytes(N, K, V, dtype, tiles, nvshmem)
        self.decays = N * K * V  # elements into a receive buffer: a map's decays
        buffers = PeerBuffers(group, 4 * size, device, nvshmem)
        rank, world = group.rank(), group.size()
        self.nvshmem, self.dense, self.tiles = nvshmem, dense, tiles
        # NVSHMEM processing elements: torch's NVSHMEM backend numbers them by global rank
        self._pe = [dist.get_global_rank(group, r) for r in range(world)] if nvshmem else None

        def region(r, reverse, slot):
            return 0 if r is None else buffers.of(r).data_ptr() + (2 * int(reverse) + slot) * size

        def chain(reverse):
            hops = []
            for link in layout.links(rank, world, reverse):
                if hops and hops[-1][-1].dst is None and not hops[-1][-1].last:  # the previous piece is ours
                    hops[-1].append(link)
                else:
                    hops.append([link])
            return [_Launch("hop", hop, (region(rank, reverse, hop[0].slot), region(rank, reverse, hop[-1].slot),
                                         region(hop[0].src, reverse, hop[0].src_slot),
                                         region(hop[-1].dst, reverse, hop[-1].dst_slot)), hop[0].src is not None,
                            (hop[0].src, hop[-1].dst))
                    for hop in hops]

        def two_legs(reverse):
            a, b = layout.links(rank, world, reverse)
            here_a, here_b = region(rank, reverse, a.slot), region(rank, reverse, b.slot)
            src_a = region(a.src, reverse, a.src_slot)
            if a.dst is None:  # the turn-around rank: C = M_b o M_a goes down at once; a and b as one hop
                return [_Launch("map", [a, b], (here_b, here_b, region(b.dst, reverse, b.dst_slot)), False,
                                (None, b.dst)),
                        _Launch("hop", [a, b], (here_a, here_a, src_a, 0), True, (a.src, None))]
            launches = [] if b.last else [
                _Launch("map", [a, b], (here_b, here_b, region(b.dst, reverse, b.dst_slot)), True, (b.src, b.dst))]
            return launches + [
                _Launch("out", [a], (here_a, here_a, src_a, region(a.dst, reverse, a.dst_slot)), a.src is not None,
                        (a.src, a.dst)),
                _Launch("close", [a, b], (here_b, region(b.src, reverse, b.src_slot)), True, (b.src, None))]

        plan = two_legs if layout is Layout.ZIGZAG and world > 1 and not dense else chain
        self._plans = {reverse: plan(reverse) for reverse in (False, True)}
        self._buffers = buffers  # the plans hold raw addresses into them

    def plan(self, reverse: bool) -> List[_Launch]:
        return self._plans[reverse]

    def pes(self, launch: _Launch) -> Tuple[int, int]:
        """NVSHMEM: the PEs of the launch's peers (the one it acknowledges, the one it sends to); -1 where
        there is none, or over peer memory."""
        if not self.nvshmem:
            return -1, -1
        return tuple(-1 if r is None else self._pe[r] for r in launch.peers)


def capacity(N: int) -> int:
    """The states a channel for N holds: a power of two. Packed batches split per document pass one state
    per document, a count that changes every step, and each new channel is a collective allocation that is
    never freed (a peer may still be writing into it); a call uses the first N."""
    return 1 << (N - 1).bit_length()


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def region_bytes(N: int, K: int, V: int, dtype: torch.dtype, tiles: int, nvshmem: bool) -> Tuple[int, int, int]:
    """(receive buffer, flags, region) bytes of one region of a channel for N states ``[K, V]`` of ``dtype`` (and
    a row of decays each) in ``tiles`` tiles: the buffer, then arrival flags, acknowledgements and call
    counters of the flags' size each; NVSHMEM adds an outbox (what a put sends from) and a scratch word (an
    acknowledgement's payload)."""
    data = _aligned(N * K * (V + 1) * dtype.itemsize)
    flags = _aligned(N * tiles * _FLAG_BYTES)
    return data, flags, data + 3 * flags + (data + _ALIGN if nvshmem else 0)


def tiles_per_state(K: int, V: int, dense: bool, num_blocks: int) -> int:
    """The tiles a state ``[K, V]`` moves as, each with its own flag: each of ``num_blocks`` blocks of rows
    (columns for dense transitions: a row of M S reads every row of S) in 32-row tiles where it divides."""
    rows = (V if dense else K) // num_blocks
    return num_blocks * (rows // _TILE_ROWS if rows % _TILE_ROWS == 0 else 1)


def dim0_stride(ts: Sequence[Tensor], tail: int) -> Optional[int]:
    """The one stride of dim 0 (elements) by which the hop kernel can address every tensor of ``ts``
    (``tail`` trailing dims per state: each entry of dim 0 contiguous, as a local slot's view of a
    batch of pieces is), 0 where dim 0 has one entry or is not a batch dim; None if there is none."""
    if any(not (t.is_contiguous() if t.dim() <= tail else t[0].is_contiguous()) for t in ts):
        return None
    strides = {t.stride(0) for t in ts if t.dim() > tail and t.shape[0] > 1}
    return strides.pop() if len(strides) == 1 else (0 if not strides else None)


_CHANNELS: Dict[_ChannelKey, _Channel] = {}


def peer_all_scan(gamma: Sequence[Tensor], delta: Sequence[Tensor], init: Optional[Tensor], route, *,
                  reverse: bool = False, out: Optional[Sequence[Tensor]] = None,
                  while_waiting: Optional[Callable[[], None]] = None,
                  aside=None) -> Tuple[List[Tensor], Optional[Tensor]]:
    """:func:`all_scan` over a device transport (same arguments and result). ``while_waiting()`` is issued
    where the rank first waits for a peer. ``aside``: a CUDA stream for every launch of the rank's part of
    the scan, each on at most ``ASIDE_PROGRAMS`` programs, the first that waits for a peer issued before
    ``while_waiting()`` (on the current stream), so that it spins beside the local work instead of after
    it; the current stream waits for the side stream after.
    ``route.what`` names the scan (layer and direction) in a :class:`ScanTimeoutError`. Over
    ``nvshmem``, the same kernels and protocol with tiles moved by NVSHMEM puts (any PE, on this node or
    another) instead of stores into the peers' mapped memory."""
    from ..kernels import scan_hop

    like = delta[0]
    dense = transition_of(gamma[0], like) is Dense
    ch = _channel(route, like, dense)
    inputs = list(out) if out is not None else [torch.empty_like(d) for d in delta]
    operands = _operands(gamma, delta, inputs, dense)
    launcher = _Launcher(scan_hop, ch, operands, like, init, route, reverse)
    plan = ch.plan(reverse)
    # The local work goes where the rank first waits for a peer; with a side stream, just after that launch
    # is issued there, so that the hop spins beside the local work. The launches after it go behind the local
    # work: under CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's setting with CP) the streams share one hardware
    # queue, where a launch that must wait for the one before it on its stream holds up all queued behind it.
    at = next((i for i, launch in enumerate(plan) if launch.waits), len(plan))
    main = None
    if aside is not None:
        at = min(at + 1, len(plan))
        main = torch.cuda.current_stream()
        aside.wait_stream(main)
    last = y_a = None
    for i, launch in enumerate(plan):
        if i == at and while_waiting is not None:
            while_waiting()
        y = launcher.issue(i, launch, y_a, aside)
        if launch.kind not in ("map", "close"):
            y_a = y
        last = y if launch.links[-1].last else last
    if at == len(plan) and while_waiting is not None:
        while_waiting()
    if main is not None:
        main.wait_stream(aside)
    if operands.s_ins is not inputs:
        for target, s_in in zip(inputs, operands.s_ins):
            target.copy_(s_in)
    return inputs, last


def _channel(route, like: Tensor, dense: bool) -> _Channel:
    """The channel for scans of states like ``like`` over ``route`` (set up with every rank of the group
    on first use)."""
    K, V = like.shape[-2:]
    N = like.numel() // (K * V)
    # Blocks of more than 32 rows move as 32-row tiles, each with its own flag: more programs in flight
    # and a finer pipeline through the zigzag turn-around (what a per-document packed batch's one
    # state per document needs to keep the link busy; bench_op.py's scan part times it).
    # Dense transitions: blocks and tiles of columns instead (a row of M S reads every row of S).
    tiles = tiles_per_state(K, V, dense, route.num_blocks)
    nvshmem = route.transport is Transport.NVSHMEM
    key = _ChannelKey(route.group, route.layout, capacity(N), K, V, like.dtype, tiles, like.device, nvshmem, dense)
    ch = _CHANNELS.get(key)
    if ch is None:
        with naming_failures(route.what, "setting up the All-Scan's symmetric buffers with every rank of the group"):
            ch = _CHANNELS[key] = _Channel(key)
    return ch


class _Operands(NamedTuple):
    """What a scan's kernels read and write, per local slot: the transitions, the deltas and the entering
    states; and the stride of dim 0 that addresses the transitions, and the one for the deltas and the
    states (:func:`dim0_stride`)."""

    gammas: List[Tensor]
    deltas: List[Tensor]
    s_ins: List[Tensor]
    strides: Tuple[int, int]


def _operands(gamma: Sequence[Tensor], delta: Sequence[Tensor], inputs: List[Tensor], dense: bool) -> _Operands:
    """The kernels' operands, the entering states written into ``inputs``: in place where one stride of
    dim 0 addresses them (ScanGLA's slot views of its batches); otherwise contiguous copies (``s_ins``
    then new tensors, to copy into ``inputs`` after the scan)."""
    gammas, deltas, s_ins = list(gamma), list(delta), inputs
    tail = 2 if dense else 1  # trailing dims of a transition: [K, K] or [K]
    strides = dim0_stride(gammas, tail), dim0_stride([*deltas, *s_ins], 2)
    if None in strides:
        gammas, deltas = [x.contiguous() for x in gammas], [x.contiguous() for x in deltas]
        s_ins = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in inputs]
        strides = dim0_stride(gammas, tail), dim0_stride([*deltas, *s_ins], 2)
    return _Operands(gammas, deltas, s_ins, strides)


class _Launcher:
    """Issues the launches of one scan over a channel (``scan_hop``: the hop kernels' module), each with
    its operands, its bounded waits and its peers. Checks first that no earlier wait of the process gave
    up."""

    def __init__(self, scan_hop, ch: _Channel, operands: _Operands, like: Tensor, init: Optional[Tensor], route,
                 reverse: bool):
        self.scan_hop, self.ch, self.operands, self.like = scan_hop, ch, operands, like
        self.route, self.reverse = route, reverse
        self.watcher = watch(like.device)
        self.timeout = self.watcher.timeout(route.group)
        self.watcher.check()  # a wait of an earlier scan gave up: fail before issuing more
        # The initial state as the kernel reads it: made on the current stream before ``aside`` waits for
        # it (a copy made later would race with the kernel reading it there).
        K, V = like.shape[-2:]
        N = like.numel() // (K * V)
        self.x_init = None if init is None else init.to(like.dtype).reshape(N, K, V).contiguous()

    def issue(self, i: int, launch: _Launch, y_a: Optional[Tensor], side=None) -> Optional[Tensor]:
        """Issue launch ``i`` of the plan, on stream ``side`` if given (beside the local work, on
        ``ASIDE_PROGRAMS`` programs). ``y_a``: the state leaving this rank's outgoing piece, which ``close`` reads.
        Returns the state leaving the launch's pieces where one is kept (the walk's last piece, or
        ``out``'s), else None."""
        ch, like, route = self.ch, self.like, self.route
        first, final = launch.links[0], launch.links[-1]
        # allocated on the current stream, whichever stream the kernel runs on, and held to the end
        # (past the current stream's wait for ``aside``)
        y = like.new_empty(like.shape) if final.last or launch.kind == "out" else None
        x = self.x_init if launch.kind in ("hop", "out") and first.first else None
        programs = ASIDE_PROGRAMS if side is not None else None
        describe = lambda: _describe(route.what, self.reverse, launch, route.layout, route.group, ch.nvshmem)
        bounded = self.watcher.arguments(self.watcher.launch_id((id(ch), self.reverse, i, route.what), describe),
                                         self.timeout)
        remote = dict(watch=bounded, pes=ch.pes(launch), nvshmem=ch.nvshmem)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            inject.delay(like.device)  # test hook: no-op unless a stress test sets delays
            self._kernel(launch, x, y, y_a, programs, remote)
            inject.delay(like.device)
        return y

    def _kernel(self, launch: _Launch, x: Optional[Tensor], y: Optional[Tensor], y_a: Optional[Tensor],
                programs: Optional[int], remote: dict) -> None:
        """The launch's kernel: ``all_scan_map``, ``all_scan_close``, or a hop (``x``: the initial state it
        reads, or None; ``y``: where the state leaving its last piece goes, or None)."""
        ch, (gammas, deltas, s_ins, strides) = self.ch, self.operands
        first, final, regions = launch.links[0], launch.links[-1], launch.regions
        sizes = (ch.tiles, ch.data, ch.flags)
        if launch.kind == "map":
            self.scan_hop.all_scan_map([gammas[first.slot], gammas[final.slot]],
                                       [deltas[first.slot], deltas[final.slot]], regions, *strides, ch.decays, *sizes,
                                       has_src=launch.waits, programs=programs, **remote)
        elif launch.kind == "close":
            self.scan_hop.all_scan_close(y_a, s_ins[final.slot], gammas[final.slot], deltas[final.slot], y, regions,
                                         *strides, ch.decays, *sizes, programs=programs, **remote)
        else:  # "hop", or "out": a zigzag rank's outgoing hop, whose outgoing state close reads
            slots = [link.slot for link in launch.links]
            hop, products = ((self.scan_hop.all_scan_dense_hop,
                              dict(precision=dense_precision(self.route.precision))) if ch.dense
                             else (self.scan_hop.all_scan_hop, {}))
            hop(0 if x is None else x.data_ptr(), [gammas[s] for s in slots], [deltas[s] for s in slots],
                [s_ins[s] for s in slots], y, regions, *strides, *sizes,
                has_src=first.src is not None, has_init=x is not None, has_dst=regions[3] != 0,
                programs=programs, **products, **remote)


def _describe(what: str, reverse: bool, launch: _Launch, layout, group, nvshmem: bool):
    """How a launch is named when one of its waits gives up (:func:`describe_launch`): its pieces."""
    pieces = " and ".join(str(link.piece) for link in launch.links)
    return describe_launch(what, reverse, layout, group, nvshmem, f"piece(s) {pieces}", launch.peers)


def describe_launch(what: str, reverse: bool, layout, group, nvshmem: bool, where: str,
                    peers: Tuple[Optional[int], Optional[int]]):
    """A device scan's launch as its waits name it: the scan, the direction, the transport, the layout and
    ``where`` in the scan; and the global ranks of its group ranks ``peers``."""
    direction = "" if ("backward" in what or "forward" in what) else ("backward " if reverse else "forward ")
    over = "NVSHMEM" if nvshmem else "peer memory"
    return (f"{what} [{direction}over {over}, {layout.value} layout on {group.size()} ranks, {where}]",
            tuple(None if r is None else dist.get_global_rank(group, r) for r in peers))
