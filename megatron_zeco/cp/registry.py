"""The token mixers a ``G`` layer can hold, each registered by its operator's folder.

An operator folder (``megatron_zeco/gla/__init__.py``, ...) calls :func:`register` with a :class:`Mixer`: the
name the specs (``mixer=``) and the main job (``--mixer``) give it, its name in messages, its context-parallel
rules key (``cp.config.RULES``), its layer spec builder and its initialisation knobs. ``megatron_zeco.specs``,
``megatron_zeco.mixers`` and the main job read this registry rather than naming operators, so adding an
operator edits none of them. Registering imports nothing of megatron-core: the main job checks its flags
against the registry before megatron-core is imported.
"""

import importlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional

from .config import RULES, Rules


@dataclass(frozen=True)
class Mixer:
    """A token mixer of the ``G`` layers.

    Attributes:
        name: the ``mixer=`` of the specs and ``--mixer`` of the main job (``gla``, ``gdn``, ``kda``).
        title: how messages name it (``GLA``, ``Gated DeltaNet``).
        operator: its context-parallel operator, a key of ``cp.config.RULES`` (a layer's ``CPConfig``).
        layer_spec: ``"module:function"``, its layer spec builder, imported when first called (it imports
            megatron-core): ``function(use_te=, cp_config=, normalization=, **knobs) -> ModuleSpec``, the GPT
            layer whose norm and token mixer the ``G`` layers take.
        knobs: its initialisation knobs (keywords of ``layer_spec``, which ``specs.hybrid_layer_spec`` and
            ``specs.hybrid_stack_spec`` pass on) and their defaults.
        megatron_core_path: a package megatron-core must have for its layer (``core/ssm/gated_delta_net``),
            looked for without importing it; None: any supported megatron-core.
        config_fields: ``"module:function"``, ``function(hidden, heads) -> dict``: the ``TransformerConfig``
            fields its layer needs beyond the model's size (the main job passes them); None: none.
    """

    name: str
    title: str
    operator: str
    layer_spec: str
    knobs: Mapping[str, object] = field(default_factory=dict)
    megatron_core_path: Optional[str] = None
    config_fields: Optional[str] = None

    def build_layer_spec(self, **kwargs):
        """The layer spec :attr:`layer_spec` builds from ``kwargs``."""
        return _resolve(self.layer_spec, self.name)(**kwargs)

    def transformer_config_fields(self, hidden: int, heads: int) -> dict:
        """The ``TransformerConfig`` fields its layer needs (:attr:`config_fields`), or none."""
        return {} if self.config_fields is None else _resolve(self.config_fields, self.name)(hidden, heads)


_MIXERS: Dict[str, Mixer] = {}


def register(mixer: Mixer, rules: Optional[Rules] = None) -> Mixer:
    """Add ``mixer`` (and, for an operator whose rules are not in ``cp.config.RULES``, its ``rules``). A
    name, a rules key or a knob's default that clashes with one registered before is a ``ValueError``;
    registering the same mixer again (a module imported twice) changes nothing."""
    if _MIXERS.get(mixer.name) == mixer and (rules is None or RULES.get(mixer.operator) == rules):
        return mixer
    if mixer.name in _MIXERS:
        raise ValueError(f"megatron_zeco: mixer {mixer.name!r} is registered already "
                         f"({_MIXERS[mixer.name].title}); give {mixer.title} another name")
    if rules is not None and mixer.operator in RULES and RULES[mixer.operator] != rules:
        raise ValueError(f"megatron_zeco: cp.config.RULES has {mixer.operator!r} already "
                         f"({RULES[mixer.operator].name}); give {mixer.title}'s operator another key")
    if rules is None and mixer.operator not in RULES:
        raise ValueError(f"megatron_zeco: mixer {mixer.name!r} runs operator {mixer.operator!r}, which has no "
                         f"entry in cp.config.RULES: pass its rules to register()")
    for knob, default in mixer.knobs.items():
        for other in _MIXERS.values():
            if knob in other.knobs and other.knobs[knob] != default:
                raise ValueError(f"megatron_zeco: knob {knob!r} defaults to {other.knobs[knob]!r} for "
                                 f"{other.title} and {default!r} for {mixer.title}: one knob, one default")
    if rules is not None:
        RULES[mixer.operator] = rules
    _MIXERS[mixer.name] = mixer
    return mixer


def mixers() -> Mapping[str, Mixer]:
    """Every registered mixer by name, in registration order (a live read-only view)."""
    return view(lambda m: m)


def view(value: Callable[[Mixer], object]) -> Mapping[str, object]:
    """A live read-only mapping from each registered mixer's name to ``value(mixer)``: it shows mixers
    registered after it was made."""
    return _View(value)


def mixer(name: str) -> Mixer:
    """The mixer registered as ``name``; ``ValueError`` listing the registered ones otherwise."""
    if name not in _MIXERS:
        raise ValueError(f"megatron_zeco: mixer {name!r} is not one of {', '.join(_MIXERS)}")
    return _MIXERS[name]


def _resolve(path: str, name: str) -> Callable:
    module, _, function = path.partition(":")
    if not function:
        raise ValueError(f"megatron_zeco: mixer {name!r}: {path!r} must be 'module:function'")
    return getattr(importlib.import_module(module), function)


class _View(Mapping):
    """A live read-only mapping over the registered mixers (``value`` of each)."""

    def __init__(self, value: Callable[[Mixer], object]):
        self._value = value

    def __getitem__(self, name):
        return self._value(_MIXERS[name])

    def __iter__(self):
        return iter(_MIXERS)

    def __len__(self):
        return len(_MIXERS)

    def __repr__(self):
        return repr(dict(self))
