import os
import random
import sys

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on the CPU through its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))  # tests/distributed.py, tests/reference.py


def pytest_report_header(config):
    """Which megatron-core the run tests (.ci/run tests two releases; the first on sys.path wins)."""
    import importlib.metadata

    try:
        return f"megatron-core {importlib.metadata.version('megatron-core')}"
    except importlib.metadata.PackageNotFoundError:
        return "megatron-core: not installed"


# The fast tier, `python -m pytest -m "not slow" -q` (a few minutes on 2 cores): every op against its
# float64 reference on one process and at P = 2, the kernels, the cost model, the docs. Everything
# else is marked slow here, in one place: the multi-rank sweeps (P = 3 .. 16, property-based draws,
# faults, the hierarchical scan), and the tests that build and train Megatron models. CI runs both.
SLOW_MODULES = {
    "test_all_scan", "test_bad_input", "test_determinism", "test_faults", "test_hierarchical", "test_hybrid",
    "test_hybrid_model", "test_megatron_model", "test_packed", "test_properties", "test_specs", "test_train",
    "test_zeco_gdn", "test_gdn_layer", "test_halo",
}
FAST_WORLDS = (1, 2)  # parametrised group sizes kept in the fast tier


def pytest_collection_modifyitems(config, items):
    for item in items:
        world = getattr(item, "callspec", None) and item.callspec.params.get("world")
        if item.module.__name__ in SLOW_MODULES or (isinstance(world, int) and world not in FAST_WORLDS):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def seed():
    """A fresh random seed per test (printed, so a failure can be replayed with ZECO_SEED=...)."""
    value = int(os.environ.get("ZECO_SEED", random.SystemRandom().randrange(2**31)))
    print(f"ZECO_SEED={value}")
    return value
