"""The process group and Megatron's model-parallel groups of the main job (Megatron-LM's
megatron/training/initialize.py)."""

import os

import torch
import torch.distributed as dist

from .arguments import TrainConfig, resolve, uses_cuda, world_size


def init_distributed(cfg: TrainConfig, log=None):
    """Check and complete ``cfg`` (:func:`resolve`; ``log`` gets its notes on rank 0), then the
    process group (from torchrun's environment; one process without it) and Megatron's
    model-parallel groups. Returns the device."""
    notes = resolve(cfg, world_size())  # before megatron-core is imported: a bad flag stops in seconds
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
