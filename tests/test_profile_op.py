"""benchmarks/profile_op.py's overlap figure: how long the hop kernels ran beside other kernels."""

from tests.helpers.benchmarks import load


def test_beside_counts_the_time_a_hop_shares_with_other_kernels():
    beside = load("profile_op").beside
    assert beside([(0, 10)], [(5, 15), (12, 20)]) == 5  # overlapping others merged, counted once
    assert beside([(0, 10), (20, 30)], [(8, 22)]) == 4
    assert beside([(0, 10)], [(3, 4), (4, 6), (20, 30)]) == 3
    assert beside([(0, 10)], []) == 0 and beside([], [(0, 1)]) == 0
