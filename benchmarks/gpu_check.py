"""The GPU check: every GPU test and the op benchmark's short rows on this machine's GPUs, one summary.

    bash benchmarks/gpu_check.sh                  # on a bare GPU machine, with .whl/ carried (docs/testing.md)
    python benchmarks/gpu_check.py --out results/gpu-check.json    # where fla-core and Triton are installed

1. **Tests**: ``tests/{gla,gated_delta_rule,kda}/test_gpu.py``, ``tests/mcore/test_cuda_graphs.py``,
   ``tests/test_green_context.py`` and the GPU cases of ``tests/common/test_norm.py`` (the fast ones:
   ``-m "not slow"``; the two-GPU cases where two GPUs are present, the give-up and every-strategy tests among
   them), in ``--jobs`` pytest-xdist workers; per file the counts of passed, failed and skipped tests with each
   skip's reason and each failure's first lines.
2. **Short benchmark rows** at ``--tokens`` per GPU (bf16, H = 16, K = V = 128), each operator:
   one GPU: the gated delta rule's and KDA's pieces with the exchange stubbed against fla's op, GPU,
   CUDA-graph and host time (``bench_op.py --op gdn|kda --piece``), and what the scan's overlap hides and costs
   (``bench_overlap.py``: GLA's and the gated delta rule's pieces beside an emulated link, with and without the
   overlap); two GPUs: fla on one GPU, fla's CP
   (gated delta rule, KDA), zeco, lasp2 and a2a in both layouts (``torchrun --nproc-per-node 2
   bench_op.py --op OP``, eager mode).
3. **Summary**: a table (printed last) and ``--out`` (JSON) with the device, date, commit and versions.

Autotuned kernels replay the configs recorded for this GPU's chip (``megatron_zeco/common/configs/``, see
``megatron_zeco/common/tuning.py``), so a cold machine compiles one config per kernel and key; the tests,
which check numerics, run a kernel's first config where the record has no pick for their shapes
(``untuned``); ``--autotune`` autotunes everything instead. ``--record DIR`` records the benchmarks' picks:
the shipped record is replayed and every kernel and key it lacks is autotuned once for all the check's
processes (the others wait for its pick); ``DIR/record.json`` is then the shipped record extended, to be
copied over it. Every process of the run shares one Triton cache
(``$TRITON_CACHE_DIR``, by default a folder under the system's temp dir).
"""

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from megatron_zeco.common import tuning  # noqa: E402  (imports nothing of torch or Triton)
TEST_FILES = ("tests/common/test_norm.py", "tests/kernels/test_scan_hop.py", "tests/kernels/test_scan_rounds.py",
              "tests/gla/test_gpu.py",
              "tests/gated_delta_rule/test_gpu.py",
              "tests/kda/test_gpu.py", "tests/mcore/test_cuda_graphs.py", "tests/test_green_context.py")
OPS = ("gla", "gdn", "kda")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/gpu-check.json", help="the summary (JSON)")
    p.add_argument("--logs", default=None, help="folder for the logs of each step (default: beside --out)")
    p.add_argument("--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 4) // 4)),
                   help="pytest-xdist workers for the tests (1: no xdist; default: a worker per 4 cores, at most 8)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per GPU of the benchmark rows")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per benchmark row")
    p.add_argument("--skip", nargs="*", default=[], choices=["tests", "bench"], help="steps left out")
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression for the tests")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds for the whole check: a step still running then is stopped (and reported as "
                        "such) and the steps after it are left out, so the summary is always written")
    configs = p.add_mutually_exclusive_group()
    configs.add_argument("--autotune", action="store_true", help="autotune every kernel (no recorded configs)")
    configs.add_argument("--record", metavar="DIR", default=None,
                        help="record the autotuner's picks: the shipped record for this GPU replayed, every other "
                             "kernel and key autotuned once for all the check's processes; DIR/record.json is the "
                             "shipped record extended (copy it to megatron_zeco/common/configs/<GPU>.json)")
    return p.parse_args(argv)


