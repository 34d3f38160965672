"""The gated delta rule (Gated DeltaNet's token mixer) under ZeCO context parallelism.

``naive.py``: the token loop (the float64 reference); ``chunk.py``: the chunked PyTorch form (the CPU
path); ``local.py``: the local op and the piece the strategies run (fla's kernels on CUDA:
``fla_piece.py``); ``op.py``: :func:`zeco_gated_delta_rule`; ``layer.py``: Megatron-Core's Gated
DeltaNet with ZeCO context parallelism.
"""

from .chunk import chunk_gated_delta_rule, chunk_gated_delta_rule_state, chunk_gated_delta_rule_state_grad
from .local import gdn_local, gdn_piece, require_gdn_backend
from .naive import naive_recurrent_gated_delta_rule
from .op import GATED_DELTA_RULE, zeco_gated_delta_rule

__all__ = ["zeco_gated_delta_rule", "GATED_DELTA_RULE",
           "naive_recurrent_gated_delta_rule", "chunk_gated_delta_rule", "chunk_gated_delta_rule_state",
           "chunk_gated_delta_rule_state_grad", "gdn_local", "gdn_piece", "require_gdn_backend"]
