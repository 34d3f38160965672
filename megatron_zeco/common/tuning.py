"""Autotuned kernel configs recorded on one GPU and replayed on another of the same chip.

Triton's autotuner compiles and times every config of a kernel the first time a process calls it with a
new key; fla's GLA, gated delta rule and KDA kernels have tens of configs each, so a cold process spends
minutes compiling before its first step. A record maps each autotuned kernel (its module and name) and key
to the config the autotuner picked; replaying it fills the autotuners' caches, so a cold process compiles
one config per kernel and key, and a key the record lacks is autotuned as before. A config sets block sizes
and the launch's shape: replayed and autotuned runs compute the same function, and may differ in rounding.

``$MEGATRON_ZECO_TUNED_CONFIGS`` (read once per process, at the first GPU kernel call):

- unset or ``off``: Triton autotunes (the default);
- ``auto``: replay ``megatron_zeco/common/configs/<GPU name>.json`` where one is shipped for this GPU or
  its chip (``recorded_for``), autotune otherwise;
- a path to a record: replay it;
- ``untuned``: replay the shipped record for this GPU if there is one; every other kernel and key runs the
  kernel's first config that compiles and launches, nothing timed (for tests, which check numerics: a cold
  process compiles one config per kernel and key whether or not a record covers it);
- ``record:DIR``: replay the shipped record for this GPU if there is one and autotune the rest, every
  process of the run sharing its results through ``DIR``: the first process to meet a kernel and key
  autotunes it (each config timed over ``RECORD_BENCH_MS`` instead of Triton's 25 + 100 ms) while the
  others wait for it, then use its pick. ``python -m megatron_zeco.common.tuning merge DIR -o FILE`` makes
  the record (``benchmarks/gpu_check.py --record DIR`` runs the check this way and merges).

``$MEGATRON_ZECO_COMPILE_LOG=DIR`` (read at the same time) logs every Triton compile of the process, a JSON
line each in ``DIR/<pid>.jsonl``: the kernel, whether Triton's cache had it, and the seconds it took, by
stage. ``python -m megatron_zeco.common.tuning compiles DIR`` sums them per kernel: where a cold start
spends its time.
"""

import argparse
import fcntl
import functools
import glob
import hashlib
import importlib
import json
import os
import re
import sys
import time
import warnings
from typing import Dict, Iterator, Optional, Tuple

ENV = "MEGATRON_ZECO_TUNED_CONFIGS"
COMPILE_LOG_ENV = "MEGATRON_ZECO_COMPILE_LOG"
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
# Packages whose autotuned kernels a record covers: fla's and this package's.
PACKAGES = ("fla.", "megatron_zeco.")
# GPUs that replay another GPU's record: the same chip (sm_90, 132 SMs) with other memory.
SAME_CHIP = {"NVIDIA_H100_80GB_HBM3": "NVIDIA_H200"}
# Triton's do_bench per config while recording: warm-up and timed milliseconds.
RECORD_BENCH_MS = (5, 20)


def gpu_name(device=None) -> str:
    """The CUDA device's name as a file name (fla's rule: runs of other characters become ``_``)."""
    import torch

    return file_name(torch.cuda.get_device_name(device))


