"""Run a function on N real processes joined in a gloo (or NCCL) process group.

``run_ranks(fn, world, *args)`` spawns ``world`` processes; each initialises
``torch.distributed`` (gloo, file rendezvous) and calls ``fn(rank, world, *args)``.
It returns every rank's result, or raises with every failing rank's traceback.
A hang becomes a failure after ``timeout`` seconds: no test can stall CI.

``RankPool(world)`` keeps up to ``world`` such processes alive and runs many small calls
on them (property-based tests), without paying a spawn per call; ``tests/conftest.py``'s
``pool`` fixture gives each test module one.

``Batched(request, test, fn, case_args)`` runs the selected cases of a parametrised test that call the same
``fn`` on the same number of processes in one launch per world size: starting the processes and
importing torch and megatron-core costs a launch of two ranks about 11 s on two cores, four ranks
about 21 s, more than a small training case's own work.

``fn`` must be importable by name in a fresh interpreter (a module-level function of a test
module or of ``tests.helpers``): the processes are spawned, and find it through the
parent's ``sys.path``.
"""

import datetime
import faulthandler
import io
import multiprocessing as mp
import os
import queue
import tempfile
import traceback

import pytest
import torch

TIMEOUT = float(os.environ.get("ZECO_TEST_TIMEOUT", 300))


def _init(rank, world, store, pg_timeout, backend):
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout))


def _call(results, rank, fn, *args):
    """Put ``(rank, True, fn(*args) serialised)`` or ``(rank, False, traceback)`` on ``results``."""
    try:
        buffer = io.BytesIO()  # by value: tensors must outlive this process
        torch.save(fn(*args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, False, traceback.format_exc()))


def _entry(fn, rank, world, store, results, args, pg_timeout, timeout, backend):
    import torch.distributed as dist

    faulthandler.dump_traceback_later(max(timeout - 5, 1))  # where a hung rank is stuck, in the log
    try:
        _init(rank, world, store, pg_timeout, backend)
        _call(results, rank, fn, rank, world, *args)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(results, ranks, timeout):
    """Every rank's result from ``results``: ``{rank: value}``, or AssertionError with the tracebacks
    of the failed ranks and the names of the ranks that did not answer within ``timeout`` s."""
    out, failures = {}, {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    while len(out) + len(failures) < len(ranks):
        left = (deadline - datetime.datetime.now()).total_seconds()
        try:
            rank, ok, value = results.get(timeout=max(left, 0.1))
        except queue.Empty:
            missing = sorted(set(ranks) - set(out) - set(failures))
            raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f} s (a hang? on a cold GPU "
                                 "machine the first calls compile and autotune for minutes)"
                                 + _format(failures)) from None
        if ok:
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            failures[rank] = value
        if failures and len(out) + len(failures) < len(ranks):
            # Peers of a failed rank may wait forever on it: give them a moment, then stop.
            deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=20))
    if failures:
        raise AssertionError(_format(failures))
    return out


