"""Triton kernels: one All-Scan hop through peer memory, ``S_out = Diag(gamma) S_in + delta``.

A rank's part of the All-Scan for one piece, with the state passed by one-sided stores
into the next rank's memory instead of messages (``comm/peer.py`` holds the protocol and
the buffers). Tile ``(n, b)`` is row tile ``b`` of the key rows of state ``n`` (a head of a
sequence, or of a document); its program (one per tile, or a capped number of programs
taking every so many tiles: a send beside other work leaves it the other SMs) waits until
the previous rank has published that tile, combines, stores the result straight into the
next rank's buffer and publishes it there. Tiles move independently, so a tile is forwarded
while the next one is still arriving: the paper's pipelined chain, issued by one launch. Where
the chain visits two pieces of this rank in a row (the zigzag turn-around), one launch
(``TWO``) combines both, so the tiles stay pipelined through the turn.

Dense transitions (the gated delta rule, ``S_out = M S_in + delta``) take their own hop kernel,
``all_scan_dense_hop_kernel``: tiles are column tiles there (a row of ``M S`` reads every row of
``S``), multiplied by ``M`` on arrival; same flags, acknowledgements and bounded waits.

A zigzag scan over peer memory has a second kind of message (``comm/peer.py``): its return
leg passes maps, a state and a row of decays, composed on each rank
(``all_scan_map_kernel``) and applied to the state leaving the rank's outgoing piece
(``all_scan_close_kernel``); same tiles, flags and acknowledgements.

Flags are sequence numbers, never reset: the sender publishes tile ``t`` of call ``seq``
by writing ``seq`` to the receiver's ``flag[t]`` after the data (release, system scope);
the receiver acknowledges by writing ``seq`` to the sender's ``ack[t]`` once it has read
the tile; before overwriting, a sender waits for the acknowledgement of its previous
message (``seq - 1``), so a slow receiver is never overrun. ``seq`` is counted on the device:
each region keeps one call counter per tile, read and bumped only by the program owning
that tile, so a launch has no per-call argument and can be captured in a CUDA graph and
replayed (every rank of a chain counts the calls in one direction alike). Every wait is bounded
(``_wait_at_least``): past the timeout it gives up, says why in a host report and marks what the
process publishes from then on, so its peers give up at once too (``comm/peer.py``, ``Watch``).
From then on every state (or map) the process's kernels deliver, here and to its peers, is NaN
(``_poison``): what a scan that gave up hands back carries NaN into every output and gradient
computed from it, never finite values from a state that did not arrive.

Shapes: ``gamma [B, ..., K]``; ``delta``, ``S_in`` ``[B, ..., K, V]``, float32 or float64, each
entry of dim 0 contiguous (dim 0 may be strided: a local slot's view of a batch of pieces);
the hops also take a delta of fewer columns than the state, its own strides, read as zero past
its columns, and decays (or a dense ``M``) inside a map (``delta_layout``, ``g_row``, ``m_row``: the
hierarchical scan's augmented states and maps, ``comm/peer_hierarchical.py``);
the incoming state and ``y`` contiguous ``[N, K, V]`` (N states in all); flags int32
``[N * tiles]``. The regions (this rank's and the peers') are passed as addresses: a
receive buffer, then its arrival flags, then the acknowledgements of what the slot sends,
then the call counters (read only by this rank).
"""

import time

import torch
import triton
import triton.language as tl

from . import DENSE_PRECISIONS
from .nvshmem import fence, put, put_signal

# A flag value with this bit set says that its sender gave up a wait (a peer before it died or
# stalled): the receiver gives up too, at once, instead of waiting out its own timeout.
POISON_BIT = 1 << 30
POISONED = tl.constexpr(POISON_BIT)


def _host_ns():
    """Nanoseconds on the host's monotonic clock: the interpreted kernels' clock (CPU tests)."""
    return time.monotonic_ns()


def _host_pause():
    """Yield the host's CPU for a moment: an interpreted kernel's spin-wait would otherwise take it from
    the very process it waits for (ranks share a few cores in CPU tests)."""
    time.sleep(2e-4)


_host_ns.__triton_builtin__ = True  # called only under TRITON_INTERPRET; no part of a compiled kernel
_host_pause.__triton_builtin__ = True


@triton.jit
def _now(INTERPRETED: tl.constexpr):
    """Nanoseconds: the GPU's global timer, or the host's clock under the interpreter."""
    if INTERPRETED:
        t = _host_ns()
    else:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    return t


@triton.jit
def _wait_at_least(flag, target, tile, WHAT: tl.constexpr, watch, report, timeout_ns, who,
                   INTERPRETED: tl.constexpr):
    """Spin until ``*flag >= target`` (acquire, system scope), then sync the program.

    Bounded: after ``timeout_ns`` of waiting (GPU clock) the wait gives up, records why in the host
    ``report`` (``comm.peer.Watch``: launch ``who`` waited for ``WHAT``, 1 a peer's data or 2 its
    acknowledgement, of ``tile``; the sequence number wanted and the one seen) and raises this
    process's ``watch`` word: every other wait then gives up at once and every later publish is
    marked ``POISONED``. A ``POISONED`` flag (the peer gave up) ends the wait the same way."""
    start = _now(INTERPRETED)
    seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    late = 0
    while (seen < target) & (late == 0):
        if INTERPRETED:
            _host_pause()
        if tl.atomic_add(watch, 0, sem="relaxed", scope="gpu") != 0:
            late = 1  # this process gave up elsewhere first; that wait reports
        elif _now(INTERPRETED) - start > timeout_ns:
            late = 2
        seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    if (late == 2) | ((seen & POISONED) != 0):
        if tl.atomic_cas(watch, 0, 1, sem="acq_rel", scope="gpu") == 0:  # the first to give up says why
            tl.store(report + 1, tl.cast(who, tl.int64))
            tl.store(report + 2, tl.cast(WHAT, tl.int64))
            tl.store(report + 3, tl.cast(late != 2, tl.int64))
            tl.store(report + 4, tl.cast(tile, tl.int64))
            tl.store(report + 5, tl.cast(target, tl.int64))
            tl.store(report + 6, tl.cast(seen, tl.int64))
            tl.atomic_xchg(report, 1, sem="release", scope="sys")
    tl.debug_barrier()


@triton.jit
def _flag_value(seq, watch):
    """What a publish writes: ``seq``, marked ``POISONED`` once this process has given up a wait."""
    value = tl.cast(seq, tl.int64)
    if tl.atomic_add(watch, 0, sem="relaxed", scope="gpu") != 0:
        value = value | POISONED
    return value


@triton.jit
def _given_up(watch):
    """Whether a wait of this process has given up (now or in an earlier scan)."""
    return tl.atomic_add(watch, 0, sem="relaxed", scope="gpu") != 0


