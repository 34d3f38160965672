"""Triton kernels (GPU; on the CPU under TRITON_INTERPRET=1 for tests). Import submodules
explicitly: importing this package does not import Triton."""

import os


def interpreted() -> bool:
    """Whether Triton runs kernels through its interpreter (``$TRITON_INTERPRET`` set, and not ``0``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
