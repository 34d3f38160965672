"""Autotuned kernel configs recorded on one GPU and replayed on another of the same name.

Triton's autotuner compiles and times every config of a kernel the first time a process calls it
with a new key; fla's gated delta rule and KDA kernels have hundreds of configs between them, so a
cold process spends minutes compiling before its first step. A record maps each autotuned kernel
(its module and name) and key to the config the autotuner picked; replaying it fills the autotuners'
caches, so a cold process compiles one config per kernel and key, and a key the record lacks is
autotuned as before. Configs change block sizes and launch shape, so replayed and autotuned runs may
differ in rounding, never in what they compute.

``$MEGATRON_ZECO_TUNED_CONFIGS`` (read once, at the first GPU kernel call):

- unset or ``off``: Triton autotunes (the default);
- ``auto``: replay ``megatron_zeco/common/configs/<GPU name>.json`` where one is shipped for this GPU
  (``recorded_for``), autotune otherwise;
- a path to a record: replay it;
- ``record:DIR``: replay the shipped record for this GPU if there is one, autotune the rest (each config timed over about 20 ms instead of Triton's 125), and at exit (or
  on SIGTERM) write what this process picked to ``DIR/<pid>.json``; merge the files of every process of a
  run with ``python -m megatron_zeco.common.tuning merge DIR -o FILE``.

Recording compiles every config of every kernel once. To spread that over the machine's cores, a recording
run can first be run as ``N`` shards at once, each with ``$MEGATRON_ZECO_TUNING_SHARD=i/N`` set: shard ``i``
compiles only the configs ``i, i + N, ...`` of each kernel into the shared Triton cache, running each once
without timing it, and records nothing; the recording run that follows then loads every config from the
cache. ``benchmarks/gpu_check.py --record`` does this.

``benchmarks/gpu_check.py`` and the benchmarks use ``auto`` unless told otherwise.
"""

import argparse
import atexit
import collections
import functools
import glob
import importlib
import json
import os
import re
import signal
import sys
from typing import Dict, Iterator, List, Optional, Tuple

ENV = "MEGATRON_ZECO_TUNED_CONFIGS"
SHARD_ENV = "MEGATRON_ZECO_TUNING_SHARD"
# Triton's do_bench per config while recording: warm-up and timed milliseconds
RECORD_BENCH_MS = (5, 20)
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
# Packages whose autotuned kernels a record covers: fla's and this package's.
PACKAGES = ("fla.", "megatron_zeco.")
# GPUs that replay another GPU's record: the same chip (sm_90, 132 SMs) with other memory.
SAME_CHIP = {"NVIDIA_H100_80GB_HBM3": "NVIDIA_H200"}


def gpu_name(device=None) -> str:
    """The CUDA device's name as a file name (fla's rule: runs of other characters become ``_``)."""
    import torch

    name = torch.cuda.get_device_name(device)
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_") or "unknown_gpu"


def recorded_for(name: str) -> Optional[str]:
    """The shipped record for the GPU ``name`` (``gpu_name``), or None."""
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


def autotuners() -> Iterator[Tuple[str, str, object]]:
    """``(module, attribute, autotuner)`` for every autotuned kernel of the imported modules of fla and
    this package."""
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(PACKAGES):
            continue
        for attribute, value in list(vars(module).items()):
            tuner = _autotuner(value)  # where its function is defined, not where it is imported
            if tuner is not None and getattr(tuner.base_fn, "__module__", None) == module_name:
                yield module_name, attribute, tuner