def run_ranks(fn, world, *args, timeout=TIMEOUT, pg_timeout=None, backend="gloo"):
    """``[fn(0, world, *args), ..., fn(world-1, world, *args)]`` run on real processes
    (``backend="nccl"``: rank r on GPU r)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(fn, r, world, store, results, args, pg_timeout or timeout, timeout,
                                                          backend))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            out = _collect(results, range(world), timeout)
        finally:
            _stop(procs)
    return [out[r] for r in range(world)]


def _stop(procs):
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()


def _format(failures):
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))


def _pool_worker(rank, world, store, tasks, results, pg_timeout):
    import torch.distributed as dist

    _init(rank, world, store, pg_timeout, "gloo")
    # One group per size, over the first ranks (new_group is collective: every rank makes each).
    groups = {size: dist.new_group(list(range(size))) for size in range(2, world + 1)}
    groups[1] = None
    while (task := tasks.get()) is not None:
        fn, size, args = task
        _call(results, rank, fn, groups[size], *args)
    dist.destroy_process_group()


class RankPool:
    """Up to ``world`` long-lived processes in one gloo process group.

    ``pool.run(fn, size, *args)`` runs ``fn(group, *args)`` on ranks ``0 .. size-1``, where
    ``group`` is a gloo group of exactly those ranks (None for size 1), and returns their
    results in rank order; the other ranks wait. A call that fails or hangs on any rank
    raises (with every failing rank's traceback) and restarts the processes, so the next
    call starts clean. The processes start at the first call, as many as it needs; a later
    call that needs more restarts them, ``world`` of them (so a module whose fast tests need
    two processes spawns two). Use as a context manager.
    """

    def __init__(self, world, timeout=TIMEOUT, pg_timeout=60.0):
        self.world, self.timeout, self.pg_timeout = world, timeout, pg_timeout
        self._procs, self._size = None, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _start(self, world):
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory()
        self._tasks = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        store = os.path.join(self._tmp.name, "store")
        self._procs = [ctx.Process(target=_pool_worker, daemon=True,
                                   args=(r, world, store, self._tasks[r], self._results, self.pg_timeout))
                       for r in range(world)]
        for p in self._procs:
            p.start()

    def run(self, fn, size, *args):
        if not 1 <= size <= self.world:
            raise ValueError(f"RankPool of {self.world} processes cannot run on {size}")
        if self._procs is not None and size > self._size:
            self.close()
            self._size = self.world  # outgrown: start all of them
        if self._procs is None:
            self._size = max(self._size, size)
            self._start(self._size)
        for r in range(size):
            self._tasks[r].put((fn, size, args))
        try:
            out = _collect(self._results, range(size), self.timeout)
        except BaseException:
            self._kill()
            raise
        return [out[r] for r in range(size)]

    def _kill(self):
        for p in self._procs:
            p.kill()
        _stop(self._procs)
        self._tmp.cleanup()
        self._procs = None

    def close(self):
        """Stop the processes (a no-op if none run)."""
        if self._procs is None:
            return
        for q in self._tasks:
            q.put(None)
        _stop(self._procs)
        self._tmp.cleanup()
        self._procs = None


# The test items left after -m / -k deselection, in run order (tests/conftest.py puts them there).
SELECTED = pytest.StashKey[list]()


def _each(rank, world, fn, cases):
    """``fn(rank, world, *args)`` for each ``args`` of ``cases`` in turn; the first failure raises, naming its case."""
    out = []
    for i, args in enumerate(cases):
        try:
            out.append(fn(rank, world, *args))
        except BaseException as e:
            raise RuntimeError(f"case {i} of this launch failed: {fn.__name__}{tuple(args)!r}") from e
    return out


def run_cases(fn, world, cases, timeout=TIMEOUT):
    """``[run_ranks(fn, world, *args) for args in cases]``, all in one launch (one set of processes runs the
    cases in turn). A failing case fails the launch, with its tracebacks and its arguments."""
    cases = [tuple(args) for args in cases]
    per_rank = run_ranks(_each, world, fn, cases, timeout=timeout)
    return [[per_rank[rank][i] for rank in range(world)] for i in range(len(cases))]


class Batched:
    """The selected cases of the parametrised test ``test`` of the requesting module, run by world size:
    ``batched(world, *args)`` returns ``run_ranks(fn, world, *args)``, running at its first call every
    selected case of that world (``params["world"]``; ``case_args(params)`` gives a case's ``args``) in one
    launch (:func:`run_cases`). Use from a module-scoped fixture. A case that fails fails every case of its
    launch, each naming the failed one."""

    def __init__(self, request, test, fn, case_args, timeout=2 * TIMEOUT):
        self.fn, self.timeout = fn, timeout
        self.cases, self.results = {}, {}
        for item in request.config.stash.get(SELECTED, []):
            if item.module is request.module and getattr(item, "originalname", None) == test:
                params = item.callspec.params
                self.cases.setdefault(params["world"], []).append(tuple(case_args(params)))

    def __call__(self, world, *args):
        if args not in self.cases.get(world, []):  # not among the selected cases: a launch of its own
            return run_ranks(self.fn, world, *args)
        if world not in self.results:
            try:
                self.results[world] = run_cases(self.fn, world, self.cases[world], timeout=self.timeout)
            except AssertionError as e:
                self.results[world] = e
        if isinstance(self.results[world], AssertionError):
            raise self.results[world]
        return self.results[world][self.cases[world].index(args)]
