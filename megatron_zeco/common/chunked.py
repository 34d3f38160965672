"""Shared pieces of the chunked PyTorch forms (the CPU path of every operator): the state dtype, chunking,
and packed segments as a padded batch."""

import torch
import torch.nn.functional as F


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype in which states are accumulated and passed between ranks."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Segments:
    """The segments of a packed ``[1, T, ...]`` sequence as a zero-padded batch ``[N, L, ...]`` and back."""

    def __init__(self, cu_seqlens: torch.Tensor, T: int, batch: int):
        cu = cu_seqlens.to(device="cpu", dtype=torch.long)
        if batch != 1 or cu.dim() != 1 or len(cu) < 2 or cu[0] != 0 or cu[-1] != T or (cu.diff() < 0).any():
            raise ValueError(f"cu_seqlens must be nondecreasing offsets from 0 to T = {T} over a batch of "
                             f"one sequence, got {cu.tolist()} for batch size {batch}")
        lengths = cu.diff()
        pos = torch.arange(int(lengths.max()))
        device = cu_seqlens.device
        self.mask = (pos < lengths[:, None]).to(device)  # [N, L]
        self.index = (cu[:-1, None] + pos).clamp(max=max(T - 1, 0)).to(device)
        self.segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)  # [T]
        self.offset = (torch.arange(T) - cu[:-1].repeat_interleave(lengths)).to(device)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, T, ...]`` -> ``[N, L, ...]``, zeros after each segment's end."""
        mask = self.mask.view(*self.mask.shape, *(1,) * (x.dim() - 2))
        return torch.where(mask, x[0][self.index], 0)

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        """``[N, L, ...]`` -> ``[1, T, ...]``."""
        return y[self.segment, self.offset].unsqueeze(0)


def chunked(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[B, T, H, D]`` -> ``[B, H, N, C, D]``, zero-padded at the end of T."""
    B, T, H, D = x.shape
    pad = -T % chunk_size
    if pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
    return x.view(B, (T + pad) // chunk_size, chunk_size, H, D).permute(0, 3, 1, 2, 4)


def unchunked(x: torch.Tensor, T: int) -> torch.Tensor:
    """``[B, H, N, C, D]`` -> ``[B, T, H, D]``."""
    B, H = x.shape[:2]
    return x.permute(0, 2, 3, 1, 4).reshape(B, -1, H, x.shape[-1])[:, :T]
