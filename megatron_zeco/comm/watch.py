"""Bounded waits of the device transports' scans: what gave up, and the check before each optimizer step.

The scan kernels over peer memory and NVSHMEM (``kernels/scan_hop.py``) spin on flags their peers raise.
A rank that never arrives (it died, or stalled) is reported, not spun on: every wait is bounded by the
group's timeout (or ``$MEGATRON_ZECO_SCAN_TIMEOUT`` seconds), measured on the GPU's clock. The rank that
gives up marks the flags it raises from then on, so the ranks after it give up at once, and delivers NaN
instead of the state it did not get, so that every output and gradient computed from it is NaN. Each
rank raises :class:`ScanTimeoutError`, naming the layer, the direction, the piece, the peer it waited
for and the call (:class:`Watch`), at its next scan and at :func:`check_scans`, which runs before every
optimizer step (:func:`install_step_check`).
"""

import os
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

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
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise ScanTimeoutError(
            f"{name}: global rank {rank} gave up waiting for {thing} from global rank {peer} "
            f"(call {wanted}, tile {tile}, flag {seen & ~POISON_BIT}): {why}. What that scan and every later one "
            f"delivered on this rank is NaN")


_WATCHES: Dict[torch.device, Watch] = {}


def watch(device: torch.device) -> Watch:
    """This process's :class:`Watch` of ``device``."""
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