@triton.jit
def _poison(x, failed):
    """``x``, or NaN everywhere once the process has given up (``failed``): a state that did not arrive
    must not pass for one that did."""
    return tl.where(failed, float("nan"), x)


@triton.jit
def _publish(flag, seq, watch):
    """Make this program's stores visible, then ``*flag = seq`` (release, system scope)."""
    tl.debug_barrier()
    tl.atomic_xchg(flag, _flag_value(seq, watch), sem="release", scope="sys")


@triton.jit
def _arrived(here, tile, seq, DATA: tl.constexpr, watch, report, timeout_ns, who, INTERPRETED: tl.constexpr):
    """Wait until call ``seq``'s ``tile`` has arrived in region ``here`` (its arrival flag)."""
    flag = (here + DATA).to(tl.pointer_type(tl.int64)) + tile
    _wait_at_least(flag, seq, tile, 1, watch, report, timeout_ns, who, INTERPRETED)


@triton.jit
def _acknowledged(sent, tile, seq, DATA: tl.constexpr, FLAGS: tl.constexpr, watch, report, timeout_ns, who,
                  INTERPRETED: tl.constexpr):
    """Wait until the receiver has read what region ``sent`` sent of ``tile`` in the previous call."""
    flag = (sent + DATA + FLAGS).to(tl.pointer_type(tl.int64)) + tile
    _wait_at_least(flag, seq - 1, tile, 2, watch, report, timeout_ns, who, INTERPRETED)


@triton.jit
def _outbox(dst, sent, DATA: tl.constexpr, FLAGS: tl.constexpr, NVSHMEM: tl.constexpr):
    """Where a tile's outgoing rows are stored: straight into the receiver's buffer (peer memory), or
    into this rank's outbox, the part of its sending region that NVSHMEM then puts."""
    if NVSHMEM:
        out = sent + DATA + 3 * FLAGS
    else:
        out = dst
    return out


@triton.jit
def _send(dst, sent, tile, start, nbytes, seq, dst_pe, watch, DATA: tl.constexpr, FLAGS: tl.constexpr,
          NVSHMEM: tl.constexpr):
    """Deliver call ``seq``'s ``tile`` (bytes ``start .. start + nbytes`` of a region's buffer, its rows
    stored where :func:`_outbox` says) and raise its arrival flag in region ``dst``: a flag store after
    the rows (peer memory), or one NVSHMEM put of the rows with the flag as its signal."""
    if NVSHMEM:
        tl.debug_barrier()
        put_signal(dst + start, sent + DATA + 3 * FLAGS + start, nbytes, dst + DATA + 8 * tile,
                   _flag_value(seq, watch), dst_pe)
    else:
        _publish((dst + DATA).to(tl.pointer_type(tl.int64)) + tile, seq, watch)


@triton.jit
def _ack(src, here, tile, seq, src_pe, watch, DATA: tl.constexpr, FLAGS: tl.constexpr, NVSHMEM: tl.constexpr):
    """Acknowledge call ``seq``'s ``tile`` to the rank that sent it (its region ``src``): a flag store,
    or (NVSHMEM) a put of a scratch word with the acknowledgement as its signal."""
    if NVSHMEM:
        scratch = DATA + 3 * FLAGS + DATA
        tl.debug_barrier()
        put_signal(src + scratch, here + scratch, 8, src + DATA + FLAGS + 8 * tile, _flag_value(seq, watch), src_pe)
    else:
        _publish((src + DATA + FLAGS).to(tl.pointer_type(tl.int64)) + tile, seq, watch)


LANE_PART = 1 << 16  # a rounds step's part column holds lane g of L as g * LANE_PART + L (lane_part)
_PART = tl.constexpr(LANE_PART)


def lane_part(lane) -> int:
    """The ``part`` column of a step of :func:`all_scan_rounds`' table for ``lane = (g, L)``:
    ``g * LANE_PART + L``, the step moving lane g's states only; 0 (every state) for None."""
    if lane is None:
        return 0
    g, L = lane
    if not 0 <= g < L < LANE_PART:
        raise ValueError(f"lane {g} of {L}: want 0 <= lane < lanes < {LANE_PART}")
    return g * LANE_PART + L


