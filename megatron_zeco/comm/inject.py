"""Delays injected into the All-Scan transports: test hooks, off unless a test turns them on.

The scans' correctness must not depend on timing: a rank may reach any kernel or message late,
and the flags and acknowledgements (peer memory) or the messages' order (send/recv) must still
deliver every state once, to the right piece, unread data never overwritten. Stress tests turn
on :func:`scan_delays` in one rank's process: before and after each of its scan kernels (peer
memory) or messages (send/recv) it then waits a random time. On CUDA the wait is a GPU sleep on
the stream the kernel runs on (the host runs on; what is queued behind it is late); on the CPU
the host sleeps (the interpreted kernels run on the host).

:func:`link_latency` emulates latency between nodes on one host: a message of the send/recv
transport (``isend``, ``recv``, ``batch_isend_irecv`` here, which the scans call) that goes to a
rank of another node is handed to the transport a fixed time after it is issued, and every
message is recorded, so that :func:`longest_message_chain` can count the hops a scan waits for one after
another (``benchmarks/emulate_latency.py``, ``tests/comm/test_hierarchical.py``).

Nothing here runs in training: with no delays or latency set, :func:`delay` returns at once and
the message functions are the ``torch.distributed`` ones.
"""

import contextlib
import queue
import random
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

_ACTIVE: Optional["_Delays"] = None


class _Delays:
    def __init__(self, max_seconds: float, seed: int, chance: float):
        self.max_seconds, self.chance = max_seconds, chance
        self.random = random.Random(seed)
        self._cycles_per_second = {}

    def draw(self) -> float:
        return self.random.uniform(0.0, self.max_seconds) if self.random.random() < self.chance else 0.0

    def wait(self, seconds: float, device: torch.device) -> None:
        if seconds <= 0:
            return
        if device.type == "cuda":
            torch.cuda._sleep(int(seconds * self._rate(device)))
        else:
            time.sleep(seconds)

    def _rate(self, device: torch.device) -> float:
        """GPU clock cycles per second, measured once per device (``torch.cuda._sleep`` counts cycles)."""
        if device not in self._cycles_per_second:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            cycles = 20_000_000
            torch.cuda._sleep(cycles)  # clocks up
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self._cycles_per_second[device] = cycles / (start.elapsed_time(end) / 1e3)
        return self._cycles_per_second[device]


@contextlib.contextmanager
def scan_delays(max_seconds: float, *, seed: int = 0, chance: float = 0.5):
    """Inside the block, this process waits before and after each All-Scan kernel or message: with
    probability ``chance`` a time drawn uniformly from ``[0, max_seconds)``, else not at all
    (``seed`` fixes the draws)."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, _Delays(max_seconds, seed, chance)
    try:
        yield
    finally:
        _ACTIVE = previous


def delay(device: torch.device) -> None:
    """A point where a scan may be late: waits as :func:`scan_delays` draws (on the current stream
    for CUDA), or returns at once when no delays are set."""
    if _ACTIVE is not None:
        _ACTIVE.wait(_ACTIVE.draw(), device)


# ---------------------------------------------------------------------------------------------- link latency

_LINK: Optional["_LinkLatency"] = None


class _LinkLatency:
    """Messages to ranks on other nodes handed to the transport ``seconds`` after they are issued,
    by one delivery thread per process (in issue order: the latency is the same for every message,
    so the order between two ranks is kept), without holding up the sender; and a record of this
    process's messages in program order."""

    def __init__(self, seconds: float, node_of: Callable[[int], int]):
        self.seconds, self.node_of = seconds, node_of
        self.me = dist.get_rank()
        self.events: List[Tuple[str, int]] = []  # ("send" | "recv", peer's global rank), in program order
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._deliver, name="link-latency", daemon=True)
        self._thread.start()

    def crosses(self, peer: int) -> bool:
        return self.node_of(peer) != self.node_of(self.me)

    def send(self, issue: Callable[[], object], peer: int):
        """``issue()`` (which posts the send and returns its work) now, or after the latency on another
        node; returns an object whose ``wait()`` waits for the message to be sent."""
        self.events.append(("send", peer))
        if self.seconds <= 0 or not self.crosses(peer):
            return issue()
        pending = _Deferred()
        self._queue.put((time.monotonic() + self.seconds, issue, pending))
        return pending

    def received(self, peer: int) -> None:
        self.events.append(("recv", peer))

    def _deliver(self) -> None:
        while (item := self._queue.get()) is not None:
            due, issue, pending = item
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                pending.work = issue()
            except BaseException as e:  # noqa: BLE001  (handed to the waiter)
                pending.error = e
            pending.ready.set()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class _Deferred:
    """The work of a send the delivery thread has not posted yet."""

    def __init__(self):
        self.ready, self.work, self.error = threading.Event(), None, None

    def wait(self, *args) -> bool:
        self.ready.wait()
        if self.error is not None:
            raise self.error
        return self.work.wait(*args)


