"""The example launchers (examples/*.sh) and the model-level benchmark's runs (benchmarks/throughput.py) pass
Megatron-LM's own argument checks: each launcher runs with ``torchrun`` replaced by a stand-in that records
its command line and environment, and Megatron's ``parse_args`` and ``validate_args`` (megatron-core 0.19's
``megatron.training``, which ``pretrain_gpt.py`` and ``pretrain_hybrid.py`` call) take the recorded flags;
the ``--spec`` it names imports as Megatron imports it, with the token mixer the run is meant to train.

``megatron.training`` ships in the megatron-core 0.19 wheels only: on 0.16 these tests skip (.ci/run's
second pass runs them)."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.benchmarks import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_TRAINING = importlib.util.find_spec("megatron.training") is not None
pytestmark = [pytest.mark.megatron,
              pytest.mark.skipif(not HAVE_TRAINING, reason="megatron.training (Megatron-LM's argument checks) ships "
                                 "with megatron-core >= 0.19 (.ci/run runs these tests in its megatron-core 0.19 pass)")]


throughput = load("throughput")  # (it imports its sibling compare_losses as the script does)
REFERENCE = throughput.MODELS["gdn-1b"][1]["megatron"]  # Megatron's own Gated DeltaNet, the benchmark's row
GRAPHS = tuple(throughput.CUDA_GRAPH_FLAGS)  # the benchmark's CUDA-graph runs
# (launcher, environment, extra flags, the G/GLA mixer class the spec must build and its CP strategy)
RUNS = {
    "gpt gla-1b cp2": ("pretrain_gpt_gla.sh", dict(MODEL="gla-1b", CP="2", GPUS="2", SEQ="8192"), (),
                       ("GatedLinearAttention", "zeco")),
    "gpt small lasp2": ("pretrain_gpt_gla.sh", dict(SPEC="gla_local_lasp2_spec", CP="2", GPUS="4"), (),
                        ("GatedLinearAttention", "lasp2")),
    "hybrid small cp2": ("pretrain_hybrid_gla.sh", dict(CP="2", GPUS="2"), (), ("GatedLinearAttention", "zeco")),
    "hybrid gdn-1b cp4 graphs": ("pretrain_hybrid_gla.sh", dict(MODEL="gdn-1b", CP="4", GPUS="4", SEQ="65536"),
                                 GRAPHS, ("ZecoGatedDeltaNet", "zeco")),
    "hybrid gdn-1b megatron cp2": ("pretrain_hybrid_gla.sh", dict(MODEL="gdn-1b", CP="2", GPUS="2", SEQ="32768",
                                                                  SPEC=REFERENCE), (), ("GatedDeltaNet", None)),
}


def _launch(tmp_path, launcher, env, extra):
    """The launcher's torchrun command line (after ``--nproc-per-node N``) and environment, recorded by a
    stand-in ``torchrun`` on PATH."""
    shim = tmp_path / "bin"
    shim.mkdir(exist_ok=True)
    record = tmp_path / "launch.json"
    (shim / "torchrun").write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, sys
        json.dump({{"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}}, open({str(record)!r}, "w"))
        """))
    (shim / "torchrun").chmod(0o755)
    megatron_lm = tmp_path / "megatron-lm"
    megatron_lm.mkdir(exist_ok=True)
    run_env = {k: v for k, v in os.environ.items() if k not in ("SPEC", "MODEL", "CP", "GPUS", "SEQ", "PATTERN")}
    run_env.update(env, PATH=f"{shim}:{os.environ['PATH']}", MEGATRON_LM=str(megatron_lm))
    done = subprocess.run(["bash", os.path.join(ROOT, "examples", launcher), *extra], env=run_env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    launched = json.loads(record.read_text())
    assert launched["cwd"] == str(megatron_lm)
    return launched


# Megatron's argument checks on the recorded flags, in a process of their own (its parser reads sys.argv);
# what it prints last is one JSON line: the flags Megatron resolved and the spec's G/GLA mixer.
CHECK = textwrap.dedent("""\
    import json, os, sys, typing
    # megatron.training imports typing.override (Python >= 3.12); on 3.11 give it what it does at run time
    typing.override = getattr(typing, "override", lambda f: f)
    from megatron.training import arguments
    from megatron.core.transformer.spec_utils import import_module
    arguments.get_device_arch_version = lambda: 9  # the GPUs the launchers are for (Hopper); none here
    sys.argv = json.loads(sys.argv[1])
    args = arguments.validate_args(arguments.parse_args())
    spec = import_module(args.spec)
    layer = getattr(spec.submodules, "gdn_layer", spec)  # HybridModel: the G slot; GPTModel: the layer
    mixer = layer.submodules.self_attention
    strategy = getattr((mixer.params or {}).get("cp_config"), "strategy", None)
    print(json.dumps(dict(spec=args.spec, cp=args.context_parallel_size, seq=args.seq_length,
                          layers=args.num_layers, cuda_graph_impl=str(args.cuda_graph_impl),
                          mixer=mixer.module.__name__, strategy=None if strategy is None else str(strategy))))
    """)


@pytest.mark.parametrize("name", RUNS)
def test_launcher_flags_pass_megatron_argument_checks(tmp_path, name):
    launcher, env, extra, mixer = RUNS[name]
    launched = _launch(tmp_path, launcher, env, extra)
    argv = launched["argv"]
    assert argv[:2] == ["--nproc-per-node", env["GPUS"]], argv
    script, flags = argv[2], argv[3:]
    assert script == ("pretrain_hybrid.py" if "hybrid" in launcher else "pretrain_gpt.py")
    child_env = {**launched["env"], "WORLD_SIZE": env["GPUS"], "RANK": "0", "LOCAL_RANK": "0"}
    child_env["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", ""), child_env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", CHECK, json.dumps([script, *flags])], env=child_env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert (got["mixer"], got["strategy"]) == mixer, got
    assert got["cp"] == int(env["CP"]) and got["seq"] == int(env.get("SEQ", 4096)), got
    assert got["cuda_graph_impl"] == ("local" if extra == GRAPHS else "none"), got
    if env.get("MODEL") == "gdn-1b":  # 12 Gated DeltaNet layers, 4 softmax layers, an MLP after each
        assert got["layers"] == 32 and flags[flags.index("--hybrid-layer-pattern") + 1].count("G") == 12, got
