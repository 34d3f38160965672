"""Save and resume training with Megatron-Core's distributed checkpointing.

A checkpoint is a directory ``ROOT/iter_NNNNNNN`` (Megatron-LM's naming) written by
``megatron.core.dist_checkpointing``:

* ``model``: the model's ``sharded_state_dict`` (each tensor with its global shape and this
  rank's slice of it: TP shards, replicas over DP x CP);
* ``optimizer``: a ``torch.optim`` optimizer's per-parameter state (Adam's moments, ...)
  sharded exactly as its parameter, its hyper-parameters, and its step;
* anything else the caller passes (the training step, the LR schedule, its configuration),
  saved once by rank 0.

Since every tensor is stored whole, a checkpoint saved at one TP x CP x DP layout loads at any
other. ``ROOT/latest_checkpointed_iteration.txt`` names the newest checkpoint, as in Megatron-LM.
"""

import copy
import os
from contextlib import nullcontext
from typing import Optional

import torch
import torch.distributed as dist

from .mcore.host import host_as_cuda

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, step: int) -> str:
    """The directory of the checkpoint taken after ``step`` under ``root``."""
    return os.path.join(root, f"iter_{step:07d}")


def find(root: str) -> Optional[str]:
    """The checkpoint ``root`` names: the newest one under it (its tracker file), or ``root``
    itself if it is a checkpoint directory; None if there is none."""
    from megatron.core.dist_checkpointing import check_is_distributed_checkpoint

    tracker = os.path.join(root, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            path = iteration_dir(root, int(f.read().strip()))
        if not check_is_distributed_checkpoint(path):
            raise ValueError(f"{tracker} names {path}, which is not a complete distributed checkpoint")
        return path
    if os.path.isdir(root) and check_is_distributed_checkpoint(root):
        return root
    return None


def read_common(path: str) -> dict:
    """The part of a checkpoint saved by rank 0 (everything but the model and optimizer tensors)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(path)


def optimizer_sharded_state_dict(optimizer: torch.optim.Optimizer, model_state: dict, is_loading=False) -> dict:
    """``optimizer.state_dict()`` with each per-parameter tensor sharded as its parameter in
    ``model_state`` (the model's ``sharded_state_dict``): what Megatron-Core's ``FP32Optimizer``
    does for the torch optimizer it wraps. The step, one number for all parameters, is kept
    apart (``common_step``). ``is_loading``: give a fresh optimizer the state tensors to load into."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    params = [p for group in optimizer.param_groups for p in group["params"]]
    if is_loading:
        for p in params:
            state = optimizer.state[p]
            if not state:  # Adam's moments, as Megatron-Core's init_state_fn makes them
                state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
    state = optimizer.state_dict()
    steps = [s["step"] for s in state["state"].values() if "step" in s]
    if any(not torch.equal(torch.as_tensor(s), torch.as_tensor(steps[0])) for s in steps):
        raise ValueError("the optimizer's step differs between parameters; a checkpoint keeps one step for all")
    optim_state_to_sharding_state(state, get_param_id_to_sharded_param_map(model_state, params),
                                  exclude_keys=("step",))
    if steps:
        state["state"]["common_step"] = steps[0]
    return state


def save(root: str, step: int, model, optimizer, common: dict, device: torch.device) -> str:
    """Save ``model``, ``optimizer`` and ``common`` (rank 0's, the same on every rank) as the
    checkpoint of ``step`` under ``root``, then point the tracker at it. Collective."""
    from megatron.core import dist_checkpointing

    path = iteration_dir(root, step)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    model_state = model.sharded_state_dict()
    state = {"model": model_state, "optimizer": optimizer_sharded_state_dict(optimizer, model_state), **common}
    with _on_host(device):
        dist_checkpointing.save(state, path)
    dist.barrier()  # every rank's shards are written before the tracker names the checkpoint
    if dist.get_rank() == 0:
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(step))
        os.replace(tmp, os.path.join(root, TRACKER))
    return path


def load(path: str, model, optimizer, device: torch.device) -> dict:
    """Load the checkpoint at ``path`` into ``model`` and ``optimizer`` (any TP x CP x DP layout);
    return its common part. Collective."""
    from megatron.core import dist_checkpointing

    model_state = model.sharded_state_dict()
    template = {"model": model_state,
                "optimizer": optimizer_sharded_state_dict(optimizer, model_state, is_loading=True)}
    with _on_host(device):
        loaded = dist_checkpointing.load(template, path)
    model.load_state_dict(loaded.pop("model"))
    optim = loaded.pop("optimizer")
    step = optim["state"].pop("common_step", None)
    if step is not None:
        for param_state in optim["state"].values():
            param_state["step"] = copy.deepcopy(step)
    optimizer.load_state_dict(optim)
    return loaded


def _on_host(device: torch.device):
    return host_as_cuda() if device.type == "cpu" else nullcontext()
