"""Delays injected into the All-Scan transports: test hooks, off unless a test turns them on.

The scans' correctness must not depend on timing: a rank may reach any kernel or message late,
and the flags and acknowledgements (peer memory) or the messages' order (send/recv) must still
deliver every state once, to the right piece, unread data never overwritten. Stress tests turn
on :func:`scan_delays` in one rank's process: before and after each of its scan kernels (peer
memory) or messages (send/recv) it then waits a random time. On CUDA the wait is a GPU sleep on
the stream the kernel runs on (the host runs on; what is queued behind it is late); on the CPU
the host sleeps (the interpreted kernels run on the host).

Nothing here runs in training: with no delays set, :func:`delay` returns at once.
"""

import contextlib
import random
import time
from typing import Optional

import torch

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
