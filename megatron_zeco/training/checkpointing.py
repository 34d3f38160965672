"""Save and resume the main job with Megatron-Core's distributed checkpointing (megatron_zeco.checkpoint),
checking that a resumed run continues the saved loss curve (Megatron-LM's megatron/training/checkpointing.py)."""

import time
from dataclasses import asdict

import torch.distributed as dist

from .. import checkpoint
from .arguments import DEFAULTS, TrainConfig

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
    differ = [f"--{name.replace('_', '-')} {saved.get(name, DEFAULTS[name])} (given {getattr(cfg, name)})"
              for name in RESUME_FLAGS if saved.get(name, DEFAULTS[name]) != getattr(cfg, name)]
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
