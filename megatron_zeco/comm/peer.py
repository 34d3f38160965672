"""All-Scan through peer memory: one-sided stores into the next rank's buffer, flags on the device.

A message through NCCL costs ~25-40 µs of latency plus host work per block (docs/benchmarks.md),
more than a whole 1 MiB state takes over NVLink, so a pipelined chain of small blocks loses. On
one node every GPU can map every other GPU's memory: each rank allocates one buffer per state
shape with torch's symmetric memory, and a hop is one Triton kernel
(``kernels/scan_hop.py``) that waits for the previous rank's tiles, combines them and stores
the result straight into the next rank's buffer, tile by tile. No host synchronisation, no
NCCL call; the kernel is ordered on the current stream like any other.

Transports (an operator's ``transport=``, a layer's ``cp_transport``; resolved once by the CP plan, and a
scan's ``Route`` carries the result):

* ``send_recv``: the process group's point-to-point messages (NCCL on GPUs, gloo on CPUs); works
  everywhere.
* ``peer_memory``: this module. On CUDA, torch symmetric memory (NVLink; multicast is never used).
  On the CPU, files in shared memory (``/dev/shm``) and the kernel under ``TRITON_INTERPRET=1``:
  slow, for testing the protocol with real processes.
* ``auto`` (default): ``$MEGATRON_ZECO_TRANSPORT`` if set, else ``peer_memory`` for CUDA states
  when every rank of the group is on this host, else ``send_recv`` (:func:`resolve_transport`; an
  operator whose rules say so, the gated delta rule's and KDA's, resolves ``auto`` to ``send_recv``
  itself: ``cp.config.RULES``).

A rank that never arrives (it died, or stalled) is reported, not spun on: every wait of the scan
kernels is bounded by the group's timeout (or ``$MEGATRON_ZECO_SCAN_TIMEOUT`` seconds), measured
on the GPU's clock. The rank that gives up marks the flags it raises from then on, so the ranks
after it give up at once, and delivers NaN instead of the state it did not get, so that every
output and gradient computed from it is NaN. Each rank raises :class:`ScanTimeoutError`, naming
the layer, the direction, the piece, the peer it waited for and the call (:class:`Watch`), at its
next scan and at :func:`check_scans`, which runs before every optimizer step
(:func:`install_step_check`).
"""

import contextlib
import os
import tempfile
import uuid
import warnings
import weakref
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import inject
from .failures import naming_failures
from .layout import Layout, Link
from .nodes import host_nodes
from .transition import Dense, transition_of

Tensor = torch.Tensor
TRANSPORTS = ("auto", "send_recv", "peer_memory", "nvshmem")
RESOLVED_TRANSPORTS = TRANSPORTS[1:]  # what a plan resolves ``auto`` to, and what a scan's Route takes
TRANSPORT_ENV = "MEGATRON_ZECO_TRANSPORT"
_ALIGN = 16
_TILE_ROWS = 32
# Programs of a send beside the local work (``aside``): a program per tile would fill every SM
# until the whole state has gone, and the local work would run after it instead of beside it.
_ASIDE_PROGRAMS = 16
_FLAG_BYTES = 8  # flags, acknowledgements and call counters: 64-bit words (NVSHMEM's signal width)
_ALLOCATED = False  # whether this process has allocated torch symmetric memory (fixing its backend)


DEVICE_TRANSPORTS = ("peer_memory", "nvshmem")
# Layers built in this process that scan over a device transport: layer -> (transport, its name).
# Torch symmetric memory takes one backend per process (CUDA's for peer memory, NVSHMEM), fixed by
# its first allocation, so one process cannot scan over both.
_CLAIMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def claim_transport(owner, transport: str, name: str) -> None:
    """Record that ``owner`` (a layer, named ``name``) scans over ``transport``: at model build, so that a
    model whose layers ask for both device transports fails there, naming them, instead of at its
    first step. ValueError if a layer of this process that is still alive asks for the other one,
    or this process's symmetric memory already runs the other backend."""
    if transport not in DEVICE_TRANSPORTS:
        return
    for other, (theirs, who) in list(_CLAIMS.items()):
        if theirs != transport and other is not owner:
            raise ValueError(f"{name}: cp_transport {transport!r}, but {who} in this process scans over {theirs!r}: "
                             f"a process runs one device transport (torch symmetric memory takes one backend per "
                             f"process). Give every layer the same cp_transport (or 'auto', which follows the "
                             f"other layers), or set ${TRANSPORT_ENV}")
    used = _symmetric_backend()
    if used is not None and (used == "NVSHMEM") != (transport == "nvshmem"):
        raise ValueError(f"{name}: cp_transport {transport!r}, but this process already allocates symmetric memory "
                         f"with the {used!r} backend; use one transport per process (${TRANSPORT_ENV})")
    _CLAIMS[owner] = (transport, name)


