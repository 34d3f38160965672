"""Triton kernels (GPU; on the CPU under TRITON_INTERPRET=1 for tests): the All-Scan hop (``scan_hop``), its
NVSHMEM build (``nvshmem``), and the delta rules' entering-state correction (``delta_correction``; its plan
and float64 reference ``delta_reference``, which imports no Triton). Import submodules explicitly:
importing this package does not import Triton. Here: how the delta rules' map products round
(:func:`map_precision`, one choice for the pieces' kernels and the scans' dense hops: :func:`dense_precision`)."""

import os

import torch


def interpreted() -> bool:
    """Whether Triton runs kernels through its interpreter (``$TRITON_INTERPRET`` set, and not ``0``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


MAP_PRECISIONS = ("tf32x3", "input")  # what map_precision returns


def map_precision(dtype: torch.dtype) -> str:
    """How the products that make and apply the delta rules' maps round, for pieces of ``dtype`` inputs
    (``delta_correction.py``, "Precision"): ``"input"`` for 16-bit inputs, as fla's own state passes round on one
    GPU; ``"tf32x3"`` (float32 accuracy) for float32 inputs, whose caller asked for it. The pieces' kernels and the
    scans' dense hops (:func:`dense_precision`) both follow it."""
    return "input" if dtype in (torch.float16, torch.bfloat16) else "tf32x3"


# How the dense hops' float32 products on tensor cores round (``tl.dot``'s ``input_precision``,
# ``scan_hop.all_scan_dense_hop``): three TF32 passes (float32 accuracy) or one.
DENSE_PRECISIONS = ("tf32x3", "tf32")


def dense_precision(precision: str) -> str:
    """The dense hops' :data:`DENSE_PRECISIONS` entry that applies and composes maps of ``precision`` (the pieces'
    map precision, :func:`map_precision`): ``"input"`` multiplies two float32 tiles in one TF32 pass, as the maps'
    own products do under it; ``"tf32x3"`` keeps float32 accuracy."""
    if precision not in MAP_PRECISIONS:
        raise ValueError(f"a map precision is one of {', '.join(MAP_PRECISIONS)}, got {precision!r}")
    return "tf32" if precision == "input" else "tf32x3"
