"""The token mixers a ``G`` layer holds, by the name the specs (``mixer=``) and the main job (``--mixer``)
give them: the context-parallel operator each runs (its ``CPConfig``'s rules), its name in messages, and
the initialisation knobs its spec function takes. Each is a live view of the registry
(``megatron_zeco.cp.registry``), where every operator folder registers its mixer; none imports megatron-core,
so the main job checks its flags with them before megatron-core is imported."""

from collections.abc import Mapping

from .cp.registry import mixers, view

# mixer -> the CP operator it runs (megatron_zeco.cp.config.RULES)
OPERATORS = view(lambda m: m.operator)
# mixer -> its name in messages
NAMES = view(lambda m: m.title)
# mixer -> the initialisation knobs of its spec function, which hybrid_layer_spec and hybrid_stack_spec pass on
KNOBS = view(lambda m: tuple(m.knobs))


class _KnobDefaults(Mapping):
    """Every mixer's initialisation knobs and their defaults, live (one default per knob: the registry checks)."""

    def _all(self) -> dict:
        return {knob: default for m in mixers().values() for knob, default in m.knobs.items()}

    def __getitem__(self, knob):
        return self._all()[knob]

    def __iter__(self):
        return iter(self._all())

    def __len__(self):
        return len(self._all())


KNOB_DEFAULTS = _KnobDefaults()


def owners(knob: str) -> str:
    """The mixers that take ``knob``, in words (``"Gated DeltaNet and KDA"``)."""
    return " and ".join(NAMES[m] for m, knobs in KNOBS.items() if knob in knobs)