def _symmetric_backend() -> Optional[str]:
    """The backend this process's torch symmetric memory is fixed to, or None while it allocated none."""
    if not torch.cuda.is_initialized():
        return None
    import torch.distributed._symmetric_memory as symm_mem

    try:
        return symm_mem.get_backend(torch.device("cuda")) if _ALLOCATED else None
    except (AttributeError, RuntimeError):
        return None


def _process_transport() -> Optional[str]:
    """The device transport this process's layers, or its symmetric memory, have chosen (None: none yet)."""
    claimed = {transport for transport, _ in _CLAIMS.values()}
    if len(claimed) == 1:
        return claimed.pop()
    used = _symmetric_backend()
    return None if used is None else ("nvshmem" if used == "NVSHMEM" else "peer_memory")


def resolve_transport(transport: str, group, like: Tensor) -> str:
    """``send_recv``, ``peer_memory`` or ``nvshmem`` for a scan over ``group`` of states like ``like``.
    ``auto`` on one node takes the process's device transport (NVSHMEM where its layers asked for it,
    else peer memory). A device transport installs the step check (:func:`install_step_check`)."""
    if transport == "auto":
        transport = os.environ.get(TRANSPORT_ENV) or ("peer_memory" if like.is_cuda and _one_host(group)
                                                      else "send_recv")
        if transport == "peer_memory" and _process_transport() == "nvshmem":
            transport = "nvshmem"
    if transport not in RESOLVED_TRANSPORTS:
        raise ValueError(f"unknown All-Scan transport {transport!r}; expected one of {', '.join(TRANSPORTS)}"
                         f" (argument transport, layer cp_transport, or ${TRANSPORT_ENV})")
    if transport == "peer_memory":
        if like.is_cuda and not _one_host(group):
            raise ValueError("All-Scan transport 'peer_memory' needs every rank of the CP group on one node; "
                             "use transport='nvshmem' or 'send_recv'")
        if not like.is_cuda and not os.environ.get("TRITON_INTERPRET"):
            raise ValueError("All-Scan transport 'peer_memory' on the CPU runs its Triton kernel under "
                             "TRITON_INTERPRET=1 (for tests); use transport='send_recv'")
    if transport == "nvshmem":
        if not like.is_cuda:
            raise ValueError("All-Scan transport 'nvshmem' needs CUDA tensors; use transport='send_recv' "
                             "(or 'peer_memory' under TRITON_INTERPRET=1 for tests)")
        import torch.distributed._symmetric_memory as symm_mem

        if not symm_mem.is_nvshmem_available():
            raise ValueError("All-Scan transport 'nvshmem': this torch build or machine has no NVSHMEM "
                             "(pip install nvidia-nvshmem-cu12 or -cu13 to match CUDA); use transport='send_recv'")
    if transport in DEVICE_TRANSPORTS:
        install_step_check()
    return transport


def _one_host(group) -> bool:
    """Whether every rank of ``group`` runs on this host (asked once per group; collective)."""
    return len(set(host_nodes(group))) == 1


class PeerBuffers:
    """``nbytes`` of memory per rank of ``group``, zeroed, allocated collectively.

    ``of(rank)`` is the buffer this process addresses for group rank ``rank`` (a uint8 tensor on this
    rank's device): the peer's own buffer mapped here (peer memory: CUDA symmetric memory on one node,
    ``/dev/shm`` files on the CPU), or, with ``nvshmem``, this rank's own symmetric buffer for every
    rank: NVSHMEM addresses a peer's buffer by this rank's address of it and the peer's PE.
    """

    def __init__(self, group, nbytes: int, device: torch.device, nvshmem: bool = False):
        # _handle keeps the symmetric allocation (and the peers' mappings) alive
        self._ranks, self._handle = (_symmetric(group, nbytes, device, nvshmem) if device.type == "cuda"
                                     else (_host_shared(group, nbytes), None))

    def of(self, rank: int) -> Tensor:
        return self._ranks[rank]


