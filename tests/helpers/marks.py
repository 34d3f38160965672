"""Marks the test modules share (pytest.ini declares them)."""

import pytest

slow = pytest.mark.slow  # outside the fast tier, `python -m pytest -m "not slow"`


def slow_params(*values):
    """Parametrisation values that run in the full suite only: ``[1, 2, *slow_params(3, 4)]``."""
    return [pytest.param(value, marks=slow) for value in values]
