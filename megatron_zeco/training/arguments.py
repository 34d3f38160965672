"""The main job's flags: TrainConfig (a field per flag), the parser, the checks that resolve a
configuration for a world size, and the start-up errors that name this job's flags (Megatron-LM's
megatron/training/arguments.py)."""

import argparse
import importlib.metadata
import importlib.util
import os
import re
import typing
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import mixers
from ..comm import Layout, as_layout
from ..comm.transport import CHOICES as TRANSPORTS
from ..cp import registry
from ..cp.config import RULES, CPConfig
from ..recall import RecallTask

PROG = "megatron_zeco.train"
DESCRIPTION = ("The main job: train a small GLA, Gated DeltaNet or KDA model (megatron-core) with ZeCO context "
               "parallelism.")
EXAMPLES = """\
    python -m megatron_zeco.train --nproc-per-node 4                   # CPU, gloo, CP = 4
    python -m megatron_zeco.train --nproc-per-node 4 --mixer kda       # Kimi Delta Attention layers
    python -m megatron_zeco.train --nproc-per-node 4 --mixer gdn       # Gated DeltaNet (megatron-core >= 0.19)
    python -m megatron_zeco.train --nproc-per-node 8 --tp 2            # TP 2 x CP 4
    python -m megatron_zeco.train --nproc-per-node 4 --pattern 'G*'    # every 2nd layer softmax attention
    python -m megatron_zeco.train --nproc-per-node 4 --model hybrid    # HybridModel 'G-G-' (megatron-core >= 0.19)
    python -m megatron_zeco.train --nproc-per-node 4 --save ckpt --load ckpt   # save, and resume if saved
    torchrun --nproc-per-node 4 -m megatron_zeco.train                 # the same processes, started by torchrun
"""
SEQ_LEN = 64  # --seq-len's default, rounded up to what the CP layout cuts evenly
GPT_LAYERS = 2  # --layers' default for --model gpt (--model hybrid takes the pattern's length)
# --hybrid-layer-pattern's symbols this job builds (Megatron-LM's): the hybrid stack's slots of
# megatron_zeco.specs.hybrid_stack_spec without TransformerEngine.
HYBRID_SYMBOLS = {"G": "the --mixer layer", "*": "softmax attention", "-": "MLP", "E": "mixture of experts"}
# Where megatron-core has HybridModel (megatron/core/models/hybrid/, from 0.19 on) and Gated DeltaNet (0.19 too;
# the gdn mixer's registered path): looked up on the path, so that the flags are checked before megatron-core is
# imported (seconds).
HYBRID_PATH = "core/models/hybrid"
GDN_PATH = registry.mixer("gdn").megatron_core_path


def _flag(default, group: str, help: str, shown: Optional[str] = None, aliases=(), **argparse_kwargs):
    """A TrainConfig field and its command-line flag: its group in --help, what it does, its default
    as --help shows it (``shown``; else the value itself), and other spellings of the flag (``aliases``:
    Megatron-LM's, where it has one)."""
    return field(default=default, metadata=dict(group=group, help=help, shown=shown, aliases=aliases,
                                                argparse=argparse_kwargs))


PARALLEL, MODEL, TASK, OPTIM, CKPT, LOGGING, FAULTS = (
    "parallelism", "model", "task", "optimisation", "checkpointing", "logging", "fault injection (testing)")


