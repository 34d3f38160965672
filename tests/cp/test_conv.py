"""The short causal convolution under context parallelism (cp/conv.py: the halo exchange of comm/halo.py,
then the local convolution from the halo) against the convolution of the whole sequence, float64.

Real gloo groups of P = 1, 2, 3, 4 (the module's pool of processes); both layouts; kernels of 4 taps (and 2);
pieces of 6, 3 and 1 tokens, so a piece's halo comes from one, or from several pieces and ranks
before it; packed documents under both splits (the convolution restarts at every document; under
the per-document split each document's pieces have their own halos), documents of one token and
documents starting at piece boundaries. The output and the gradients of the input, the weight and
the bias to 1e-12.
"""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_zeco import Layout, packed_positions
from megatron_zeco.cp import CPConfig
from megatron_zeco.cp.conv import planned_causal_conv1d
from megatron_zeco.cp.plan import make_plan
from tests.helpers.checks import above, assert_no_failures
from tests.helpers.marks import slow_except
from tests.helpers.reference import SPLITS, document_lengths, rel_err

RANK_POOL = dict(world=4, pg_timeout=120)
TOL = 1e-12
C, B = 5, 2


def whole_conv(x, weight, bias, cu=None):
    """silu(conv) of the whole sequence ``x [B, S, C]``, zero-padded on the left, each document alone."""
    bounds = [0, x.shape[1]] if cu is None else cu.tolist()
    W = weight.shape[-1]
    parts = [F.conv1d(F.pad(x[:, a:b].transpose(1, 2), (W - 1, 0)), weight.unsqueeze(1), bias, groups=C)
             for a, b in zip(bounds[:-1], bounds[1:])]
    return F.silu(torch.cat(parts, dim=2).transpose(1, 2))


def _problem(seed, batch, length, W):
    gen = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(batch, length, C, generator=gen, dtype=torch.float64) for _ in range(2))
    weight = torch.randn(C, W, generator=gen, dtype=torch.float64)
    bias = torch.randn(C, generator=gen, dtype=torch.float64)
    return x, dy, weight, bias


def _compare(group, plan, x, dy, weight, bias, mine, cu=None, per_document=False):
    """Errors of this rank's output and gradients (dx of its tokens; dw, db summed over the group)."""
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    ref = whole_conv(*leaves, cu)
    want = torch.autograd.grad(ref, leaves, dy)
    local = x[:, mine].clone().requires_grad_()
    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    y = planned_causal_conv1d(plan, local, w, b, "silu", cu_seqlens=cu, per_document=per_document)
    dx, dw, db = torch.autograd.grad(y, (local, w, b), dy[:, mine])
    if group is not None:
        for t in (dw, db):
            dist.all_reduce(t, group=group)
    return {"y": rel_err(y, ref.detach()[:, mine]), "dx": rel_err(dx, want[0][:, mine]),
            "dw": rel_err(dw, want[1]), "db": rel_err(db, want[2])}


def _check(group, seed):
    world = 1 if group is None else group.size()
    rank = 0 if group is None else group.rank()
    failures = []

    def record(what, errors):
        bad = above(errors, TOL)
        if bad:
            failures.append(f"{what}: {bad}")

    # unpacked: B rows; zigzag pieces of 6, 3 and 1 tokens (1 < W - 1: halos over several pieces)
    for n, (layout, local_len, W) in enumerate(itertools.product(Layout, (12, 6, 2), (4, 2))):
        x, dy, weight, bias = _problem(seed + n, B, world * local_len, W)
        plan = make_plan(CPConfig(layout=layout, transport="send_recv"), group, like=x, name="test")
        mine = layout.shard(torch.arange(world * local_len), rank, world, dim=0)
        record(f"{layout.value} T={local_len} W={W}", _compare(group, plan, x, dy, weight, bias, mine))
    # packed: the documents of tests/cp/test_packed.py (one-token ones, ones at piece boundaries, one over all ranks)
    for n_split, (layout, per_document) in enumerate(SPLITS):
        plan = make_plan(CPConfig(layout=layout, transport="send_recv"), group, like=torch.zeros(()), name="test")
        for n_case, lengths in enumerate(document_lengths(seed + n_split, world, 8, per_document)):
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            x, dy, weight, bias = _problem(seed + 100 * n_split + n_case, 1, world * 8, 4)
            mine = packed_positions(cu, layout, world, rank, per_document)
            record(f"packed {layout} per_document={per_document} lengths={lengths}",
                   _compare(group, plan, x, dy, weight, bias, mine, cu, per_document))
    return failures


@pytest.mark.parametrize("world", slow_except([1, 2, 3, 4], 2))
def test_convolution_matches_whole_sequence(pool, seed, world):
    assert_no_failures(pool.run(_check, world, seed))