def environment(args, step):
    """The environment a step runs in: one Triton cache for all, the tuned-config mode of the step: the tests
    check numerics and run untuned kernels where the record has no pick (``untuned``), the benchmarks run
    the recorded or autotuned configs."""
    env = dict(os.environ)
    env.setdefault("TRITON_CACHE_DIR", os.path.join(tempfile.gettempdir(), "megatron-zeco-triton-cache"))
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    if step == "tests" and not args.autotune:
        env.setdefault(tuning.ENV, "untuned")
    elif args.record:
        env[tuning.ENV] = "record:" + os.path.join(os.path.abspath(args.record), "picks")
    elif args.autotune:
        env[tuning.ENV] = "off"
    else:
        env.setdefault(tuning.ENV, "auto")
    return env


def inherited_tests_mode(args, env_before=None):
    """A line warning that the tests' tuned-config mode comes from the environment and autotunes (anything but
    ``untuned``: every kernel and key the record lacks is autotuned, which from a cold cache takes longer than
    the tests themselves), or None."""
    env_before = os.environ if env_before is None else env_before
    mode = env_before.get(tuning.ENV)
    if args.autotune or mode in (None, "untuned"):
        return None
    return (f"gpu_check: the tests run with ${tuning.ENV}={mode} from the environment: every kernel and key "
            f"without a recorded pick is autotuned (minutes per kernel from a cold cache); unset it to run them "
            f"untuned, as the check does by default")


class Clock:
    """The check's deadline (``--time-limit``): seconds left, None for no limit."""

    def __init__(self, limit):
        self.deadline = None if limit is None else time.perf_counter() + limit

    def left(self):
        return None if self.deadline is None else self.deadline - time.perf_counter()


STOPPED = "stopped at the time limit"


def write_record(directory, device):
    """DIR/record.json: the picks of the recording run, over the shipped record for this GPU."""
    out = os.path.join(directory, "record.json")
    shipped = tuning.recorded_for(tuning.file_name(device))
    command = [sys.executable, "-m", "megatron_zeco.common.tuning", "merge", os.path.join(directory, "picks"),
               "-o", out] + (["--into", shipped] if shipped else [])
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    print(done.stdout + done.stderr, flush=True)
    return {"record": out if done.returncode == 0 else None, "over": shipped, "merge": done.stdout.strip()}


def run(step, command, env, logs, clock):
    """Run ``command`` (its output into ``logs/step.log`` and to the console), in a process group stopped
    at the clock's deadline; (exit status or STOPPED, seconds)."""
    started = time.perf_counter()
    left = clock.left()
    if left is not None and left <= 0:
        print(f"\n=== {step}: left out (no time left)", flush=True)
        return "left out", 0.0
    print(f"\n=== {step}: {' '.join(command)}", flush=True)
    env = {**env, tuning.COMPILE_LOG_ENV: os.path.join(logs, "compiles", step)}
    with open(os.path.join(logs, f"{step}.log"), "w") as log:
        with _interruptible_children():
            proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
        stopped = []
        timer = None if left is None else threading.Timer(left, lambda: (stopped.append(1), _stop(proc)))
        if timer is not None:
            timer.start()
        for line in proc.stdout:
            log.write(line)
            sys.stdout.write(line)
        status = proc.wait()
        if timer is not None:
            timer.cancel()
    seconds = time.perf_counter() - started
    status = STOPPED if stopped else status
    print(f"=== {step}: exit {status} after {seconds:.0f} s", flush=True)
    return status, seconds


