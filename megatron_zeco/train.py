"""The main job: train a small GLA, Gated DeltaNet or KDA model (megatron-core) with ZeCO context parallelism.

Examples and every flag: ``python -m megatron_zeco.train --help`` (megatron_zeco/training/arguments.py).

Uses megatron-core directly (parallel_state, GPTModel or HybridModel, the specs of this package,
dist_checkpointing); gradients of the parameters, replicated over data and context parallel
ranks, are summed over that group as Megatron's DDP does. Runs on GPUs with NCCL when torch
sees them (``--device auto``). ``--nproc-per-node`` checks the flags before it starts the processes
(torchrun's launcher, ``torch.distributed.run``): a bad flag stops the job in seconds, its message the
last line. Prints loss, recall accuracy, tokens/s and the CP strategy every ``--log-interval`` steps,
and a summary at the end. Flags, save/resume: docs/main-job.md.
"""

import json
import logging
import os
import sys
import time
import warnings
from dataclasses import replace

import torch.distributed as dist

from .comm import ScanTimeoutError
from .mcore import hide_optional_package_notices
from .training.arguments import (PROG, ConfigError, TrainConfig, build_parser, check_device, cp_config,
                                 launch_rank, make_task, parse_args, resolve, resolve_mixer,
                                 resolve_model, startup_errors, to_argv, uses_cuda)
from .training.initialize import init_distributed
from .training.model import build_model
from .training.training import global_batch, grad_norm, local_batch, loss_and_accuracy, reduce_gradients, train

# The job's pieces, as megatron_zeco.training lays them out, importable from here as before.
__all__ = ["ConfigError", "TrainConfig", "build_model", "build_parser", "check_device", "cp_config", "global_batch",
           "grad_norm", "init_distributed", "launch", "local_batch", "loss_and_accuracy", "main", "make_task",
           "parse_args", "reduce_gradients", "resolve", "resolve_mixer", "resolve_model", "to_argv", "train"]

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
        if launch_rank() == 0:
            print(message, file=sys.stderr, flush=True)
        elif int(os.environ.get("WORLD_SIZE", 1)) > 1:
            # Every rank finds the same error; rank 0 prints it and its exit ends the others. Leaving
            # first, another rank would have the launcher stop rank 0 before its message is out.
            time.sleep(OTHER_RANKS_WAIT)
        code = 2
    except (ScanTimeoutError, FloatingPointError) as e:  # each rank says what it saw; no step was applied
        message = f"{PROG}: error on global rank {launch_rank()}: {type(e).__name__}: {e}"
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
