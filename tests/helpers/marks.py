"""Marks the test modules share (pytest.ini declares them)."""

import pytest

slow = pytest.mark.slow  # outside the fast tier, `python -m pytest -m "not slow"`


def slow_except(values, *fast):
    """Parametrisation ``values``, every one but ``fast`` marked slow: ``slow_except([1, 2, 3, 4], 2)``
    keeps P = 2 in the fast tier and runs P = 1, 3, 4 in the full suite only. A tuple is one case of
    several argument names."""
    def slow_case(value):
        return pytest.param(*value, marks=slow) if isinstance(value, tuple) else pytest.param(value, marks=slow)

    return [value if value in fast else slow_case(value) for value in values]