@contextlib.contextmanager
def _interruptible_children():
    """Start processes that take SIGINT: a shell starts its background jobs with SIGINT ignored and their
    children inherit that, so a step started from one would miss the interrupt that lets it write its report.
    A handler (unlike an ignored signal) is reset to the default in a new program, which Python turns into
    KeyboardInterrupt. The check's own disposition is restored once the step has started."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stop(*procs):
    """Stop each of ``procs`` and every process it started (its process group): SIGINT (pytest then reports the
    tests that ended and writes its JUnit file), SIGTERM, then SIGKILL."""
    for sig, grace in ((signal.SIGINT, 15), (signal.SIGTERM, 5), (signal.SIGKILL, 0)):
        for proc in procs:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.perf_counter() + grace
        while time.perf_counter() < deadline and any(proc.poll() is None for proc in procs):
            time.sleep(0.5)


def _entry():
    return {"passed": 0, "failed": 0, "skipped": 0, "seconds": 0.0, "skips": {}, "failures": {}}


def test_results(junit, log):
    """Per test file: counts of passed, failed, skipped; the reasons of skips and the first lines of failures.
    From pytest's JUnit XML, or where a stopped run wrote none, from its log's verbose lines."""
    files = {}
    if not os.path.exists(junit):
        pattern = re.compile(r"(PASSED|FAILED|SKIPPED|ERROR) (tests/\S+?\.py)::(\S+)")
        for line in open(log) if os.path.exists(log) else ():
            match = pattern.search(line)
            if match:
                outcome, name, test = match.groups()
                entry = files.setdefault(name, _entry())
                kind = {"PASSED": "passed", "SKIPPED": "skipped"}.get(outcome, "failed")
                entry[kind] += 1
                if kind == "failed":
                    entry["failures"][test] = "(see the log)"
        return files
    for case in ET.parse(junit).getroot().iter("testcase"):
        if not case.get("name"):  # a test a stopped run left unfinished: no outcome to count
            continue
        name = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        entry = files.setdefault(name, _entry())
        entry["seconds"] += float(case.get("time", 0))
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        test = case.get("name")
        if outcome is None:
            entry["passed"] += 1
        elif outcome.tag == "skipped":
            entry["skipped"] += 1
            entry["skips"][test] = (outcome.get("message") or "")[:300]
        else:
            entry["failed"] += 1
            text = (outcome.get("message") or "") + "\n" + (outcome.text or "")
            entry["failures"][test] = "\n".join(text.strip().splitlines()[-12:])[:2000]
    return files


def run_tests(args, env, logs, gpus, clock):
    junit = os.path.join(logs, "tests.xml")
    if os.path.exists(junit):
        os.remove(junit)
    command = [sys.executable, "-m", "pytest", *TEST_FILES, "-m", "not slow", "-v", "-rs", "--durations=15",
               "-p", "no:cacheprovider", "-p", "no:benchmark", f"--junitxml={junit}", "-o", "junit_family=xunit1"]
    if args.jobs > 1:
        command += ["-n", str(args.jobs)]
    if args.keyword:
        command += ["-k", args.keyword]
    times = os.path.join(logs, "test-times.tsv")
    if os.path.exists(times):
        os.remove(times)
    status, seconds = run("tests", command, {**env, "MEGATRON_ZECO_TEST_LOG": times}, logs, clock)
    files = test_results(junit, os.path.join(logs, "tests.log"))
    return {"exit": status, "seconds": round(seconds, 1), "files": files, "gpus": gpus,
            "slowest": slowest_tests(times)}


def slowest_tests(path, count=10):
    """The ``count`` longest test phases of the run's test log (tests/conftest.py writes it), longest first."""
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) == 4:
                    rows.append({"test": parts[0], "phase": parts[1], "outcome": parts[2], "seconds": float(parts[3])})
    return sorted(rows, key=lambda r: -r["seconds"])[:count]


def compiles(logs):
    """Per step, the compile log summed (megatron_zeco/common/tuning.py), the five slowest kernels and the ten
    processes that compiled longest kept."""
    root = os.path.join(logs, "compiles")
    steps = sorted(os.listdir(root)) if os.path.isdir(root) else []
    return {step: {**summary, "kernels": summary["kernels"][:5], "by_process": summary["by_process"][:10]}
            for step, summary in ((step, tuning.compile_summary(os.path.join(root, step))) for step in steps)}


