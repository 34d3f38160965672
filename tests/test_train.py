"""The main job (python -m megatron_zeco.train) as a command: its flags (fast tier: parsed and checked
without processes), its start-up errors, its launcher (--nproc-per-node), every mixer learning the task,
and save / resume through Megatron-Core's distributed checkpointing on real gloo process groups."""

import contextlib
import importlib.util
import io
import os
import subprocess
import sys
from unittest import mock

import pytest

from tests.helpers.distributed import run_ranks
from tests.helpers.megatron import host_as_cuda

TINY = dict(layers=2, hidden=32, heads=4, seq_len=32, batch=4, steps=6, log_interval=10**6)
HAVE_HYBRID_MODEL = importlib.util.find_spec("megatron.core.models.hybrid") is not None  # and Gated DeltaNet
needs_hybrid_model = pytest.mark.skipif(not HAVE_HYBRID_MODEL,
                                        reason="--model hybrid needs megatron-core >= 0.19 (HybridModel; .ci/run "
                                               "runs these tests in its megatron-core 0.19 pass)")


# --- flags -----------------------------------------------------------------------------------------

def test_help_describes_every_flag_with_its_default():
    from dataclasses import fields

    from megatron_zeco import train as T

    parser = T.build_parser()
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert set(actions) == {f.name for f in fields(T.TrainConfig)}
    groups = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    titles = ("parallelism", "model", "task", "optimisation", "checkpointing", "logging", "fault injection (testing)")
    for title in titles:
        assert groups[title], title
    assert set().union(*(groups[t] for t in titles)) == set(actions)
    for dest, action in actions.items():
        text = action.help % dict(default=action.default)
        description, _, default = text.rpartition(" (default: ")
        assert description.strip() and default.endswith(")"), f"--{dest}: {text!r}"
        if action.default is not None and not isinstance(action.default, bool):
            assert default == f"{action.default})", f"--{dest}: {text!r}"
    help_text = parser.format_help()
    assert all(a.option_strings[0] in help_text for a in actions.values())


def test_defaults_match_the_config():
    from megatron_zeco import train as T

    assert T.parse_args([]) == T.TrainConfig()
    cfg = T.parse_args(["--cp", "2", "--piece-split", "3", "--save", "d", "--deterministic", "--lr", "0.5"])
    assert (cfg.cp, cfg.piece_split, cfg.save, cfg.deterministic, cfg.lr) == (2, 3, "d", True, 0.5)


def test_every_alias_is_its_flag():
    """Each other spelling of a flag (Megatron-LM's: --train-iters for --steps) sets the same field."""
    from dataclasses import fields

    from megatron_zeco import train as T

    aliases = {alias: f.name for f in fields(T.TrainConfig) for alias in f.metadata["aliases"]}
    assert aliases == {"--train-iters": "steps"}
    for alias, name in aliases.items():
        assert getattr(T.parse_args([alias, "7"]), name) == 7
        assert T.parse_args([alias, "7"]) == T.parse_args(["--" + name.replace("_", "-"), "7"])


def test_launcher_passes_the_flags_on():
    """What --nproc-per-node hands its processes parses back to the same configuration, itself left out."""
    from dataclasses import replace

    from megatron_zeco import train as T

    cfg = T.parse_args(["--nproc-per-node", "4", "--mixer", "kda", "--conv-init", "uniform", "--lr", "0.0123",
                        "--deterministic", "--hybrid-layer-pattern", "G-*-", "--model", "hybrid", "--seed", "7"])
    argv = T.to_argv(cfg)
    assert "--nproc-per-node" not in argv
    assert T.parse_args(argv) == replace(cfg, nproc_per_node=None)
    assert T.to_argv(T.TrainConfig()) == []


