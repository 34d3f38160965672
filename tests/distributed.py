"""Run a function on N real processes joined in a gloo (or NCCL) process group.

``run_ranks(fn, world, *args)`` spawns ``world`` processes; each initialises
``torch.distributed`` (gloo, file rendezvous) and calls ``fn(rank, world, *args)``.
It returns every rank's result, or raises with every failing rank's traceback.
A hang becomes a failure after ``timeout`` seconds: no test can stall CI.
"""

import datetime
import faulthandler
import io
import multiprocessing as mp
import os
import queue
import tempfile
import traceback

import torch

TIMEOUT = float(os.environ.get("ZECO_TEST_TIMEOUT", 300))


def _entry(fn, rank, world, store, results, args, pg_timeout, timeout, backend):
    import torch
    import torch.distributed as dist

    faulthandler.dump_traceback_later(max(timeout - 5, 1))  # where a hung rank is stuck, in the log
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        buffer = io.BytesIO()  # by value: tensors must outlive this process
        torch.save(fn(rank, world, *args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


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
        out, failures = {}, {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        try:
            while len(out) + len(failures) < world:
                left = (deadline - datetime.datetime.now()).total_seconds()
                try:
                    rank, ok, value = results.get(timeout=max(left, 0.1))
                except queue.Empty:
                    missing = sorted(set(range(world)) - set(out) - set(failures))
                    raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f} s (hang?)"
                                         + _format(failures)) from None
                if ok:
                    out[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    failures[rank] = value
                if failures and len(out) + len(failures) < world:
                    # Peers of a failed rank may wait forever on it: give them a moment, then stop.
                    deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=20))
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    if failures:
        raise AssertionError(_format(failures))
    return [out[r] for r in range(world)]


def _format(failures):
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))


def host_as_cuda():
    """megatron-core 0.16's dist-checkpointing and sequence-parallel collectives assume CUDA
    (buffers on torch.cuda.current_device(), host copies followed by torch.cuda.synchronize()).
    On a CPU-only machine, let the host stand in for the device; everything else runs unchanged."""
    from contextlib import ExitStack
    from unittest import mock

    stack = ExitStack()
    stack.enter_context(mock.patch("torch.cuda.current_device", return_value="cpu"))
    stack.enter_context(mock.patch("torch.cuda.synchronize", return_value=None))
    return stack
