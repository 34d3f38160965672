"""megatron_zeco: ZeCO context parallelism for gated linear attention in Megatron-Core.

Where things live:
  ops/     GLA and the gated delta rule on one device: float64-ready reference loops (naive.py),
           chunked PyTorch (chunk.py, delta_chunk.py)
  comm/    sequence layouts over a CP group and the state scans (All-Scan, all-gather)
  cp/      the context-parallel operators ``zeco_gla`` and ``zeco_gated_delta_rule`` and their strategies
"""

from .comm import Layout, ScanTimeoutError, check_scans
from .cp import STRATEGIES, packed_positions, zeco_gated_delta_rule, zeco_gla

__all__ = ["zeco_gla", "zeco_gated_delta_rule", "packed_positions", "check_scans", "ScanTimeoutError", "Layout",
           "STRATEGIES"]
__version__ = "0.1.0"