@pytest.mark.parametrize("world,flags,seq_len", [
    (3, {}, 66), (4, {}, 64), (3, dict(layout="contiguous"), 66), (5, dict(layout="contiguous"), 65),
    (2, dict(piece_split=3), 72), (1, {}, 64), (6, dict(tp=2), 66), (4, dict(seq_len=40), 40),
])
def test_default_sequence_length_fits_the_layout(world, flags, seq_len):
    """The default --seq-len is rounded up to what the layout cuts evenly (one line says so);
    an explicit one is kept."""
    from megatron_zeco import train as T

    cfg = T.TrainConfig(**flags)
    notes = T.resolve(cfg, world)
    assert cfg.seq_len == seq_len and cfg.tp * cfg.cp * cfg.dp == world
    assert len(notes) == (seq_len != 64 and "seq_len" not in flags)
    if notes:
        assert f"--seq-len {seq_len}" in notes[0]


@pytest.mark.parametrize("world,flags,names", [
    (2, dict(seq_len=50), ["--seq-len 50", "multiple of 4", "--cp 2"]),
    (4, dict(seq_len=60, cp=2, dp=2, piece_split=2), ["--seq-len 60", "multiple of 8", "--piece-split 2"]),
    (2, dict(tp=3), ["--tp 3", "number of processes (2)"]),
    (4, dict(tp=2, cp=3), ["--tp 2 x --cp 3 x --dp 1", "number of processes (4)"]),
    (2, dict(hidden=50), ["--hidden 50", "--heads 4"]),
    (2, dict(batch=5, dp=2, cp=1), ["--batch 5", "--dp 2"]),
    (2, dict(save_interval=5), ["--save-interval", "--save DIR"]),
    (2, dict(steps=0), ["--steps"]),
    (2, dict(mixer="kda", piece_split=2), ["--piece-split applies to --mixer gla only"]),
    (2, dict(mixer="kda", strategy="lasp1"), ["cp_strategy 'lasp1' is not one of zeco, lasp2, a2a for KDA"]),
    (2, dict(mixer="mamba"), ["--mixer must be one of gla, gdn, kda"]),
    (2, dict(conv_init="uniform"), ["--conv-init applies to --mixer gdn and kda", "GLA has none"]),
    (2, dict(num_blocks=3), ["cp_num_blocks 3 must divide the key head dim (16)", "--hidden 64 / --heads 4"]),
    (2, dict(mixer="kda", num_blocks=3), ["cp_num_blocks 3 must divide the value head dim (16)"]),
    (2, dict(pairs=9), ["9 pairs need at least as many keys", "--pairs 9, --keys 8"]),
    (2, dict(pairs=8, keys=8, seq_len=24), ["8 pairs need a sequence of more than 24 tokens", "--seq-len 24"]),
])
def test_resolve_names_the_flag_to_change(world, flags, names):
    from megatron_zeco import train as T

    with pytest.raises(ValueError) as error:
        T.resolve(T.TrainConfig(**flags), world)
    assert all(n in str(error.value) for n in names), str(error.value)


@needs_hybrid_model
@pytest.mark.megatron
@pytest.mark.parametrize("flags,names", [
    (dict(hybrid_layer_pattern="G-|G-"), ["'G-|G-'", "'|' separates pipeline stages", "drop the '|'"]),
    (dict(hybrid_layer_pattern="GM-"), ["'GM-'", "no layer for 'M'", "'G' (the --mixer layer), '*' (softmax attention)"]),
    (dict(hybrid_layer_pattern=""), ["no layers"]),
    (dict(layers=3), ["--layers 3 must equal the 4 layers of --hybrid-layer-pattern 'G-G-'"]),
    (dict(pattern="G*"), ["--pattern is for --model gpt", "--hybrid-layer-pattern 'G-*-'"]),
    (dict(hybrid_layer_pattern="G-E-", experts=1), ["--experts 1", "at least 2"]),
    (dict(hybrid_layer_pattern="G-E-", tp=2), ["'G-E-' with --tp 2", "sequence parallelism", "use --tp 1"]),
])
def test_hybrid_model_flags_are_checked(flags, names):
    from megatron_zeco import train as T

    with pytest.raises(ValueError) as error:
        T.resolve(T.TrainConfig(model="hybrid", **flags), 2)
    assert all(n in str(error.value) for n in names), str(error.value)


