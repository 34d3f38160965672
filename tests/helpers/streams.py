"""CUDA's streams stood in for by recorders, so that the order in which a scan issues its launches, its
local work and its stream waits is seen on the CPU (the interpreted kernels run as issued)."""

import contextlib

import torch


@contextlib.contextmanager
def recorded_streams(log):
    """Within the block ``torch.cuda.current_stream()`` and ``torch.cuda.stream(s)`` run on recorders:
    ``wait_stream`` appends ``("wait", waiting, waited)`` to ``log``. Yields ``(main, side, current)``: the
    current stream's recorder, a side stream's, and the stack whose top is the stream in use."""

    class Recorder:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait", self.name, other.name))

    main, side = Recorder("main"), Recorder("aside")
    current = [main]

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    saved = torch.cuda.current_stream, torch.cuda.stream
    torch.cuda.current_stream, torch.cuda.stream = (lambda device=None: current[-1]), stream
    try:
        yield main, side, current
    finally:
        torch.cuda.current_stream, torch.cuda.stream = saved


def made_streams(monkeypatch):
    """``torch.cuda.Stream`` stood in for by a recorder: returns the list each stream made appends its
    ``(device, priority)`` to."""
    made = []

    class Recorder:
        def __init__(self, device, priority=0):
            made.append((device, priority))

    monkeypatch.setattr(torch.cuda, "Stream", Recorder)
    return made