@dataclass
class TrainConfig:
    # -- parallelism
    nproc_per_node: Optional[int] = _flag(None, PARALLEL, "start this many processes on this machine, one per rank, "
                                          "as torchrun --nproc-per-node does, once the flags are checked: a bad one "
                                          "stops the job here, before any process starts (under torchrun leave it "
                                          "out)", shown="this process alone, or torchrun's processes", metavar="N")
    tp: int = _flag(1, PARALLEL, "tensor-parallel size: each layer's heads and the vocabulary split over this "
                                 "many ranks")
    cp: Optional[int] = _flag(None, PARALLEL, "context-parallel size: each sequence split over this many ranks",
                              shown="the processes / (--tp x --dp)")
    dp: int = _flag(1, PARALLEL, "data-parallel size: each step's sequences split over this many model replicas")
    strategy: str = _flag("zeco", PARALLEL, "how the recurrent state crosses the CP ranks: zeco (All-Scan, one "
                          "state per rank), lasp2 (all-gather of the states), lasp1 (ring; gla only), a2a "
                          "(all-to-all of heads)", metavar="{" + ",".join(RULES["gla"].strategies) + "}")
    layout: str = _flag("zigzag", PARALLEL, "how a sequence is cut over the CP ranks: zigzag (Megatron's "
                        "load-balanced split into 2 x CP pieces) or contiguous (CP pieces)",
                        metavar="{" + ",".join(m.value for m in Layout) + "}")
    num_blocks: int = _flag(1, PARALLEL, "All-Scan pipeline blocks: the state is sent in this many blocks of "
                            "rows (a divisor of the head dim, --hidden / --heads)")
    transport: str = _flag("auto", PARALLEL, "how All-Scan moves the states (--strategy zeco): send_recv (the CP "
                           "group's messages: NCCL, gloo), peer_memory (stores into the peers' GPU memory, one node; "
                           "on the CPU only under TRITON_INTERPRET=1, for tests), nvshmem, or auto: peer memory "
                           "between the GPUs of one node, else send_recv",
                           metavar="{" + ",".join(TRANSPORTS) + "}")
    piece_split: Optional[int] = _flag(None, PARALLEL, "--mixer gla: run each CP piece as this many batched "
                                       "sub-pieces (zeco and lasp2; exact; --seq-len must then divide into them)",
                                       shown="chosen by the op: 2 for zeco with the contiguous layout, else 1")
    device: str = _flag("auto", PARALLEL, "cuda (NCCL, one GPU per process), cpu (gloo), or auto: cuda when "
                        "torch sees a GPU", choices=["auto", "cpu", "cuda"])
    # -- model
    model: str = _flag("gpt", MODEL, "gpt: megatron-core's GPTModel, layers by --pattern (deprecated in "
                       "megatron-core 0.19, which says so at start-up); hybrid: megatron-core's HybridModel, the "
                       "current Megatron model (megatron-core >= 0.19), layers by --hybrid-layer-pattern",
                       choices=["gpt", "hybrid"])
    mixer: str = _flag("gla", MODEL, "the token mixer of the G layers: gla (gated linear attention), gdn "
                       "(megatron-core's Gated DeltaNet: the gated delta rule, a short convolution; megatron-core "
                       ">= 0.19) or kda (Kimi Delta Attention: the gated delta rule with a forget gate per key "
                       "channel, a short convolution)", choices=mixers.OPERATORS)
    conv_init: Optional[str] = _flag(None, MODEL, "--mixer gdn and kda: the short convolution's initial taps: "
                                     "identity (each channel starts passing its own token on: the layer starts as "
                                     "without the convolution and learns its taps) or uniform (nn.Conv1d's, as fla's "
                                     "and Megatron's layers draw them: uniform in +-1/2 for 4 taps)",
                                     shown="identity for gdn and kda; gla has no convolution",
                                     choices=["identity", "uniform"])
    gate_init: str = _flag("timescales", MODEL, "how the forget gates start: timescales (memories from one token to "
                           "four sequence lengths: spread over the key channels for gla and kda, over the heads for "
                           "gdn) or layer (the layer's own initialisation: fla's zero gate bias for gla, fla's KDA "
                           "models' for kda, Megatron's GatedDeltaNet's for gdn)", choices=["timescales", "layer"])
    pattern: str = _flag("G", MODEL, "--model gpt: layer kinds, repeated over the depth: G = the --mixer layer, "
                         "* = causal softmax attention ('G*': every second layer softmax)")
    hybrid_layer_pattern: str = _flag("G-G-", MODEL, "--model hybrid: one layer per symbol, as Megatron-LM's "
                                      "flag: G = the --mixer layer, * = causal softmax attention, - = MLP, E = "
                                      "mixture of experts (needs a GPU); the GPTModel pattern 'G*' is 'G-*-' here")
    experts: int = _flag(4, MODEL, "--model hybrid: experts of each E layer (Megatron's router: top-2, no "
                         "auxiliary loss)")
    position_embedding: str = _flag("none", MODEL, "rope: rotary embeddings in the softmax layers (the G layers "
                                    "carry no positions)", choices=["none", "rope"])
    layers: Optional[int] = _flag(None, MODEL, "--model gpt: transformer layers; --model hybrid: the number of "
                                  "symbols in --hybrid-layer-pattern, which it must equal",
                                  shown=f"{GPT_LAYERS} for gpt; for hybrid the pattern's length")
    hidden: int = _flag(64, MODEL, "hidden size (a multiple of --heads)")
    heads: int = _flag(4, MODEL, "attention heads per layer (a multiple of --tp; for a2a, of --tp x --cp)")
    dtype: str = _flag("float32", MODEL, "parameters and activations; float64 for exactness checks",
                       choices=["float32", "float64"])
    init_std: float = _flag(0.1, MODEL, "standard deviation of the initial weights (~ hidden ** -0.5; "
                            "Megatron's 0.02 is tuned for wide models)")
    # -- task
    task: str = _flag("recall", TASK, "recall: multi-query associative recall, loss on the answers only; "
                      "mock: the same random tokens, loss on every token", choices=["recall", "mock"])
    seq_len: Optional[int] = _flag(None, TASK, "tokens per sequence (a multiple of the pieces --layout cuts it "
                                   "into: 2 x --cp for zigzag, --cp for contiguous, times --piece-split)",
                                   shown=f"{SEQ_LEN}, rounded up to such a multiple")
    batch: int = _flag(16, TASK, "sequences per step over all data-parallel ranks (a multiple of --dp)")
    pairs: int = _flag(4, TASK, "key/value bindings per sequence (at most --keys)")
    keys: int = _flag(8, TASK, "distinct keys")
    values: int = _flag(8, TASK, "distinct values (chance accuracy is 1 / --values)")
    filler: int = _flag(8, TASK, "distinct filler tokens between the bindings and the questions")
    seed: int = _flag(1234, TASK, "initial weights and data: step s trains on a batch drawn from a generator "
                      "seeded with --seed and s")
    # -- optimisation
    steps: int = _flag(500, OPTIM, "training steps (the learning-rate schedule spans them); --train-iters, as "
                       "Megatron-LM spells it, is the same flag", aliases=("--train-iters",))
    lr: float = _flag(3e-3, OPTIM, "peak learning rate of AdamW: linear warm-up over 5%% of the steps, then "
                      "cosine decay to a tenth")
    clip_grad: float = _flag(1.0, OPTIM, "clip the global gradient norm to this (0: no clipping)")
    deterministic: bool = _flag(False, OPTIM, "Megatron's deterministic mode (deterministic_mode and torch's "
                                "deterministic algorithms): two runs give bit-identical losses", shown="off")
    # -- checkpointing
    save: Optional[str] = _flag(None, CKPT, "save Megatron-Core distributed checkpoints (model, optimizer, step, "
                                "schedule) under this directory, as DIR/iter_NNNNNNN: every --save-interval "
                                "steps and at the end", shown="no saving", metavar="DIR")
    load: Optional[str] = _flag(None, CKPT, "resume from the newest checkpoint under this directory (or from "
                                "this checkpoint directory), at any --tp, --cp, --dp; with none there, start "
                                "from step 0", shown="start from step 0", metavar="DIR")
    save_interval: int = _flag(0, CKPT, "with --save: also save every this many steps (0: only at the end)")
    exit_interval: int = _flag(0, CKPT, "stop after a step that is a multiple of this, saving first if --save "
                               "is given (as Megatron-LM's --exit-interval; 0: run all --steps)")
    # -- logging
    log_interval: int = _flag(50, LOGGING, "print loss, accuracy, gradient norm, learning rate and tokens/s "
                              "every this many steps")
    # -- fault injection (testing)
    stall: Optional[str] = _flag(None, FAULTS, "global rank RANK sleeps SECONDS before the forward pass of step "
                                 "STEP, as a peer that hangs and comes back would: with --transport peer_memory or "
                                 "nvshmem the scans waiting on it give up after $MEGATRON_ZECO_SCAN_TIMEOUT s, and "
                                 "the job stops before that step's optimizer step, naming the scan and the peer",
                                 shown="none", metavar="RANK:STEP:SECONDS")


DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}


class _Parser(argparse.ArgumentParser):
    """Prints (help, usage, errors) on the first process only: torchrun starts one per rank."""

    def _print_message(self, message, file=None):
        if launch_rank() == 0:
            super()._print_message(message, file)

    def error(self, message):
        """The message, after one line of usage (``--help`` lists every flag)."""
        self.exit(2, f"usage: {self.prog} [--nproc-per-node N] [--FLAG VALUE ...] (--help lists the flags)\n"
                     f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog="examples:\n" + EXAMPLES.rstrip("\n"))
    groups = {}
    for f in fields(TrainConfig):
        meta = f.metadata
        group = groups.get(meta["group"]) or groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        shown = meta["shown"] if meta["shown"] is not None else "%(default)s"
        kwargs = dict(default=f.default, help=f"{meta['help']} (default: {shown})", **meta["argparse"])
        kind = next((t for t in typing.get_args(f.type) if t is not type(None)), f.type)  # Optional[X] -> X
        if kind is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = kind
        group.add_argument("--" + f.name.replace("_", "-"), *meta["aliases"], **kwargs)
    return parser


def parse_args(argv=None) -> TrainConfig:
    return TrainConfig(**vars(build_parser().parse_args(argv)))


def to_argv(cfg: TrainConfig) -> List[str]:
    """The flags that give ``cfg`` back through :func:`parse_args` (those away from their defaults),
    ``--nproc-per-node`` left out: what :func:`launch` passes its processes."""
    argv = []
    for f in fields(TrainConfig):
        value = getattr(cfg, f.name)
        if f.name == "nproc_per_node" or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