def _describe(config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def snapshot() -> Dict[str, List[dict]]:
    """What every autotuner has picked so far: ``{"module:attribute": [{"key": [...], "config": {...}}]}``."""
    out = {}
    for module, attribute, tuner in autotuners():
        picks = [{"key": list(key), "config": _describe(config)} for key, config in tuner.cache.items()]
        if picks and len(tuner.configs) > 1:
            out[f"{module}:{attribute}"] = picks
    return out


def _versions() -> dict:
    import torch
    import triton

    try:
        import importlib.metadata as metadata
        fla = metadata.version("fla-core")
    except Exception:
        fla = None
    return {"torch": torch.__version__, "triton": triton.__version__, "fla-core": fla}


def write_snapshot(directory: str) -> None:
    """This process's picks into ``directory/<pid>.json`` (nothing if it autotuned nothing)."""
    picks = snapshot()
    if not picks:
        return
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{os.getpid()}.json"), "w") as f:
        json.dump({"gpu": gpu_name(), **_versions(), "kernels": picks}, f)


def merge(paths: List[str]) -> dict:
    """One record from several processes' snapshots: per kernel and key the config most of them picked."""
    votes = collections.defaultdict(collections.Counter)
    meta = {}
    for path in paths:
        with open(path) as f:
            snap = json.load(f)
        meta = {k: v for k, v in snap.items() if k != "kernels"}
        for kernel, picks in snap["kernels"].items():
            for pick in picks:
                votes[kernel, json.dumps(pick["key"])][json.dumps(pick["config"], sort_keys=True)] += 1
    kernels = collections.defaultdict(list)
    for (kernel, key), counts in sorted(votes.items()):
        config = json.loads(counts.most_common(1)[0][0])
        kernels[kernel].append({"key": json.loads(key), "config": config})
    return {**meta, "kernels": dict(kernels)}


def replay(record: dict) -> Tuple[int, int]:
    """Fill the autotuners' caches from ``record`` (``merge``'s form): each entry's config is looked up
    among the kernel's own configs, so a record of another fla release whose configs changed is skipped
    rather than run. Returns (entries replayed, entries skipped)."""
    replayed = skipped = 0
    for kernel, picks in record["kernels"].items():
        module, _, attribute = kernel.partition(":")
        try:
            tuner = _autotuner(getattr(importlib.import_module(module), attribute))
        except (ImportError, AttributeError):
            tuner = None
        for pick in picks:
            config = None if tuner is None else next((c for c in tuner.configs if _describe(c) == pick["config"]), None)
            if config is None:
                skipped += 1
                continue
            tuner.cache.setdefault(tuple(pick["key"]), config)
            replayed += 1
    return replayed, skipped


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _shard(value: str) -> Tuple[int, int]:
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise ValueError(f"{SHARD_ENV}={value!r}: expected i/N with 0 <= i < N")
    return i, n


def _compile_shard(i: int, n: int) -> None:
    """Autotuners compile (and run once, untimed) only their configs i, i + n, ...; the others are not built."""
    from triton.runtime.autotuner import Autotuner

    bench = Autotuner._bench

    def _bench(self, *args, config, **meta):
        index = self.configs.index(config) if config in self.configs else 0
        if index % n != i:
            return [float("inf")] * 3
        saved = self._do_bench
        self._do_bench = lambda call, quantiles: (call(), [0.0] * 3)[1]
        try:
            return bench(self, *args, config=config, **meta)
        finally:
            self._do_bench = saved

    Autotuner._bench = _bench


def _short_benchmarks() -> None:
    """Triton's benchmark of each config over RECORD_BENCH_MS instead of its default 25 + 100 ms."""
    import triton.testing

    full = triton.testing.do_bench
    warmup, rep = RECORD_BENCH_MS
    triton.testing.do_bench = functools.wraps(full)(
        lambda fn, *args, **kw: full(fn, *args, **{"warmup": warmup, "rep": rep, **kw}))


def _record_at_exit(directory: str) -> None:
    atexit.register(write_snapshot, directory)
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        write_snapshot(directory)
        if callable(previous):
            previous(signum, frame)
        raise SystemExit(128 + signum)

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread: the exit hook alone
        pass


@functools.lru_cache(maxsize=None)
def configure() -> str:
    """Apply ``$MEGATRON_ZECO_TUNED_CONFIGS`` once per process (see the module's docstring); returns what
    was done, in words. ValueError for a value that is none of the documented forms."""
    value = os.environ.get(ENV, "off").strip()
    if value in ("", "off"):
        return "autotune"
    if value.startswith("record:"):
        directory = value[len("record:"):]
        if not directory:
            raise ValueError(f"{ENV}=record:DIR needs a directory")
        if os.environ.get(SHARD_ENV):
            i, n = _shard(os.environ[SHARD_ENV])
            _compile_shard(i, n)
            return f"compiling configs {i} mod {n} (no record)"
        _short_benchmarks()
        _record_at_exit(directory)
        shipped = recorded_for(gpu_name())  # a record grows: what it has is replayed (and written again)
        replayed = replay(_load(shipped))[0] if shipped else 0
        return f"autotune, recording into {directory}" + (f" ({replayed} configs replayed from {shipped})"
                                                          if shipped else "")
    path = recorded_for(gpu_name()) if value == "auto" else value
    if path is None:
        return f"autotune (no record shipped for {gpu_name()})"
    if not os.path.exists(path):
        raise ValueError(f"{ENV}={value!r}: no such record (expected off, auto, record:DIR or a record's path)")
    replayed, skipped = replay(_load(path))
    return f"replayed {replayed} configs from {path}" + (f" ({skipped} skipped: not among the kernels' configs)"
                                                        if skipped else "")


def main(argv=None):
    p = argparse.ArgumentParser(description="Merge the per-process snapshots of a recording run into one record.")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge DIR/*.json into one record")
    m.add_argument("directory")
    m.add_argument("-o", "--out", required=True)
    args = p.parse_args(argv)
    paths = sorted(glob.glob(os.path.join(args.directory, "*.json")))
    if not paths:
        p.error(f"no snapshots in {args.directory}")
    record = merge(paths)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    entries = sum(len(v) for v in record["kernels"].values())
    print(f"{args.out}: {len(record['kernels'])} kernels, {entries} keys, from {len(paths)} processes")


if __name__ == "__main__":
    main()
