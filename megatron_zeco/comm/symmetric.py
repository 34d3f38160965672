"""Memory every rank of a group can address: the buffers of the device transports' scans.

On CUDA, torch symmetric memory: each rank allocates, and maps its peers' allocations (NVLink; multicast
is never used), or, for NVSHMEM, addresses them by its own address and the peer's PE. Torch symmetric
memory takes one backend per process, fixed by its first allocation (:func:`backend`). On the CPU, files
in shared memory (``/dev/shm``): slow, for testing the scans' protocol with real processes.
"""

import os
import tempfile
import uuid
import warnings
from typing import List, Optional

import torch
import torch.distributed as dist

Tensor = torch.Tensor
_ALLOCATED = False  # whether this process has allocated torch symmetric memory (fixing its backend)


def backend() -> Optional[str]:
    """The backend this process's torch symmetric memory is fixed to, or None while it allocated none."""
    if not _ALLOCATED or not torch.cuda.is_initialized():
        return None
    import torch.distributed._symmetric_memory as symm_mem

    try:
        return symm_mem.get_backend(torch.device("cuda"))
    except (AttributeError, RuntimeError):
        return None


class PeerBuffers:
    """``nbytes`` of memory per rank of ``group``, zeroed, allocated collectively.

    ``of(rank)`` is the buffer this process addresses for group rank ``rank`` (a uint8 tensor on this
    rank's device): the peer's own buffer mapped here (peer memory: CUDA symmetric memory on one node,
    ``/dev/shm`` files on the CPU), or, with ``nvshmem``, this rank's own symmetric buffer for every
    rank: NVSHMEM addresses a peer's buffer by this rank's address of it and the peer's PE.
    """

    def __init__(self, group, nbytes: int, device: torch.device, nvshmem: bool = False):
        # _handle keeps the symmetric allocation (and the peers' mappings) alive
        self._ranks, self._handle = (_symmetric(group, nbytes, device, nvshmem) if device.type == "cuda"
                                     else (_host_shared(group, nbytes), None))

    def of(self, rank: int) -> Tensor:
        return self._ranks[rank]


def _symmetric(group, nbytes: int, device: torch.device, nvshmem: bool):
    global _ALLOCATED
    import torch.distributed._symmetric_memory as symm_mem

    backend = symm_mem.get_backend(device)
    if nvshmem and backend != "NVSHMEM":
        try:
            symm_mem.set_backend("NVSHMEM")  # for the whole process: fixed by its first allocation
        except RuntimeError as e:
            raise ValueError(f"All-Scan transport 'nvshmem' needs torch symmetric memory's NVSHMEM backend, but "
                             f"this process already allocates symmetric memory with {backend!r}: use one "
                             f"transport per process") from e
    with warnings.catch_warnings():  # needed by older torch, deprecated (a no-op) by newer
        warnings.simplefilter("ignore", FutureWarning)
        symm_mem.enable_symm_mem_for_group(group.group_name)
    _ALLOCATED = True
    local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(local, group.group_name) if group.size() > 1 else None  # one rank: no peers
    local.zero_()
    torch.cuda.synchronize(device)  # zeroed everywhere before any peer writes a flag
    dist.barrier(group=group)
    views = [local if nvshmem or r == group.rank() else handle.get_buffer(r, (nbytes,), torch.uint8, 0)
             for r in range(group.size())]
    return views, handle


def _host_shared(group, nbytes: int) -> List[Tensor]:
    names: List[Optional[str]] = [os.path.join(_shm_dir(), f"megatron_zeco_{uuid.uuid4().hex}")]
    dist.broadcast_object_list(names, src=dist.get_global_rank(group, 0), group=group)
    path = f"{names[0]}_{group.rank()}"
    with open(path, "wb") as f:
        f.truncate(nbytes)  # zeros
    dist.barrier(group=group)
    views = [torch.from_file(f"{names[0]}_{r}", shared=True, size=nbytes, dtype=torch.uint8)
             for r in range(group.size())]
    dist.barrier(group=group)  # everyone has mapped every file: the names can go
    os.unlink(path)
    return views


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
