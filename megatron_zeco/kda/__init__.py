"""Kimi Delta Attention (KDA, fla's ``chunk_kda``) on one device.

``naive.py`` is the readable recurrence every other path is tested against; ``chunk.py`` the chunked
PyTorch form and a piece's summary (``S_out = M S_in + E``, ``M`` a dense K x K matrix) and entering-state
gradient; ``backend.py`` the local operation and the piece the context-parallel strategies call.
"""

from .local import TorchKDAPiece, kda_local
from .chunk import chunk_kda, chunk_kda_state, chunk_kda_state_grad
from .naive import naive_recurrent_kda

__all__ = [
    "naive_recurrent_kda",
    "chunk_kda",
    "chunk_kda_state",
    "chunk_kda_state_grad",
    "kda_local",
    "TorchKDAPiece",
]