@needs_hybrid_model
@pytest.mark.megatron
def test_hybrid_model_takes_its_layers_from_the_pattern():
    from megatron_zeco import train as T

    cfg = T.TrainConfig(model="hybrid", hybrid_layer_pattern="G-G-G-*-")
    notes = T.resolve(cfg, 2)
    assert cfg.layers == 8 and notes == ["--layers 8: the layer count of --hybrid-layer-pattern 'G-G-G-*-' (one "
                                         "layer per symbol)"]
    cfg = T.TrainConfig(model="hybrid", layers=4)
    assert T.resolve(cfg, 2) == [] and cfg.layers == 4
    cfg = T.TrainConfig()
    assert T.resolve(cfg, 2) == [] and cfg.layers == 2  # --model gpt


def test_gpt_model_refuses_the_hybrid_pattern():
    from megatron_zeco import train as T

    with pytest.raises(ValueError, match="--hybrid-layer-pattern is for --model hybrid; --model gpt takes --pattern"):
        T.resolve(T.TrainConfig(hybrid_layer_pattern="G-*-"), 2)


@pytest.mark.skipif(HAVE_HYBRID_MODEL, reason="megatron-core has HybridModel and Gated DeltaNet")
@pytest.mark.parametrize("flags,what", [(dict(model="hybrid"), "--model hybrid"), (dict(mixer="gdn"), "--mixer gdn")])
def test_megatron_core_without_hybrid_model_or_gated_deltanet_names_the_version(flags, what):
    from megatron_zeco import train as T

    with pytest.raises(ValueError, match=rf"{what} .*needs megatron-core >= 0\.19 .*this is megatron-core 0\.16"):
        T.resolve(T.TrainConfig(**flags), 2)


