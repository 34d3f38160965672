"""Strategy ``a2a``: head-parallel all-to-all (Megatron's approach for its linear layers).

Trade the sequence split for a head split: after one all-to-all every rank holds the whole
sequence for H/P heads, runs the local operator over it, and a second all-to-all brings the
outputs back. Moves O(T*d) activations per layer (ZeCO moves one state) and needs H divisible by P.

Each input travels in its own dtype (a float32 log decay beside bfloat16 q, k, v is not widened with
them), and nothing is copied beyond what an all-to-all needs: a contiguous send buffer per rank, the
received parts in sequence order.
"""

from typing import List

import torch

from ..comm.functional import all_gather, all_to_all
from .local import initial_state_to


def head_all_to_all(op, plan, call, inputs, h0):
    """``op.run_local`` over the whole sequence for this rank's heads. ``inputs``: per-token tensors
    ``[B, T, H, ...]``. Returns ``(o, final on every rank)``."""
    group, packing = plan.group, call.packing
    world, me = group.size(), group.rank()
    heads = inputs[0].shape[2] // world
    gathered = None if packing is None else packing.gathered
    mine = tuple(_whole_sequence(all_to_all(list(x.split(heads, dim=2)), group), plan, gathered) for x in inputs)
    h0 = None if h0 is None else h0[:, me * heads:(me + 1) * heads]
    o, final = op.run_local(mine, initial_state_to(h0, mine[0]), call)
    if packing is None:
        back = all_to_all([plan.layout.shard(o, r, world, dim=1) for r in range(world)], group)
    else:
        order, _, sizes = gathered
        back = all_to_all(list(o[:, order].split(sizes, dim=1)), group)
    o = back[0] if world == 1 else torch.cat(back, dim=2)
    return o, (all_gather(final, 1, group) if call.output_final_state else None)


def _whole_sequence(parts: List[torch.Tensor], plan, gathered):
    """Every rank's tokens of this rank's heads (``parts``, in group rank order) in sequence order: the
    layout's unshard, or for packed input the tokens back at their global positions (``gathered``:
    ``Packing.gathered``)."""
    if gathered is None:
        return parts[0] if len(parts) == 1 and plan.pieces_per_rank == 1 else plan.layout.unshard(parts, dim=1)
    whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return whole[:, gathered[1]]
