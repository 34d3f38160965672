"""A context-parallel plan: a :class:`~megatron_zeco.cp.config.CPConfig` resolved over a process group.

One frozen :class:`CPPlan` holds what every call of a layer shares: the group, the config, the
strategy object (:mod:`megatron_zeco.cp.strategies`; the local one on one rank), and the knobs that needed
the group or the device resolved (the All-Scan's :class:`~megatron_zeco.comm.transport.Transport`, its
side stream). :func:`make_plan` makes it, collectively the first time per group, so every rank builds its
plan at the same point. A layer builds one plan at its first forward pass; an operator called alone
builds one per group, knobs and input shapes (``cp.operator``).
"""

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..comm import Layout
from ..comm.all_scan import Route
from ..comm.functional import broadcast
from ..comm.transport import Transport, resolve as resolve_transport
from .strategies import BY_NAME, LOCAL


@dataclass(frozen=True)
class CPPlan:
    """How one layer runs under context parallelism, every knob resolved.

    Attributes:
        group: the CP process group, or None (one rank).
        config: the knobs as given (a :class:`~megatron_zeco.cp.config.CPConfig`; ``config.strategy`` is
            ``none`` on one rank).
        strategy: the strategy object that runs the calls (:mod:`megatron_zeco.cp.strategies`).
        transport: the All-Scan's :class:`~megatron_zeco.comm.transport.Transport`.
        overlap: whether a side CUDA stream runs beside the local work (``zeco``, ``lasp2``).
        name: names the caller in communication errors.
    """

    group: Optional[object]
    config: object
    strategy: object = LOCAL
    transport: Transport = Transport.SEND_RECV
    overlap: bool = False
    name: str = ""

    @property
    def layout(self) -> Layout:
        return self.config.layout

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def node_size(self) -> Optional[int]:
        return self.config.node_size

    @property
    def world(self) -> int:
        return 1 if self.group is None else self.group.size()

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank()

    @property
    def pieces_per_rank(self) -> int:
        return len(self.layout.pieces(0, self.world))

    def piece_split(self, tokens: int, packed: bool) -> int:
        """Sub-pieces per piece for a call with ``tokens`` per rank: the configured number, else 2 for zeco
        on an unpacked contiguous split with an even count (a contiguous piece then runs as two batched
        halves, the shape zigzag gives a rank anyway: more independent sequences for fla's sequential
        state kernels), else 1. Packed batches run as segments already."""
        if packed:
            return 1
        if self.config.piece_split is not None:
            return self.config.piece_split
        halves = (self.strategy.all_scan and self.world > 1 and self.layout is Layout.CONTIGUOUS
                  and self.config.rules.applies("piece_split") and tokens % 2 == 0)
        return 2 if halves else 1

    def route(self, what: str, precision: str = "tf32x3") -> Route:
        """The route of this plan's scans (:class:`~megatron_zeco.comm.all_scan.Route`), ``what`` naming one,
        ``precision`` the pieces' map precision (``megatron_zeco.kernels.map_precision``)."""
        return Route(self.layout, self.group, self.num_blocks, self.transport, self.node_size, what=what,
                     precision=precision)


def make_plan(config, group, like: Optional[torch.Tensor] = None, name: str = "") -> CPPlan:
    """``config`` (a :class:`~megatron_zeco.cp.config.CPConfig`) over ``group`` (None or a group of one: no
    context parallelism) for states like ``like`` (its device): the strategy's object,
    ``transport="auto"`` by the operator's rules and the group's hosts, ``overlap=None`` on for zeco over a
    device transport where the operator's rules say so (``Rules.auto_overlap``). Collective the first time
    per group (which hosts share a node). ``name`` names the caller in communication errors."""
    world = 1 if group is None else group.size()
    if world == 1:
        return CPPlan(None, _with_strategy(config, "none"), LOCAL, name=name)
    strategy = BY_NAME[config.strategy]
    transport = Transport.SEND_RECV
    if strategy.all_scan:
        try:
            transport = resolve_transport(config.transport, group, like, auto=config.rules.auto_transport)
        except ValueError as e:  # named as the caller's, like every other input error
            raise ValueError(f"{name}: {e}") from None
    overlap = config.overlap
    if overlap is None:
        overlap = strategy.all_scan and transport.device and config.rules.auto_overlap
    return CPPlan(group, config, strategy, transport, bool(overlap), name)


def _with_strategy(config, strategy: str):
    return replace(config, strategy=strategy)


def final_state_everywhere(plan: CPPlan, final: torch.Tensor) -> torch.Tensor:
    """The state after the last token on every rank of the plan's group, from the rank holding the
    last piece (whose scan result ``final`` is; zeros elsewhere); backward sums onto that rank."""
    last_piece = plan.layout.num_pieces(plan.world) - 1
    return broadcast(final, plan.layout.owner(last_piece, plan.world)[0], plan.group)
