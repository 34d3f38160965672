"""Triton kernels (GPU; on the CPU under TRITON_INTERPRET=1 for tests): the All-Scan hop (``scan_hop``), its
NVSHMEM build (``nvshmem``), and the delta rules' entering-state correction (``delta_correction``; its plan
and float64 reference ``delta_reference``, which imports no Triton). Import submodules explicitly:
importing this package does not import Triton."""

import os


def interpreted() -> bool:
    """Whether Triton runs kernels through its interpreter (``$TRITON_INTERPRET`` set, and not ``0``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
