"""Communication failures named for the user: which operation, which rank, doing what."""

import contextlib

import torch.distributed as dist


@contextlib.contextmanager
def naming_failures(what: str, doing: str):
    """Re-raise a communication failure (dead peer, timeout) with what was being done, and by whom."""
    try:
        yield
    except RuntimeError as e:
        raise RuntimeError(f"{what}: global rank {dist.get_rank()} failed {doing} "
                           f"(the peer died, stalled past the process group's timeout, or diverged): {e}") from e
