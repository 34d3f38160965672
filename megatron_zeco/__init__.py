"""megatron_zeco: ZeCO context parallelism for gated linear attention in Megatron-Core.

Where things live:
  ops/     GLA on one device: float64-ready reference loop (naive.py), chunked PyTorch (chunk.py)
  comm/    sequence layouts over a CP group and the state scans (All-Scan, all-gather)
  cp/      the context-parallel operator ``zeco_gla`` and its strategies
"""

from .comm import Layout
from .cp import STRATEGIES, packed_positions, zeco_gla

__all__ = ["zeco_gla", "packed_positions", "Layout", "STRATEGIES"]
__version__ = "0.1.0"
