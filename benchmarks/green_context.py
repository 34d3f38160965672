"""Disjoint SM partitions of one GPU (CUDA green contexts), for ``bench_overlap.py --scan-sms``: green
contexts on groups of SMs and on the SMs left (:func:`split_sms`), and streams whose kernels run on a
context's SMs only (:func:`green_stream`).

A hop kernel spinning beside the local work on a stream of the highest priority shares SMs with that work's
programs. ``bench_overlap.py``'s mode ``partition`` gives it SMs of its own and the in-chunk work the rest, to
tell what the sharing costs the hop. Work on the primary context's streams still runs on every SM.

The driver's split (``cuDevSmResourceSplitByCount``) hands out SMs in groups of the GPU's granularity
(8 on Hopper); each context comes with the SM count the driver gave it. CUDA 12.4 or later (a driver that
has green contexts), through the driver library alone: no toolkit at run time.
"""

import ctypes
import functools
from typing import Tuple

import torch

_SM = 1  # CU_DEV_RESOURCE_TYPE_SM
_GREEN_CTX_DEFAULT_STREAM = 0x1  # CU_GREEN_CTX_DEFAULT_STREAM, which cuGreenCtxCreate requires
_STREAM_NON_BLOCKING = 0x1  # CU_STREAM_NON_BLOCKING, which cuGreenCtxStreamCreate requires
# A CUdevResource is 144 bytes up to CUDA 13 (its type, 92 bytes of padding, a 48-byte union whose first
# word is CUdevSmResource.smCount); the buffers are larger, so that a later, larger layout is not overrun.
_RESOURCE_BYTES = 1024
_SM_COUNT_OFFSET = 96


class GreenContextError(RuntimeError):
    """The driver refused a step of making a partition (too old, or the split impossible)."""


@functools.lru_cache(maxsize=None)
def _driver():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise GreenContextError(f"SM partitions need the CUDA driver library (libcuda.so.1): {e}") from e


def _call(name, *args):
    cu = _driver()
    fn = getattr(cu, name, None)
    if fn is None:
        raise GreenContextError(f"SM partitions need a CUDA driver with green contexts (12.4 or later): "
                                f"this one has no {name}")
    rc = fn(*args)
    if rc != 0:
        msg = ctypes.c_char_p()
        cu.cuGetErrorName(rc, ctypes.byref(msg))
        raise GreenContextError(f"{name} failed: {msg.value.decode() if msg.value else rc}")


def _sm_count(resource) -> int:
    return ctypes.c_uint.from_buffer(resource, _SM_COUNT_OFFSET).value


def _green_context(cu_device, resource) -> int:
    desc, ctx = ctypes.c_void_p(), ctypes.c_void_p()
    _call("cuDevResourceGenerateDesc", ctypes.byref(desc), resource, ctypes.c_uint(1))
    _call("cuGreenCtxCreate", ctypes.byref(ctx), desc, cu_device, ctypes.c_uint(_GREEN_CTX_DEFAULT_STREAM))
    return ctx.value


def green_stream(context: int, device: torch.device) -> "torch.cuda.ExternalStream":
    """A new stream of the highest priority on the green context ``context`` (:func:`split_sms`)."""
    stream = ctypes.c_void_p()
    high = torch.cuda.Stream.priority_range()[1]  # (least, greatest): lower is higher
    _call("cuGreenCtxStreamCreate", ctypes.byref(stream), ctypes.c_void_p(context),
          ctypes.c_uint(_STREAM_NON_BLOCKING), ctypes.c_int(high))
    return torch.cuda.ExternalStream(stream.value, device=device)


def split_sms(device: torch.device, sms: int, groups: int = 1) -> Tuple[Tuple[int, int], ...]:
    """Green contexts on disjoint SMs of ``device``: ``groups`` of (at least) ``sms`` SMs each, then one on
    the SMs left; each as (context, its SM count), for :func:`green_stream`. They are never destroyed.

    Raises :class:`GreenContextError` where the driver has no green contexts or cannot split so."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"SM partitions are of CUDA devices, not {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(index)  # the primary context exists and is current
    total = torch.cuda.get_device_properties(index).multi_processor_count
    if not (sms > 0 and groups > 0 and sms * groups < total):
        raise ValueError(f"SM partitions of {groups} x {sms} SMs must leave some to the rest: 0 < groups * sms "
                         f"< {total} (the SMs of {torch.cuda.get_device_name(index)}), got {groups} x {sms}")
    cu_device = ctypes.c_int()
    _call("cuDeviceGet", ctypes.byref(cu_device), ctypes.c_int(index))
    whole = ctypes.create_string_buffer(_RESOURCE_BYTES)
    _call("cuDeviceGetDevResource", cu_device, whole, ctypes.c_int(_SM))
    parts = ctypes.create_string_buffer(_RESOURCE_BYTES * groups)
    rest = ctypes.create_string_buffer(_RESOURCE_BYTES)
    made = ctypes.c_uint(groups)
    _call("cuDevSmResourceSplitByCount", parts, ctypes.byref(made), whole, rest, ctypes.c_uint(0),
          ctypes.c_uint(sms))
    if made.value != groups or _sm_count(rest) == 0:
        raise GreenContextError(f"the driver could not split {total} SMs into {groups} x {sms} and the rest "
                                f"({made.value} group(s), {_sm_count(rest)} SMs left)")
    stride = _stride(parts, groups, sms) if groups > 1 else _RESOURCE_BYTES
    found = [ctypes.create_string_buffer(parts.raw[i * stride:(i + 1) * stride], _RESOURCE_BYTES)
             for i in range(groups)]
    return tuple((_green_context(cu_device, r), _sm_count(r)) for r in (*found, rest))


def _stride(parts, groups: int, sms: int) -> int:
    """The size of the driver's CUdevResource (144 bytes in CUDA 12.4 to 13), from the array of ``groups``
    groups of at least ``sms`` SMs it wrote: the stride at which every element is an SM resource of as
    many SMs as the first."""
    words = lambda offset: ctypes.c_uint.from_buffer(parts, offset).value  # noqa: E731
    first = words(_SM_COUNT_OFFSET)
    for stride in range(_SM_COUNT_OFFSET + 4, _RESOURCE_BYTES + 1, 4):
        if all(words(i * stride) == _SM and words(i * stride + _SM_COUNT_OFFSET) == first >= sms
               for i in range(1, groups)):
            return stride
    raise GreenContextError("the driver's split wrote SM groups of a layout this module does not know")

