"""The chunked delta rule's recurrences, shared by the operators whose chunks reduce to the same terms
(the gated delta rule, KDA): given each chunk's terms, the pass over the chunks for the output and the
final state, a piece's summary ``S_out = M S_in + E``, and the entering state's gradient ``A``.

Each operator computes its chunks' terms (``gated_delta_rule/chunk.py``, ``kda/chunk.py``: the WY / UT
transform under its own decays), all ``[B, H, N, C, ...]`` in the state dtype, N chunks of C tokens:

* ``qg`` ``[.., C, K]``: the decayed queries ``exp(G_i) * q_i`` (None where not needed);
* ``attn`` ``[.., C, C]``: the intra-chunk reads ``P_ij`` for ``j <= i``, zero above the diagonal (None
  likewise);
* ``U`` ``[.., C, V]`` and ``W`` ``[.., C, K]``: the corrections ``nu = U - W S_0``;
* ``kd`` ``[.., C, K]``: the keys decayed to the chunk's end, ``exp(G_C - G_j) * k_j``;
* ``last`` ``[.., K]``: the chunk's decay ``exp(G_C)`` per key channel.

Then ``o = scale (qg S_0 + attn nu)`` and ``S_out = M_c S_0 + E_c`` with ``M_c = Diag(last) - kd^T W``,
``E_c = kd^T U``. Differentiable with torch.autograd.
"""

from typing import NamedTuple, Optional, Tuple

import torch

from .chunked import chunked, unchunked

Tensor = torch.Tensor


class DeltaChunks(NamedTuple):
    """Per-chunk terms of the module docstring."""

    qg: Optional[Tensor]
    attn: Optional[Tensor]
    U: Optional[Tensor]
    W: Tensor
    kd: Tensor
    last: Tensor


def transitions(c: DeltaChunks) -> Tensor:
    """Every chunk's ``M_c = Diag(exp(G_C)) - Kd^T W`` ``[B, H, N, K, K]``."""
    return torch.diag_embed(c.last) - c.kd.transpose(-1, -2) @ c.W


def outputs(c: DeltaChunks, scale: float, initial_state: Optional[Tensor], T: int) -> Tuple[Tensor, Tensor]:
    """The outputs ``[B, T, H, V]`` (state dtype) from ``initial_state`` (None: zeros), and the final state."""
    B, H, _, _, K = c.W.shape
    S = c.U.new_zeros(B, H, K, c.U.shape[-1]) if initial_state is None else initial_state.to(c.U.dtype)
    S_in, nu = [], []
    for n in range(c.U.shape[2]):
        S_in.append(S)
        nu.append(c.U[:, :, n] - c.W[:, :, n] @ S)
        S = c.last[:, :, n].unsqueeze(-1) * S + c.kd[:, :, n].transpose(-1, -2) @ nu[-1]
    S_in, nu = torch.stack(S_in, dim=2), torch.stack(nu, dim=2)
    return unchunked(scale * (c.qg @ S_in + c.attn @ nu), T), S


def summary(c: DeltaChunks) -> Tuple[Tensor, Tensor]:
    """A piece's ``E [B, H, K, V]`` (the final state from a zero state) and ``M [B, H, K, K]``."""
    M_c = transitions(c)
    E_c = c.kd.transpose(-1, -2) @ c.U
    E, M = E_c[:, :, 0], M_c[:, :, 0]
    for n in range(1, E_c.shape[2]):
        E, M = M_c[:, :, n] @ E + E_c[:, :, n], M_c[:, :, n] @ M
    return E, M


def entering_grad(c: DeltaChunks, do: Tensor, scale: float, chunk_size: int) -> Tensor:
    """``A [B, H, K, V]``, the gradient of ``<do, o>`` with respect to the entering state: per chunk the
    outputs read ``S_0`` through ``scale (qg - attn W)``; the chunks are walked backwards through
    ``M_c^T``."""
    doc = chunked(do.to(c.W.dtype), chunk_size)
    local = scale * (c.qg - c.attn @ c.W).transpose(-1, -2) @ doc  # [B, H, N, K, V]
    M_c = transitions(c)
    A = local[:, :, -1]
    for n in range(local.shape[2] - 2, -1, -1):
        A = local[:, :, n] + M_c[:, :, n].transpose(-1, -2) @ A
    return A
