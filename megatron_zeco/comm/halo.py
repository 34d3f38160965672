"""Halo exchange: the inputs a short causal convolution needs from before each of a rank's pieces.

A causal convolution of W taps reads, at each token, the W - 1 tokens before it. With the sequence
split over the ranks of a context-parallel group, the tokens before a piece's first one belong to
the piece before it, which another rank holds: under the contiguous layout rank r's piece follows
rank r-1's; under the zigzag layout rank r's front piece r follows rank r-1's front piece, and its
back piece 2P-1-r follows piece 2P-2-r of rank r+1 (rank P-1's back piece follows its own front
piece). Packed documents restart the convolution: nothing crosses a document start, and under
the per-document split each document's pieces have halos of their own. Pieces shorter than
W - 1 tokens take their halo from several pieces, and ranks, before them.

:func:`halo_plan` says, from where every rank's pieces sit in the sequence, which of its tokens each
rank sends to which peer and where the tokens it receives go; :func:`halo_exchange` moves them (one
message per pair of ranks that share tokens, all posted at once) and, in backward, sends the halo's
gradient back to the tokens it came from. Peers are addressed through the group
(``dist.get_global_rank``), so any Megatron context-parallel group works.
"""

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from .failures import naming_failures

Tensor = torch.Tensor
TAG = 1 << 24  # point-to-point tag of halo messages (All-Scan's tags count pieces and blocks from 0)


@dataclass(frozen=True)
class HaloPlan:
    """One rank's part of a halo exchange.

    Attributes:
        width: tokens before each segment (W - 1 for a convolution of W taps).
        segments: local offsets ``[N+1]`` of the rank's N segments: its pieces, cut where documents
            start. Each segment is convolved from its own halo.
        sends: ``(peer, local token indices)``: what each peer needs from this rank, in its order.
        recvs: ``(peer, halo slots)``: where the tokens from each peer go (slot ``n * width + j``:
            segment n's j-th halo token, oldest first).
        local: ``(local token indices, halo slots)`` of the halo tokens the rank holds itself.
    """

    width: int
    segments: Tuple[int, ...]
    sends: Tuple[Tuple[int, Tuple[int, ...]], ...]
    recvs: Tuple[Tuple[int, Tuple[int, ...]], ...]
    local: Tuple[Tuple[int, ...], Tuple[int, ...]]

    @property
    def num_segments(self) -> int:
        return len(self.segments) - 1


def halo_plan(ranges: Sequence[Sequence[Tuple[int, int]]], starts: Sequence[int], rank: int, width: int) -> HaloPlan:
    """The plan of ``rank`` in a group whose rank r holds the global token ranges ``ranges[r]``
    (``[start, end)``, in its local order) of a sequence whose documents start at ``starts``
    (sorted; ``[0]`` for one document). Every rank computes every rank's needs, so the plans agree.
    """
    starts = sorted(set(starts))
    held = sorted((a, b, r, offset) for r, runs in enumerate(ranges) for a, b, offset in _offsets(runs))
    firsts = [a for a, *_ in held]

    def owner(position: int) -> Tuple[int, int]:
        a, b, r, offset = held[bisect_right(firsts, position) - 1]
        if not a <= position < b:
            raise ValueError(f"halo_plan: token {position} is held by no rank")
        return r, offset + position - a

    def needs(r: int) -> List[Tuple[int, int, int]]:
        """``(halo slot, owner rank, owner's local index)`` of every halo token rank r needs."""
        out = []
        for n, (a, _, _) in enumerate(_segments(ranges[r], starts)):
            document = starts[bisect_right(starts, a) - 1]
            for position in range(max(a - width, document), a):
                out.append((n * width + width - (a - position), *owner(position)))
        return out

    sends: Dict[int, List[int]] = {}
    for peer in range(len(ranges)):
        if peer != rank:
            mine = [index for _, r, index in needs(peer) if r == rank]
            if mine:
                sends[peer] = mine
    recvs: Dict[int, List[int]] = {}
    local: Tuple[List[int], List[int]] = ([], [])
    for slot, r, index in needs(rank):
        if r == rank:
            local[0].append(index)
            local[1].append(slot)
        else:
            recvs.setdefault(r, []).append(slot)
    offsets = [0]
    for a, b, _ in _segments(ranges[rank], starts):
        offsets.append(offsets[-1] + b - a)
    return HaloPlan(width, tuple(offsets), tuple((p, tuple(v)) for p, v in sorted(sends.items())),
                    tuple((p, tuple(v)) for p, v in sorted(recvs.items())), (tuple(local[0]), tuple(local[1])))


