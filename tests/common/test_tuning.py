"""Recorded autotune picks (megatron_zeco/common/tuning.py): a recording run's processes tune each kernel and
key once between them, the record replays what they picked, and a replayed process times nothing.

Triton's interpreter runs the kernel (tests/helpers/tuned_kernel.py); its autotuner's timing is replaced by a
preference order, each process a fresh interpreter (recording patches Triton's autotuner for the process).
"""

import json
import os
import subprocess
import sys

import pytest

from megatron_zeco.common import tuning

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNEL = "tests.helpers.tuned_kernel:scale_kernel"


def _process(mode, directory, prefer, *lengths):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-m", "tests.helpers.tuned_kernel", mode, str(directory), str(prefer),
                          *map(str, lengths)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_recording_run_tunes_each_key_once_and_the_record_replays_it(tmp_path):
    shared = tmp_path / "run"
    first = _process("record", shared, 32, 100, 200)
    assert first["timed"] == [16, 32, 64] * 2 and first["ran"] == [32, 32]
    # Triton's own cache key is the one the recorder computes (the key arguments, then every tensor's dtype)
    assert first["keys"] == [[100, "torch.float32", "torch.float32"], [200, "torch.float32", "torch.float32"]]
    # another process of the run: the key already tuned is taken, not timed (even where it would pick another)
    second = _process("record", shared, 64, 200, 300)
    assert second["timed"] == [16, 32, 64] and second["ran"] == [32, 64]
    record = tuning.merge(str(shared))
    picks = {tuple(e["key"]): e["config"]["kwargs"]["BLOCK"] for e in record["kernels"][KERNEL]}
    assert picks == {(100, "torch.float32", "torch.float32"): 32, (200, "torch.float32", "torch.float32"): 32,
                     (300, "torch.float32", "torch.float32"): 64}
    path = tmp_path / "record.json"
    path.write_text(json.dumps(record))
    replayed = _process("replay", path, 16, 100, 300, 400)
    assert replayed["timed"] == [16, 32, 64] and replayed["ran"] == [32, 64, 16]  # 400: not recorded, tuned


def test_an_untuned_process_runs_each_kernels_first_config_and_times_nothing(tmp_path):
    out = _process("untuned", tmp_path, 64, 100, 200)
    assert out["timed"] == [] and out["ran"] == [16, 16]
    assert out["keys"] == [[100, "torch.float32", "torch.float32"], [200, "torch.float32", "torch.float32"]]


