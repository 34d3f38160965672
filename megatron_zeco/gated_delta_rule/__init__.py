"""The gated delta rule (Gated DeltaNet's token mixer) under ZeCO context parallelism.

``naive.py``: the token loop (the float64 reference); ``chunk.py``: the chunked PyTorch form (the CPU
path); ``local.py``: the local op and the piece the strategies run (fla's kernels on CUDA:
``fla_piece.py``); ``op.py``: :func:`zeco_gated_delta_rule`; ``layer.py``: Megatron-Core's Gated
DeltaNet with ZeCO context parallelism.
"""

from ..cp.registry import Mixer, register
from .chunk import chunk_gated_delta_rule, chunk_gated_delta_rule_state, chunk_gated_delta_rule_state_grad
from .local import gdn_local, gdn_piece, require_backend, require_gdn_backend
from .naive import naive_recurrent_gated_delta_rule
from .op import GATED_DELTA_RULE, zeco_gated_delta_rule

__all__ = ["zeco_gated_delta_rule", "GATED_DELTA_RULE",
           "naive_recurrent_gated_delta_rule", "chunk_gated_delta_rule", "chunk_gated_delta_rule_state",
           "chunk_gated_delta_rule_state_grad", "gdn_local", "gdn_piece", "require_backend", "require_gdn_backend"]

# The G layers' mixer --mixer gdn / mixer="gdn": Megatron-Core's Gated DeltaNet layer (megatron-core >= 0.19)
# under ZeCO (megatron_zeco.cp.registry).
register(Mixer(name="gdn", title="Gated DeltaNet", operator=GATED_DELTA_RULE.key,
               layer_spec="megatron_zeco.specs:gdn_layer_spec", knobs=dict(gate_timescales=None, conv_init=None),
               megatron_core_path="core/ssm/gated_delta_net",
               config_fields="megatron_zeco.gated_delta_rule.layer:transformer_config_fields"))