def _offsets(runs):
    """``(start, end, local offset)`` of a rank's ranges."""
    offset = 0
    for a, b in runs:
        yield a, b, offset
        offset += b - a


def _segments(runs, starts):
    """A rank's ranges cut where documents start: ``(start, end, local offset)``."""
    for a, b, offset in _offsets(runs):
        cuts = starts[bisect_right(starts, a):bisect_left(starts, b)]
        for lo, hi in zip([a, *cuts], [*cuts, b]):
            yield lo, hi, offset + lo - a


def halo_exchange(x: Tensor, plan: HaloPlan, group, what: str = "halo exchange") -> Tensor:
    """Every segment's halo: ``[B, N, width, C]`` from this rank's tokens ``x [B, T, C]`` (zeros
    where a segment has fewer than ``width`` tokens before it in its document). Differentiable:
    backward returns each halo token's gradient to the rank, and token, it came from. ``what``
    names the caller in communication errors."""
    return _HaloExchange.apply(x, plan, group, what)


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group, what):
        ctx.plan, ctx.group, ctx.what = plan, group, what
        B, T, C = x.shape
        halo = x.new_zeros(B, plan.num_segments * plan.width, C)
        received = _exchange(group, [(peer, x[:, list(index)]) for peer, index in plan.sends],
                             [(peer, len(slots)) for peer, slots in plan.recvs], x, f"{what} (forward)")
        for (_, slots), part in zip(plan.recvs, received):
            halo[:, list(slots)] = part
        sources, slots = plan.local
        if sources:
            halo[:, list(slots)] = x[:, list(sources)]
        return halo.view(B, plan.num_segments, plan.width, C)

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        B, _, _, C = grad.shape
        grad = grad.reshape(B, -1, C)
        received = _exchange(ctx.group, [(peer, grad[:, list(slots)]) for peer, slots in plan.recvs],
                             [(peer, len(index)) for peer, index in plan.sends], grad, f"{ctx.what} (backward)")
        dx = grad.new_zeros(B, plan.segments[-1], C)
        for (_, index), part in zip(plan.sends, received):
            dx.index_add_(1, torch.tensor(index, device=dx.device), part)
        sources, slots = plan.local
        if sources:
            dx.index_add_(1, torch.tensor(sources, device=dx.device), grad[:, list(slots)])
        return dx, None, None, None


def _exchange(group, sends: Sequence[Tuple[int, Tensor]], recvs: Sequence[Tuple[int, int]], like: Tensor,
              what: str) -> List[Tensor]:
    """Post every send and receive at once (one batch: NCCL runs it as one group, so no rank waits on
    a peer that waits on it) and wait for all; returns the received ``[B, n, C]`` tensors."""
    if not sends and not recvs:
        return []
    ops, received = [], []
    for peer, tensor in sends:
        ops.append(dist.P2POp(dist.isend, tensor.contiguous(), dist.get_global_rank(group, peer), group, TAG))
    for peer, n in recvs:
        buffer = like.new_empty(like.shape[0], n, like.shape[-1])
        received.append(buffer)
        ops.append(dist.P2POp(dist.irecv, buffer, dist.get_global_rank(group, peer), group, TAG))
    peers = sorted({p for p, _ in sends} | {p for p, _ in recvs})
    with naming_failures(what, f"exchanging halo tokens with group ranks {peers}"):
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received
