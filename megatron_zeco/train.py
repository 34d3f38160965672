"""The main job: train a small GLA, Gated DeltaNet or KDA model (megatron-core) with ZeCO context parallelism.

    python -m megatron_zeco.train --nproc-per-node 4                   # CPU, gloo, CP = 4
    python -m megatron_zeco.train --nproc-per-node 4 --mixer kda       # Kimi Delta Attention layers
    python -m megatron_zeco.train --nproc-per-node 4 --mixer gdn       # Gated DeltaNet (megatron-core >= 0.19)
    python -m megatron_zeco.train --nproc-per-node 8 --tp 2            # TP 2 x CP 4
    python -m megatron_zeco.train --nproc-per-node 4 --pattern 'G*'    # every 2nd layer softmax attention
    python -m megatron_zeco.train --nproc-per-node 4 --model hybrid    # HybridModel 'G-G-' (megatron-core >= 0.19)
    python -m megatron_zeco.train --nproc-per-node 4 --save ckpt --load ckpt   # save, and resume if saved
    torchrun --nproc-per-node 4 -m megatron_zeco.train                 # the same processes, started by torchrun

Uses megatron-core directly (parallel_state, GPTModel or HybridModel, the specs of this package,
dist_checkpointing); gradients of the parameters, replicated over data and context parallel
ranks, are summed over that group as Megatron's DDP does. Runs on GPUs with NCCL when torch
sees them (``--device auto``). ``--nproc-per-node`` checks the flags before it starts the processes
(torchrun's launcher, ``torch.distributed.run``): a bad flag stops the job in seconds, its message the
last line. Prints loss, recall accuracy, tokens/s and the CP strategy every ``--log-interval`` steps,
and a summary at the end. Flags, save/resume: docs/main-job.md.
"""

import argparse
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import re
import sys
import time
import typing
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import checkpoint, mixers
from .comm import Layout, ScanTimeoutError, as_layout, check_scans
from .comm.transport import CHOICES as TRANSPORTS
from .cp import registry
from .cp.config import RULES, CPConfig
from .mcore import hide_optional_package_notices
from .recall import RecallTask

PROG = "megatron_zeco.train"
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


_DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}


class _Parser(argparse.ArgumentParser):
    """Prints (help, usage, errors) on the first process only: torchrun starts one per rank."""

    def _print_message(self, message, file=None):
        if _launch_rank() == 0:
            super()._print_message(message, file)

    def error(self, message):
        """The message, after one line of usage (``--help`` lists every flag)."""
        self.exit(2, f"usage: {self.prog} [--nproc-per-node N] [--FLAG VALUE ...] (--help lists the flags)\n"
                     f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog="examples:\n" + "\n".join(__doc__.split("\n\n")[1].splitlines()))
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
        if cfg.hybrid_layer_pattern != _DEFAULTS["hybrid_layer_pattern"]:
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
    if cfg.pattern != _DEFAULTS["pattern"]:
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


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def _launch_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def uses_cuda(cfg: TrainConfig) -> bool:
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def init_distributed(cfg: TrainConfig, log=None):
    """Check and complete ``cfg`` (:func:`resolve`; ``log`` gets its notes on rank 0), then the
    process group (from torchrun's environment; one process without it) and Megatron's
    model-parallel groups. Returns the device."""
    notes = resolve(cfg, _world_size())  # before megatron-core is imported: a bad flag stops in seconds
    from megatron.core import parallel_state

    use_cuda = uses_cuda(cfg)
    if cfg.deterministic:
        # As Megatron-LM's --deterministic-mode (megatron/training/determinism.py); NCCL and cuBLAS
        # read these once, at their start.
        os.environ.setdefault("NCCL_ALGO", "Ring")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if not dist.is_initialized():
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl" if use_cuda else "gloo"
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:  # python -m megatron_zeco.train: one process
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if log is not None and dist.get_rank() == 0:
        for note in notes:
            log(note)
    parallel_state.initialize_model_parallel(cfg.tp, 1, context_parallel_size=cfg.cp)
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def transformer_config(cfg: TrainConfig):
    """The model's TransformerConfig (Megatron's own checks of the sizes run here)."""
    from megatron.core.transformer import TransformerConfig

    # CUDA graphs are off; say so in the form this megatron-core takes (its default, "full", is deprecated).
    names = {f.name for f in fields(TransformerConfig)}
    graphs = dict(cuda_graph_modules=[]) if "cuda_graph_modules" in names else dict(cuda_graph_scope=[])
    # HybridModel's E layers: Megatron's router defaults (top-2, no auxiliary loss), experts the size
    # of the MLP layers (said, or megatron-core warns). Linears without biases, as Megatron's MoE models
    # train (--disable-bias-linear): its local experts' forward adds an expert's bias in place to a
    # view of autograd's and fails.
    moe = {}
    if cfg.model == "hybrid" and "E" in cfg.hybrid_layer_pattern:
        moe = dict(num_moe_experts=cfg.experts, moe_ffn_hidden_size=4 * cfg.hidden, add_bias_linear=False)
    # What the mixer's layers need of the config beyond the model's size (Gated DeltaNet: its heads, its SiLU).
    mixer_fields = registry.mixer(cfg.mixer).transformer_config_fields(cfg.hidden, cfg.heads)
    # A GPTModel's checkpoint stacks each layer tensor of its block along a layer axis, which needs every
    # layer to hold the same tensors; GLA and softmax layers (--pattern 'G*') do not (without this the
    # save fails megatron-core's sharding check), so they are saved per layer, as HybridModel's always
    # are. ('hetereogenous' is megatron-core's spelling, in 0.16 and 0.19 alike.)
    mixed = cfg.model == "gpt" and len(set(cfg.pattern)) > 1
    return TransformerConfig(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
        tensor_model_parallel_size=cfg.tp, context_parallel_size=cfg.cp,
        use_cpu_initialization=True, params_dtype=getattr(torch, cfg.dtype),
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=cfg.init_std,
        deterministic_mode=cfg.deterministic, hetereogenous_dist_checkpoint=mixed, **graphs, **moe, **mixer_fields,
    )


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


