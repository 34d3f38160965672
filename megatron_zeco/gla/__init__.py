"""Gated linear attention (GLA) under ZeCO context parallelism.

``naive.py``: the token loop (the float64 reference); ``chunk.py``: the chunked PyTorch form (the CPU
path); ``local.py``: the local op and the piece the strategies run (fla's ``chunk_gla`` on CUDA);
``fla_piece.py`` and ``kernels.py``: a piece on fla's kernels with this package's Triton kernels
fused in; ``op.py``: :func:`zeco_gla`; ``layer.py``: the Megatron-Core token mixer.
"""

from ..cp.registry import Mixer, register
from .chunk import chunk_gla, chunk_gla_state, chunk_gla_state_grad
from .local import gla_bwd, gla_fwd, gla_piece, require_backend
from .naive import naive_recurrent_gla
from .op import GLA, zeco_gla

__all__ = ["zeco_gla", "GLA", "naive_recurrent_gla", "chunk_gla", "chunk_gla_state",
           "chunk_gla_state_grad", "gla_fwd", "gla_bwd", "gla_piece", "require_backend"]

# The G layers' mixer --mixer gla / mixer="gla" (megatron_zeco.cp.registry).
register(Mixer(name="gla", title="GLA", operator=GLA.key, layer_spec="megatron_zeco.specs:gla_layer_spec",
               knobs=dict(gate_low_rank_dim=16, gate_timescales=None)))