def bench_rows(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_bench(args, env, logs, gpus, clock):
    """The short rows; each step's JSON (bench_op's) and its exit status."""
    steps = {}
    for op in ("gdn", "kda"):
        out = os.path.join(logs, f"piece-{op}.json")
        status, seconds = run(f"bench-piece-{op}", [sys.executable, "benchmarks/bench_op.py", "--op", op, "--piece",
                                                    "--tokens", str(args.tokens), "--iters", str(args.iters),
                                                    "--out", out], env, logs, clock)
        steps[f"piece-{op}"] = {"exit": status, "seconds": round(seconds, 1), "result": bench_rows(out)}
    out = os.path.join(logs, "overlap.json")
    status, seconds = run("bench-overlap", [sys.executable, "benchmarks/bench_overlap.py", "--op", "gla", "gdn",
                                            "--tokens", str(args.tokens), "--iters", str(args.iters), "--out", out],
                          env, logs, clock)
    steps["overlap"] = {"exit": status, "seconds": round(seconds, 1), "result": bench_rows(out)}
    if gpus >= 2:
        for op in OPS:
            out = os.path.join(logs, f"op-{op}.json")
            strategies = ["zeco", "lasp2", "a2a"] + ([] if op == "gla" else ["fla-cp"])
            status, seconds = run(f"bench-op-{op}", [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "benchmarks/bench_op.py",
                "--op", op, "--parts", "op", "--modes", "eager", "--tokens", str(args.tokens),
                "--iters", str(args.iters), "--strategies", *strategies, "--out", out], env, logs, clock)
            steps[f"op-{op}"] = {"exit": status, "seconds": round(seconds, 1), "result": bench_rows(out)}
    return steps


def piece_table(result):
    """(case, direction, gpu ms, graph ms, host ms, x fla) rows of the piece benchmark."""
    rows = (result or {}).get("rows", [])
    base = {(r["tokens"], r["direction"]): r["gpu_ms"] for r in rows if r["case"] == "fla"}
    return [(r["case"], r["direction"], r["gpu_ms"], r.get("graph_ms"), r["host_ms"],
             r["gpu_ms"] / base[r["tokens"], r["direction"]]) for r in rows if (r["tokens"], r["direction"]) in base]


def overlap_table(result):
    """(op, arrival us, mode, fwd ms, its in-chunk ms, its departure ms, bwd ms, its in-chunk ms, its departure
    ms) rows of the overlap benchmark."""
    return [(r["op"], r["arrival_us"], r["mode"], *(r.get(f"{d}_{k}ms") for d in ("fwd", "bwd")
                                                     for k in ("", "local_", "departure_")))
            for r in (result or {}).get("rows", [])]


def op_table(result):
    """(strategy, CP, layout, ms, host ms, x fla on one GPU) rows of one operator's two-GPU benchmark."""
    rows = [r for r in (result or {}).get("rows", []) if r.get("part") == "op" and r.get("ms") is not None]
    base = {r["tokens_per_gpu"]: r["ms"] for r in rows if r["strategy"] == "fla"}
    return [(r["strategy"], r["cp"], r["layout"], r["ms"], r["host_ms"], r["ms"] / base[r["tokens_per_gpu"]])
            for r in rows if r["tokens_per_gpu"] in base]


def commit():
    """The checkout's commit, ``-dirty`` where tracked files differ from it (a copied working tree)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if changed else "")


def versions(env):
    """torch, Triton, fla-core, megatron-core and the GPUs, as the steps' interpreter sees them."""
    code = ("import json, importlib.metadata as m, torch, triton\n"
            "def v(n):\n try: return m.version(n)\n except Exception: return None\n"
            "print(json.dumps({'torch': torch.__version__, 'triton': triton.__version__, 'fla-core': v('fla-core'),"
            " 'megatron-core': v('megatron-core'), 'cuda': torch.version.cuda, 'gpus': torch.cuda.device_count(),"
            " 'device': torch.cuda.get_device_name() if torch.cuda.is_available() else None}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"gpu_check: the interpreter cannot import torch and Triton:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary_lines(report):
    meta = report["meta"]
    lines = [f"\nGPU check: {meta['device']} x{meta['gpus']}, {meta['date']}, code {meta['commit']}, torch "
             f"{meta['torch']}, Triton {meta['triton']}, fla-core {meta['fla-core']}, configs: tests "
             f"{meta['configs']['tests']}, benchmarks {meta['configs']['bench']}",
             f"total {report['seconds']:.0f} s"]
    if report.get("record"):
        lines.append(f"record: {report['record']['merge']}")
    tests = report.get("tests")
    if tests:
        lines.append(f"\ntests ({tests['seconds']:.0f} s, exit {tests['exit']}):")
        lines.append(f"  {'file':40s} {'passed':>6s} {'failed':>6s} {'skipped':>7s} {'s':>6s}")
        for name, e in sorted(tests["files"].items()):
            lines.append(f"  {name:40s} {e['passed']:6d} {e['failed']:6d} {e['skipped']:7d} {e['seconds']:6.0f}")
            lines += [f"    FAILED {t}: {m.splitlines()[-1] if m else ''}"[:200] for t, m in e["failures"].items()]
            reasons = sorted(set(e["skips"].values()))
            lines += [f"    skipped ({sum(r == s for s in e['skips'].values())}): {r}"[:200] for r in reasons]
        if tests.get("slowest"):
            lines.append("  slowest:")
            lines += [f"    {r['seconds']:6.1f} s {r['phase']:8s} {r['outcome']:7s} {r['test']}"[:200]
                      for r in tests["slowest"]]
    for step, result in (report.get("bench") or {}).items():
        lines.append(f"\n{step} ({result['seconds']:.0f} s, exit {result['exit']}):")
        if step == "overlap":
            lines.append(f"  {'op':4s} {'arrival us':>10s} {'mode':8s} "
                         + " ".join(f"{h:>9s}" for h in ("fwd ms", "in-chunk", "departure", "bwd ms", "in-chunk",
                                                         "departure")))
            lines += [f"  {o:4s} {a:10.0f} {m:8s} " + " ".join("-".rjust(9) if v is None else f"{v:9.3f}" for v in vs)
                      for o, a, m, *vs in overlap_table(result["result"])]
        elif step.startswith("piece-"):
            lines.append(f"  {'case':22s} {'dir':8s} {'gpu ms':>8s} {'graph ms':>8s} {'host ms':>8s} {'x fla':>6s}")
            lines += [f"  {c:22s} {d:8s} {g:8.3f} {'-' if gr is None else f'{gr:8.3f}':>8s} {h:8.3f} {x:6.2f}"
                      for c, d, g, gr, h, x in piece_table(result["result"])]
        else:
            lines.append(f"  {'strategy':10s} {'CP':>2s} {'layout':10s} {'ms':>8s} {'host ms':>8s} {'x 1 GPU':>7s}")
            lines += [f"  {s:10s} {p:2d} {l:10s} {m:8.3f} {'-' if h is None else f'{h:8.3f}':>8s} {x:7.2f}"
                      for s, p, l, m, h, x in op_table(result["result"])]
    if report.get("compiles"):
        lines.append("\nTriton compiles (cache hits left out):")
        for step, c in report["compiles"].items():
            lines.append(f"  {step:16s} {c['compiles']:5d} compiles in {c['processes']:3d} processes, "
                         f"{c['seconds']:7.1f} s; slowest: " + ", ".join(f"{k['kernel'].split(':')[-1]} "
                                                                         f"{k['seconds']:.0f} s ({k['compiles']})"
                                                                         for k in c["kernels"][:3]))
    return lines


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    clock = Clock(args.time_limit)
    logs = args.logs or os.path.dirname(os.path.abspath(args.out))
    os.makedirs(logs, exist_ok=True)
    shutil.rmtree(os.path.join(logs, "compiles"), ignore_errors=True)  # a log of this run's compiles only
    env = environment(args, "bench")
    info = versions(env)
    if not info["gpus"]:
        sys.exit("gpu_check: no CUDA GPU visible")
    args.gpus = info["gpus"]
    report = {"meta": {**info, "date": datetime.date.today().isoformat(), "commit": commit(),
                       "configs": {"tests": environment(args, "tests")[tuning.ENV], "bench": env[tuning.ENV]},
                       "command": " ".join(sys.argv)}}
    if "tests" not in args.skip:
        note = inherited_tests_mode(args)
        if note:
            print(note, file=sys.stderr, flush=True)
        report["tests"] = run_tests(args, environment(args, "tests"), logs, info["gpus"], clock)
    if "bench" not in args.skip:
        report["bench"] = run_bench(args, env, logs, info["gpus"], clock)
    if args.record:
        report["record"] = write_record(args.record, info["device"])
    report["compiles"] = compiles(logs)
    report["seconds"] = round(time.perf_counter() - started, 1)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("\n".join(summary_lines(report)), flush=True)
    failed = (report.get("tests", {}).get("exit", 0) not in (0, 5)
              or any(s["exit"] != 0 for s in (report.get("bench") or {}).values()))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