def test_flags_are_checked_before_megatron_core_is_imported():
    """resolve (every check of the job's own flags) imports no megatron-core, so a bad flag stops the job in the
    seconds torch takes to import, not the tens megatron-core takes (a fresh interpreter)."""
    script = ("import sys\nfrom megatron_zeco import train as T\n"
              "for flags in ({}, dict(mixer='gdn'), dict(mixer='kda', model='hybrid')):\n"
              "    try:\n        T.resolve(T.TrainConfig(**flags), 4)\n    except ValueError:\n        pass\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_rope_on_the_cpu_is_refused():
    from megatron_zeco import train as T

    with pytest.raises(ValueError, match="--position-embedding rope needs a GPU"):
        T.check_device(T.TrainConfig(position_embedding="rope", device="cpu"))
    T.check_device(T.TrainConfig(device="cpu"))
    with pytest.raises(ValueError, match="E .mixture of experts. needs a GPU"):
        T.check_device(T.TrainConfig(model="hybrid", hybrid_layer_pattern="G-GE", device="cpu"))


# --- start-up errors -------------------------------------------------------------------------------

# argv: what the message must name (and where the check lives)
MISCONFIGURED = {
    "seq-len": (["--seq-len", "50"], ["--seq-len 50 must be a multiple of 4"]),  # train.resolve
    "world": (["--tp", "3"], ["--tp 3 x --dp 1 must divide the number of processes (2)"]),  # train.resolve
    "strategy": (["--strategy", "ring"], ["cp_strategy 'ring' is not one of zeco, lasp1, lasp2, a2a",  # CPConfig
                                          "cp_strategy is --strategy"]),
    "a2a heads": (["--strategy", "a2a", "--heads", "3", "--hidden", "48"],  # the layer's LayerCP
                  ["a2a strategy", "--context-parallel-size (2)", "--context-parallel-size is --cp",
                   "--num-attention-heads is --heads"]),
    "tp heads": (["--tp", "2", "--cp", "1", "--heads", "3", "--hidden", "48"],  # megatron-core TransformerConfig
                 ["num_attention_heads (3) must be a multiple of tensor_model_parallel_size (2)",
                  "num_attention_heads is --heads"]),
    "blocks": (["--num-blocks", "3"], ["cp_num_blocks 3 must divide", "cp_num_blocks is --num-blocks"]),
    "pattern": (["--pattern", "GX"], ["hybrid layer pattern 'GX'"]),  # mcore.gpt_hybrid.check_pattern
    "pairs": (["--pairs", "9"], ["9 pairs need at least as many keys"]),  # RecallTask, through train.resolve
    "rope": (["--pattern", "G*", "--position-embedding", "rope", "--device", "cpu"],  # train.check_device
             ["--position-embedding rope needs a GPU"]),
}
if not HAVE_HYBRID_MODEL:  # megatron-core 0.16: train.resolve_model, train.resolve_mixer
    MISCONFIGURED["hybrid"] = (["--model", "hybrid"], ["--model hybrid (megatron-core's HybridModel) needs "
                                                        "megatron-core >= 0.19", "pip install 'megatron-core>=0.19.2'"])
    MISCONFIGURED["gdn"] = (["--mixer", "gdn"], ["--mixer gdn (its layers need megatron-core's "
                                                  "megatron/core/ssm/gated_delta_net) needs megatron-core >= 0.19"])


def _main_outputs(rank, world, cases, load_dir):
    """megatron_zeco.train.main for each argv: its exit status and everything it printed."""
    from megatron_zeco import train as T

    out = {}
    for name, argv in cases.items():
        argv = [a.replace("{load}", load_dir) for a in argv]
        text = io.StringIO()
        code = 0
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            try:
                T.main(["--steps", "2"] + argv)
            except SystemExit as e:
                code = e.code
        out[name] = (code, text.getvalue())
    return out


@pytest.mark.slow
def test_misconfiguration_prints_one_message_from_rank_0_and_exits_2(tmp_path):
    """Each case on 2 real processes: rank 0 prints one ``megatron_zeco.train: error:`` naming the
    flag, rank 1 prints nothing, both exit with status 2, no traceback, no context repeated (megatron-core's
    "when instantiating ..." after a layer's message that names the layer); a checkpoint saved with
    another model refuses to load the same way."""
    # A checkpoint of another model for the last case: hidden 32 instead of 64.
    cases = {name: argv for name, (argv, _) in MISCONFIGURED.items()}
    cases["save hidden 32"] = ["--hidden", "32", "--save", "{load}"]
    cases["load with hidden 64"] = ["--load", "{load}"]
    results = run_ranks(_main_outputs, 2, cases, str(tmp_path))
    expected = {**{name: names for name, (_, names) in MISCONFIGURED.items()},
                "load with hidden 64": ["was saved with --hidden 32 (given 64)"]}
    assert results[0]["save hidden 32"][0] == 0, results[0]["save hidden 32"][1]
    for name, names in expected.items():
        (code0, text0), (code1, text1) = results[0][name], results[1][name]
        assert code0 == code1 == 2, (name, code0, code1, text0)
        assert text0.count("megatron_zeco.train: error:") == 1, (name, text0)
        assert all(n in text0 for n in names), (name, text0)
        assert "Traceback" not in text0 and "when instantiating" not in text0 and text1 == "", (name, text0, text1)


# --- the command and its launcher ------------------------------------------------------------------

def _command(*flags, launcher=("--nproc-per-node", "2")):
    """``python -m megatron_zeco.train`` with ``launcher`` flags (its own, or torchrun's as a prefix): the
    finished process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if launcher[0] == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", *launcher[1:], "-m", "megatron_zeco.train", *flags]
    else:
        cmd = [sys.executable, "-m", "megatron_zeco.train", *launcher, *flags]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_launcher_stops_a_bad_flag_before_any_process_starts():
    """python -m megatron_zeco.train --nproc-per-node 2 --seq-len 50 (the README's command): the job's checks run
    in the launcher, for 2 processes, before any starts: one message, the last line, exit status 2; an unknown
    value likewise, after one line of usage."""
    done = _command("--seq-len", "50")
    message = "megatron_zeco.train: error: --seq-len 50 must be a multiple of 4: the zigzag layout cuts each " \
              "sequence into 4 equal pieces over --cp 2 ranks"
    assert (done.returncode, done.stdout, done.stderr) == (2, "", message + "\n"), done
    done = _command("--mixer", "nope")
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 2 and lines[0].startswith("usage: megatron_zeco.train "), done
    assert lines[1] == "megatron_zeco.train: error: argument --mixer: invalid choice: 'nope' (choose from 'gla', " \
                       "'gdn', 'kda')", done


@pytest.mark.slow
@pytest.mark.megatron  # run under each megatron-core release (.ci/run)
def test_main_job_command_runs():
    """The README's main job (python -m megatron_zeco.train --nproc-per-node 2), a few steps on 2 processes."""
    done = _command("--steps", "3", "--log-interval", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TP 1 x CP 2 x DP 1" in done.stdout and "step     3/3" in done.stdout and "done: 3 steps" in done.stdout


@pytest.mark.slow
def test_launcher_prints_an_error_found_by_the_processes_last_and_once():
    """A misconfiguration only the layers see (a2a over 3 heads at CP 2): the processes start, rank 0 prints
    the message, and nothing follows it (none of torchrun's reports), exit status 2."""
    done = _command("--strategy", "a2a", "--heads", "3", "--hidden", "48")
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert output.count("megatron_zeco.train: error:") == 1 and "Traceback" not in output, output
    assert done.stderr.rstrip().endswith("--context-parallel-size is --cp, --spec megatron_zeco.specs "
                                         "gla_local_spec is --strategy zeco)"), output
    assert "GatedLinearAttention (layer 1): the a2a strategy" in done.stderr.splitlines()[-2], output


@pytest.mark.slow
def test_misconfigured_command_under_torchrun_prints_one_message():
    """torchrun --nproc-per-node 2 -m megatron_zeco.train --seq-len 50: the message from rank 0, no traceback
    through this package, a non-zero exit, and the message again at the end of torchrun's own failure
    report (its root cause: the line a user reads last)."""
    done = _command("--seq-len", "50", launcher=("torchrun", "--nproc-per-node", "2"))
    output = done.stdout + done.stderr
    assert done.returncode != 0
    message = "megatron_zeco.train: error: --seq-len 50 must be a multiple of 4"
    assert done.stderr.startswith(message) or f"\n{message}" in done.stderr, output
    root_cause = output[output.index("Root Cause"):]
    assert message in root_cause, output
    assert "megatron_zeco/train.py" not in output and "Warning" not in output, output


# --- every mixer learns the task ------------------------------------------------------------------

# The recall task made small (2 bindings of 4 keys to 4 values, 24 tokens, 2 layers of hidden 32): the job's
# defaults otherwise (each mixer's initialisation among them), 150 steps on one process (the layers under CP
# compute what they do on one: tests/*/test_layer.py, tests/mcore/). Chance is a loss of
# ln 4 = 1.39, where a model that does not learn the task stays; each mixer is below 0.1 by then.
LEARNING = dict(layers=2, hidden=32, heads=2, seq_len=24, pairs=2, keys=4, values=4, filler=4, steps=150,
                log_interval=10**6)
LEARNED = 0.5  # the mean loss of the last 10 steps must be below this


def _learning(rank, world, mixer):
    from megatron_zeco import train as T

    return [loss for loss, _ in T.train(T.TrainConfig(**LEARNING, mixer=mixer), log=lambda line: None)]


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.parametrize("mixer", [pytest.param("gla", marks=pytest.mark.variant),
                                   pytest.param("kda", marks=pytest.mark.variant),
                                   pytest.param("gdn", marks=needs_hybrid_model)])
def test_every_mixer_learns_the_task(mixer):
    """A layer that stops learning (a gate that cannot open, a wrong initialisation, a term lost) fails here."""
    losses = run_ranks(_learning, 1, mixer)[0]
    final = sum(losses[-10:]) / 10
    assert losses[0] > 1.3 and final < LEARNED, (mixer, losses[0], final, losses[-10:])


# --- save and resume -------------------------------------------------------------------------------

def _resume_runs(rank, world, root):
    """Histories (loss, accuracy per step) of: 6 steps straight at TP 1 x CP 2; 3 steps saved and
    stopped (--exit-interval); resumed at the same layout, at TP 2 x CP 1, at DP 2 x CP 1; plus the
    log lines of the resumed run and of a --load without a checkpoint."""
    from megatron_zeco import train as T

    def run(log=None, **flags):
        lines = []
        history = T.train(T.TrainConfig(**{**TINY, **flags}), log=lines.append)
        return (history, lines) if log else history

    ckpt = os.path.join(root, "ckpt")
    out = {"straight": run(cp=2)}
    out["first"], out["first log"] = run(log=True, cp=2, save=ckpt, exit_interval=3)
    out["resumed"], out["resumed log"] = run(log=True, cp=2, load=ckpt)
    out["tp2"] = run(tp=2, cp=1, load=ckpt)
    out["dp2"] = run(dp=2, cp=1, load=ckpt)
    out["empty"], out["empty log"] = run(log=True, cp=2, steps=1, load=os.path.join(root, "nothing"))
    return out


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    return run_ranks(_resume_runs, 2, str(tmp_path_factory.mktemp("resume")))


@pytest.mark.slow
def test_resumed_run_continues_the_same_losses_exactly(resume_runs):
    """3 steps + save + load + 3 steps == 6 steps straight, to the bit (CPU, CP = 2): model, AdamW
    state, step (so data and learning rate) all come back."""
    for rank, out in enumerate(resume_runs):
        straight, first, resumed = out["straight"], out["first"], out["resumed"]
        assert len(straight) == 6 and len(first) == 3 and len(resumed) == 3
        assert first == straight[:3], (rank, first, straight)
        assert resumed == straight[3:], (rank, resumed, straight)
    log = resume_runs[0]["first log"] + resume_runs[0]["resumed log"]
    assert any(line.startswith("saved step 3 to ") for line in log), log
    assert any(line.startswith("resumed from ") and "step 3, saved at TP 1 x CP 2 x DP 1" in line for line in log)
    assert any(line.startswith("done: 3 steps 4-6 of 6 in ") for line in log), log
    assert resume_runs[1]["first log"] == [], "only rank 0 logs"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_checkpoint_loads_at_another_layout(resume_runs, layout):
    """Saved at TP 1 x CP 2, resumed at TP 2 x CP 1 and at DP 2 x CP 1: the next step's loss (the
    model) and the two after it (the AdamW moments, resharded) as the straight run's, to fp32 rounding."""
    for out in resume_runs:
        for (loss, _), (ref, _) in zip(out[layout], out["straight"][3:], strict=True):
            assert loss == pytest.approx(ref, rel=1e-5, abs=0), (layout, out[layout], out["straight"])


@pytest.mark.slow
def test_load_without_a_checkpoint_starts_from_step_0(resume_runs):
    out = resume_runs[0]
    assert len(out["empty"]) == 1 and out["empty"][0] == out["straight"][0]
    assert any("no checkpoint there; starting from step 0" in line for line in out["empty log"])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", pytest.param("hybrid", marks=[needs_hybrid_model, pytest.mark.megatron])])
def test_command_saves_and_resumes_without_warnings(tmp_path, model):
    """torchrun: 2 steps saved at CP 2 (--exit-interval), resumed at TP 2; no warning in either
    output (megatron-core's Apex/TE notices and torch's deprecations inside its checkpointing are
    filtered; CUDA graph scope set as this megatron-core wants it). GLA and softmax attention layers
    (the softmax layers' K/V all-gather runs backward under CP 2): --model gpt --pattern 'G*' (a
    GPTModel whose layers differ, saved per layer) and, on megatron-core >= 0.19 (CI's second
    pass), --model hybrid 'G-*-' (its only run as a command: the warnings of 0.19, and a
    HybridModel checkpoint resharded to TP 2)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    layers = ["--pattern", "G*"] if model == "gpt" else ["--model", "hybrid", "--hybrid-layer-pattern", "G-*-"]
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "megatron_zeco.train",
            "--steps", "4", "--log-interval", "1", "--hidden", "32", *layers]
    first = subprocess.run(base + ["--save", str(tmp_path), "--exit-interval", "2"], env=env, capture_output=True,
                           text=True, timeout=300)
    second = subprocess.run(base + ["--load", str(tmp_path), "--tp", "2"], env=env, capture_output=True, text=True,
                            timeout=300)
    for done in (first, second):
        assert done.returncode == 0, done.stdout + done.stderr
        assert "Warning" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert "step     2/4" in first.stdout and "step     3/4" not in first.stdout
    assert "resumed from" in second.stdout and "step     3/4" in second.stdout and "done: 2 steps 3-4 of 4" in \
        second.stdout


# --- --model hybrid (megatron-core >= 0.19) --------------------------------------------------------

HYBRID = dict(TINY, model="hybrid", layers=None, hybrid_layer_pattern="G-*-")  # GLA, MLP, softmax, MLP


def _hybrid_runs(rank, world, root):
    """Histories of --model hybrid (G-*-): 6 steps at CP 2 and at CP 1 (DP 2); 3 steps saved at CP 2
    and resumed; and the error of --model gpt loading that checkpoint."""
    from megatron_zeco import train as T

    ckpt = os.path.join(root, "ckpt")
    out = {"cp2": T.train(T.TrainConfig(**HYBRID, cp=2), log=lambda line: None),
           "cp1": T.train(T.TrainConfig(**HYBRID, cp=1, dp=2), log=lambda line: None)}
    out["first"] = T.train(T.TrainConfig(**HYBRID, cp=2, save=ckpt, exit_interval=3), log=lambda line: None)
    out["resumed"] = T.train(T.TrainConfig(**HYBRID, cp=2, load=ckpt), log=lambda line: None)
    try:
        T.train(T.TrainConfig(**TINY, cp=2, load=ckpt), log=lambda line: None)
    except T.ConfigError as e:
        out["gpt error"] = str(e)
    # E layers: megatron-core's MoE router moves its weights to CUDA, which the job refuses on the CPU
    # (check_device); the host stands in for CUDA here, as in tests/mcore/test_hybrid_stack.py.
    moe = dict(HYBRID, hybrid_layer_pattern="G-GE", steps=3)
    with host_as_cuda(), mock.patch("megatron_zeco.training.training.check_device"):
        out["moe cp2"] = T.train(T.TrainConfig(**moe, cp=2), log=lambda line: None)
        out["moe cp1"] = T.train(T.TrainConfig(**moe, cp=1, dp=2), log=lambda line: None)
    return out


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory):
    return run_ranks(_hybrid_runs, 2, str(tmp_path_factory.mktemp("hybrid")))


@pytest.mark.slow
@needs_hybrid_model
@pytest.mark.megatron
def test_hybrid_model_under_cp_trains_as_one_rank(hybrid_runs):
    """--model hybrid 'G-*-': 6 AdamW steps at CP 2 (GLA by ZeCO, softmax attention by its K/V
    all-gather) give CP 1's losses (float32, 1e-5)."""
    for out in hybrid_runs:
        assert len(out["cp2"]) == len(out["cp1"]) == 6
        for (loss, _), (ref, _) in zip(out["cp2"], out["cp1"]):
            assert loss == pytest.approx(ref, rel=1e-5, abs=0), (out["cp2"], out["cp1"])


@pytest.mark.slow
@needs_hybrid_model
@pytest.mark.megatron
def test_hybrid_model_with_experts_under_cp_trains_as_one_rank(hybrid_runs):
    """--model hybrid 'G-GE' (--experts 4, top-2 routing): 3 steps at CP 2 give CP 1's losses
    (float32, 1e-5)."""
    for out in hybrid_runs:
        assert len(out["moe cp2"]) == len(out["moe cp1"]) == 3
        for (loss, _), (ref, _) in zip(out["moe cp2"], out["moe cp1"]):
            assert loss == pytest.approx(ref, rel=1e-5, abs=0), (out["moe cp2"], out["moe cp1"])


@pytest.mark.slow
@needs_hybrid_model
@pytest.mark.megatron
def test_hybrid_model_resumes_the_same_losses_and_refuses_the_other_model(hybrid_runs):
    """3 steps + save + load + 3 steps == 6 steps straight, to the bit (HybridModel's
    sharded_state_dict through dist checkpointing); --model gpt refuses the checkpoint."""
    for out in hybrid_runs:
        assert out["first"] == out["cp2"][:3] and out["resumed"] == out["cp2"][3:], out
        assert "was saved with --model hybrid (given gpt)" in out["gpt error"], out["gpt error"]


# --- --mixer gdn (megatron-core >= 0.19) ------------------------------------------------------------

GDN = dict(TINY, mixer="gdn")


def _gdn_runs(rank, world, root):
    """Histories of --mixer gdn: 6 steps at CP 2 (zeco, lasp2, a2a) and at CP 1 (DP 2); 3 steps saved at CP 2
    and resumed; 3 steps of --model hybrid 'G-*-' at CP 2 and CP 1."""
    from megatron_zeco import train as T

    def run(**flags):
        return T.train(T.TrainConfig(**{**GDN, **flags}), log=lambda line: None)

    ckpt = os.path.join(root, "ckpt")
    out = {"zeco": run(cp=2), "cp1": run(cp=1, dp=2), "lasp2": run(cp=2, strategy="lasp2"),
           "a2a": run(cp=2, strategy="a2a")}
    out["first"] = run(cp=2, save=ckpt, exit_interval=3)
    out["resumed"] = run(cp=2, load=ckpt)
    hybrid = dict(model="hybrid", layers=None, hybrid_layer_pattern="G-*-", steps=3)
    out["hybrid cp2"], out["hybrid cp1"] = run(cp=2, **hybrid), run(cp=1, dp=2, **hybrid)
    return out


@pytest.mark.slow
@needs_hybrid_model
@pytest.mark.megatron
def test_gated_deltanet_job_trains_as_one_rank_under_every_strategy_and_resumes(tmp_path):
    """--mixer gdn at CP 2, by zeco, lasp2 and a2a, GPTModel and HybridModel: CP 1's losses (float32, 1e-5);
    3 steps + save + load + 3 steps == 6 steps straight, to the bit."""
    for out in run_ranks(_gdn_runs, 2, str(tmp_path)):
        for name, ref in (("zeco", "cp1"), ("lasp2", "cp1"), ("a2a", "cp1"), ("hybrid cp2", "hybrid cp1")):
            assert len(out[name]) == len(out[ref]) > 0, name
            for (loss, _), (want, _) in zip(out[name], out[ref]):
                assert loss == pytest.approx(want, rel=1e-5, abs=0), (name, out[name], out[ref])
        assert out["first"] == out["zeco"][:3] and out["resumed"] == out["zeco"][3:], out


# --- a stalled rank --------------------------------------------------------------------------------

def _stalled_job(rank, world, root):
    """The job over peer memory with ``--stall 1:3:8`` (rank 1 away for 8 s before step 3's forward pass)
    and a 2 s bound on the scans' waits, saving after every step: its exit status, what it printed to
    stderr, and the checkpoints left."""
    from megatron_zeco import train as T

    os.environ["MEGATRON_ZECO_SCAN_TIMEOUT"] = "2"
    save = os.path.join(root, "ckpt")
    err, code = io.StringIO(), 0
    with contextlib.redirect_stderr(err):
        try:
            T.main(["--layers", "1", "--hidden", "16", "--heads", "2", "--seq-len", "24", "--batch", "2",
                    "--steps", "4", "--transport", "peer_memory", "--save", save, "--save-interval", "1",
                    "--stall", "1:3:8"])
        except SystemExit as e:
            code = e.code
    return code, err.getvalue(), sorted(os.listdir(save))


@pytest.mark.slow
def test_a_rank_stalled_mid_run_stops_the_job_before_the_step_is_applied(tmp_path):
    """Every rank, the stalled one when it comes back included, stops at step 3 with ScanTimeoutError
    naming a layer's scan and the peer, exit status 1; steps 1 and 2 were saved, step 3 was not."""
    for rank, (code, text, saved) in enumerate(run_ranks(_stalled_job, 3, str(tmp_path), timeout=600)):
        assert code == 1, (rank, code, text)
        assert f"error on global rank {rank}: ScanTimeoutError" in text and "All-Scan" in text, (rank, text)
        assert "Traceback" not in text, (rank, text)
        assert "iter_0000002" in saved and "iter_0000003" not in saved, (rank, saved)