@triton.jit
def _lane_tile(at, LANE, LANES, TILES: tl.constexpr):
    """The ``at``-th tile of lane ``LANE`` of ``LANES``: the lane holds states ``LANE``, ``LANE + LANES``, ...
    (every state with one lane: ``LANES`` 1), all of their tiles."""
    return (LANE + LANES * (at // TILES)) * TILES + at % TILES


@triton.jit
def _tile(tile, here, TILES: tl.constexpr, DATA: tl.constexpr, FLAGS: tl.constexpr):
    """Tile ``tile``'s state ``i_n`` and row tile ``i_b``, its call counter in region ``here`` and this
    call's sequence number."""
    calls = (here + DATA + 2 * FLAGS).to(tl.pointer_type(tl.int64)) + tile
    return tile // TILES, tile % TILES, calls, tl.load(calls) + 1


@triton.jit
def _rows(i_n, i_b, r, G_STRIDE, S_STRIDE, INNER: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
          ROWS: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr, G_ROW):
    """Rows ``r .. r + BR`` of the tile: their indices, masks (rows; rows x columns) and offsets into a
    contiguous ``[N, K, V]`` buffer, into the strided slots (delta, s_in) and into gamma (a state's decays
    ``G_ROW`` apart)."""
    cols = tl.arange(0, BV)
    i_o, i_h = i_n // INNER, i_n % INNER
    rows = i_b * ROWS + r + tl.arange(0, BR)
    in_block = rows < i_b * ROWS + ROWS
    mask = in_block[:, None] & (cols[None, :] < V)
    offs = i_n * K * V + rows[:, None] * V + cols[None, :]
    s_offs = i_o * S_STRIDE + i_h * K * V + rows[:, None] * V + cols[None, :]
    return rows, in_block, mask, offs, s_offs, i_o * G_STRIDE + (i_h * K + rows) * G_ROW


@triton.jit
def _delta_rows(i_n, rows, in_block, D_STRIDE, D_ROW, DV, INNER: tl.constexpr, K: tl.constexpr, BV: tl.constexpr):
    """Offsets and mask of ``rows`` of state ``i_n`` in a delta of ``DV`` columns (those past DV read as
    zero), rows ``D_ROW`` apart."""
    cols = tl.arange(0, BV)
    i_o, i_h = i_n // INNER, i_n % INNER
    return i_o * D_STRIDE + (i_h * K + rows[:, None]) * D_ROW + cols[None, :], in_block[:, None] & (cols[None, :] < DV)


@triton.jit
def all_scan_hop_kernel(
    x_init,  # address of the incoming state where no rank sends it (initial state, or this rank's own)
    gamma, delta, s_in,  # the (first) piece's decay and delta, and where its incoming state goes
    gamma2, delta2, s_in2,  # TWO: the next piece, also on this rank (the zigzag turn-around)
    y_out,  # local copy of the outgoing state (KEEP_Y)
    here, sent, src, dst,  # addresses of the regions: this rank's receiving one and sending one, the peers'
    src_pe, dst_pe,  # NVSHMEM: the peers' PEs (src and dst are then this rank's addresses of their regions)
    G_STRIDE, S_STRIDE,  # element strides between consecutive entries of dim 0 (gamma; s_in)
    D_STRIDE, D_ROW, DV,  # delta: dim-0 stride, row stride, columns (those from DV to V read as zero)
    G_ROW,  # gamma: the stride between a state's decays (1; a map's column of decays: its row stride)
    INNER: tl.constexpr,  # states per entry of dim 0
    K: tl.constexpr, V: tl.constexpr, ROWS: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr,
    DATA: tl.constexpr, FLAGS: tl.constexpr,  # bytes of a region's receive buffer and of its flag array
    NT, TILES: tl.constexpr,  # tiles of the lane (its states x TILES), row tiles per state
    LANE, LANES,  # the lane whose states the launch moves (_lane_tile)
    HAS_SRC: tl.constexpr, HAS_INIT: tl.constexpr, HAS_DST: tl.constexpr, KEEP_Y: tl.constexpr,
    TWO: tl.constexpr,
    watch, report, timeout_ns, who,  # the bounded waits (_wait_at_least): addresses, limit, launch id
    INTERPRETED: tl.constexpr, NVSHMEM: tl.constexpr,
    PASS: tl.constexpr = False,  # pass the incoming state on as it is (no gamma, no delta)
):
    watch, report = watch.to(tl.pointer_type(tl.int32)), report.to(tl.pointer_type(tl.int64))
    dtype = delta.dtype.element_ty
    ELEM: tl.constexpr = dtype.primitive_bitwidth // 8
    if HAS_DST:
        out = _outbox(dst, sent, DATA, FLAGS, NVSHMEM).to(tl.pointer_type(dtype))
    for at in range(tl.program_id(0), NT, tl.num_programs(0)):
        tile = _lane_tile(at, LANE, LANES, TILES)
        i_n, i_b, calls, seq = _tile(tile, here, TILES, DATA, FLAGS)
        if HAS_SRC:  # the previous rank's tile has arrived in this region
            _arrived(here, tile, seq, DATA, watch, report, timeout_ns, who, INTERPRETED)
            x_in = here.to(tl.pointer_type(dtype))
        elif HAS_INIT:
            x_in = x_init.to(tl.pointer_type(dtype))
        if HAS_DST:  # the next rank has read what this rank sent it last time
            _acknowledged(sent, tile, seq, DATA, FLAGS, watch, report, timeout_ns, who, INTERPRETED)
        failed = _given_up(watch)
        for r in range(0, ROWS, BR):
            rows, in_block, mask, offs, s_offs, g_offs = _rows(i_n, i_b, r, G_STRIDE, S_STRIDE, INNER, K, V,
                                                               ROWS, BR, BV, G_ROW)
            d_offs, d_mask = _delta_rows(i_n, rows, in_block, D_STRIDE, D_ROW, DV, INNER, K, BV)
            if HAS_SRC or HAS_INIT:
                x = tl.load(x_in + offs, mask=mask, other=0.0, cache_modifier=".cg")
            else:
                x = tl.zeros([BR, BV], dtype)
            x = _poison(x, failed)
            if PASS:
                y = x
            else:
                decay = tl.load(gamma + g_offs, mask=in_block, other=0.0)
                y = decay[:, None] * x + tl.load(delta + d_offs, mask=d_mask, other=0.0)
            tl.store(s_in + s_offs, x, mask=mask)
            if TWO:
                tl.store(s_in2 + s_offs, y, mask=mask)
                decay = tl.load(gamma2 + g_offs, mask=in_block, other=0.0)
                y = decay[:, None] * y + tl.load(delta2 + d_offs, mask=d_mask, other=0.0)
            if HAS_DST:
                tl.store(out + offs, y, mask=mask)
            if KEEP_Y:
                tl.store(y_out + offs, y, mask=mask)
        if HAS_DST:
            _send(dst, sent, tile, (i_n * K + i_b * ROWS) * V * ELEM, ROWS * V * ELEM, seq, dst_pe,
                  watch, DATA, FLAGS, NVSHMEM)
        if HAS_SRC:
            _ack(src, here, tile, seq, src_pe, watch, DATA, FLAGS, NVSHMEM)
        tl.store(calls, seq)


@triton.jit
def all_scan_map_kernel(
    gamma_a, delta_a, gamma_b, delta_b,  # this rank's two pieces' maps (walk order: a out, b back)
    here, sent, dst,  # regions: this rank's (receives the map from the next rank; its acks), the previous rank's
    dst_pe,  # NVSHMEM: the previous rank's PE
    G_STRIDE, S_STRIDE, G_OFF,  # dim-0 strides (gamma; delta); element offset of a region's decays
    INNER: tl.constexpr, K: tl.constexpr, V: tl.constexpr, ROWS: tl.constexpr, BR: tl.constexpr,
    BV: tl.constexpr, DATA: tl.constexpr, FLAGS: tl.constexpr, NT, TILES: tl.constexpr, HAS_SRC: tl.constexpr,
    watch, report, timeout_ns, who, INTERPRETED: tl.constexpr, NVSHMEM: tl.constexpr,
):
    """The zigzag return leg: ``C = M_b o C_next o M_a`` (``C_next`` from the next rank, the identity on
    the turn-around rank), sent to the previous rank as a map: decays ``gamma_b gamma_C gamma_a`` and
    state ``gamma_b (gamma_C delta_a + delta_C) + delta_b``. Needs nothing from the outgoing leg."""
    watch, report = watch.to(tl.pointer_type(tl.int32)), report.to(tl.pointer_type(tl.int64))
    dtype = delta_a.dtype.element_ty
    ELEM: tl.constexpr = dtype.primitive_bitwidth // 8
    x_in, out = here.to(tl.pointer_type(dtype)), _outbox(dst, sent, DATA, FLAGS, NVSHMEM).to(tl.pointer_type(dtype))
    for tile in range(tl.program_id(0), NT, tl.num_programs(0)):
        i_n, i_b, calls, seq = _tile(tile, here, TILES, DATA, FLAGS)
        if HAS_SRC:  # the next rank's map has arrived (all_scan_close_kernel reads it again and acks it)
            _arrived(here, tile, seq, DATA, watch, report, timeout_ns, who, INTERPRETED)
        _acknowledged(sent, tile, seq, DATA, FLAGS, watch, report, timeout_ns, who, INTERPRETED)
        failed = _given_up(watch)
        for r in range(0, ROWS, BR):
            rows, in_block, mask, offs, s_offs, g_offs = _rows(i_n, i_b, r, G_STRIDE, S_STRIDE, INNER, K, V,
                                                               ROWS, BR, BV, 1)
            e = tl.load(delta_a + s_offs, mask=mask, other=0.0)
            g = tl.load(gamma_a + g_offs, mask=in_block, other=0.0)
            if HAS_SRC:
                g_c = tl.load(x_in + G_OFF + i_n * K + rows, mask=in_block, other=0.0, cache_modifier=".cg")
                e = g_c[:, None] * e + tl.load(x_in + offs, mask=mask, other=0.0, cache_modifier=".cg")
                g = g_c * g
            g_b = tl.load(gamma_b + g_offs, mask=in_block, other=0.0)
            e = _poison(g_b[:, None] * e + tl.load(delta_b + s_offs, mask=mask, other=0.0), failed)
            tl.store(out + offs, e, mask=mask)
            tl.store(out + G_OFF + i_n * K + rows, _poison(g_b * g, failed), mask=in_block)
        if NVSHMEM:  # the decays first, in their own put, ordered before the state's (which carries the flag)
            decays = (G_OFF + i_n * K + i_b * ROWS) * ELEM
            tl.debug_barrier()
            put(dst + decays, sent + DATA + 3 * FLAGS + decays, ROWS * ELEM, dst_pe)
            fence()
        _send(dst, sent, tile, (i_n * K + i_b * ROWS) * V * ELEM, ROWS * V * ELEM, seq, dst_pe,
              watch, DATA, FLAGS, NVSHMEM)
        if not HAS_SRC:
            tl.store(calls, seq)


@triton.jit
def all_scan_close_kernel(
    y_a,  # the state leaving this rank's outgoing piece (contiguous, all_scan_hop's y_out)
    s_in, gamma_b, delta_b, y_out,  # piece b: where its incoming state goes; the walk's end (LAST)
    here, src,  # regions: this rank's (holds the next rank's map), the next rank's (gets the ack)
    src_pe,  # NVSHMEM: the next rank's PE
    G_STRIDE, S_STRIDE, G_OFF,
    INNER: tl.constexpr, K: tl.constexpr, V: tl.constexpr, ROWS: tl.constexpr, BR: tl.constexpr,
    BV: tl.constexpr, DATA: tl.constexpr, FLAGS: tl.constexpr, NT, TILES: tl.constexpr, LAST: tl.constexpr,
    watch, report, timeout_ns, who, INTERPRETED: tl.constexpr, NVSHMEM: tl.constexpr,
):
    """Piece b's incoming state ``C_next(y_a)`` from the next rank's map; on the rank ending the walk
    also the state leaving piece b (``y_out``)."""
    watch, report = watch.to(tl.pointer_type(tl.int32)), report.to(tl.pointer_type(tl.int64))
    x_in = here.to(tl.pointer_type(s_in.dtype.element_ty))
    for tile in range(tl.program_id(0), NT, tl.num_programs(0)):
        i_n, i_b, calls, seq = _tile(tile, here, TILES, DATA, FLAGS)
        _arrived(here, tile, seq, DATA, watch, report, timeout_ns, who, INTERPRETED)
        failed = _given_up(watch)
        for r in range(0, ROWS, BR):
            rows, in_block, mask, offs, s_offs, g_offs = _rows(i_n, i_b, r, G_STRIDE, S_STRIDE, INNER, K, V,
                                                               ROWS, BR, BV, 1)
            g_c = tl.load(x_in + G_OFF + i_n * K + rows, mask=in_block, other=0.0, cache_modifier=".cg")
            x = g_c[:, None] * tl.load(y_a + offs, mask=mask, other=0.0) \
                + tl.load(x_in + offs, mask=mask, other=0.0, cache_modifier=".cg")
            x = _poison(x, failed)
            tl.store(s_in + s_offs, x, mask=mask)
            if LAST:
                g_b = tl.load(gamma_b + g_offs, mask=in_block, other=0.0)
                tl.store(y_out + offs, g_b[:, None] * x + tl.load(delta_b + s_offs, mask=mask, other=0.0), mask=mask)
        _ack(src, here, tile, seq, src_pe, watch, DATA, FLAGS, NVSHMEM)
        tl.store(calls, seq)


@triton.jit
def _map_rows(i_n, i_b, r, K: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr,
              COLS: tl.constexpr):
    """Rows ``r .. r + BR`` of tile ``(i_n, i_b)`` of maps ``[N, K, W]``: the rows' indices and mask, the mask
    of their elements and their offsets in a map and in a receive buffer. A row tile (``COLS`` 0: ``ROWS`` rows,
    every column; the same offsets in both), or a dense map's column tile (``COLS`` columns of all K rows, ``ROWS``
    then K, ``BV`` a power of two from COLS: stored together in a buffer, as ``all_scan_dense_hop_kernel``'s)."""
    if COLS:
        cols = tl.arange(0, BV)
        rows = r + tl.arange(0, BR)
        in_block = rows < K
        mask = in_block[:, None] & (cols[None, :] < COLS)
        at_map = i_n * K * W + rows[:, None] * W + i_b * COLS + cols[None, :]
        at_buffer = i_n * K * W + i_b * K * COLS + rows[:, None] * COLS + cols[None, :]
    else:
        rows, in_block, mask, at_map, _, _ = _rows(i_n, i_b, r, 0, 0, 1, K, W, ROWS, BR, BV, 1)
        at_buffer = at_map
    return rows, in_block, mask, at_map, at_buffer


@triton.jit
def all_scan_rounds_kernel(
    own,  # the map this rank's launch starts from (contiguous [N, K, W]: the state's E columns, then the decays)
    y_out,  # where the map it composes goes (contiguous [N, K, W])
    table,  # int64 [STEPS, 8]: per step (here, sent, src, dst, src_pe, dst_pe, compose, part); 0 where unused
    counters,  # address of the region whose call counters the launch keeps
    K: tl.constexpr, W: tl.constexpr, E: tl.constexpr, ROWS: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr,
    DATA: tl.constexpr, FLAGS: tl.constexpr, NT, TILES: tl.constexpr, LANE, LANES, STEPS: tl.constexpr,
    watch, report, timeout_ns, who,  # the bounded waits; step s waits as launch ``who + s``
    COPY: tl.constexpr,  # own is not y_out: each tile starts as own's
    INTERPRETED: tl.constexpr, NVSHMEM: tl.constexpr,
    COLS: tl.constexpr = 0,  # dense maps: column tiles of COLS columns (ROWS = K), steps passing the map on only
):
    """A run of steps of the hierarchical scan passing one map on, in one launch (``comm/peer_hierarchical.py``:
    a leader's lanes handed out, its rounds of phase B and C's send, or C's receive and sends inside a node).
    Step s of ``table``: where it has a source, wait for call ``seq``'s tile of the map
    sent to it and compose it under this rank's map (``compose``, diagonal maps: ``[E | t] <- t [E' | t'] + [E |
    0]``, the map from the leader ``2^r`` segments back) or take it as it is, and acknowledge it; then, where
    it has a destination, send the map as it now is (after the acknowledgement of the previous call). ``own`` may
    be ``y_out`` (a run that starts with a receive; ``COPY`` is off then). Tile by tile: a tile goes through every
    step before the program takes its next tile, so a round's tile leaves as soon as the same tile of the earlier
    rounds has arrived, instead of after the whole message. A step given a part (lane g of L) takes only that
    lane's tiles (a leader's lanes handed out; the parts of a state a rank takes in and sends on, and the others it
    receives). A tile's steps wait only for the same tile of earlier steps on other ranks (or for the previous
    call), so no wait closes a cycle whatever the number of programs. Each wait reports its own step's launch id
    (``who + s``). Dense maps (``COLS``) move in :func:`all_scan_dense_hop_kernel`'s column tiles and are only
    passed on here (a column tile of a composed dense map reads every column tile of the map received: their
    composes are launches of that kernel). Same flags, acknowledgements, bounded waits and poisoning as
    :func:`all_scan_hop_kernel`."""
    watch, report = watch.to(tl.pointer_type(tl.int32)), report.to(tl.pointer_type(tl.int64))
    dtype = y_out.dtype.element_ty
    ELEM: tl.constexpr = dtype.primitive_bitwidth // 8
    TILE: tl.constexpr = K * COLS if COLS else ROWS * W  # elements of a tile
    for at in range(tl.program_id(0), NT, tl.num_programs(0)):
        tile = _lane_tile(at, LANE, LANES, TILES)
        i_n, i_b, calls, seq = _tile(tile, counters, TILES, DATA, FLAGS)
        if COPY:
            for r in range(0, ROWS, BR):
                rows, in_block, mask, at_map, at_buffer = _map_rows(i_n, i_b, r, K, W, ROWS, BR, BV, COLS)
                tl.store(y_out + at_map, tl.load(own + at_map, mask=mask, other=0.0), mask=mask)
            tl.debug_barrier()
        for step in tl.static_range(STEPS):
            row = table + 8 * step
            here, sent, src, dst = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
            src_pe, dst_pe = tl.load(row + 4).to(tl.int32), tl.load(row + 5).to(tl.int32)
            compose = tl.load(row + 6) != 0
            part = tl.load(row + 7)  # 0: every tile; else lane g of L as g * _PART + L: that lane's states only
            if part != 0:
                if i_n % (part % _PART) != part // _PART:
                    src, dst = src * 0, dst * 0
            step_who = who + step
            if src != 0:  # the map sent to this rank: composed under its own (a round of B), or taken as it is
                _arrived(here, tile, seq, DATA, watch, report, timeout_ns, step_who, INTERPRETED)
                failed = _given_up(watch)
                x_in = here.to(tl.pointer_type(dtype))
                for r in range(0, ROWS, BR):
                    rows, in_block, mask, at_map, at_buffer = _map_rows(i_n, i_b, r, K, W, ROWS, BR, BV, COLS)
                    x = _poison(tl.load(x_in + at_buffer, mask=mask, other=0.0, cache_modifier=".cg"), failed)
                    if not COLS:
                        if compose:
                            t = tl.load(y_out + (i_n * K + rows) * W + E, mask=in_block, other=0.0)
                            own_e = tl.load(y_out + at_map, mask=mask & (tl.arange(0, BV)[None, :] < E), other=0.0)
                            tl.debug_barrier()
                            x = t[:, None] * x + own_e
                    tl.store(y_out + at_map, x, mask=mask)
                _ack(src, here, tile, seq, src_pe, watch, DATA, FLAGS, NVSHMEM)
            if dst != 0:  # the map as it now is, to the leader 2^r segments on (or C's: into the next segment)
                _acknowledged(sent, tile, seq, DATA, FLAGS, watch, report, timeout_ns, step_who, INTERPRETED)
                failed = _given_up(watch)
                out = _outbox(dst, sent, DATA, FLAGS, NVSHMEM).to(tl.pointer_type(dtype))
                tl.debug_barrier()
                for r in range(0, ROWS, BR):
                    rows, in_block, mask, at_map, at_buffer = _map_rows(i_n, i_b, r, K, W, ROWS, BR, BV, COLS)
                    tl.store(out + at_buffer, _poison(tl.load(y_out + at_map, mask=mask, other=0.0), failed), mask=mask)
                _send(dst, sent, tile, (i_n * K * W + i_b * TILE) * ELEM, TILE * ELEM, seq, dst_pe, watch, DATA,
                      FLAGS, NVSHMEM)
            tl.debug_barrier()
        tl.store(calls, seq)


@triton.jit
def _dense_product(M, m_base, M_ROW, x, r, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
                   PRECISION: tl.constexpr):
    """Rows ``r .. r + BR`` of ``M x``: ``M`` a K x K matrix at ``M + m_base`` (rows ``M_ROW`` apart), ``x`` the
    ``[BK, BC]`` columns it acts on (rows past K zero). ``tl.dot`` on tensor cores (``DOT``) in ``PRECISION``:
    ``"tf32x3"``, three TF32 passes (float32 accuracy, each operand split into a TF32 head and tail), or
    ``"tf32"``, one (each operand rounded to 10 explicit mantissa bits); or products summed elementwise (float64,
    and blocks under 16)."""
    rows = r + tl.arange(0, BR)
    kk = tl.arange(0, BK)
    m = tl.load(M + m_base + rows[:, None] * M_ROW + kk[None, :], mask=(rows[:, None] < K) & (kk[None, :] < K),
                other=0.0)
    if DOT:
        y = tl.dot(m, x, input_precision=PRECISION)
    else:
        y = tl.sum(m[:, :, None] * x[None, :, :], axis=1)
    return rows, y


@triton.jit
def all_scan_dense_hop_kernel(
    x_init,  # address of the incoming state where no rank sends it (contiguous [N, K, V]), or 0
    M, delta, s_in,  # the (first) piece's transition [.., K, K] and delta, and where its incoming state goes
    M2, delta2, s_in2,  # TWO: the next piece, also on this rank (the zigzag turn-around)
    y_out,  # local copy of the outgoing state (KEEP_Y; contiguous [N, K, V])
    here, sent, src, dst,  # regions, as all_scan_hop_kernel's
    src_pe, dst_pe,
    M_STRIDE, S_STRIDE,  # element strides between consecutive entries of dim 0 (M; s_in)
    D_STRIDE, D_ROW, DV,  # delta: dim-0 stride, row stride, columns (those from DV to V read as zero)
    M_ROW,  # M's row stride (K; a map's transition part: the map's row stride)
    INNER: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    COLS: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, DOT: tl.constexpr,
    PRECISION: tl.constexpr, DATA: tl.constexpr, FLAGS: tl.constexpr, NT, TILES: tl.constexpr, LANE, LANES,
    HAS_SRC: tl.constexpr, HAS_INIT: tl.constexpr, HAS_DST: tl.constexpr, KEEP_Y: tl.constexpr,
    TWO: tl.constexpr,
    watch, report, timeout_ns, who, INTERPRETED: tl.constexpr, NVSHMEM: tl.constexpr,
    PASS: tl.constexpr = False,  # pass the incoming state on as it is (no M, no delta)
):
    """:func:`all_scan_hop_kernel` for dense transitions (the gated delta rule): ``S_out = M S_in +
    delta``. A row of ``M S`` reads every row of ``S``, a column only its own, so tile ``(n, b)`` is
    column tile ``b`` (``COLS`` columns, all K rows) of state ``n``. In the receive buffers a tile's
    rows are stored together (``[K, COLS]`` at element ``(n K V + b K COLS)``), so that it moves as
    one contiguous put over NVSHMEM. Same flags, acknowledgements and bounded waits."""
    watch, report = watch.to(tl.pointer_type(tl.int32)), report.to(tl.pointer_type(tl.int64))
    dtype = delta.dtype.element_ty
    ELEM: tl.constexpr = dtype.primitive_bitwidth // 8
    kk = tl.arange(0, BK)
    cc = tl.arange(0, BC)
    if HAS_DST:
        out = _outbox(dst, sent, DATA, FLAGS, NVSHMEM).to(tl.pointer_type(dtype))
    for at in range(tl.program_id(0), NT, tl.num_programs(0)):
        tile = _lane_tile(at, LANE, LANES, TILES)
        i_n, i_b, calls, seq = _tile(tile, here, TILES, DATA, FLAGS)
        i_o, i_h = i_n // INNER, i_n % INNER
        m_base = i_o * M_STRIDE + i_h * K * M_ROW
        s_base = i_o * S_STRIDE + i_h * K * V + i_b * COLS  # the tile's first column in the slots
        d_base = i_o * D_STRIDE + i_h * K * D_ROW + i_b * COLS  # ... and in delta
        d_cols = (cc[None, :] < COLS) & (i_b * COLS + cc[None, :] < DV)
        in_tile = (kk[:, None] < K) & (cc[None, :] < COLS)
        s_offs = s_base + kk[:, None] * V + cc[None, :]
        tile_base = i_n * K * V + i_b * K * COLS  # in a receive buffer (the tile's rows together)
        if HAS_SRC:  # the previous rank's tile has arrived in this region
            _arrived(here, tile, seq, DATA, watch, report, timeout_ns, who, INTERPRETED)
            x = tl.load(here.to(tl.pointer_type(dtype)) + tile_base + kk[:, None] * COLS + cc[None, :], mask=in_tile,
                        other=0.0, cache_modifier=".cg")
        elif HAS_INIT:
            x = tl.load(x_init.to(tl.pointer_type(dtype)) + i_n * K * V + i_b * COLS + kk[:, None] * V + cc[None, :],
                        mask=in_tile, other=0.0)
        else:
            x = tl.zeros([BK, BC], dtype)
        if HAS_DST:  # the next rank has read what this rank sent it last time
            _acknowledged(sent, tile, seq, DATA, FLAGS, watch, report, timeout_ns, who, INTERPRETED)
        x = _poison(x, _given_up(watch))
        tl.store(s_in + s_offs, x, mask=in_tile)
        if PASS:
            if HAS_DST:
                tl.store(out + tile_base + kk[:, None] * COLS + cc[None, :], x, mask=in_tile)
            if KEEP_Y:
                tl.store(y_out + i_n * K * V + i_b * COLS + kk[:, None] * V + cc[None, :], x, mask=in_tile)
        elif TWO:  # piece 1's outgoing state is piece 2's incoming one: all its rows, then piece 2
            for r in range(0, K, BR):
                rows, y = _dense_product(M, m_base, M_ROW, x, r, K, BR, BK, DOT, PRECISION)
                mask = (rows[:, None] < K) & (cc[None, :] < COLS)
                d = tl.load(delta + d_base + rows[:, None] * D_ROW + cc[None, :], mask=(rows[:, None] < K) & d_cols,
                            other=0.0)
                tl.store(s_in2 + s_base + rows[:, None] * V + cc[None, :], y + d, mask=mask)
            tl.debug_barrier()
            x = tl.load(s_in2 + s_offs, mask=in_tile, other=0.0)
            M_last, delta_last = M2, delta2
        else:
            M_last, delta_last = M, delta
        if not PASS:
            for r in range(0, K, BR):
                rows, y = _dense_product(M_last, m_base, M_ROW, x, r, K, BR, BK, DOT, PRECISION)
                mask = (rows[:, None] < K) & (cc[None, :] < COLS)
                y += tl.load(delta_last + d_base + rows[:, None] * D_ROW + cc[None, :], mask=(rows[:, None] < K) & d_cols,
                             other=0.0)
                if HAS_DST:
                    tl.store(out + tile_base + rows[:, None] * COLS + cc[None, :], y, mask=mask)
                if KEEP_Y:
                    tl.store(y_out + i_n * K * V + i_b * COLS + rows[:, None] * V + cc[None, :], y, mask=mask)
        if HAS_DST:
            _send(dst, sent, tile, tile_base * ELEM, K * COLS * ELEM, seq, dst_pe, watch, DATA, FLAGS, NVSHMEM)
        if HAS_SRC:
            _ack(src, here, tile, seq, src_pe, watch, DATA, FLAGS, NVSHMEM)
        tl.store(calls, seq)


def _lane_states(N: int, lane) -> int:
    """States of lane ``lane = (g, L)`` among N: g, g + L, ... (:func:`_lane_tile`); N where ``lane`` is None."""
    if lane is None:
        return N
    g, L = lane
    if not 0 <= g < L:
        raise ValueError(f"lane {g} of {L}: want 0 <= lane < lanes")
    return len(range(g, N, L))


def _shape(delta, tiles, programs=None, lane=None):
    """Grid and launch constants for N states like ``delta`` (``[B, ..., K, V]``) in ``tiles`` row tiles:
    one program per tile, or at most ``programs``, each then taking every ``programs``-th tile. ``lane``:
    ``(g, L)``, the tiles of lane g of L only (the kernel's ``LANE``, ``LANES``; None: kernels without)."""
    K, V = delta.shape[-2:]
    N = delta.numel() // (K * V)
    rows = K // tiles
    BV = triton.next_power_of_2(V)
    BR = max(1, min(triton.next_power_of_2(rows), 4096 // BV))
    NT = _lane_states(N, lane) * tiles
    lanes = {} if lane is None else dict(LANE=lane[0], LANES=lane[1])
    return (min(NT, programs or NT),), dict(
        INNER=N // delta.shape[0] if delta.dim() > 2 else 1, K=K, V=V, ROWS=rows, BR=BR, BV=BV, NT=NT,
        TILES=tiles, num_warps=min(16, max(1, BR * BV // 256)), **lanes)


def _watched(watch, like) -> dict:
    """The bounded waits' kernel arguments: ``watch`` = (address of the process's watch word, address of
    its host report, timeout in ns, launch id) (``comm.watch.Watch``); the host's clock under the
    interpreter (CPU tensors)."""
    address, report, timeout_ns, who = watch
    return dict(watch=address, report=report, timeout_ns=timeout_ns, who=who, INTERPRETED=not like.is_cuda)


def _kernel(kernel, nvshmem: bool):
    """``kernel``, or its NVSHMEM variant (``kernels/nvshmem.py``)."""
    if not nvshmem:
        return kernel
    from .nvshmem import nvshmem_kernel

    return nvshmem_kernel(kernel)


def all_scan_hop(x_init, gammas, deltas, s_ins, y_out, regions, g_stride, s_stride, tiles, data_bytes,
                 flag_bytes, *, has_src, has_init, has_dst, watch, pes=(-1, -1), nvshmem=False, programs=None,
                 pass_through=False, delta_layout=None, g_row=1, lane=(0, 1)):
    """Launch one hop over one piece, or two consecutive ones (``len(gammas) == 2``), of N states
    x ``tiles`` tiles of rows, each with its own flag (see the module docstring).

    ``gammas``, ``deltas``, ``s_ins``: per piece; entry i of dim 0 starts ``i * g_stride``
    (gammas) or ``i * s_stride`` (the others) elements in; ``delta_layout = (d_stride, d_row, d_cols)``:
    the deltas' own dim-0 stride, row stride and columns instead (those past ``d_cols`` read as zero:
    a state's delta acting on a wider map ``[S | T]``); ``g_row``: the stride between a state's decays
    (a map's column of decays). ``regions``: ``(here, sent, src, dst)``
    integer addresses (0 where unused): this rank's receiving region and sending region, the
    previous rank's, the next rank's; a region is a receive buffer of ``data_bytes``, then arrival
    flags, acknowledgements and call counters of ``flag_bytes`` each (and, NVSHMEM, an outbox of
    ``data_bytes`` and a scratch word). ``x_init``: the address of a contiguous incoming state, or 0;
    ``y_out``: where the outgoing state goes too, or None. ``programs``: at most this many programs
    (None: one per tile), to leave SMs to other streams. ``watch``: what bounds the waits
    (:func:`_watched`). ``nvshmem``: move tiles by NVSHMEM puts; ``src`` and ``dst`` are then this
    rank's addresses of the peers' (symmetric) regions and ``pes`` the peers' PEs. ``pass_through``: the
    hop passes the incoming state on unchanged (one piece; ``gammas`` and ``deltas`` are not read: any
    tensors of the state's dtype, ``deltas[-1]`` of the state's shape). ``lane = (g, L)``: only states
    g, g + L, ... (a lane of the hierarchical scan); nothing is launched where the lane holds none.
    """
    if pass_through and len(gammas) != 1:
        raise ValueError("all_scan_hop: a pass-through hop walks one piece")
    grid, shape = _shape(s_ins[-1], tiles, programs, lane)
    if shape["NT"] == 0:
        return
    _kernel(all_scan_hop_kernel, nvshmem)[grid](
        x_init, gammas[0], deltas[0], s_ins[0], gammas[-1], deltas[-1], s_ins[-1],
        s_ins[-1] if y_out is None else y_out, *regions, *pes, g_stride, s_stride,
        *_delta_layout(delta_layout, s_stride, shape["V"]), g_row,
        DATA=data_bytes, FLAGS=flag_bytes, HAS_SRC=has_src, HAS_INIT=has_init, HAS_DST=has_dst,
        KEEP_Y=y_out is not None, TWO=len(gammas) == 2, **_watched(watch, deltas[0]), NVSHMEM=nvshmem,
        PASS=pass_through, **shape,
    )


def _tensor_cores(dtype: torch.dtype, *block_dims: int) -> bool:
    """Whether a dense hop's products run as ``tl.dot`` (``_dense_product``'s ``DOT``): float32 blocks whose
    every dimension is 16 or more."""
    return dtype == torch.float32 and min(block_dims) >= 16


def dense_block_rows(K: int, columns: int, dtype: torch.dtype) -> int:
    """Rows of ``M`` a dense hop's program multiplies at a time, for a tile of ``columns`` columns: 64 on tensor
    cores (float32 tiles of 16 columns or more; ``benchmarks/bench_hop.py --dense-block-rows`` times the
    choices), else 32 (elementwise products, each row block holding rows x K x columns of them in registers)."""
    BK = triton.next_power_of_2(K)
    return min(BK, 64 if _tensor_cores(dtype, BK, triton.next_power_of_2(columns)) else 32)


def all_scan_dense_hop(x_init, Ms, deltas, s_ins, y_out, regions, m_stride, s_stride, tiles, data_bytes,
                       flag_bytes, *, has_src, has_init, has_dst, watch, pes=(-1, -1), nvshmem=False, programs=None,
                       pass_through=False, delta_layout=None, m_row=None, lane=(0, 1), block_rows=None,
                       precision="tf32x3"):
    """:func:`all_scan_hop` for dense transitions (:func:`all_scan_dense_hop_kernel`): ``Ms`` per piece,
    ``[B, ..., K, K]`` (entry i of dim 0 ``i * m_stride`` elements in), float32 or float64 like the
    states; ``tiles`` column tiles per state (a divisor of V); ``m_row``: their row stride (None: K, a
    map's transition part: the map's); ``block_rows``: rows of ``M`` a program multiplies at a time, a power
    of two (None: :func:`dense_block_rows`); ``precision``: how float32 products on tensor cores round, one of
    :data:`DENSE_PRECISIONS` (``megatron_zeco.kernels.dense_precision`` of the pieces' map precision). Other
    arguments as :func:`all_scan_hop`."""
    if pass_through and len(Ms) != 1:
        raise ValueError("all_scan_dense_hop: a pass-through hop walks one piece")
    if precision not in DENSE_PRECISIONS:
        raise ValueError(f"all_scan_dense_hop: precision must be one of {DENSE_PRECISIONS}, got {precision!r}")
    if block_rows is not None and (block_rows < 1 or block_rows & (block_rows - 1)):
        raise ValueError(f"all_scan_dense_hop: block_rows must be a power of two, got {block_rows}")
    delta = s_ins[-1]  # of the state's shape
    K, V = delta.shape[-2:]
    N = delta.numel() // (K * V)
    cols = V // tiles
    BC, BK = triton.next_power_of_2(cols), triton.next_power_of_2(K)
    BR = min(BK, block_rows or dense_block_rows(K, cols, delta.dtype))
    dot = _tensor_cores(delta.dtype, BR, BK, BC)
    NT = _lane_states(N, lane) * tiles
    if NT == 0:
        return
    _kernel(all_scan_dense_hop_kernel, nvshmem)[(min(NT, programs or NT),)](
        x_init, Ms[0], deltas[0], s_ins[0], Ms[-1], deltas[-1], s_ins[-1], s_ins[-1] if y_out is None else y_out,
        *regions, *pes, m_stride, s_stride, *_delta_layout(delta_layout, s_stride, V), K if m_row is None else m_row,
        INNER=N // delta.shape[0] if delta.dim() > 2 else 1, K=K, V=V,
        COLS=cols, BC=BC, BK=BK, BR=BR, DOT=dot, PRECISION=precision, DATA=data_bytes, FLAGS=flag_bytes, NT=NT,
        TILES=tiles, LANE=lane[0], LANES=lane[1],
        HAS_SRC=has_src, HAS_INIT=has_init, HAS_DST=has_dst, KEEP_Y=y_out is not None, TWO=len(Ms) == 2,
        **_watched(watch, delta), NVSHMEM=nvshmem, PASS=pass_through, num_warps=4)


def all_scan_rounds(own, y_out, table, counters, tiles, data_bytes, flag_bytes, *, watch, nvshmem=False,
                    programs=None, lane=(0, 1), dense=False):
    """Launch :func:`all_scan_rounds_kernel`: a run of steps of the hierarchical scan in one launch, from its
    map ``own`` into ``y_out`` (both contiguous ``[N, K, W]``: diagonal maps ``W = V + 1``, dense ones
    ``dense`` ``W = V + K`` in ``tiles`` column tiles, passed on only). ``table``: an int64 tensor
    ``[steps, 8]`` on the maps' device, per step ``(here, sent, src, dst, src_pe, dst_pe, compose, part)``
    (the regions as :func:`all_scan_hop`'s; a step receives where ``src`` is set, then sends where ``dst``
    is, composing what it receives where ``compose`` is set (diagonal maps only), else taking it as it is;
    ``part``: 0, or ``g * LANE_PART + L``, the step moving lane g's states of L only: :func:`lane_part`);
    ``counters``: the region whose call counters the launch keeps. ``watch``: as :func:`all_scan_hop`'s, its
    launch id the first step's (step s waits as id + s). Other arguments as :func:`all_scan_hop`."""
    grid, shape = _shape(y_out, tiles, programs, lane)
    if shape["NT"] == 0:
        return
    K, W = shape["K"], shape["V"]
    tile = dict(ROWS=shape["ROWS"], BR=shape["BR"], BV=shape["BV"], num_warps=shape["num_warps"])
    if dense:  # column tiles: all K rows of W // tiles columns
        cols = W // tiles
        BC = triton.next_power_of_2(cols)
        BR = max(1, min(triton.next_power_of_2(K), 4096 // BC))
        tile = dict(ROWS=K, BR=BR, BV=BC, COLS=cols, num_warps=min(16, max(1, BR * BC // 256)))
    address, report, timeout_ns, who = watch
    _kernel(all_scan_rounds_kernel, nvshmem)[grid](
        own, y_out, table, counters, K=K, W=W, E=W - 1, DATA=data_bytes, FLAGS=flag_bytes, NT=shape["NT"],
        TILES=tiles, LANE=shape["LANE"], LANES=shape["LANES"], STEPS=table.shape[0], watch=address, report=report,
        timeout_ns=timeout_ns, who=who, COPY=own.data_ptr() != y_out.data_ptr(), INTERPRETED=not y_out.is_cuda,
        NVSHMEM=nvshmem, **tile)


def _delta_layout(layout, s_stride: int, V: int):
    """The deltas' (dim-0 stride, row stride, columns): ``layout``, or the states' (``s_stride``, V, V)."""
    return (s_stride, V, V) if layout is None else layout


def all_scan_map(gammas, deltas, regions, g_stride, s_stride, g_off, tiles, data_bytes, flag_bytes, *, has_src,
                 watch, pes=(-1, -1), nvshmem=False, programs=None):
    """Launch the zigzag return leg on one rank (:func:`all_scan_map_kernel`): ``gammas``, ``deltas``
    of its pieces a and b; ``regions``: ``(here, sent, dst)``; ``g_off``: where a region's decays
    start (elements). Other arguments as :func:`all_scan_hop`."""
    (gamma_a, gamma_b), (delta_a, delta_b) = gammas, deltas
    grid, shape = _shape(delta_a, tiles, programs)
    _kernel(all_scan_map_kernel, nvshmem)[grid](
        gamma_a, delta_a, gamma_b, delta_b, *regions, pes[1], g_stride, s_stride, g_off, DATA=data_bytes,
        FLAGS=flag_bytes, HAS_SRC=has_src, **_watched(watch, delta_a), NVSHMEM=nvshmem, **shape)


def all_scan_close(y_a, s_in, gamma_b, delta_b, y_out, regions, g_stride, s_stride, g_off, tiles, data_bytes,
                   flag_bytes, *, watch, pes=(-1, -1), nvshmem=False, programs=None):
    """Launch :func:`all_scan_close_kernel`: piece b's incoming state from the next rank's map applied to
    ``y_a``, and ``y_out`` (the walk's last state) unless it is None. ``regions``: ``(here, src)``. Other
    arguments as :func:`all_scan_hop`."""
    grid, shape = _shape(delta_b, tiles, programs)
    _kernel(all_scan_close_kernel, nvshmem)[grid](
        y_a, s_in, gamma_b, delta_b, s_in if y_out is None else y_out, *regions, pes[0], g_stride, s_stride, g_off,
        DATA=data_bytes, FLAGS=flag_bytes, LAST=y_out is not None, **_watched(watch, delta_b), NVSHMEM=nvshmem,
        **shape)
