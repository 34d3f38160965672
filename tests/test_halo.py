"""The short causal convolution under context parallelism (halo exchange, comm/halo.py, and the local
convolution from the halo, ops/conv.py) against the convolution of the whole sequence, float64.

Real gloo groups of P = 1, 2, 3, 4 (one pool of processes); both layouts; kernels of 4 taps (and 2);
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

from distributed import RankPool
from megatron_zeco import Layout, packed_positions
from megatron_zeco.comm.halo import halo_plan
from megatron_zeco.cp import CPConfig
from megatron_zeco.cp.conv import planned_causal_conv1d
from reference import rel_err
from test_packed import SPLITS, _documents

TOL = 1e-12
C, B = 5, 2


@pytest.fixture(scope="module")
def pool():
    with RankPool(4, pg_timeout=120) as p:
        yield p


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
        bad = {k: f"{e:.1e}" for k, e in errors.items() if not e < TOL}
        if bad:
            failures.append(f"{what}: {bad}")

    # unpacked: B rows; zigzag pieces of 6, 3 and 1 tokens (1 < W - 1: halos over several pieces)
    for n, (layout, local_len, W) in enumerate(itertools.product(Layout, (12, 6, 2), (4, 2))):
        x, dy, weight, bias = _problem(seed + n, B, world * local_len, W)
        plan = CPConfig(layout=layout, transport="send_recv").plan(group, like=x, name="test")
        mine = layout.shard(torch.arange(world * local_len), rank, world, dim=0)
        record(f"{layout.value} T={local_len} W={W}", _compare(group, plan, x, dy, weight, bias, mine))
    # packed: the test_packed documents (one-token ones, ones at piece boundaries, one over all ranks)
    for n_split, (layout, per_document) in enumerate(SPLITS):
        plan = CPConfig(layout=layout, transport="send_recv").plan(group, like=torch.zeros(()), name="test")
        for n_case, lengths in enumerate(_documents(seed + n_split, world, 8, per_document)):
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            x, dy, weight, bias = _problem(seed + 100 * n_split + n_case, 1, world * 8, 4)
            mine = packed_positions(cu, layout, world, rank, per_document)
            record(f"packed {layout} per_document={per_document} lengths={lengths}",
                   _compare(group, plan, x, dy, weight, bias, mine, cu, per_document))
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_convolution_matches_whole_sequence(pool, seed, world):
    failures = pool.run(_check, world, seed)
    assert not any(failures), "\n".join(f"rank {r}: {f}" for r, fs in enumerate(failures) for f in fs)


def test_plan_sends_each_rank_the_tokens_before_its_pieces():
    """Zigzag over 3 ranks, pieces of 4 tokens, W = 4: rank r's front piece takes rank r-1's front
    piece's last 3 tokens; its back piece 5-r takes piece 4-r's, from rank r+1; rank 2's back piece
    follows its own front piece (no message)."""
    ranges = [[(p * 4, p * 4 + 4) for p in Layout.ZIGZAG.pieces(r, 3)] for r in range(3)]
    plans = [halo_plan(ranges, [0], r, 3) for r in range(3)]
    # rank 0 holds pieces 0 and 5: piece 5 needs tokens 17..19 of piece 4 (rank 1's slot 1: local 5..7)
    assert plans[0].recvs == ((1, (3, 4, 5)),) and plans[0].sends == ((1, (1, 2, 3)),)
    assert plans[1].sends == ((0, (5, 6, 7)), (2, (1, 2, 3))) and plans[1].recvs == ((0, (0, 1, 2)), (2, (3, 4, 5)))
    assert plans[2].local == ((1, 2, 3), (3, 4, 5)) and plans[2].recvs == ((1, (0, 1, 2)),)
    assert plans[2].sends == ((1, (5, 6, 7)),)
    # packed: a document starting inside the halo cuts it; one starting at a piece needs none
    plan = halo_plan([[(0, 4)], [(4, 8)]], [0, 3, 4], 1, 3)
    assert plan.recvs == () and plan.segments == (0, 4)
    plan = halo_plan([[(0, 4)], [(4, 8)]], [0, 2], 1, 3)
    assert plan.recvs == ((0, (1, 2)),) and plan.segments == (0, 4)  # tokens 2, 3; slot 0 stays zero
