"""The token mixers a ``G`` layer holds, by the name the specs (``mixer=``) and the main job (``--mixer``)
give them: the context-parallel operator each runs (its ``CPConfig``'s rules), its name in messages, and
the initialisation knobs its spec function takes. Imports nothing: the main job checks its flags with it
before megatron-core is imported."""

# mixer -> the CP operator it runs (megatron_zeco.cp.config.RULES)
OPERATORS = {"gla": "gla", "gdn": "gated_delta_rule", "kda": "kda"}
NAMES = {"gla": "GLA", "gdn": "Gated DeltaNet", "kda": "KDA"}
# The initialisation knobs of each mixer's spec function (specs.gla_layer_spec, gdn_layer_spec,
# kda_layer_spec), which hybrid_layer_spec and hybrid_stack_spec pass on, and their defaults.
KNOBS = {"gla": ("gate_low_rank_dim", "gate_timescales"), "gdn": ("gate_timescales", "conv_init"),
         "kda": ("gate_timescales", "conv_init")}
KNOB_DEFAULTS = dict(gate_low_rank_dim=16, gate_timescales=None, conv_init=None)


def owners(knob: str) -> str:
    """The mixers that take ``knob``, in words (``"Gated DeltaNet and KDA"``)."""
    return " and ".join(NAMES[m] for m, knobs in KNOBS.items() if knob in knobs)
