"""The halo plan (comm/halo.py): which tokens before its pieces each rank receives, and from whom, for
the short convolution under context parallelism (computed through it: tests/cp/test_conv.py)."""

from megatron_zeco import Layout
from megatron_zeco.comm.halo import halo_plan


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
