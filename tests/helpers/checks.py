"""Comparisons the multi-rank tests share: errors above a tolerance, and failures collected per rank."""


def above(errors, tol):
    """``{name: "1.2e-09"}`` for every error of ``errors`` (a dict of floats) not below ``tol`` (NaN included)."""
    return {name: f"{e:.1e}" for name, e in errors.items() if not e < tol}


def assert_no_failures(results):
    """``results``: per rank, the list of its failures (strings). Passes if every list is empty; else
    fails listing every failure with its rank."""
    assert not any(results), "\n".join(f"rank {r}: {f}" for r, failures in enumerate(results) for f in failures)