class ConfigError(ValueError):
    """A misconfiguration found while the job starts; the message names the flag to change."""


def resolve(cfg: TrainConfig, world: int) -> List[str]:
    """Fill in what depends on the number of processes (``cp``, ``seq_len``) and check the flags
    against each other; ValueError naming the flag to change. Returns lines for the log."""
    notes = resolve_model(cfg)
    resolve_mixer(cfg)
    config = cp_config(cfg)  # the CP knobs' own checks, as every entry point runs them
    for name in ("tp", "dp", "layers", "hidden", "heads", "batch", "steps", "log_interval", "pairs", "keys",
                 "values", "filler"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    for name in ("save_interval", "exit_interval"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(cfg, name)}")
    if cfg.cp is None:
        if world % (cfg.tp * cfg.dp):
            raise ValueError(f"--tp {cfg.tp} x --dp {cfg.dp} must divide the number of processes ({world}): "
                             f"--cp takes the rest")
        cfg.cp = world // (cfg.tp * cfg.dp)
    if cfg.cp < 1 or cfg.tp * cfg.cp * cfg.dp != world:
        raise ValueError(f"--tp {cfg.tp} x --cp {cfg.cp} x --dp {cfg.dp} must equal the number of processes ({world})")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no GPU here; use --device cpu (or auto)")
    if cfg.hidden % cfg.heads:
        raise ValueError(f"--hidden {cfg.hidden} must be a multiple of --heads {cfg.heads}: each head gets "
                         f"hidden / heads channels")
    split = cfg.piece_split or 1
    pieces = as_layout(cfg.layout).num_pieces(cfg.cp) * split if cfg.cp > 1 else 1
    why = f"the {cfg.layout} layout cuts each sequence into {pieces} equal pieces over --cp {cfg.cp} ranks" \
        + (f" (x --piece-split {split})" if split > 1 else "")
    if cfg.seq_len is None:
        cfg.seq_len = -(-SEQ_LEN // pieces) * pieces
        if cfg.seq_len != SEQ_LEN:
            notes.append(f"--seq-len {cfg.seq_len}: the default {SEQ_LEN} rounded up to a multiple of {pieces} "
                         f"({why})")
    elif cfg.seq_len % pieces:
        raise ValueError(f"--seq-len {cfg.seq_len} must be a multiple of {pieces}: {why}")
    if cfg.batch % cfg.dp:
        raise ValueError(f"--batch {cfg.batch} must be divisible by --dp {cfg.dp}")
    if cfg.save_interval and not cfg.save:
        raise ValueError("--save-interval needs --save DIR")
    try:
        config.check_dims(cfg.hidden // cfg.heads, cfg.hidden // cfg.heads)  # the pipeline blocks
    except ValueError as e:
        raise ValueError(f"{e} (a head's dim is --hidden {cfg.hidden} / --heads {cfg.heads})") from None
    try:
        make_task(cfg)  # the recall task's sizes
    except ValueError as e:
        raise ValueError(f"{e} (--pairs {cfg.pairs}, --keys {cfg.keys}, --seq-len {cfg.seq_len})") from None
    stall_of(cfg)
    return notes


def stall_of(cfg: TrainConfig):
    """``--stall RANK:STEP:SECONDS`` as ``(rank, step, seconds)``, or None; ValueError if malformed."""
    if cfg.stall is None:
        return None
    try:
        rank, step, seconds = cfg.stall.split(":")
        rank, step, seconds = int(rank), int(step), float(seconds)
    except ValueError:
        rank = None
    if rank is None or rank < 0 or step < 1 or not seconds >= 0:
        raise ValueError(f"--stall {cfg.stall!r} must be RANK:STEP:SECONDS (a global rank, a step from 1, "
                         f"seconds), e.g. 1:3:10")
    return rank, step, seconds


def megatron_core_has(path: str) -> bool:
    """Whether the megatron-core that ``import megatron`` finds has ``megatron/<path>`` (a package), looked
    up without importing it."""
    spec = importlib.util.find_spec("megatron")
    return spec is not None and any(os.path.isdir(os.path.join(root, path))
                                    for root in spec.submodule_search_locations or ())


def have_hybrid_model() -> bool:
    """Whether this megatron-core has HybridModel (megatron.core.models.hybrid, from 0.19 on)."""
    return megatron_core_has(HYBRID_PATH)


def _needs_megatron_core_019(what: str, instead: str) -> ValueError:
    return ValueError(f"{what} needs megatron-core >= 0.19 (0.19.2 is tested), and this is megatron-core "
                      f"{importlib.metadata.version('megatron-core')}: pip install 'megatron-core>=0.19.2' (its wheels "
                      f"need Python >= 3.12; docs/main-job.md unpacks one on 3.11), or {instead}")


def resolve_mixer(cfg: TrainConfig) -> None:
    """Check ``--mixer`` against this megatron-core and ``--conv-init`` against the mixer, filling in the
    latter's default; ValueError naming the flag to change."""
    if cfg.mixer not in mixers.OPERATORS:
        raise ValueError(f"--mixer must be one of {', '.join(mixers.OPERATORS)}, got {cfg.mixer!r}")
    mixer = registry.mixer(cfg.mixer)
    if mixer.megatron_core_path is not None and not megatron_core_has(mixer.megatron_core_path):
        others = " or ".join(m for m, other in registry.mixers().items() if other.megatron_core_path is None)
        raise _needs_megatron_core_019(f"--mixer {cfg.mixer} (its layers need megatron-core's "
                                       f"megatron/{mixer.megatron_core_path})", f"use --mixer {others}")
    if "conv_init" in mixers.KNOBS[cfg.mixer]:
        cfg.conv_init = cfg.conv_init or "identity"
    elif cfg.conv_init is not None:
        having = " and ".join(m for m, knobs in mixers.KNOBS.items() if "conv_init" in knobs)
        raise ValueError(f"--conv-init applies to --mixer {having} (their short convolutions); "
                         f"{mixers.NAMES[cfg.mixer]} has none: drop it")


def resolve_model(cfg: TrainConfig) -> List[str]:
    """Check ``--model`` and its pattern flag; fill in ``--layers`` (for hybrid, the pattern's
    length). ValueError naming the flag to change; returns lines for the log."""
    if cfg.model == "gpt":
        if cfg.hybrid_layer_pattern != DEFAULTS["hybrid_layer_pattern"]:
            raise ValueError("--hybrid-layer-pattern is for --model hybrid; --model gpt takes --pattern "
                             "(G the --mixer layer, * softmax attention), e.g. --pattern 'G*' for 'G-*-'")
        if cfg.layers is None:
            cfg.layers = GPT_LAYERS
        return []
    if cfg.model != "hybrid":
        raise ValueError(f"--model must be gpt or hybrid, got {cfg.model!r}")
    if not have_hybrid_model():
        raise _needs_megatron_core_019("--model hybrid (megatron-core's HybridModel)", "use --model gpt")
    pattern = cfg.hybrid_layer_pattern
    if cfg.pattern != DEFAULTS["pattern"]:
        raise ValueError("--pattern is for --model gpt; --model hybrid takes --hybrid-layer-pattern, one layer per "
                         "symbol (--pattern 'G*' is --hybrid-layer-pattern 'G-*-')")
    if "|" in pattern:
        raise ValueError(f"--hybrid-layer-pattern {pattern!r}: '|' separates pipeline stages, and this job runs one "
                         f"stage (no pipeline parallelism); drop the '|'")
    unknown = sorted(set(pattern) - set(HYBRID_SYMBOLS))
    if not pattern or unknown:
        offered = ", ".join(f"{s!r} ({name})" for s, name in HYBRID_SYMBOLS.items())
        raise ValueError(f"--hybrid-layer-pattern {pattern!r}: " + (f"no layer for {', '.join(map(repr, unknown))}; "
                         if unknown else "no layers; ") + f"its symbols are {offered}, e.g. 'G-G-G-*-'")
    if "E" in pattern and cfg.experts < 2:
        raise ValueError(f"--experts {cfg.experts}: an E layer routes each token to 2 experts; give at least 2")
    if "E" in pattern and cfg.tp > 1:
        raise ValueError(f"--hybrid-layer-pattern {pattern!r} with --tp {cfg.tp}: megatron-core runs MoE under tensor "
                         f"parallelism only with sequence parallelism, which this job does not use; use --tp 1")
    if cfg.layers is None:
        cfg.layers = len(pattern)
        return [f"--layers {cfg.layers}: the layer count of --hybrid-layer-pattern {pattern!r} (one layer per "
                f"symbol)"]
    if cfg.layers != len(pattern):
        raise ValueError(f"--layers {cfg.layers} must equal the {len(pattern)} layers of --hybrid-layer-pattern "
                         f"{pattern!r} (one per symbol); leave --layers out to take the pattern's")
    return []


def check_device(cfg: TrainConfig):
    """ValueError for what megatron-core cannot run on the chosen device. (Tests that train RoPE
    models on the CPU let the host stand in for CUDA: tests/helpers/megatron.py; the job does not.)"""
    if cfg.position_embedding == "rope" and not uses_cuda(cfg):
        raise ValueError("--position-embedding rope needs a GPU: megatron-core's rotary embeddings move their "
                         "tables to CUDA; on the CPU use --position-embedding none")
    if cfg.model == "hybrid" and "E" in cfg.hybrid_layer_pattern and not uses_cuda(cfg):
        raise ValueError(f"--hybrid-layer-pattern {cfg.hybrid_layer_pattern!r}: E (mixture of experts) needs a GPU: "
                         f"megatron-core's MoE router moves its weights to CUDA; on the CPU use - (MLP) layers")


def uses_cuda(cfg: TrainConfig) -> bool:
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


# --- start-up errors ------------------------------------------------------------------------------

# Flags of Megatron-LM (and spec arguments) that the layer's and megatron-core's errors name, and
# this job's flag for each.
_JOB_FLAGS = {
    "--num-attention-heads": "--heads", "num_attention_heads": "--heads",
    "--tensor-model-parallel-size": "--tp", "tensor_model_parallel_size": "--tp",
    "--context-parallel-size": "--cp", "--seq-length": "--seq-len", "--hidden-size": "--hidden",
    "hidden_size": "--hidden", "--num-layers": "--layers", "--kv-channels": "--hidden / --heads",
    "--num-experts": "--experts",
    "cp_strategy": "--strategy", "cp_layout": "--layout", "cp_num_blocks": "--num-blocks",
    "cp_piece_split": "--piece-split", "cp_transport": "--transport", "cp_overlap_scan": "(no flag)",
    "--position-embedding-type": "--position-embedding",
    "--linear-num-key-heads": "--heads", "--linear-num-value-heads": "--heads",
    "--linear-key-head-dim": "--hidden / --heads", "--linear-value-head-dim": "--hidden / --heads",
    "--spec megatron_zeco.specs gla_local_spec": "--strategy zeco",
    "--spec megatron_zeco.specs kda_hybrid_stack_local_spec": "--strategy zeco",
    "--spec megatron_zeco.specs gdn_hybrid_stack_local_spec": "--strategy zeco",
}


# megatron-core's build_module appends " when instantiating <module>" to an error at each level of a spec.
_INSTANTIATING = re.compile(r"(?: when instantiating \w+)+$")


def _without_repeated_context(message: str) -> str:
    """``message`` without megatron-core's " when instantiating ..." suffixes where it names the innermost
    module already (this package's layers' errors start with it)."""
    found = _INSTANTIATING.search(message)
    if found and found.group(0).split(" when instantiating ")[1] in message[:found.start()]:
        return message[:found.start()]
    return message


@contextmanager
def startup_errors():
    """A ValueError inside (this job's checks, the layer's ``_check_config``, megatron-core's
    TransformerConfig, the CP input checks of the first step, a checkpoint that does not fit)
    becomes a ConfigError whose message also names this job's flags."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as e:
        message = _without_repeated_context(str(e))
        named = [f"{theirs} is {ours}" for theirs, ours in _JOB_FLAGS.items() if theirs in message]
        raise ConfigError(message + (f"\n  (flags of this job: {', '.join(named)})" if named else "")) from e


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def launch_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def cp_config(cfg: TrainConfig) -> CPConfig:
    """The G layers' context parallelism from the job's flags (ValueError naming the bad knob)."""
    knobs = dict(strategy=cfg.strategy, layout=cfg.layout, num_blocks=cfg.num_blocks, transport=cfg.transport)
    operator = mixers.OPERATORS[cfg.mixer]
    if RULES[operator].applies("piece_split"):
        knobs["piece_split"] = cfg.piece_split
    elif cfg.piece_split is not None:
        having = " and ".join(m for m, op in mixers.OPERATORS.items() if RULES[op].applies("piece_split"))
        raise ValueError(f"--piece-split applies to --mixer {having} only; drop it for --mixer {cfg.mixer}")
    return CPConfig(operator=operator, **knobs)


def make_task(cfg: TrainConfig) -> RecallTask:
    return RecallTask(seq_len=cfg.seq_len, num_pairs=cfg.pairs, num_keys=cfg.keys, num_values=cfg.values,
                      num_filler=cfg.filler)
