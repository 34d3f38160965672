"""One home for the context-parallel knobs: :class:`CPConfig`, checked once against its operator's rules.

A layer, or one call of an operator, runs under context parallelism (CP) as its ``CPConfig`` says:

================  ==============================================================  ===================
knob              what                                                            layer and spec
================  ==============================================================  ===================
``strategy``      how the recurrent state crosses the CP ranks                    ``cp_strategy``
``layout``        which pieces of the sequence each rank holds                    ``cp_layout``
``num_blocks``    pipeline blocks of the All-Scan                                 ``cp_num_blocks``
``transport``     how the All-Scan moves states                                   ``cp_transport``
``overlap``       a side CUDA stream for (part of) the scan                       ``cp_overlap_scan``
``piece_split``   sub-pieces per piece, batched                                   ``cp_piece_split``
``packed_split``  how packed (THD) batches are split over the ranks               ``cp_packed_split``
``node_size``     ranks of the CP group per node                                  ``cp_node_size``
================  ==============================================================  ===================

What each operator allows is one entry of :data:`RULES` (its strategies, which axis of the state
the pipeline blocks cut, what ``auto`` means for its transport, which knobs apply to it): a new
operator is a new entry. A config is checked when it is made and names the knob and its layer
keyword in every error, the same whichever entry point made it (the operator's keywords, a layer
spec, a layer, ``megatron_zeco.train``'s flags). ``cp.plan.make_plan`` resolves what needs the
process group and the device (``transport="auto"``, ``overlap=None``, the strategy on one rank) once per
layer into a ``CPPlan``; everything below the plan receives resolved values only.
"""

from dataclasses import dataclass, fields
from typing import FrozenSet, List, Optional, Tuple, Union

from ..comm import Layout
from ..comm.transport import Transport, check_request

PACKED_SPLITS = ("auto", "document", "sequence")
# The knobs every operator takes; the others apply where an operator's rules list them.
SHARED_KNOBS = frozenset({"strategy", "layout", "num_blocks", "transport", "overlap", "packed_split"})


@dataclass(frozen=True)
class Rules:
    """What an operator allows under context parallelism.

    Attributes:
        name: how errors name the operator.
        strategies: the CP strategies it runs (``none``, one rank, always).
        blocks: the state axis the All-Scan's pipeline blocks cut: ``rows`` (key rows: a diagonal
            transition acts row by row) or ``columns`` (value columns: a dense transition mixes rows).
        auto_transport: what ``transport="auto"`` means: None (by the group's hosts: peer memory between
            the GPUs of one node, else the group's messages; ``$MEGATRON_ZECO_TRANSPORT`` overrides) or a
            :class:`~megatron_zeco.comm.transport.Transport` (``comm.transport.resolve``).
        auto_overlap: what ``overlap=None`` means over a device transport: whether the scan's hops go on a
            side stream, on few programs, to spin beside the in-chunk work that needs no entering state
            (worth it where that work is longer than what the hop loses on few programs; docs/scaling.md,
            "The overlap, measured on one GPU"). Off unless an operator's measurements say so.
        knobs: the knobs beyond :data:`SHARED_KNOBS` that apply to it.
    """

    name: str
    strategies: Tuple[str, ...]
    blocks: str
    auto_transport: Optional[Transport]
    auto_overlap: bool = False
    knobs: FrozenSet[str] = frozenset()

    def applies(self, knob: str) -> bool:
        return knob in SHARED_KNOBS or knob in self.knobs


