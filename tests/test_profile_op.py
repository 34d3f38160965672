"""benchmarks/profile_op.py's overlap figure: how long the hop kernels ran beside other kernels."""

import importlib.util
import os
import sys
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _profile_op():
    bench = os.path.join(ROOT, "benchmarks")
    spec = importlib.util.spec_from_file_location("profile_op", os.path.join(bench, "profile_op.py"))
    module = importlib.util.module_from_spec(spec)
    with mock.patch.object(sys, "path", [bench, *sys.path]):
        spec.loader.exec_module(module)
    return module


def test_beside_counts_the_time_a_hop_shares_with_other_kernels():
    beside = _profile_op().beside
    assert beside([(0, 10)], [(5, 15), (12, 20)]) == 5  # overlapping others merged, counted once
    assert beside([(0, 10), (20, 30)], [(8, 22)]) == 4
    assert beside([(0, 10)], [(3, 4), (4, 6), (20, 30)]) == 3
    assert beside([(0, 10)], []) == 0 and beside([], [(0, 1)]) == 0