def _mixer_knobs(cfg: TrainConfig) -> dict:
    """The G layers' arguments (megatron_zeco.specs) from the job's flags, for either model: the CP knobs and
    the initialisation knobs the mixer has (mixers.KNOBS): the gates' memories (--gate-init: from one token to
    four sequence lengths, or the layer's own), the convolution's taps (--conv-init; uniform is the layers' own
    default)."""
    init = dict(gate_timescales=(1.0, 4.0 * cfg.seq_len) if cfg.gate_init == "timescales" else None,
                conv_init=None if cfg.conv_init == "uniform" else cfg.conv_init)
    mine = {k: v for k, v in init.items() if k in mixers.KNOBS[cfg.mixer]}
    return dict(mixer=cfg.mixer, cp_config=cp_config(cfg), **mine)


def layer_spec(cfg: TrainConfig):
    """This package's layer spec for ``--pattern``: G layers alone, or G and softmax layers."""
    from . import specs

    knobs = _mixer_knobs(cfg)
    if cfg.pattern == "G":
        return registry.mixer(knobs.pop("mixer")).build_layer_spec(**knobs)
    return specs.hybrid_layer_spec(cfg.pattern, **knobs)


def gpt_model(cfg: TrainConfig, config, vocab_size: int):
    """megatron-core's GPTModel over :func:`layer_spec`."""
    from megatron.core.models.gpt import GPTModel

    if cfg.position_embedding not in ("none", "rope"):
        raise ValueError(f"--position-embedding must be none or rope, got {cfg.position_embedding!r}")
    return GPTModel(config=config, transformer_layer_spec=layer_spec(cfg), vocab_size=vocab_size,
                    max_sequence_length=cfg.seq_len, position_embedding_type=cfg.position_embedding)


def hybrid_model(cfg: TrainConfig, config, vocab_size: int):
    """megatron-core's HybridModel (>= 0.19) of ``--hybrid-layer-pattern`` over this package's
    hybrid stack spec (Megatron-Core linears and norms; the G layers as ``--pattern``'s)."""
    from .models import build_hybrid_model
    from .specs import hybrid_stack_spec

    return build_hybrid_model(config, cfg.hybrid_layer_pattern, vocab_size, cfg.seq_len,
                              hybrid_stack_spec(**_mixer_knobs(cfg)), position_embedding_type=cfg.position_embedding)


# Model kinds (--model): name -> builder(cfg, TransformerConfig, vocab_size).
MODEL_KINDS = {"gpt": gpt_model, "hybrid": hybrid_model}


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device):
    """The model ``--model`` names; identical initial weights for any TP/CP layout."""
    torch.manual_seed(cfg.seed)
    model = MODEL_KINDS[cfg.model](cfg, transformer_config(cfg), vocab_size)
    return model.to(device=device, dtype=getattr(torch, cfg.dtype))  # some norms ignore params_dtype


