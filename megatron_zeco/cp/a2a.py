"""Strategy ``a2a``: head-parallel all-to-all (Megatron's approach for its linear layers).

Trade the sequence split for a head split: after one all-to-all every rank
holds the whole sequence for H/P heads, runs GLA over it, and a second
all-to-all brings the outputs back. Moves O(T*d) activations per layer (ZeCO
moves one state) and needs H divisible by P.
"""

import torch

from ..comm.functional import all_gather, all_to_all
from .local import LocalGLA


def a2a_gla(q, k, v, g, h0, scale, layout, group, output_final_state, packing=None):
    world, me = group.size(), group.rank()
    K, V = q.shape[-1], v.shape[-1]
    heads = q.shape[2] // world
    fused = torch.cat([q, k, v, g], dim=-1)
    parts = all_to_all(list(fused.split(heads, dim=2)), group)  # rank r's tokens of my heads
    if packing is None:
        whole = layout.unshard(parts, dim=1)
    else:  # packed: tokens go back to their global positions (documents may be split one by one)
        positions = [packing.positions(r) for r in range(world)]
        whole = torch.cat(parts, dim=1)[:, torch.cat(positions).argsort()]
    q_, k_, v_, g_ = whole.split([K, K, V, K], dim=-1)
    h0 = None if h0 is None else h0[:, me * heads:(me + 1) * heads]
    o, final = LocalGLA.apply(q_, k_, v_, g_, h0, scale, output_final_state,
                              *(() if packing is None else (packing.documents, packing.documents_cpu)))
    if packing is None:
        back = all_to_all([layout.shard(o, r, world, dim=1) for r in range(world)], group)
    else:
        back = all_to_all([o[:, p] for p in positions], group)
    o = torch.cat(back, dim=2)
    return o, (all_gather(final, 1, group) if output_final_state else None)
