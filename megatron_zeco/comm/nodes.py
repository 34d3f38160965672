"""Which ranks of a process group share a node.

The All-Scan passes states between neighbouring pieces; where the group spans several nodes the
hops between nodes cost most, and the scan's shape across them follows this structure
(``all_scan``'s ``nodes``). Ranks on one host form a node. Tests and latency emulation force
nodes of ``node_size`` consecutive group ranks instead (``$MEGATRON_ZECO_NODE_SIZE``).
"""

import os
import socket
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

NODE_SIZE_ENV = "MEGATRON_ZECO_NODE_SIZE"
_HOSTS: Dict[object, Tuple[int, ...]] = {}


def host_nodes(group) -> Tuple[int, ...]:
    """The node of each rank of ``group`` (in group rank order), numbered by first appearance:
    ranks with one host name share a node. Collective the first time per group (every rank of
    the group must call it), a dict lookup after."""
    if group not in _HOSTS:
        names: List[Optional[str]] = [None] * group.size()
        dist.all_gather_object(names, socket.gethostname(), group=group)
        first = {}
        _HOSTS[group] = tuple(first.setdefault(name, len(first)) for name in names)
    return _HOSTS[group]


def group_nodes(group, node_size: Optional[int] = None) -> Tuple[int, ...]:
    """The node of each rank of ``group``: ``node_size`` consecutive group ranks per node if given,
    else ``$MEGATRON_ZECO_NODE_SIZE`` if set, else the hosts (:func:`host_nodes`)."""
    if group is None:
        return (0,)
    if node_size is None and os.environ.get(NODE_SIZE_ENV):
        try:
            node_size = int(os.environ[NODE_SIZE_ENV])
        except ValueError:
            raise ValueError(f"${NODE_SIZE_ENV} must be a positive integer, got "
                             f"{os.environ[NODE_SIZE_ENV]!r}") from None
    if node_size is None:
        return host_nodes(group)
    check_node_size(node_size)
    return tuple(r // node_size for r in range(group.size()))


def check_node_size(node_size: Optional[int]) -> None:
    """ValueError unless ``node_size`` is None or a positive integer."""
    if node_size is not None and (isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1):
        raise ValueError(f"node_size must be a positive integer (ranks per node) or None, got {node_size!r}")
