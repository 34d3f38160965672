"""benchmarks/gpu_check.py's own logic on the CPU: a step stopped at the time limit, the logs it reads back
and the summary it prints (the steps themselves need GPUs)."""

import importlib.util
import os
import signal
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "benchmarks", "gpu_check.py"))
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

# A step that outlives the time limit; interrupted (SIGINT), it reports as pytest does, then exits.
SLOW_STEP = ("import sys, time\n"
             "print('started', flush=True)\n"
             "try:\n    time.sleep(60)\n"
             "except KeyboardInterrupt:\n    print('interrupted: wrote its report', flush=True)\n    sys.exit(2)\n")


@pytest.mark.parametrize("sigint", [signal.default_int_handler, signal.SIG_IGN], ids=["handled", "ignored"])
def test_a_step_past_the_time_limit_is_interrupted_first_and_reported_stopped(tmp_path, sigint):
    """Also when the check itself runs with SIGINT ignored (a shell's background job), which its steps would
    inherit; the check's own disposition is left as it was."""
    clock = gpu_check.Clock(2.0)
    previous = signal.signal(signal.SIGINT, sigint)
    try:
        status, seconds = gpu_check.run("slow", [sys.executable, "-c", SLOW_STEP], dict(os.environ), str(tmp_path),
                                        clock)
        assert signal.getsignal(signal.SIGINT) == sigint
    finally:
        signal.signal(signal.SIGINT, previous)
    assert status == gpu_check.STOPPED and seconds < 30
    log = (tmp_path / "slow.log").read_text()
    assert "interrupted: wrote its report" in log  # SIGINT came first, so pytest can write its JUnit file
    assert gpu_check.run("next", [sys.executable, "-c", "pass"], {}, str(tmp_path), clock) == ("left out", 0.0)


def test_the_summary_shows_the_slowest_tests_and_the_compile_time(tmp_path):
    times = tmp_path / "test-times.tsv"
    times.write_text("tests/a.py::fast\tcall\tpassed\t1.0\ntests/a.py::slow\tcall\tpassed\t90.5\n"
                     "tests/b.py::broken\tsetup\tfailed\t3.0\ncut sho")
    slowest = gpu_check.slowest_tests(str(times), count=2)
    assert [r["test"] for r in slowest] == ["tests/a.py::slow", "tests/b.py::broken"]
    compiles = tmp_path / "compiles" / "tests"
    compiles.mkdir(parents=True)
    (compiles / "1.jsonl").write_text('{"kernel": "fla.ops.x:k1", "cache_hit": false, "seconds": 40.0}\n'
                                      '{"kernel": "fla.ops.x:k1", "cache_hit": true, "seconds": 0.1}\n')
    (compiles / "2.jsonl").write_text('{"kernel": "fla.ops.x:k2", "cache_hit": false, "seconds": 2.0}\n{"kern')
    summary = gpu_check.compiles(str(tmp_path))["tests"]
    assert (summary["processes"], summary["compiles"], summary["cache_hits"], summary["seconds"]) == (2, 2, 1, 42.0)
    report = {"meta": {"device": "GPU", "gpus": 2, "date": "d", "commit": "c", "torch": "t", "triton": "3",
                       "fla-core": "f", "configs": {"tests": "untuned", "bench": "auto"}},
              "seconds": 100.0, "compiles": {"tests": summary},
              "tests": {"seconds": 95.0, "exit": 0, "slowest": slowest,
                        "files": {"tests/a.py": {**gpu_check._entry(), "passed": 2}}}}
    text = "\n".join(gpu_check.summary_lines(report))
    assert "90.5 s call" in text and "tests/a.py::slow" in text
    assert "2 compiles in   2 processes,    42.0 s; slowest: k1 40 s (1), k2 2 s (1)" in text


def test_the_summary_shows_the_overlap_rows():
    row = dict(part="overlap", op="gla", tokens=16384, arrival_us=300.0, mode="overlap", fwd_ms=0.9, fwd_local_ms=0.38,
               fwd_departure_ms=0.31, bwd_ms=2.7, bwd_local_ms=1.4, bwd_departure_ms=0.32)
    old = {k: v for k, v in row.items() if "departure" not in k}  # a file written before departures were timed
    report = {"meta": {"device": "GPU", "gpus": 1, "date": "d", "commit": "c", "torch": "t", "triton": "3",
                       "fla-core": "f", "configs": {"tests": "untuned", "bench": "auto"}}, "seconds": 10.0,
              "bench": {"overlap": {"exit": 0, "seconds": 9.0, "result": {"rows": [row, dict(old, mode="serial")]}}}}
    text = "\n".join(gpu_check.summary_lines(report))
    assert "  gla         300 overlap      0.900     0.380     0.310     2.700     1.400     0.320" in text, text
    assert "  gla         300 serial       0.900     0.380         -     2.700     1.400         -" in text, text


def test_every_test_that_needs_a_gpu_is_in_a_file_the_check_runs():
    """A test that skips without CUDA runs only where the GPU check runs it: every test module with such a
    skip is among the check's files (a GPU test written elsewhere would never run), and each of those exists."""
    import glob
    import re

    needs_gpu = re.compile(r"skipif\(\s*not\s*\(?[^)]*torch\.cuda\.is_available\(\)|torch\.cuda\.device_count\(\)\s*<")
    found = set()
    for path in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True):
        with open(path) as f:
            if needs_gpu.search(f.read()):
                found.add(os.path.relpath(path, ROOT))
    assert found, "no GPU test found: the pattern no longer matches how GPU tests skip"
    assert found <= set(gpu_check.TEST_FILES), sorted(found - set(gpu_check.TEST_FILES))
    assert all(os.path.exists(os.path.join(ROOT, name)) for name in gpu_check.TEST_FILES)


@pytest.mark.parametrize("mode", [None, "untuned", "auto", "off", "record:/tmp/picks"])
def test_a_tests_mode_inherited_from_the_environment_that_autotunes_is_named(mode):
    """The tests run ``untuned`` unless the environment says otherwise; a setting that autotunes is named
    before the tests start, since from a cold cache it takes longer than the tests."""
    args = gpu_check.parse_args([])
    env = {} if mode is None else {gpu_check.tuning.ENV: mode}
    note = gpu_check.inherited_tests_mode(args, env)
    if mode in (None, "untuned"):
        assert note is None
    else:
        assert f"{gpu_check.tuning.ENV}={mode}" in note and "unset it" in note
    assert gpu_check.inherited_tests_mode(gpu_check.parse_args(["--autotune"]), env) is None