def make_task(cfg: TrainConfig) -> RecallTask:
    return RecallTask(seq_len=cfg.seq_len, num_pairs=cfg.pairs, num_keys=cfg.keys, num_values=cfg.values,
                      num_filler=cfg.filler)


def global_batch(cfg: TrainConfig, task: RecallTask, step: int) -> dict:
    """The whole step's batch (all data-parallel ranks), the same on every rank: a function of
    the seed and the step alone, so a resumed run sees the same data."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    batch = task.batch(cfg.batch, gen)
    if cfg.task == "mock":
        batch["loss_mask"] = torch.ones_like(batch["loss_mask"])
    elif cfg.task != "recall":
        raise ValueError(f"--task must be recall or mock, got {cfg.task!r}")
    return batch


def local_batch(cfg: TrainConfig, batch: dict) -> dict:
    """This rank's share: its data-parallel rows, then its context-parallel tokens."""
    from megatron.core import parallel_state

    if cfg.batch % cfg.dp:
        raise ValueError(f"--batch {cfg.batch} must be divisible by --dp {cfg.dp}")
    dp_rank = parallel_state.get_data_parallel_rank()
    rows = slice(dp_rank * cfg.batch // cfg.dp, (dp_rank + 1) * cfg.batch // cfg.dp)
    batch = {k: v[rows] for k, v in batch.items()}
    # zigzag is exactly Megatron's get_batch_on_this_cp_rank split (tests/mcore/test_gpt_model.py),
    # whose signature changes between megatron-core releases.
    cp_rank = parallel_state.get_context_parallel_rank()
    return {k: Layout(cfg.layout).shard(v, cp_rank, cfg.cp, dim=1) for k, v in batch.items()}


def loss_and_accuracy(model, batch: dict, device):
    """Masked mean cross-entropy over the whole global batch (so gradients sum over DP x CP),
    and the summed (answer count, correct answers) over DP x CP."""
    from megatron.core import parallel_state

    tokens, labels, mask = (batch[k].to(device) for k in ("tokens", "labels", "loss_mask"))
    logits = model(tokens, None, None)  # [b, s, vocab / tp]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    token_loss = _vocab_parallel_cross_entropy(logits, labels)
    mask = mask.to(logits.dtype)
    correct = (_vocab_parallel_argmax(logits.detach()) == labels).to(mask.dtype)
    stats = torch.stack([mask.sum(), (correct * mask).sum()])
    dist.all_reduce(stats, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return (token_loss * mask).sum() / stats[0], stats


def _vocab_parallel_cross_entropy(logits, labels):
    """Per-token cross-entropy of ``[b, s, vocab / tp]`` logits, in their own dtype
    (Megatron's version computes in float32 and allocates on CUDA)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region as tp_sum

    tp = parallel_state.get_tensor_model_parallel_group()
    if tp.size() == 1:
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    peak = logits.detach().amax(dim=-1, keepdim=True)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=tp)
    shifted = logits - peak
    local = labels - tp.rank() * logits.shape[-1]
    inside = (local >= 0) & (local < logits.shape[-1])
    target = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * inside
    return tp_sum(shifted.exp().sum(-1), group=tp).log() - tp_sum(target, group=tp)


def _vocab_parallel_argmax(logits):
    """argmax over a vocabulary split across tensor-parallel ranks."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_group()
    best, index = logits.max(dim=-1)
    if tp.size() == 1:
        return index
    index = index + tp.rank() * logits.shape[-1]
    bests = [torch.empty_like(best) for _ in range(tp.size())]
    indices = [torch.empty_like(index) for _ in range(tp.size())]
    dist.all_gather(bests, best.contiguous(), group=tp)
    dist.all_gather(indices, index.contiguous(), group=tp)
    return torch.stack(indices).gather(0, torch.stack(bests).argmax(0, keepdim=True)).squeeze(0)


def reduce_gradients(model):
    """Sum gradients over the data x context parallel group (parameters are replicated there)."""
    from megatron.core import parallel_state

    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if dp_cp.size() > 1 and grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=dp_cp)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def _log(message: str):
    print(message, flush=True)  # progress must show up in redirected logs as it happens


def grad_norm(model) -> torch.Tensor:
    """Norm of the whole (TP-unsharded) gradient, the same on every rank (call after reduce_gradients)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_group()
    total = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    for p in model.parameters():  # TP-sharded gradients from every TP rank, replicated ones once
        if p.grad is not None and (getattr(p, "tensor_model_parallel", False) or tp.rank() == 0):
            total += p.grad.double().pow(2).sum()
    dist.all_reduce(total, group=tp)
    return total.sqrt()


def lr_schedule(cfg: TrainConfig):
    """Linear warm-up over 5% of the steps, then cosine decay to a tenth."""
    warmup = max(1, cfg.steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, cfg.steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return factor


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


# --- save and resume ------------------------------------------------------------------------------

# Flags that shape the loss curve: a resumed run takes them as saved (--steps may change: the
# learning-rate schedule then spans the new count). The parallel layout, CP strategy, device and
# logging may change: a checkpoint loads at any TP x CP x DP; so may the initialisation (--conv-init,
# --gate-init, --init-std): the weights are the checkpoint's.
RESUME_FLAGS = ("model", "mixer", "pattern", "hybrid_layer_pattern", "experts", "position_embedding", "layers",
                "hidden", "heads", "dtype", "task", "seq_len", "batch", "pairs", "keys", "values", "filler", "seed",
                "lr", "clip_grad")


def save_checkpoint(cfg: TrainConfig, step: int, model, optimizer, scheduler, device, log):
    start = time.time()
    path = checkpoint.save(cfg.save, step, model, optimizer,
                           dict(step=step, config=asdict(cfg), scheduler=scheduler.state_dict()), device)
    if dist.get_rank() == 0:
        log(f"saved step {step} to {path} in {time.time() - start:.1f} s")


def resume(cfg: TrainConfig, model, optimizer, scheduler, device, log) -> int:
    """Load the checkpoint ``--load`` names into the model, optimizer and LR schedule; the step
    it was taken after (0 with none). ValueError if it was saved with other RESUME_FLAGS."""
    path = checkpoint.find(cfg.load)
    rank0 = dist.get_rank() == 0
    if path is None:
        if rank0:
            log(f"--load {cfg.load}: no checkpoint there; starting from step 0")
        return 0
    saved = checkpoint.read_common(path).get("config")
    if not isinstance(saved, dict):
        raise ValueError(f"--load {path} is a distributed checkpoint, but not of this job (no configuration in it)")
    # A flag newer than the checkpoint had its default then (--model gpt, ...).
    differ = [f"--{name.replace('_', '-')} {saved.get(name, _DEFAULTS[name])} (given {getattr(cfg, name)})"
              for name in RESUME_FLAGS if saved.get(name, _DEFAULTS[name]) != getattr(cfg, name)]
    if differ:
        raise ValueError(f"--load {path} was saved with {', '.join(differ)}; a resumed run continues its loss "
                         f"curve with the same model, task, data and optimiser flags: pass those")
    common = checkpoint.load(path, model, optimizer, device)
    scheduler.load_state_dict(common["scheduler"])
    step = int(common["step"])
    if rank0:
        log(f"resumed from {path}: step {step}, saved at TP {saved['tp']} x CP {saved['cp']} x DP {saved['dp']}"
            + (f"; the learning-rate schedule now spans --steps {cfg.steps} (saved: {saved['steps']})"
               if saved["steps"] != cfg.steps else ""))
    return step


# --- the loop -------------------------------------------------------------------------------------

def train(cfg: TrainConfig, log=_log):
    """Run the training loop (resuming from ``--load``, saving to ``--save``); returns the per-step
    (loss, accuracy) of the steps it ran. A misconfiguration found while starting (flags, model
    build, checkpoint, first step) raises ConfigError, the same on every rank."""
    try:
        with startup_errors():
            device = init_distributed(cfg, log)  # checks the flags (resolve) first
            check_device(cfg)
            task = make_task(cfg)
            model = build_model(cfg, task.vocab_size, device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg))
            first = resume(cfg, model, optimizer, scheduler, device, log) + 1 if cfg.load else 1
        return _loop(cfg, task, model, optimizer, scheduler, device, first, log)
    finally:
        parallel_state = sys.modules.get("megatron.core.parallel_state")  # none if the flags stopped the job
        if parallel_state is not None:
            parallel_state.destroy_model_parallel()


def _loop(cfg, task, model, optimizer, scheduler, device, first, log):
    from megatron.core import parallel_state

    rank0 = dist.get_rank() == 0
    if rank0:
        name = mixers.NAMES[cfg.mixer]
        if cfg.model == "hybrid":
            kind = f"HybridModel {cfg.hybrid_layer_pattern!r} (G = {name}),"
        else:
            kind = (name if cfg.pattern == "G" else f"hybrid ({cfg.pattern!r}, G = {name})") + " GPTModel"
        log(f"megatron_zeco: {kind} {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads | "
            f"TP {cfg.tp} x CP {cfg.cp} x DP {cfg.dp} on {device.type} | CP strategy {cfg.strategy}, "
            f"layout {cfg.layout}" + (f", piece split {cfg.piece_split or 'auto'}"
                                     if RULES[mixers.OPERATORS[cfg.mixer]].applies("piece_split") else "")
            + " | "
            f"seq {cfg.seq_len}, batch {cfg.batch}, task {cfg.task} "
            f"(chance accuracy {task.chance:.3f})")
    history, step, saved_at = [], first - 1, None
    start = window_start = time.time()
    window_steps, saving = 0, 0.0  # steps since the last log line; seconds spent saving checkpoints
    stall = stall_of(cfg)
    for step in range(first, cfg.steps + 1):
        if stall is not None and stall[:2] == (dist.get_rank(), step):
            time.sleep(stall[2])
        with startup_errors() if step == first else nullcontext():  # the first forward checks the CP inputs
            batch = local_batch(cfg, global_batch(cfg, task, step))
            optimizer.zero_grad(set_to_none=True)
            loss, stats = loss_and_accuracy(model, batch, device)
        loss.backward()
        reduce_gradients(model)
        norm = grad_norm(model)
        finite = bool(norm.isfinite())  # waits for the step's backward pass: every scan has ended by now
        check_scans()  # a scan that gave up (its results NaN): ScanTimeoutError naming it, before the update
        if not finite:
            raise FloatingPointError(f"step {step}: the gradient norm is {float(norm)}; not applying it (lower "
                                     f"--lr, or check the inputs)")
        if cfg.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), cfg.clip_grad, norm)
        optimizer.step()
        scheduler.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        accuracy = float(stats[1] / stats[0])
        history.append((float(global_loss), accuracy))
        window_steps += 1
        exiting = cfg.exit_interval > 0 and step % cfg.exit_interval == 0 and step < cfg.steps
        if rank0 and (step % cfg.log_interval == 0 or step == cfg.steps or exiting):
            now = time.time()
            log(f"step {step:5d}/{cfg.steps} | loss {history[-1][0]:.4f} | recall acc {accuracy:.3f} | "
                f"grad norm {float(norm):.3f} | lr {scheduler.get_last_lr()[0]:.2e} | "
                f"{window_steps * cfg.batch * cfg.seq_len / (now - window_start):8.0f} tokens/s | {cfg.strategy}")
            window_start, window_steps = now, 0
        if cfg.save and (step == cfg.steps or exiting or (cfg.save_interval and step % cfg.save_interval == 0)):
            began = time.time()
            save_checkpoint(cfg, step, model, optimizer, scheduler, device, log)
            saved_at, spent = step, time.time() - began
            saving, window_start = saving + spent, window_start + spent  # tokens/s counts training time only
        if exiting:
            break
    if rank0:
        _summary(cfg, task, history, (first, step), time.time() - start, saving, saved_at, log)
    return history


def _summary(cfg, task, history, steps, elapsed, saving, saved_at, log):
    first, last = steps
    if not history:
        log(f"done: nothing to run (resumed after step {first - 1}, --steps {cfg.steps})")
        return
    tail = history[-min(20, len(history)):]
    ran = f"steps {first}-{last}" if first > 1 else "steps"
    stopped = f" (stopped by --exit-interval {cfg.exit_interval})" if last < cfg.steps else ""
    kept = f" | saved step {saved_at} under {cfg.save} ({saving:.1f} s saving)" if saved_at is not None else ""
    log(f"done: {len(history)} {ran} of {cfg.steps}{stopped} in {elapsed:.1f} s, "
        f"{len(history) * cfg.batch * cfg.seq_len / (elapsed - saving):.0f} tokens/s | final loss "
        f"{sum(h[0] for h in tail) / len(tail):.4f}, recall accuracy {sum(h[1] for h in tail) / len(tail):.3f} "
        f"(chance {task.chance:.3f}, mean of the last {len(tail)} steps){kept}")


# --- the command ----------------------------------------------------------------------------------

# What megatron-core (and torch, inside megatron-core's checkpointing) warn about on every rank that
# a user of this job cannot act on, besides its notices about optional packages (mcore): torch's
# deprecations of what megatron-core calls. (message, module, category), matched as
# warnings.filterwarnings does.
NOT_ACTIONABLE = (
    (r"`load_state_dict` is deprecated", r"megatron\.core\.dist_checkpointing\.", FutureWarning),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", r"torch\.distributed\.checkpoint\.",
     FutureWarning),
    (r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a single "
     r"process", r"torch\.distributed\.checkpoint\.", UserWarning),  # megatron-core 0.19 reads common.pt alone
    (r"The argument order of load has been changed", r"torch\.distributed\.checkpoint\.", UserWarning),
)
# On the CPU, also megatron-core's advice on CUDA streams (on GPUs it stays: the user may act on it).
NOT_ACTIONABLE_ON_CPU = (
    (r"When using .* it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
     r"megatron\.core\.tensor_parallel\.layers", UserWarning),
)
# Log records likewise: (logger, message start). megatron-core 0.19 announces the deprecation of
# the save path its own synchronous save takes.
NOT_ACTIONABLE_LOGS = (
    ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated"),
)


class _DropMessage(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


def quiet_third_party_warnings(on_cpu: bool):
    """Hide the NOT_ACTIONABLE warnings and log records and megatron-core's notices about missing optional
    packages (mcore.OPTIONAL_PACKAGE_NOTICES), each by message and module or logger; every other warning
    shows."""
    hide_optional_package_notices()
    for message, module, category in NOT_ACTIONABLE + (NOT_ACTIONABLE_ON_CPU if on_cpu else ()):
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, start in NOT_ACTIONABLE_LOGS:
        logging.getLogger(name).addFilter(_DropMessage(start))


# Seconds a rank other than 0 waits, after a misconfiguration, for rank 0 to print it and exit (the
# launcher then stops the others at once).
OTHER_RANKS_WAIT = 10.0


def _tell_the_launcher(message: str) -> None:
    """Under torchrun, hand ``message`` to its failure report (the error file it names in
    ``$TORCHELASTIC_ERROR_FILE``), so that the report it prints last ends with the message, not with a
    pointer to its documentation."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)


def launch(cfg: TrainConfig) -> int:
    """``--nproc-per-node N``: check the flags here, as for N processes (a bad one raises ConfigError before
    any process starts), then run N processes of this job on this machine through torchrun's own launcher
    (``torch.distributed.run``), and return their exit status. A process that stops on an error of this
    job has printed its one message, which stays the last line: the launcher's own reports are not
    printed; for any other failure torchrun's report is."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args as torchrun_args, run

    if "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ:
        raise ConfigError(f"--nproc-per-node {cfg.nproc_per_node}: this process is one of torchrun's, which "
                          f"started them all; leave --nproc-per-node out under torchrun")
    if cfg.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be at least 1, got {cfg.nproc_per_node}")
    with startup_errors():
        checked = replace(cfg)
        resolve(checked, cfg.nproc_per_node)
        check_device(checked)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its notice
    for name in list(logging.root.manager.loggerDict):  # the agent's notices of the processes it stops
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(torchrun_args(["--nproc-per-node", str(cfg.nproc_per_node), "--module", PROG, *to_argv(cfg)]))
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        if isinstance(failure.message, str) and failure.message.startswith(f"{PROG}: error"):
            return failure.exitcode  # the process printed it
        print(e.format_msg(), file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv=None):
    """The command: one message from rank 0 and exit status 2 for a misconfiguration."""
    owns_group = not dist.is_initialized()
    code = 0
    try:
        cfg = parse_args(argv)
        if cfg.nproc_per_node is not None:
            code = launch(cfg)
        else:
            quiet_third_party_warnings(on_cpu=not uses_cuda(cfg))
            train(cfg)
    except ConfigError as e:
        message = f"{PROG}: error: {e}"
        _tell_the_launcher(message)
        if _launch_rank() == 0:
            print(message, file=sys.stderr, flush=True)
        elif int(os.environ.get("WORLD_SIZE", 1)) > 1:
            # Every rank finds the same error; rank 0 prints it and its exit ends the others. Leaving
            # first, another rank would have the launcher stop rank 0 before its message is out.
            time.sleep(OTHER_RANKS_WAIT)
        code = 2
    except (ScanTimeoutError, FloatingPointError) as e:  # each rank says what it saw; no step was applied
        message = f"{PROG}: error on global rank {_launch_rank()}: {type(e).__name__}: {e}"
        print(message, file=sys.stderr, flush=True)
        _tell_the_launcher(message)
        code = 1
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
