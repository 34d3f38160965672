"""Differentiable collectives over a group (group ranks, not global ranks, as arguments)."""

from typing import List

import torch
import torch.distributed as dist

Tensor = torch.Tensor


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, group):
        ctx.src, ctx.group = src, group
        out = x.detach().clone().contiguous()
        dist.broadcast(out, dist.get_global_rank(group, src), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        # Every rank's copy was used: the source's gradient is their sum.
        grad = grad.contiguous().clone()
        dist.reduce(grad, dist.get_global_rank(ctx.group, ctx.src), group=ctx.group)
        if dist.get_rank(ctx.group) != ctx.src:
            grad.zero_()
        return grad, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        ctx.shapes = [x.shape for x in xs]
        out = [torch.empty_like(x) for x in xs]
        dist.all_to_all(out, [x.contiguous() for x in xs], group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        out = [torch.empty(s, dtype=grads[0].dtype, device=grads[0].device) for s in ctx.shapes]
        dist.all_to_all(out, [g.contiguous() for g in grads], group=ctx.group)
        return (None, *out)


# torch 2.13 renames reduce_scatter_tensor to reduce_scatter_single (same arguments) and warns
# (FutureWarning) at every call of the old name; older releases have the old name only.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        # Every rank used every part: this rank's part of the sum over ranks (reduce-scatter).
        blocks = grad.movedim(ctx.dim, 0).contiguous()  # rank r's part is the r-th block of rows
        mine = blocks.new_empty((blocks.shape[0] // dist.get_world_size(ctx.group), *blocks.shape[1:]))
        _reduce_scatter(mine, blocks, group=ctx.group)
        return mine.movedim(0, ctx.dim), None, None


def broadcast(x: Tensor, src: int, group) -> Tensor:
    """``x`` of group rank ``src`` on every rank; backward sums the gradients onto ``src``."""
    return _Broadcast.apply(x, src, group)


def all_to_all(xs: List[Tensor], group) -> List[Tensor]:
    """Send ``xs[r]`` to group rank r; returns what each rank sent here (all parts of one shape)."""
    return list(_AllToAll.apply(group, *xs))


def all_gather(x: Tensor, dim: int, group) -> Tensor:
    """Concatenation along ``dim`` of every rank's ``x`` (same shape on all ranks); backward
    reduce-scatters the gradient."""
    return _AllGather.apply(x, dim, group)
