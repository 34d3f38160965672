"""Fixtures every test module shares, and the Triton interpreter on machines without CUDA.

Tiers (docs/testing.md): ``python -m pytest -m "not slow" -q`` is the fast tier, one small case of
every operator path; the tests marked ``slow`` in their own files make up the rest of the full
suite, ``python -m pytest tests -q``.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on the CPU through its interpreter (set before
    os.environ.setdefault("TRITON_INTERPRET", "1")  # anything imports triton)
else:  # the tests check numerics: every autotuned kernel no record covers runs its first config, untimed
    os.environ.setdefault("MEGATRON_ZECO_TUNED_CONFIGS", "untuned")  # (docs/testing.md, "Cold start")


def _share_cores():
    """Under pytest-xdist, each worker's intra-op threads: the process's cores split among the workers
    (unless ``OMP_NUM_THREADS`` says otherwise), also for the processes a test starts. torch's default, a
    thread per core in every worker, makes the float64 references' many small operations spin on one
    another: with 6 workers on 32 cores one reference took over 140 s where a lone worker takes 1 s."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


_share_cores()

from tests.helpers.distributed import SELECTED, RankPool  # noqa: E402
from tests.helpers.reference import draw_seed  # noqa: E402


@pytest.hookimpl(trylast=True)  # after the -m / -k deselection
def pytest_collection_modifyitems(config, items):
    config.stash[SELECTED] = list(items)


def pytest_report_header(config):
    """Which megatron-core the run tests (.ci/run tests two releases; the first on sys.path wins)."""
    import importlib.metadata

    try:
        return f"megatron-core {importlib.metadata.version('megatron-core')}"
    except importlib.metadata.PackageNotFoundError:
        return "megatron-core: not installed"


def pytest_runtest_logreport(report):
    """With ``$MEGATRON_ZECO_TEST_LOG`` set (the GPU check sets it), a line per test phase as it ends:
    the test, its phase, outcome and seconds, appended to that file by whichever process ran it, so a run
    stopped part-way still shows where its time went."""
    path = os.environ.get("MEGATRON_ZECO_TEST_LOG")
    from_worker = getattr(report, "node", None) is not None  # pytest-xdist's controller: the worker wrote it
    if path and not from_worker and (report.when == "call" or report.outcome != "passed" or report.duration > 1):
        with open(path, "a") as f:
            f.write(f"{report.nodeid}\t{report.when}\t{report.outcome}\t{report.duration:.1f}\n")


@pytest.fixture
def seed():
    """A fresh random seed per test (printed, so a failure can be replayed with ZECO_SEED=...)."""
    return draw_seed()


@pytest.fixture(scope="module")
def pool(request):
    """The module's pool of long-lived gloo processes (``RankPool``), its size and timeouts from the
    module's ``RANK_POOL`` (the keywords of ``RankPool``: ``world``, ``timeout``, ``pg_timeout``).
    The processes start at the module's first call of ``pool.run``, as many as it needs."""
    settings = getattr(request.module, "RANK_POOL", None)
    if settings is None:
        raise RuntimeError(f"{request.module.__name__} uses the pool fixture: set RANK_POOL = dict(world=...)")
    with RankPool(**settings) as p:
        yield p
