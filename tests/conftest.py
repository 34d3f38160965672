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


@pytest.fixture
def seed():
    """A fresh random seed per test (printed, so a failure can be replayed with ZECO_SEED=...)."""
    value = int(os.environ.get("ZECO_SEED", random.SystemRandom().randrange(2**31)))
    print(f"ZECO_SEED={value}")
    return value
