"""A context-parallel plan: how a layer's sequence is split over its CP group and how states travel.

One frozen :class:`CPPlan` holds what every call of a layer shares: the group, the strategy, the
layout, the All-Scan's pipeline blocks, its transport, whether its sends run on a side stream, and
which ranks share a node. :func:`cp_plan` resolves the defaults that need the group or the
device (``transport="auto"``, ``overlap=None``): collective the first time per group,
so every rank builds its plan at the same point. ``GatedLinearAttention`` builds one plan per
layer; :func:`megatron_zeco.zeco_gla` builds one per call.
"""

from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..comm import Layout, as_layout
from ..comm.functional import broadcast
from ..comm.nodes import check_node_size
from ..comm.peer import resolve_transport


@dataclass(frozen=True)
class CPPlan:
    """How one layer runs under context parallelism.

    Attributes:
        group: the CP process group, or None (one rank).
        strategy: ``zeco``, ``lasp2``, ``lasp1``, ``a2a``; ``none`` on one rank.
        layout: which pieces of the sequence each rank holds.
        num_blocks: blocks of key rows the All-Scan pipelines (``zeco``).
        transport: the All-Scan's resolved transport (``send_recv``, ``peer_memory`` or ``nvshmem``).
        overlap: a side CUDA stream beside the local work (``zeco``, ``lasp2``).
        node_size: ranks per node, or None: from the hosts or ``$MEGATRON_ZECO_NODE_SIZE``
            (``comm.nodes``; looked up by the scan, which names a failure there).
        name: names the caller in communication errors.
    """

    group: Optional[object]
    strategy: str
    layout: Layout
    num_blocks: int = 1
    transport: str = "send_recv"
    overlap: bool = False
    node_size: Optional[int] = None
    name: str = "zeco_gla"

    @property
    def world(self) -> int:
        return 1 if self.group is None else self.group.size()

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank()

    @property
    def pieces_per_rank(self) -> int:
        return len(self.layout.pieces(0, self.world))

    def scan_kwargs(self) -> dict:
        """The keywords :func:`megatron_zeco.comm.all_scan` takes from the plan."""
        return dict(layout=self.layout, group=self.group, num_blocks=self.num_blocks, transport=self.transport,
                    node_size=self.node_size)


def cp_plan(group, *, strategy: str = "zeco", layout: Union[str, Layout] = "contiguous", num_blocks: int = 1,
            overlap: Optional[bool] = None, transport: str = "auto", node_size: Optional[int] = None,
            like: Optional[torch.Tensor] = None, name: str = "zeco_gla") -> CPPlan:
    """The plan of a layer over ``group`` (None or a group of one: no context parallelism).

    ``transport="auto"`` and ``overlap=None`` are resolved for states like ``like`` (its device):
    peer memory for CUDA states on one node, else send/recv; the side stream on for zeco over
    peer memory. ``node_size``: ranks per node (None: from the hosts or
    ``$MEGATRON_ZECO_NODE_SIZE``, looked up by the scan). Collective the first time per group
    on CUDA.
    """
    layout = as_layout(layout)
    world = 1 if group is None else group.size()
    check_node_size(node_size)
    if world == 1:
        return CPPlan(None, "none", layout, num_blocks, name=name)
    if strategy == "zeco":
        try:
            transport = resolve_transport(transport, group, like)
        except ValueError as e:  # named as the caller's, like every other input error
            raise ValueError(f"{name}: {e}") from None
    else:
        transport = "send_recv"
    if overlap is None:
        overlap = strategy == "zeco" and transport in ("peer_memory", "nvshmem")
    return CPPlan(group, strategy, layout, num_blocks, transport, bool(overlap), node_size, name)


def final_state_everywhere(plan: CPPlan, final: torch.Tensor) -> torch.Tensor:
    """The state after the last token on every rank of the plan's group, from the rank holding the
    last piece (whose scan result ``final`` is; zeros elsewhere); backward sums onto that rank."""
    last_piece = plan.layout.num_pieces(plan.world) - 1
    return broadcast(final, plan.layout.owner(last_piece, plan.world)[0], plan.group)
