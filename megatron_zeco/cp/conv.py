"""Context-parallel short causal convolution (Gated DeltaNet's, before the gated delta rule).

Each rank convolves its own pieces of the sequence; the W - 1 tokens before each piece come from
the ranks that hold them by a halo exchange (``comm/halo.py``), and the local convolution starts
each piece from them (``common/conv.py``). The result is exactly the convolution of the whole
sequence, restarted at every document of a packed one, under either layout and either packed
split. Per layer this moves (W - 1) x C values per piece, against the all-to-all of every
token's channels that a head-parallel convolution needs.
"""

import functools
import weakref
from typing import Optional

import torch

from ..comm.halo import HaloPlan, halo_exchange, halo_plan
from ..common.conv import causal_conv1d
from .packed import Packing, _pieces
from .plan import CPPlan

Tensor = torch.Tensor
_PACKED_HALOS: "weakref.WeakKeyDictionary[Packing, dict]" = weakref.WeakKeyDictionary()


def planned_causal_conv1d(plan: CPPlan, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                          activation: Optional[str] = None, cu_seqlens: Optional[Tensor] = None,
                          per_document: bool = False) -> Tensor:
    """The depthwise causal convolution of a sequence split over ``plan``'s group; this rank's part.

    Args:
        plan: the layer's CP plan (its group and layout).
        x: ``[B, T, C]`` this rank's tokens in the layout's order (T the same on every rank).
        weight: ``[C, W]``; bias: ``[C]`` or None; activation: None or ``silu``.
        cu_seqlens, per_document: packed documents (B = 1), as :func:`megatron_zeco.zeco_gla` takes
            them: the convolution restarts at every document.

    Returns:
        ``[B, T, C]``: for each of this rank's tokens, the convolution of the whole sequence there.
        Differentiable in x (the halo's gradient returns to the ranks it came from), the weight and
        the bias.
    """
    B, T, C = x.shape
    width = weight.shape[-1] - 1
    if cu_seqlens is None:
        halos = _dense_plan(plan.layout, plan.world, plan.rank, T, width)
    else:
        if B != 1:  # checked here: the convolution runs before the recurrence's own checks
            raise ValueError(f"{plan.name}: short convolution: packed sequences (cu_seqlens) have batch size 1, "
                             f"got B = {B}")
        packing = Packing.cached(cu_seqlens, plan.layout, plan.world, plan.rank, T, per_document, x.device)
        cached = _PACKED_HALOS.setdefault(packing, {})
        if width not in cached:
            ranges = [_pieces(packing.bounds, plan.layout, plan.world, r, per_document) for r in range(plan.world)]
            cached[width] = halo_plan(ranges, packing.bounds[:-1], plan.rank, width)
        halos = cached[width]
    n = halos.num_segments
    # nothing crosses ranks and no segment starts after tokens of its own document (one rank, or a packed
    # piece that starts every document it holds): every halo is zeros, which is the convolution's own start
    starts_alone = not (halos.sends or halos.recvs or halos.local[0])
    halo = None if starts_alone else halo_exchange(x, halos, plan.group, f"{plan.name}: short convolution")
    if cu_seqlens is None:  # equal segments: the rank's pieces of every row, as a batch
        y = causal_conv1d(x.reshape(B * n, T // n, C), weight, bias, activation,
                          None if halo is None else halo.reshape(B * n, width, C))
        return y.reshape(B, T, C)
    segments = torch.tensor(halos.segments, dtype=torch.long, device=x.device)
    return causal_conv1d(x, weight, bias, activation, None if halo is None else halo[0], cu_seqlens=segments)


@functools.lru_cache(maxsize=64)
def _dense_plan(layout, world: int, rank: int, T: int, width: int) -> HaloPlan:
    """The halo plan of B unpacked sequences (every row split alike)."""
    if world == 1:
        return halo_plan([[(0, T)]], [0], 0, width)
    pieces = layout.num_pieces(world)
    size = world * T // pieces
    ranges = [[(p * size, (p + 1) * size) for p in layout.pieces(r, world)] for r in range(world)]
    return halo_plan(ranges, [0], rank, width)
