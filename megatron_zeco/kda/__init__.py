"""Kimi Delta Attention (KDA, fla's ``chunk_kda``) on one device.

``naive.py`` is the readable recurrence every other path is tested against; ``chunk.py`` the chunked
PyTorch form and a piece's summary (``S_out = M S_in + E``, ``M`` a dense K x K matrix) and entering-state
gradient; ``local.py`` the local operation and the piece the context-parallel strategies call;
``op.py``: :func:`zeco_kda`; ``layer.py``: a Megatron-Core KDA mixer with ZeCO context parallelism.
"""

from ..cp.registry import Mixer, register
from .local import kda_local, kda_piece, require_backend, require_kda_backend
from .op import KDA, zeco_kda
from .chunk import chunk_kda, chunk_kda_state, chunk_kda_state_grad
from .naive import naive_recurrent_kda

__all__ = [
    "zeco_kda",
    "KDA",
    "naive_recurrent_kda",
    "chunk_kda",
    "chunk_kda_state",
    "chunk_kda_state_grad",
    "kda_local",
    "kda_piece",
    "require_backend",
    "require_kda_backend",
]

# The G layers' mixer --mixer kda / mixer="kda" (megatron_zeco.cp.registry).
register(Mixer(name="kda", title="KDA", operator=KDA.key, layer_spec="megatron_zeco.specs:kda_layer_spec",
               knobs=dict(gate_timescales=None, conv_init=None)))
