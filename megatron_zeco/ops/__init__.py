"""Gated linear attention and the gated delta rule on one device.

``naive.py`` is the readable recurrences every other path is tested against;
``chunk.py`` (GLA) and ``delta_chunk.py`` (gated delta rule) the chunked PyTorch forms;
``backend.py`` and ``delta_backend.py`` the local operations that the context-parallel
strategies in :mod:`megatron_zeco.cp` call (``fla_piece.py``, ``fla_delta_piece.py``: the
GPU forms of a piece whose entering state comes from the scan).
"""

from .backend import gla_bwd, gla_fwd, gla_piece, require_backend
from .chunk import chunk_gla, chunk_gla_state, chunk_gla_state_grad, state_dtype
from .delta_backend import gdn_local, gdn_piece
from .delta_chunk import chunk_gated_delta_rule, chunk_gated_delta_rule_state, chunk_gated_delta_rule_state_grad
from .naive import naive_recurrent_gated_delta_rule, naive_recurrent_gla

__all__ = [
    "naive_recurrent_gla",
    "naive_recurrent_gated_delta_rule",
    "chunk_gla",
    "chunk_gla_state",
    "chunk_gla_state_grad",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_state",
    "chunk_gated_delta_rule_state_grad",
    "state_dtype",
    "gla_fwd",
    "gla_bwd",
    "gla_piece",
    "gdn_local",
    "gdn_piece",
    "require_backend",
]