RULES = {
    "gla": Rules("GLA", ("zeco", "lasp1", "lasp2", "a2a"), blocks="rows", auto_transport=None, auto_overlap=True,
                 knobs=frozenset({"piece_split", "node_size"})),
    # auto stays the group's messages for the dense hop kernel until GPU timings make peer memory the default;
    # over a device transport the delta rules' hops run beside their pieces' work that needs no scan result
    # (the forward's output from a zero state, the backward's recompute of the chunk states): measured on one
    # GPU for both, on two for the gated delta rule (docs/scaling.md, "The overlap, measured on one GPU")
    "gated_delta_rule": Rules("the gated delta rule", ("zeco", "lasp2", "a2a"), blocks="columns",
                              auto_transport=Transport.SEND_RECV, auto_overlap=True),
    "kda": Rules("KDA", ("zeco", "lasp2", "a2a"), blocks="columns", auto_transport=Transport.SEND_RECV,
                 auto_overlap=True),
}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class CPConfig:
    """Every context-parallel knob of a layer or a call (see the module docstring), checked against
    ``RULES[operator]`` when made: ``ValueError`` naming each bad knob by its layer keyword. Frozen;
    ``layout`` is held as a :class:`~megatron_zeco.comm.Layout`.

    Attributes:
        operator: the key of the operator's rules (``gla``, ``gated_delta_rule``, ``kda``).
        strategy: ``zeco`` (All-Scan), ``lasp2`` (all-gather), ``lasp1`` (ring), ``a2a`` (head
            all-to-all), as the operator allows; on one rank every strategy is the local op.
        layout: ``zigzag`` (Megatron's CP split: 2P pieces, rank r holds r and 2P-1-r) or
            ``contiguous``.
        num_blocks: pipeline blocks of the All-Scan (a divisor of the head dim the rules name).
        transport: ``auto``, ``send_recv``, ``peer_memory`` or ``nvshmem``.
        overlap: a side CUDA stream for the scan; None: on for ``zeco`` over a device transport where the
            operator's rules say so (``Rules.auto_overlap``: every operator built here).
        piece_split: sub-pieces per piece, batched (GLA); None: chosen per call.
        packed_split: ``document``, ``sequence`` or ``auto`` (from Megatron-LM's arguments).
        node_size: ranks of the CP group per node (GLA's hierarchical scan); None: from the hosts.
    """

    operator: str = "gla"
    strategy: str = "zeco"
    layout: Union[str, Layout] = "zigzag"
    num_blocks: int = 1
    transport: str = "auto"
    overlap: Optional[bool] = None
    piece_split: Optional[int] = None
    packed_split: str = "auto"
    node_size: Optional[int] = None

    def __post_init__(self):
        if self.operator not in RULES:
            raise ValueError(f"CPConfig: unknown operator {self.operator!r}; expected one of {', '.join(RULES)}")
        problems = self._problems()
        if problems:
            raise ValueError("; ".join(problems))
        object.__setattr__(self, "layout", Layout(self.layout))

    @property
    def rules(self) -> Rules:
        return RULES[self.operator]

    def _problems(self) -> List[str]:
        rules, problems = self.rules, []
        for f in fields(self):
            if f.name != "operator" and not rules.applies(f.name) and getattr(self, f.name) != f.default:
                problems.append(f"{KEYWORDS[f.name]} applies to {_applying(f.name)} only; keep its default "
                                f"({f.default!r}) for {rules.name}")
        if self.strategy not in rules.strategies + ("none",):
            problems.append(f"cp_strategy {self.strategy!r} is not one of {', '.join(rules.strategies)} for "
                            f"{rules.name}")
        if self.layout not in [m.value for m in Layout] + list(Layout):
            problems.append(f"cp_layout {self.layout!r} is not one of {', '.join(m.value for m in Layout)}")
        if not _is_int(self.num_blocks) or self.num_blocks < 1:
            problems.append(f"cp_num_blocks {self.num_blocks!r} must be a positive integer")
        if check_request(self.transport):
            problems.append(check_request(self.transport))
        if self.overlap is not None and not isinstance(self.overlap, bool):
            problems.append(f"cp_overlap_scan {self.overlap!r} must be True, False or None")
        if self.piece_split is not None and (not _is_int(self.piece_split) or self.piece_split < 1):
            problems.append(f"cp_piece_split {self.piece_split!r} must be a positive integer or None")
        if self.packed_split not in PACKED_SPLITS:
            problems.append(f"cp_packed_split {self.packed_split!r} is not one of {', '.join(PACKED_SPLITS)}")
        if self.node_size is not None and (not _is_int(self.node_size) or self.node_size < 1):
            problems.append(f"cp_node_size {self.node_size!r} must be a positive integer (ranks of the CP group per "
                            f"node) or None")
        return problems

    def dims_problems(self, K: int, V: int) -> List[str]:
        """What is wrong with the knobs for heads of key dim ``K`` and value dim ``V``."""
        axis, dim = ("key", K) if self.rules.blocks == "rows" else ("value", V)
        if dim % self.num_blocks:
            what = "key rows" if self.rules.blocks == "rows" else "value columns"
            return [f"cp_num_blocks {self.num_blocks} must divide the {axis} head dim ({dim}): {self.rules.name}'s "
                    f"All-Scan pipelines the state in blocks of {what}"]
        return []

    def check_dims(self, K: int, V: int) -> None:
        """ValueError from :meth:`dims_problems`."""
        problems = self.dims_problems(K, V)
        if problems:
            raise ValueError("; ".join(problems))

# Each knob's layer and spec keyword.
KEYWORDS = {"strategy": "cp_strategy", "layout": "cp_layout", "num_blocks": "cp_num_blocks",
            "transport": "cp_transport", "overlap": "cp_overlap_scan", "piece_split": "cp_piece_split",
            "packed_split": "cp_packed_split", "node_size": "cp_node_size"}
_KNOBS = {keyword: knob for knob, keyword in KEYWORDS.items()}


def _applying(knob: str) -> str:
    names = [rules.name for rules in RULES.values() if rules.applies(knob)]
    return " and ".join(names) if names else "no operator"


def split_keywords(kwargs: dict) -> Tuple[dict, dict]:
    """``kwargs`` of a layer or spec as (the CP knobs among them, by knob name; the rest)."""
    knobs = {_KNOBS[key]: value for key, value in kwargs.items() if key in _KNOBS}
    return knobs, {key: value for key, value in kwargs.items() if key not in _KNOBS}


def config_of(operator: str, config: Optional[CPConfig], knobs: dict, who: str) -> CPConfig:
    """The CPConfig of a layer or spec of ``operator``: ``config`` as given, or one made from the ``cp_*``
    keywords ``knobs`` (by knob name, :func:`split_keywords`); not both. ``who`` names the caller."""
    if config is not None:
        if knobs:
            raise ValueError(f"{who}: give either cp_config or the cp_* keywords "
                             f"({', '.join(KEYWORDS[k] for k in knobs)}), not both")
        if config.operator != operator:
            raise ValueError(f"{who}: cp_config is {RULES[config.operator].name}'s (operator="
                             f"{config.operator!r}), not {RULES[operator].name}'s (operator={operator!r})")
        return config
    try:
        return CPConfig(operator=operator, **knobs)
    except ValueError as e:
        raise ValueError(f"{who}: {e}") from None
