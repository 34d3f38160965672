"""NVSHMEM device calls for the All-Scan kernels (``transport="nvshmem"``).

Triton reaches NVSHMEM's device library (``libnvshmem_device.bc``, shipped with the
``nvidia-nvshmem`` wheel) through extern calls; a kernel that makes them is compiled with that
library linked in and its module initialised for NVSHMEM after loading (torch's
``requires_nvshmem``, see :func:`nvshmem_kernel`). The calls here are the block-scoped ones: every
thread of the program calls them together and NVSHMEM splits the copy among them, then (for
``putmem_signal_block``) updates the signal once, after the data, as one ordered delivery.

Signal and comparison operations take the values of NVSHMEM's own headers (3.4:
``nvshmem_common_transport.h``: ``NVSHMEM_SIGNAL_SET = 9``), not torch's docstrings, which give
other numbers. Signals are 64-bit words in symmetric memory; the waits spin on them as on peer
memory's flags (``scan_hop._wait_at_least``), bounded by the scan's timeout.

Nothing here runs without a GPU: the kernels take these calls only in branches a ``constexpr``
turns off elsewhere (peer memory, the interpreter).
"""

import functools
import types

import triton
import triton.language as tl
from triton.language import core

NVSHMEM_SIGNAL_SET = tl.constexpr(9)


@triton.jit
def put(dst, src, nbytes, pe):
    """Block-scoped put of ``nbytes`` from local address ``src`` to symmetric address ``dst`` on PE
    ``pe`` (every thread of the program calls it)."""
    putmem_block(tl.cast(dst, tl.int64), tl.cast(src, tl.int64), tl.cast(nbytes, tl.int64), tl.cast(pe, tl.int32))


@triton.jit
def put_signal(dst, src, nbytes, signal, value, pe):
    """:func:`put`, then ``*signal = value`` on PE ``pe`` once the data is there."""
    putmem_signal_block(tl.cast(dst, tl.int64), tl.cast(src, tl.int64), tl.cast(nbytes, tl.int64),
                        tl.cast(signal, tl.int64), tl.cast(value, tl.uint64), tl.cast(NVSHMEM_SIGNAL_SET, tl.int32),
                        tl.cast(pe, tl.int32))


@core.extern
def putmem_block(dst, src, nbytes, pe, _semantic=None):
    """``nvshmemx_putmem_block(dst, src, nbytes, pe)``: copy ``nbytes`` from local ``src`` to symmetric
    ``dst`` (this PE's address of it) on PE ``pe``; returns once ``src`` may be reused."""
    return core.extern_elementwise(
        "", "", [dst, src, nbytes, pe],
        {(core.dtype("int64"), core.dtype("int64"), core.dtype("int64"), core.dtype("int32")):
         ("nvshmemx_putmem_block", core.dtype("int32"))},
        is_pure=False, _semantic=_semantic)


@core.extern
def putmem_signal_block(dst, src, nbytes, signal, value, sig_op, pe, _semantic=None):
    """``nvshmemx_putmem_signal_block``: :func:`putmem_block`, then ``*signal = value`` on PE ``pe``
    (``sig_op`` :data:`NVSHMEM_SIGNAL_SET`), delivered after the data."""
    return core.extern_elementwise(
        "", "", [dst, src, nbytes, signal, value, sig_op, pe],
        {(core.dtype("int64"), core.dtype("int64"), core.dtype("int64"), core.dtype("int64"), core.dtype("uint64"),
          core.dtype("int32"), core.dtype("int32")): ("nvshmemx_putmem_signal_block", core.dtype("int32"))},
        is_pure=False, _semantic=_semantic)


@core.extern
def fence(_semantic=None):
    """``nvshmem_fence()``: puts issued before it to a PE are delivered before those issued after."""
    return core.extern_elementwise("", "", [], {(): ("nvshmem_fence", core.dtype("int32"))}, is_pure=False,
                                   _semantic=_semantic)


@functools.lru_cache(maxsize=None)
def nvshmem_kernel(kernel):
    """The NVSHMEM variant of a ``@triton.jit`` kernel: the same source under its own name (so that
    torch initialises NVSHMEM only in the modules that link it), compiled with NVSHMEM's device
    library. Launch it with ``NVSHMEM=True``."""
    from torch.distributed._symmetric_memory._nvshmem_triton import requires_nvshmem

    fn = kernel.fn
    name = f"{fn.__name__}_nvshmem"
    copy = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__qualname__, copy.__doc__, copy.__module__ = name, fn.__doc__, fn.__module__
    copy.__annotations__ = dict(fn.__annotations__)  # which arguments are constexpr
    return requires_nvshmem(triton.jit(copy))
