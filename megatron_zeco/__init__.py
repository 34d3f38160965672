"""megatron_zeco: ZeCO context parallelism for linear attention in Megatron-Core.

Where things live (``docs/design.md`` has the map):
  gla/, gated_delta_rule/,  one folder per operator:
  kda/                      its reference loop, chunked PyTorch form,
                            local op on fla's kernels, the context-parallel function, its Megatron layer
  cp/                       what every operator shares under context parallelism: the knobs
                            (``CPConfig``), plans, strategies, input checks, packed documents
  comm/                     sequence layouts over a CP group and the state scans (All-Scan, all-gather)
  kernels/, common/         shared Triton kernels (the All-Scan hop), shared local pieces
  mcore/, specs.py          Megatron-Core glue and the layer specs for pretrain_gpt.py / pretrain_hybrid.py
"""

from .comm import Layout, ScanTimeoutError, check_scans
from .cp import STRATEGIES, CPConfig, packed_positions
# Importing an operator's folder registers its mixer (cp/registry.py); this order is --mixer's.
from .gla.op import zeco_gla
from .gated_delta_rule.op import zeco_gated_delta_rule
from .kda.op import zeco_kda

__all__ = ["zeco_gla", "zeco_gated_delta_rule", "zeco_kda", "CPConfig", "packed_positions", "check_scans", "ScanTimeoutError",
           "Layout", "STRATEGIES"]
__version__ = "0.1.0"
