"""The context-parallel core every operator shares.

``config.py``: :class:`CPConfig`, every knob, checked against its operator's rules (``RULES``);
``plan.py``: the config resolved over a process group (:class:`CPPlan`); ``strategies.py``: the
strategies by name (zeco and lasp2 in ``scan.py``, lasp1 in ``ring.py``, a2a in ``a2a.py``, none);
``operator.py``: what an operator gives them, and one call through them (its piece protocol in
``piece.py``); ``checks.py``: input
checks that agree across ranks; ``packed.py``: packed documents (Megatron's THD format);
``conv.py``: the short causal convolution across pieces (halo exchange); ``registry.py``: the
token mixers the operator folders register (what the specs and the main job offer).

The operators themselves are folders of their own (``megatron_zeco/gla``,
``megatron_zeco/gated_delta_rule``); nothing here imports them.
"""

from .config import RULES, CPConfig, Rules
from .packed import Packing, packed_positions
from .plan import CPPlan
from .strategies import BY_NAME

STRATEGIES = tuple(BY_NAME)  # every strategy's name ("none": one rank)

__all__ = ["CPConfig", "CPPlan", "RULES", "Rules", "STRATEGIES", "Packing", "packed_positions"]