@contextlib.contextmanager
def link_latency(seconds: float, node_size: int):
    """Inside the block, an All-Scan message (send/recv transport) this process sends to a rank of
    another node (nodes of ``node_size`` consecutive global ranks) is handed to the transport
    ``seconds`` after it is issued: latency between nodes, emulated on one host. Messages inside a
    node go at once. Yields the record (a list, in program order, of ``("send" | "recv", peer)``,
    peers as global ranks) that :func:`longest_message_chain` reads."""
    global _LINK
    previous, _LINK = _LINK, _LinkLatency(seconds, lambda rank: rank // node_size)
    try:
        yield _LINK.events
    finally:
        _LINK.close()
        _LINK = previous


def isend(tensor: torch.Tensor, dst: int, group, tag: int = 0):
    """``dist.isend`` through the link-latency hook (at once when none is set)."""
    if _LINK is None:
        return dist.isend(tensor, dst, group=group, tag=tag)
    return _LINK.send(lambda: dist.isend(tensor, dst, group=group, tag=tag), dst)


def recv(tensor: torch.Tensor, src: int, group, tag: int = 0) -> None:
    """``dist.recv``, recorded by the link-latency hook when one is set."""
    dist.recv(tensor, src, group=group, tag=tag)
    if _LINK is not None:
        _LINK.received(src)


def batch_isend_irecv(ops: Sequence["dist.P2POp"]) -> list:
    """``dist.batch_isend_irecv`` through the link-latency hook: sends to other nodes leave after the
    latency, the rest at once; the works in the order of ``ops``. Receives are recorded after the
    sends (the caller waits for them before it sends again)."""
    if _LINK is None:
        return dist.batch_isend_irecv(list(ops))
    works: List[object] = [None] * len(ops)
    now = []
    for i, op in enumerate(ops):
        if op.op is dist.isend and _LINK.seconds > 0 and _LINK.crosses(op.peer):
            works[i] = _LINK.send(lambda op=op: dist.isend(op.tensor, op.peer, group=op.group, tag=op.tag), op.peer)
        else:
            if op.op is dist.isend:
                _LINK.events.append(("send", op.peer))
            now.append(i)
    if now:
        for i, work in zip(now, dist.batch_isend_irecv([ops[i] for i in now])):
            works[i] = work
    _LINK.events.extend(("recv", op.peer) for op in ops if op.op is not dist.isend)
    return works


def longest_message_chain(traces: Sequence[Sequence[Tuple[str, int]]], weight: Callable[[int, int], float]) -> float:
    """The longest chain of messages through the recorded program orders (``traces[r]``: what
    :func:`link_latency` yielded on global rank r), each message from a to b weighing ``weight(a, b)``:
    with 1 between nodes and 0 inside, the hops between nodes a scan must wait for one after
    another. A message's k-th receive from a peer is that peer's k-th send to it."""
    clock = [0.0] * len(traces)
    sent: Dict[Tuple[int, int], List[float]] = {}
    taken: Dict[Tuple[int, int], int] = {}
    at = [0] * len(traces)
    while any(i < len(t) for i, t in zip(at, traces)):
        progress = False
        for r, trace in enumerate(traces):
            while at[r] < len(trace):
                kind, peer = trace[at[r]]
                if kind == "send":
                    sent.setdefault((r, peer), []).append(clock[r] + weight(r, peer))
                else:
                    k = taken.get((peer, r), 0)
                    arrived = sent.get((peer, r), [])
                    if k >= len(arrived):
                        break
                    clock[r] = max(clock[r], arrived[k])
                    taken[(peer, r)] = k + 1
                at[r] += 1
                progress = True
        if not progress:
            raise ValueError("longest_message_chain: the traces wait for messages nobody sends")
    return max(clock)
