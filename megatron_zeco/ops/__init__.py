"""Gated linear attention on one device.

``naive.py`` is the readable recurrence every other path is tested against;
``chunk.py`` the chunked PyTorch form; ``backend.py`` the local operations that
the context-parallel strategies in :mod:`megatron_zeco.cp` call (``fla_piece.py``:
the GPU form of a piece whose incoming state comes from the scan).
"""

from .backend import gla_bwd, gla_fwd, gla_piece, require_backend
from .chunk import chunk_gla, chunk_gla_state, chunk_gla_state_grad, state_dtype
from .naive import naive_recurrent_gla

__all__ = [
    "naive_recurrent_gla",
    "chunk_gla",
    "chunk_gla_state",
    "chunk_gla_state_grad",
    "state_dtype",
    "gla_fwd",
    "gla_bwd",
    "gla_piece",
    "require_backend",
]