def _symmetric(group, nbytes: int, device: torch.device, nvshmem: bool):
    global _ALLOCATED
    import torch.distributed._symmetric_memory as symm_mem

    backend = symm_mem.get_backend(device)
    if nvshmem and backend != "NVSHMEM":
        try:
            symm_mem.set_backend("NVSHMEM")  # for the whole process: fixed by its first allocation
        except RuntimeError as e:
            raise ValueError(f"All-Scan transport 'nvshmem' needs torch symmetric memory's NVSHMEM backend, but "
                             f"this process already allocates symmetric memory with {backend!r}: use one "
                             f"transport per process (${TRANSPORT_ENV})") from e
    with warnings.catch_warnings():  # needed by older torch, deprecated (a no-op) by newer
        warnings.simplefilter("ignore", FutureWarning)
        symm_mem.enable_symm_mem_for_group(group.group_name)
    _ALLOCATED = True
    local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(local, group.group_name) if group.size() > 1 else None  # one rank: no peers
    local.zero_()
    torch.cuda.synchronize(device)  # zeroed everywhere before any peer writes a flag
    dist.barrier(group=group)
    views = [local if nvshmem or r == group.rank() else handle.get_buffer(r, (nbytes,), torch.uint8, 0)
             for r in range(group.size())]
    return views, handle


def _host_shared(group, nbytes: int) -> List[Tensor]:
    names: List[Optional[str]] = [os.path.join(_shm_dir(), f"megatron_zeco_{uuid.uuid4().hex}")]
    dist.broadcast_object_list(names, src=dist.get_global_rank(group, 0), group=group)
    path = f"{names[0]}_{group.rank()}"
    with open(path, "wb") as f:
        f.truncate(nbytes)  # zeros
    dist.barrier(group=group)
    views = [torch.from_file(f"{names[0]}_{r}", shared=True, size=nbytes, dtype=torch.uint8)
             for r in range(group.size())]
    dist.barrier(group=group)  # everyone has mapped every file: the names can go
    os.unlink(path)
    return views


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class _Launch(NamedTuple):
    """One kernel of a rank's part of a scan: ``hop`` (``all_scan_hop``: the links it walks, two at a
    zigzag turn-around), ``out`` (the same for a zigzag rank's outgoing piece a, keeping the state
    leaving it), ``map`` or ``close`` (the zigzag return leg: ``all_scan_map``, ``all_scan_close``;
    links = the rank's pieces a and b); the addresses of the regions it uses; whether it waits for
    another rank; the group ranks it may wait for (the one whose data it receives, the one whose
    acknowledgement it needs before sending again; None: no such wait), named when a wait times out."""

    kind: str
    links: List[Link]
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
        self.data = _aligned(N * K * (V + 1) * dtype.itemsize)
        self.decays = N * K * V  # elements into a receive buffer: a map's decays
        self.flags = _aligned(N * tiles * _FLAG_BYTES)
        # NVSHMEM: an outbox (what a put sends from) and a scratch word (an acknowledgement's payload)
        size = self.data + 3 * self.flags + (self.data + _ALIGN if nvshmem else 0)
        buffers = PeerBuffers(group, 4 * size, device, nvshmem)
        rank, world = group.rank(), group.size()
        self.nvshmem = nvshmem
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


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _dim0_stride(ts: Sequence[Tensor], tail: int) -> Optional[int]:
    """The one stride of dim 0 (elements) by which the hop kernel can address every tensor of ``ts``
    (``tail`` trailing dims per state: each entry of dim 0 contiguous, as a local slot's view of a
    batch of pieces is), 0 where dim 0 has one entry or is not a batch dim; None if there is none."""
    if any(not (t.is_contiguous() if t.dim() <= tail else t[0].is_contiguous()) for t in ts):
        return None
    strides = {t.stride(0) for t in ts if t.dim() > tail and t.shape[0] > 1}
    return strides.pop() if len(strides) == 1 else (0 if not strides else None)


_CHANNELS: Dict[_ChannelKey, _Channel] = {}
TIMEOUT_ENV = "MEGATRON_ZECO_SCAN_TIMEOUT"
_DEFAULT_TIMEOUT = 600.0  # seconds, where the group's own timeout cannot be read


