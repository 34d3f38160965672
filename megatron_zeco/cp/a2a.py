"""Strategy ``a2a``: head-parallel all-to-all (Megatron's approach for its linear layers).

Trade the sequence split for a head split: after one all-to-all every rank holds the whole
sequence for H/P heads, runs the local operator over it, and a second all-to-all brings the
outputs back. Moves O(T*d) activations per layer (ZeCO moves one state) and needs H divisible by P.
"""

import torch

from ..comm.functional import all_gather, all_to_all
from .local import initial_state_to


def head_all_to_all(op, plan, call, inputs, h0):
    """``op.local`` over the whole sequence for this rank's heads. ``inputs``: per-token tensors
    ``[B, T, H, ...]`` (one trailing dim or none: ``[B, T, H]`` gates travel as a last dim of 1),
    exchanged as one all-to-all. Returns ``(o, final on every rank)``."""
    group, layout, packing = plan.group, plan.layout, call.packing
    world, me = group.size(), group.rank()
    heads = inputs[0].shape[2] // world
    widths = [x.shape[-1] if x.dim() == 4 else 1 for x in inputs]
    fused = torch.cat([x if x.dim() == 4 else x.unsqueeze(-1) for x in inputs], dim=-1)
    parts = all_to_all(list(fused.split(heads, dim=2)), group)  # rank r's tokens of my heads
    if packing is None:
        whole = layout.unshard(parts, dim=1)
    else:  # packed: tokens go back to their global positions (documents may be split one by one)
        positions = [packing.positions(r) for r in range(world)]
        whole = torch.cat(parts, dim=1)[:, torch.cat(positions).argsort()]
    # one all-to-all in the widest dtype (the gated delta rule's g may be float32 beside bf16 inputs)
    mine = [(y if x.dim() == 4 else y.squeeze(-1)).to(x.dtype) for x, y in zip(inputs, whole.split(widths, dim=-1))]
    h0 = None if h0 is None else h0[:, me * heads:(me + 1) * heads]
    o, final = op.local(tuple(mine), initial_state_to(h0, mine[0]), call)
    if packing is None:
        back = all_to_all([layout.shard(o, r, world, dim=1) for r in range(world)], group)
    else:
        back = all_to_all([o[:, p] for p in positions], group)
    o = torch.cat(back, dim=2)
    return o, (all_gather(final, 1, group) if call.output_final_state else None)