def test_an_untuned_process_passes_over_a_config_the_compiler_fails_on(tmp_path):
    """Only a failure of Triton's compiler passes a config over (with a warning); any other error, and the
    compiler failing on every config, is raised."""
    out = _process("untuned-compiler-fails:16", tmp_path, 64, 100, 200)
    assert out["timed"] == [] and out["ran"] == [32, 32]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    for mode, error in (("untuned-compiler-fails:16,32,64", "PassManager::run failed"),
                        ("untuned-error:16", "some other error")):
        done = subprocess.run([sys.executable, "-m", "tests.helpers.tuned_kernel", mode, str(tmp_path), "64", "100"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode != 0 and f"RuntimeError: {error}" in done.stderr, (mode, done.stderr[-2000:])
    assert "Triton's compiler failed on config" in subprocess.run(
        [sys.executable, "-m", "tests.helpers.tuned_kernel", "untuned-compiler-fails:16", str(tmp_path), "64", "100"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300).stderr


def test_replay_skips_configs_the_kernel_does_not_have():
    import tests.helpers.tuned_kernel as k

    tuner = tuning._autotuner(k.scale_kernel)
    known = tuning.describe(k.CONFIGS[1])
    unknown = {**known, "num_warps": 8}
    record = {"kernels": {KERNEL: [{"key": [7, "torch.float32", "torch.float32"], "config": known},
                                   {"key": [8, "torch.float32", "torch.float32"], "config": unknown}],
                          "tests.helpers.tuned_kernel:no_such_kernel": [{"key": [1], "config": known}]}}
    try:
        assert tuning.replay(record) == (1, 2)
        assert tuner.cache[(7, "torch.float32", "torch.float32")] is k.CONFIGS[1]
        assert (8, "torch.float32", "torch.float32") not in tuner.cache
    finally:
        tuner.cache.clear()


@pytest.mark.parametrize("value", ["record:", "/no/such/record.json"])
def test_bad_settings_are_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(tuning.ENV, value)
    monkeypatch.setattr(tuning, "gpu_name", lambda device=None: "NVIDIA_H200")
    tuning.configure.cache_clear()
    try:
        with pytest.raises(ValueError, match=tuning.ENV):
            tuning.configure()
    finally:
        tuning.configure.cache_clear()


def test_a_gpu_without_its_own_record_takes_its_chips():
    assert tuning.file_name("NVIDIA H100 80GB HBM3") in tuning.SAME_CHIP
    for name, chip in tuning.SAME_CHIP.items():
        assert tuning.recorded_for(name) == tuning.recorded_for(chip)


def test_the_compile_log_sums_each_kernels_compiles(tmp_path, monkeypatch):
    import triton
    from triton.knobs import CompileTimes

    class Source:  # what Triton hands the listener: the JIT function under ``fn``
        def __init__(self, fn):
            self.fn = fn

    def kernel_a():
        pass

    def kernel_b():
        pass

    monkeypatch.setattr(triton.knobs.compilation, "listener", None)
    tuning.log_compiles(str(tmp_path))
    listen = triton.knobs.compilation.listener
    for fn, us, hit in ((kernel_a, 2_000_000, False), (kernel_b, 500_000, False), (kernel_a, 1_000_000, False),
                        (kernel_b, 9_000_000, True)):
        listen(src=Source(fn), metadata={}, metadata_group={}, cache_hit=hit,
               times=CompileTimes(ir_initialization=us // 2, lowering_stages=[("ttir", us // 4), ("cubin", us // 4)],
                                  store_results=0))
    summary = tuning.compile_summary(str(tmp_path))
    name = f"{__name__}:kernel_"
    assert (summary["processes"], summary["compiles"], summary["cache_hits"]) == (1, 3, 1)
    assert summary["seconds"] == 3.5
    assert summary["kernels"] == [{"kernel": name + "a", "compiles": 2, "seconds": 3.0},
                                  {"kernel": name + "b", "compiles": 1, "seconds": 0.5}]
    (process,) = summary["by_process"]
    assert (process["process"], process["compiles"], process["seconds"]) == (str(os.getpid()), 3, 3.5)
    assert process["last_at"] >= 0


def _shipped_record_problems():
    """What is wrong with the shipped records' entries for this package's kernels, one line each, with the
    kernels' configs as on a GPU (this runs in a process without Triton's interpreter)."""
    import glob
    import importlib

    problems = []
    records = sorted(glob.glob(os.path.join(tuning.CONFIG_DIR, "*.json")))
    if not records:
        problems.append("no record shipped")
    for path in records:
        name = os.path.basename(path)
        record = json.load(open(path))
        if name != tuning.file_name(record["gpu"]) + ".json":
            problems.append(f"{name}: recorded on {record['gpu']}")
        ours = {k: v for k, v in record["kernels"].items() if k.startswith("megatron_zeco.")}
        if not ours:
            problems.append(f"{name}: no entry for this package's kernels")
        for kernel, picks in ours.items():
            module, _, attribute = kernel.partition(":")
            tuner = tuning._autotuner(getattr(importlib.import_module(module), attribute, None))
            if tuner is None:
                problems.append(f"{name}: {kernel} is not an autotuned kernel")
                continue
            configs = [tuning.describe(c) for c in tuner.configs]
            problems += [f"{name}: {kernel} has no config {pick['config']}" for pick in picks
                         if pick["config"] not in configs]
    return problems


def test_shipped_records_name_this_package_s_kernels_and_their_configs():
    """Every record in megatron_zeco/common/configs/ is named for its GPU, and each of its entries for this
    package's kernels names an autotuned kernel that exists and one of that kernel's own configs on a GPU
    (a renamed kernel or a changed config list would otherwise be skipped on every GPU without a word).
    fla's entries are checked where fla imports: `replay` counts the entries it skips."""
    code = ("import json; from tests.common.test_tuning import _shipped_record_problems as p; "
            "print(json.dumps(p()))")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