def file_name(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_") or "unknown_gpu"


def recorded_for(name: str) -> Optional[str]:
    """The shipped record for the GPU ``name`` (``gpu_name``) or for its chip, or None."""
    for candidate in (name, SAME_CHIP.get(name)):
        path = candidate and os.path.join(CONFIG_DIR, f"{candidate}.json")
        if path and os.path.exists(path):
            return path
    return None


def _autotuner(obj):
    """The Triton ``Autotuner`` inside ``obj`` (under ``heuristics`` wrappers), or None."""
    from triton.runtime.autotuner import Autotuner

    for _ in range(4):
        if isinstance(obj, Autotuner):
            return obj
        obj = getattr(obj, "fn", None)
    return None


def autotuners(packages=PACKAGES) -> Iterator[Tuple[str, object]]:
    """``("module:attribute", autotuner)`` for every autotuned kernel of the imported modules of ``packages``,
    named where its function is defined (not where it is imported)."""
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(packages):
            continue
        for attribute, value in list(vars(module).items()):
            tuner = _autotuner(value)
            if tuner is not None and getattr(tuner.base_fn, "__module__", None) == module_name:
                yield f"{module_name}:{attribute}", tuner


def describe(config) -> dict:
    """A Triton config as the record writes it."""
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def tuning_key(tuner, args, kwargs) -> tuple:
    """The key under which Triton's ``Autotuner.run`` caches its pick for this call: the values of the
    kernel's ``key`` arguments, then the dtype of every tensor argument."""
    named = {**dict(zip(tuner.arg_names, args)), **kwargs}
    named = {k: v for k, v in named.items() if k in tuner.arg_names}
    key = [named[k] for k in tuner.keys if k in named]
    return tuple(key + [str(v.dtype) for v in named.values() if hasattr(v, "dtype")])


def replay(record: dict) -> Tuple[int, int]:
    """Fill the autotuners' caches from ``record`` (``merge``'s form). Each entry's config is looked up
    among the kernel's own configs, so a record of another release whose configs changed is skipped
    rather than run. Returns (entries replayed, entries skipped)."""
    replayed = skipped = 0
    for kernel, picks in record["kernels"].items():
        module, _, attribute = kernel.partition(":")
        try:
            tuner = _autotuner(getattr(importlib.import_module(module), attribute))
        except (ImportError, AttributeError):
            tuner = None
        for pick in picks:
            config = None if tuner is None else next((c for c in tuner.configs if describe(c) == pick["config"]), None)
            if config is None:
                skipped += 1
                continue
            tuner.cache.setdefault(tuple(pick["key"]), config)
            replayed += 1
    return replayed, skipped


class SharedRecord:
    """A recording run's picks in ``directory``, one file per kernel and key, written as they are made and
    shared by every process of the run: ``pick`` autotunes a key that no process has tuned, under a lock
    that makes the others wait for it and then take its pick."""

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._names: Dict[int, str] = {}

    def name(self, tuner) -> str:
        if id(tuner) not in self._names:
            self._names.update({id(t): n for n, t in autotuners()})
        fn = tuner.base_fn
        return self._names.get(id(tuner), f"{fn.__module__}:{fn.__name__}")

    def _path(self, kernel: str, key: tuple) -> str:
        digest = hashlib.md5(json.dumps([kernel, list(key)]).encode()).hexdigest()[:16]
        return os.path.join(self.directory, f"{file_name(kernel)}-{digest}")

    def pick(self, tuner, key: tuple, run):
        """``run()`` (the autotuner's call) with the run's pick for ``key``: another process's, read from its
        file into ``tuner.cache``, or, where none has tuned it yet, the one ``run()`` makes (written for the
        others)."""
        kernel = self.name(tuner)
        path = self._path(kernel, key)
        with open(path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if os.path.exists(path + ".json"):
                    wanted = _load(path + ".json")["config"]
                    config = next((c for c in tuner.configs if describe(c) == wanted), None)
                    if config is not None:
                        tuner.cache[key] = config
                        return run()
                result = run()
                if key in tuner.cache:
                    entry = {"kernel": kernel, "key": list(key), "config": describe(tuner.cache[key])}
                    with open(path + ".tmp", "w") as f:
                        json.dump(entry, f)
                    os.replace(path + ".tmp", path + ".json")
                return result
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _share_autotuning(record: SharedRecord) -> None:
    """Every autotuner of this process tunes a new key through ``record`` (shared with the run's other
    processes), timing each config over RECORD_BENCH_MS."""
    import triton.testing
    from triton.runtime.autotuner import Autotuner

    full = triton.testing.do_bench
    warmup, rep = RECORD_BENCH_MS
    triton.testing.do_bench = functools.wraps(full)(
        lambda fn, *a, **kw: full(fn, *a, **{"warmup": warmup, "rep": rep, **kw}))
    run = Autotuner.run

    def shared_run(self, *args, **kwargs):
        if len(self.configs) > 1:
            key = tuning_key(self, args, kwargs)
            if key not in self.cache:
                return record.pick(self, key, lambda: run(self, *args, **kwargs))
        return run(self, *args, **kwargs)

    Autotuner.run = shared_run


# What Triton raises when its compiler fails on a config (an MLIR pass, e.g. software pipelining, that gives up)
_COMPILER_FAILURE = "PassManager::run failed"


def _take_first_config() -> None:
    """Every autotuner of this process runs a key it has no pick for on its first config that launches,
    timing nothing: a config refused for its resources (e.g. shared memory) is passed over, and so, with a
    warning naming it, is one the compiler fails on (Triton's ``PassManager::run failed``); where every config
    fails, the last failure is raised."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.errors import OutOfResources

    run = Autotuner.run

    def first_run(self, *args, **kwargs):
        if len(self.configs) > 1:
            key = tuning_key(self, args, kwargs)
            if key not in self.cache:
                for i, config in enumerate(self.configs):
                    self.cache[key] = config
                    try:
                        return run(self, *args, **kwargs)
                    except (OutOfResources, RuntimeError) as e:
                        del self.cache[key]
                        compiler = not isinstance(e, OutOfResources)
                        if (compiler and _COMPILER_FAILURE not in str(e)) or i == len(self.configs) - 1:
                            raise
                        if compiler:
                            fn = self.base_fn
                            warnings.warn(f"{fn.__module__}:{fn.__name__}: Triton's compiler failed on config "
                                          f"{config} ({_COMPILER_FAILURE}); running the next one")
        return run(self, *args, **kwargs)

    Autotuner.run = first_run


def log_compiles(directory: str) -> None:
    """Append a line to ``directory/<pid>.jsonl`` for every Triton compile of this process (Triton's
    compilation listener): ``{"kernel", "cache_hit", "seconds", "stages": {stage: seconds}, "at"}``, ``at``
    the seconds since the log began."""
    import triton

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{os.getpid()}.jsonl")
    began = time.perf_counter()

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        fn = getattr(src, "fn", None)
        name = f"{fn.__module__}:{fn.__name__}" if fn is not None else str(metadata.get("name"))
        stages = {"ir": times.ir_initialization / 1e6, **{ext: us / 1e6 for ext, us in times.lowering_stages}}
        entry = {"kernel": name, "cache_hit": cache_hit, "seconds": round(sum(stages.values()), 4),
                 "stages": {k: round(v, 4) for k, v in stages.items()}, "at": round(time.perf_counter() - began, 2)}
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    triton.knobs.compilation.listener = listener


def compile_summary(directory: str) -> dict:
    """The compile log in ``directory`` summed: processes, compiles and cache hits, seconds, per kernel
    (slowest first) its compiles and seconds, and per process (slowest first) its compiles, their seconds
    and when it last met a kernel."""
    kernels: Dict[str, list] = {}
    summary = {"processes": 0, "compiles": 0, "cache_hits": 0, "seconds": 0.0}
    processes = []
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        summary["processes"] += 1
        mine = {"process": os.path.basename(path)[:-len(".jsonl")], "compiles": 0, "seconds": 0.0, "last_at": 0.0}
        with open(path) as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except ValueError:  # a line cut short by a stopped process
                    continue
                mine["last_at"] = max(mine["last_at"], entry.get("at", 0.0))
                if entry["cache_hit"]:
                    summary["cache_hits"] += 1
                    continue
                summary["compiles"] += 1
                summary["seconds"] += entry["seconds"]
                mine["compiles"] += 1
                mine["seconds"] += entry["seconds"]
                totals = kernels.setdefault(entry["kernel"], [0, 0.0])
                totals[0] += 1
                totals[1] += entry["seconds"]
        processes.append({**mine, "seconds": round(mine["seconds"], 1)})
    summary["seconds"] = round(summary["seconds"], 1)
    summary["kernels"] = [{"kernel": k, "compiles": n, "seconds": round(t, 1)}
                          for k, (n, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])]
    # per process: its compiles, their seconds, and when (seconds after its log began) it last met a kernel
    summary["by_process"] = sorted(processes, key=lambda p: -p["seconds"])
    return summary


def merge(directory: str) -> dict:
    """The record of a recording run: ``{"gpu", versions, "kernels": {"module:attribute": [{"key", "config"}]}}``."""
    kernels: Dict[str, list] = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        with open(path) as f:
            entry = json.load(f)
        kernels.setdefault(entry["kernel"], []).append({"key": entry["key"], "config": entry["config"]})
    meta = {}
    info = os.path.join(directory, "meta")
    if os.path.exists(info):
        with open(info) as f:
            meta = json.load(f)
    return {**meta, "kernels": {k: sorted(v, key=lambda e: json.dumps(e["key"])) for k, v in sorted(kernels.items())}}


def _versions() -> dict:
    import importlib.metadata as metadata

    import torch
    import triton

    try:
        fla = metadata.version("fla-core")
    except metadata.PackageNotFoundError:
        fla = None
    return {"gpu": gpu_name(), "torch": torch.__version__, "triton": triton.__version__, "fla-core": fla}


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


@functools.lru_cache(maxsize=None)
def configure() -> str:
    """Apply ``$MEGATRON_ZECO_TUNED_CONFIGS`` once per process (see the module's docstring); returns what
    was done, in words. ValueError for a value that is none of the documented forms."""
    if os.environ.get(COMPILE_LOG_ENV):
        log_compiles(os.environ[COMPILE_LOG_ENV])
    value = os.environ.get(ENV, "off").strip()
    if value in ("", "off"):
        return "autotune"
    if value.startswith("record:"):
        directory = value[len("record:"):]
        if not directory:
            raise ValueError(f"{ENV}=record:DIR needs a directory")
        record = SharedRecord(directory)
        with open(os.path.join(directory, "meta"), "w") as f:
            json.dump(_versions(), f)
        shipped = recorded_for(gpu_name())  # a record grows: what it has is replayed, and kept
        replayed = replay(_load(shipped))[0] if shipped else 0
        _share_autotuning(record)
        return f"autotune, recording into {directory}" + (f" ({replayed} configs replayed from {shipped})"
                                                          if shipped else "")
    if value == "untuned":
        shipped = recorded_for(gpu_name())
        replayed = replay(_load(shipped))[0] if shipped else 0
        _take_first_config()
        return "first config of every kernel" + (f", {replayed} configs replayed from {shipped}" if shipped else "")
    path = recorded_for(gpu_name()) if value == "auto" else value
    if path is None:
        return f"autotune (no record shipped for {gpu_name()})"
    if not os.path.exists(path):
        raise ValueError(f"{ENV}={value!r}: no such record (expected off, auto, untuned, record:DIR or a record's path)")
    replayed, skipped = replay(_load(path))
    return f"replayed {replayed} configs from {path}" + (f" ({skipped} skipped: not among the kernels' configs)"
                                                        if skipped else "")


def main(argv=None):
    p = argparse.ArgumentParser(description="Merge a recording run's picks (record:DIR) into one record; sum a "
                                            "compile log.")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="DIR's picks into one record (JSON)")
    m.add_argument("directory")
    m.add_argument("-o", "--out", required=True)
    m.add_argument("--into", default=None, help="a record to extend (its entries kept where DIR has none)")
    c = sub.add_parser("compiles", help=f"the compile log in DIR (${COMPILE_LOG_ENV}) summed per kernel")
    c.add_argument("directory")
    c.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    if args.command == "compiles":
        summary = compile_summary(args.directory)
        print(f"{summary['compiles']} compiles ({summary['cache_hits']} cache hits) in {summary['processes']} "
              f"processes: {summary['seconds']:.1f} s")
        for k in summary["kernels"][:args.top]:
            print(f"  {k['seconds']:8.1f} s {k['compiles']:4d}  {k['kernel']}")
        return
    record = merge(args.directory)
    if args.into:
        old = _load(args.into)
        for kernel, picks in old["kernels"].items():
            keys = {json.dumps(e["key"]) for e in record["kernels"].get(kernel, [])}
            record["kernels"].setdefault(kernel, []).extend(e for e in picks if json.dumps(e["key"]) not in keys)
    if not record["kernels"]:
        p.error(f"no picks in {args.directory}")
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    entries = sum(len(v) for v in record["kernels"].values())
    print(f"{args.out}: {entries} configs of {len(record['kernels'])} kernels")


if __name__ == "__main__":
    main()