class ScanTimeoutError(RuntimeError):
    """A peer-memory All-Scan gave up waiting for a peer: it died, stalled, or diverged."""


class Watch:
    """What bounds one process's waits on its peers, per device.

    The scan kernels spin on flags that peers raise; a wait gives up after the scan's timeout (GPU
    clock), records which launch waited for what in ``report`` (host memory the device writes: the
    host reads it at any time without synchronising) and raises ``word`` (device memory), after which
    every other wait of the process gives up at once, every flag it raises is marked poisoned, so
    that its own peers give up at once too, and every state its kernels deliver is NaN. The host
    raises :class:`ScanTimeoutError` naming the layer, the direction, the piece, the peer and the
    call (:meth:`check`) at the start of every later scan and wherever :func:`check_scans` is
    called (before each optimizer step: :func:`install_step_check`). After that the process's scans
    stay failed: every later check raises the same error.
    """

    def __init__(self, device: torch.device):
        self.word = torch.zeros(1, dtype=torch.int32, device=device)
        self.report = torch.zeros(8, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._launches: Dict[tuple, int] = {}
        self._named: List[str] = []  # per launch id: what waited
        self._peers: List[Tuple[Optional[int], Optional[int]]] = []  # ... for which global ranks
        self._limits: Dict[int, float] = {}  # ... and for how long (seconds)
        self._timeout: Dict[object, float] = {}

    def launch_id(self, key: tuple, describe: Callable[[], Tuple[str, Tuple[Optional[int], Optional[int]]]]) -> int:
        """A stable id for one launch of one scan (``key``), so a graph replay reports like the capture.
        ``describe()``: the launch's name and the global ranks it may wait for (data, acknowledgement)."""
        if key not in self._launches:
            name, peers = describe()
            self._launches[key] = len(self._named)
            self._named.append(name)
            self._peers.append(peers)
        return self._launches[key]

    def timeout(self, group) -> float:
        """Seconds a wait may last: ``$MEGATRON_ZECO_SCAN_TIMEOUT``, else the group's own timeout."""
        if os.environ.get(TIMEOUT_ENV):
            try:
                value = float(os.environ[TIMEOUT_ENV])
            except ValueError:
                value = -1.0
            if not value > 0:
                raise ValueError(f"${TIMEOUT_ENV} must be a positive number of seconds, got "
                                 f"{os.environ[TIMEOUT_ENV]!r}")
            return value
        if group not in self._timeout:
            try:
                backend = group._get_backend(self.word.device if self.word.is_cuda else torch.device("cpu"))
                self._timeout[group] = backend.options._timeout.total_seconds()
            except (AttributeError, RuntimeError):
                self._timeout[group] = _DEFAULT_TIMEOUT
        return self._timeout[group]

    def arguments(self, who: int, timeout: float) -> Tuple[int, int, int, int]:
        """What the kernels take (``kernels.scan_hop._watched``) for launch ``who`` waiting ``timeout`` s."""
        self._limits[who] = timeout
        return self.word.data_ptr(), self.report.data_ptr(), int(timeout * 1e9), who

    @property
    def failed(self) -> bool:
        """Whether a wait of this process has given up (as far as the device has reported it)."""
        return int(self.report[0]) != 0

    def check(self) -> None:
        """Raise :class:`ScanTimeoutError` if a wait of this process has given up."""
        if not self.failed:
            return
        who, what, relayed, tile, wanted, seen = (int(x) for x in self.report[1:7])
        from ..kernels.scan_hop import POISON_BIT

        name, peer = self._named[who], self._peers[who][what - 1]
        thing = "the state it passes on" if what == 1 else "the acknowledgement of what it was sent last"
        why = (f"global rank {peer} gave up first (a rank before it died or stalled)" if relayed else
               f"none came within {self._limits.get(who, float('nan')):g} s (${TIMEOUT_ENV} or the process "
               f"group's timeout): the peer died, stalled, or diverged")
        raise ScanTimeoutError(
            f"{name}: global rank {dist.get_rank()} gave up waiting for {thing} from global rank {peer} "
            f"(call {wanted}, tile {tile}, flag {seen & ~POISON_BIT}): {why}. What that scan and every later one "
            f"delivered on this rank is NaN")


_WATCHES: Dict[torch.device, Watch] = {}


def _watch(device: torch.device) -> Watch:
    if device not in _WATCHES:
        _WATCHES[device] = Watch(device)
    return _WATCHES[device]


def check_scans() -> None:
    """Raise :class:`ScanTimeoutError` if an All-Scan of this process over a device transport
    (``peer_memory``, ``nvshmem``) has given up waiting for a peer.

    A scan that gives up does not raise inside the call (on GPUs its kernels run after the host has
    moved on): it delivers NaN, so everything computed from it is NaN, and records why. Call this
    once per training step after the backward pass and before the optimizer applies the gradients
    (Megatron's training loop and ``megatron_zeco.train`` do: :func:`install_step_check`). It reads
    host memory the GPU writes, without synchronising; what it sees is complete once the device has
    finished the step's backward pass (as it has when the optimizer has computed the gradient
    norm). Costs nothing when no scan has run over a device transport."""
    for watch in _WATCHES.values():
        watch.check()


def _check_before_step(optimizer, args, kwargs) -> None:
    check_scans()


_STEP_CHECK = None


def install_step_check() -> None:
    """Check the scans (:func:`check_scans`) before every ``torch.optim.Optimizer`` step of this process.

    Megatron's optimizers (``megatron.core.optimizer``: its mixed-precision and distributed
    optimizers, torch's, Apex's or TransformerEngine's Adam inside) call the inner torch optimizer's
    ``step`` after they have reduced the gradients and computed their norm, which synchronises with
    the device: by then every scan of the step has finished or given up, and a scan that gave up
    raises :class:`ScanTimeoutError` before any parameter changes. Installed once per process, by
    the first plan over a device transport."""
    global _STEP_CHECK
    if _STEP_CHECK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_CHECK = register_optimizer_step_pre_hook(_check_before_step)


def peer_all_scan(gamma: Sequence[Tensor], delta: Sequence[Tensor], init: Optional[Tensor], route, *,
                  reverse: bool = False, out: Optional[Sequence[Tensor]] = None,
                  while_waiting: Optional[Callable[[], None]] = None,
                  aside=None) -> Tuple[List[Tensor], Optional[Tensor]]:
    """:func:`all_scan` over a device transport (same arguments and result). ``aside``: a CUDA stream for the
    launches before the rank's first wait for a peer (sends that need nothing), which then run while
    ``while_waiting()`` runs on the current stream; the current stream waits for them after.
    ``route.what`` names the scan (layer and direction) in a :class:`ScanTimeoutError`. Over
    ``nvshmem``, the same kernels and protocol with tiles moved by NVSHMEM puts (any PE, on this node or
    another) instead of stores into the peers' mapped memory."""
    layout, group, num_blocks, what = route.layout, route.group, route.num_blocks, route.what
    nvshmem = route.transport == "nvshmem"
    from ..kernels.scan_hop import all_scan_close, all_scan_dense_hop, all_scan_hop, all_scan_map

    like = delta[0]
    K, V = like.shape[-2:]
    N = like.numel() // (K * V)
    dense = transition_of(gamma[0], like) is Dense
    # Channels hold a power of two of states: packed batches split per document pass one state
    # per document, a count that changes every step, and each new channel is a collective
    # allocation that is never freed (a peer may still be writing into it). A call uses the first N.
    capacity = 1 << (N - 1).bit_length()
    # Blocks of more than 32 rows move as 32-row tiles, each with its own flag: more programs in flight
    # and a finer pipeline through the zigzag turn-around (what a per-document packed batch's one
    # state per document needs to keep the link busy; bench_op.py's scan part times it).
    # Dense transitions: blocks and tiles of columns instead (a row of M S reads every row of S).
    rows = (V if dense else K) // num_blocks
    tiles = num_blocks * (rows // _TILE_ROWS if rows % _TILE_ROWS == 0 else 1)
    key = _ChannelKey(group, layout, capacity, K, V, like.dtype, tiles, like.device, nvshmem, dense)
    ch = _CHANNELS.get(key)
    if ch is None:
        with naming_failures(what, "setting up the All-Scan's symmetric buffers with every rank of the group"):
            ch = _CHANNELS[key] = _Channel(key)
    inputs = list(out) if out is not None else [torch.empty_like(d) for d in delta]
    # The kernel reads and writes the slots in place where one stride of dim 0 addresses them
    # (ScanGLA's slot views of its batches); otherwise through contiguous copies.
    gammas, deltas, s_ins = list(gamma), list(delta), inputs
    tail = 2 if dense else 1  # trailing dims of a transition: [K, K] or [K]
    strides = _dim0_stride(gammas, tail), _dim0_stride([*deltas, *s_ins], 2)
    if None in strides:
        gammas, deltas = [x.contiguous() for x in gammas], [x.contiguous() for x in deltas]
        s_ins = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in inputs]
        strides = _dim0_stride(gammas, tail), _dim0_stride([*deltas, *s_ins], 2)
    watch = _watch(like.device)
    timeout = watch.timeout(group)
    watch.check()  # a wait of an earlier scan gave up: fail before issuing more
    # The initial state as the kernel reads it: made on the current stream before ``aside`` waits for
    # it (a copy made later would race with the kernel reading it there).
    x_init = None if init is None else init.to(like.dtype).reshape(N, K, V).contiguous()
    last = y_a = None
    plan = ch.plan(reverse)
    wait_at = next((i for i, launch in enumerate(plan) if launch.waits), len(plan))
    sizes = (tiles, ch.data, ch.flags)
    main = torch.cuda.current_stream() if aside is not None else None
    if main is not None:
        aside.wait_stream(main)
    for i, launch in enumerate(plan):
        if i == wait_at:
            if while_waiting is not None:
                while_waiting()
            if main is not None:
                main.wait_stream(aside)
        links, regions = launch.links, launch.regions
        first, final = links[0], links[-1]
        # allocated on the current stream, whichever stream the kernel runs on, and held to the end
        # (past the current stream's wait for ``aside``)
        y = like.new_empty(like.shape) if final.last or launch.kind == "out" else None
        x = x_init if launch.kind in ("hop", "out") and first.first else None
        beside = main is not None and i < wait_at
        programs = _ASIDE_PROGRAMS if beside else None
        bounded = watch.arguments(watch.launch_id((id(ch), reverse, i, what), lambda: _describe(
            what, reverse, launch, layout, group, nvshmem)), timeout)
        remote = dict(watch=bounded, pes=ch.pes(launch), nvshmem=nvshmem)
        with torch.cuda.stream(aside) if beside else contextlib.nullcontext():
            inject.delay(like.device)  # test hook: no-op unless a stress test sets delays
            if launch.kind == "map":
                all_scan_map([gammas[first.slot], gammas[final.slot]], [deltas[first.slot], deltas[final.slot]],
                             regions, *strides, ch.decays, *sizes, has_src=launch.waits, programs=programs,
                             **remote)
            elif launch.kind == "close":
                all_scan_close(y_a, s_ins[final.slot], gammas[final.slot], deltas[final.slot], y, regions, *strides,
                               ch.decays, *sizes, **remote)
            else:  # "hop", or "out": a zigzag rank's outgoing hop, whose outgoing state close reads
                slots = [link.slot for link in links]
                hop = all_scan_dense_hop if dense else all_scan_hop
                hop(0 if x is None else x.data_ptr(), [gammas[s] for s in slots], [deltas[s] for s in slots],
                    [s_ins[s] for s in slots], y, regions, *strides, *sizes,
                    has_src=first.src is not None, has_init=x is not None, has_dst=regions[3] != 0,
                    programs=programs, **remote)
                y_a = y
            inject.delay(like.device)
        last = y if final.last else last
    if wait_at == len(plan):
        if while_waiting is not None:
            while_waiting()
        if main is not None:
            main.wait_stream(aside)
    if s_ins is not inputs:
        for target, s_in in zip(inputs, s_ins):
            target.copy_(s_in)
    return inputs, last


def _describe(what: str, reverse: bool, launch: _Launch, layout, group, nvshmem: bool):
    """How a launch is named when one of its waits gives up: the scan, the direction and the pieces;
    and the global ranks it waits for."""
    direction = "" if ("backward" in what or "forward" in what) else ("backward " if reverse else "forward ")
    pieces = " and ".join(str(link.piece) for link in launch.links)
    over = "NVSHMEM" if nvshmem else "peer memory"
    peers = tuple(None if r is None else dist.get_global_rank(group, r) for r in launch.peers)
    return (f"{what} [{direction}over {over}, {layout.value} layout on {group.size()} ranks, piece(s) {pieces}]",
            peers)
