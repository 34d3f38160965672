"""A stand-in for CUDA where megatron-core assumes it on a CPU-only host (no megatron-core import)."""

from contextlib import ExitStack


def host_as_cuda():
    """megatron-core's dist-checkpointing (and its sequence-parallel collectives) assume CUDA:
    buffers on ``torch.cuda.current_device()``, host copies followed by ``torch.cuda.synchronize()``.
    On a CPU-only run, let the host stand in for the device; everything else runs unchanged."""
    from unittest import mock

    stack = ExitStack()
    stack.enter_context(mock.patch("torch.cuda.current_device", return_value="cpu"))
    stack.enter_context(mock.patch("torch.cuda.synchronize", return_value=None))
    return stack
