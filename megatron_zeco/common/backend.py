"""Which form runs an operator's local work, and the autograd record the local ops keep.

On CUDA, for float32, bfloat16 and float16, the local work runs on GPU kernels (flash-linear-
attention's and this package's Triton kernels); elsewhere, and for float64, on the chunked PyTorch
forms (exact, slow on GPUs). ``MEGATRON_ZECO_BACKEND=torch`` forces the PyTorch forms for every
operator (the same numbers up to rounding); ``MEGATRON_ZECO_GLA_BACKEND``, its earlier name, still works,
with a deprecation warning.

:func:`record` runs a differentiable function on autograd leaves of its inputs and keeps its own
autograd record, so that :func:`replay` later costs what that function's backward costs.
"""

import functools
import importlib
import importlib.metadata
import os
import warnings
from typing import Callable, NamedTuple, Optional, Tuple, Union

import torch

Tensor = torch.Tensor
BACKEND_ENV = "MEGATRON_ZECO_BACKEND"
DEPRECATED_BACKEND_ENV = "MEGATRON_ZECO_GLA_BACKEND"  # its earlier name
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The fla-core release whose kernels (and internal functions, whose signatures change between releases)
# the GPU paths call; setup.py's ``gpu`` extra installs it.
FLA_VERSION = "0.6.0"


def uses_kernels(device: Union[torch.device, str], dtype: torch.dtype) -> bool:
    """GPU kernels serve CUDA tensors of kernel dtypes unless the PyTorch forms are forced."""
    return torch.device(device).type == "cuda" and dtype in KERNEL_DTYPES and backend_choice() != "torch"


def backend_choice() -> str:
    """``$MEGATRON_ZECO_BACKEND`` (``auto`` or ``torch``), else its deprecated name's value, else ``auto``."""
    value = os.environ.get(BACKEND_ENV)
    if value is None and DEPRECATED_BACKEND_ENV in os.environ:
        _warn_deprecated()
        value = os.environ[DEPRECATED_BACKEND_ENV]
    return value or "auto"


@functools.lru_cache(maxsize=None)
def _warn_deprecated() -> None:
    warnings.warn(f"${DEPRECATED_BACKEND_ENV} is deprecated (it sets the backend of every operator): set "
                  f"${BACKEND_ENV} instead", DeprecationWarning, stacklevel=3)


def fla(what: str, path: str):
    """The object at ``path`` in flash-linear-attention (``fla.ops.gla.chunk_gla``), imported on first use
    (fla needs a GPU driver). ImportError naming the fix, and ``what`` needs it, unless fla-core
    :data:`FLA_VERSION` imports (:func:`require_fla`)."""
    require_fla(what)
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@functools.lru_cache(maxsize=None)
def require_fla(what: str) -> None:
    """ImportError naming the fix (and that ``what`` needs it) unless fla-core :data:`FLA_VERSION` imports."""
    fix = (f"Install it with `pip install fla-core=={FLA_VERSION}` (the `gpu` extra of megatron_zeco), or set "
           f"{BACKEND_ENV}=torch to run the (slow) PyTorch forms on the GPU.")
    try:
        import fla  # noqa: F401
    except ImportError as e:
        raise ImportError(f"megatron_zeco: {what} runs on flash-linear-attention, which failed to import ({e}). "
                          f"{fix}") from e
    try:
        version = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        version = getattr(fla, "__version__", None)
    if version != FLA_VERSION:
        raise ImportError(f"megatron_zeco: {what} runs on fla-core {FLA_VERSION}, whose internal kernels it calls "
                          f"(their signatures change between releases); this is {version or 'an unknown version'}. "
                          f"{fix}")
    from .tuning import configure

    configure()  # recorded autotune picks, where $MEGATRON_ZECO_TUNED_CONFIGS asks for them


def varlen(x: Tensor, cu_seqlens: Optional[Tensor], cu_seqlens_cpu: Optional[Tensor]) -> dict:
    """Packed-input keywords of the local op that serves ``x``: fla takes the host copy of the offsets
    (its launch tables then need no read-back from the device), the PyTorch forms read them themselves."""
    if cu_seqlens is None:
        return {}
    if cu_seqlens_cpu is None or not uses_kernels(x.device, x.dtype):
        return {"cu_seqlens": cu_seqlens}
    return {"cu_seqlens": cu_seqlens, "cu_seqlens_cpu": cu_seqlens_cpu}


@functools.lru_cache(maxsize=64)
def fla_varlen(offsets: Tuple[int, ...], chunk_size: int, device: torch.device) -> dict:
    """fla's keywords for packed documents at ``offsets`` on ``device`` (its chunked kernels at ``chunk_size``):
    ``cu_seqlens`` on the device, its host copy ``cu_seqlens_cpu`` and fla's ``chunk_indices``, made once per
    offsets and device (a copy from pageable host memory, or fla's read-back, would wait for the device).
    Shared by every caller: read, never modify."""
    require_fla("packed documents on fla's kernels")
    from fla.ops.utils import prepare_chunk_indices

    host = torch.tensor(offsets, dtype=torch.long)
    cu = host.pin_memory().to(device, non_blocking=True)
    return dict(cu_seqlens=cu, chunk_indices=prepare_chunk_indices(cu, chunk_size, cu_seqlens_cpu=host),
                cu_seqlens_cpu=host)


class Saved(NamedTuple):
    """What :func:`replay` needs from :func:`record`: the inputs as autograd leaves (``inputs`` of them,
    then the initial state if any) and the outputs."""
    leaves: Tuple[Tensor, ...]
    o: Tensor
    ht: Optional[Tensor]
    inputs: int


def record(fn: Callable, inputs: Tuple[Tensor, ...], initial_state: Optional[Tensor], **kw
           ) -> Tuple[Tensor, Optional[Tensor], Saved]:
    """``fn(*inputs, initial_state=..., **kw) -> (o, ht)`` run on autograd leaves of its inputs, keeping
    ``fn``'s own autograd record for :func:`replay` (so a backward costs what ``fn``'s costs)."""
    with torch.enable_grad():
        leaves = tuple(x.detach().requires_grad_() for x in inputs)
        if initial_state is not None:
            leaves += (initial_state.detach().requires_grad_(),)
        h0 = leaves[len(inputs)] if initial_state is not None else None
        o, ht = fn(*leaves[:len(inputs)], initial_state=h0, **kw)
    return o.detach(), (None if ht is None else ht.detach()), Saved(leaves, o, ht, len(inputs))


def replay(saved: Saved, do: Tensor, dht: Optional[Tensor]) -> Tuple[Tuple[Tensor, ...], Optional[Tensor]]:
    """The gradients of :func:`record`'s inputs and of its initial state (None if it had none) from
    the output gradient ``do`` and the final-state gradient ``dht`` (None: the final state is unused;
    the forward must have output it otherwise)."""
    outputs, grads = [saved.o], [do]
    if dht is not None:
        outputs.append(saved.ht)
        grads.append(dht)
    result = torch.autograd.grad(outputs, saved.leaves, grads)
    return result[:saved.inputs], (result[saved.inputs] if len(result) > saved.inputs else None)
