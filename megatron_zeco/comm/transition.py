"""The linear part of a piece's map ``S_out = T S_in + delta``: a diagonal or a dense matrix.

The scans (``all_scan.py``, ``hierarchical.py``) pass states and compose maps; all they need to
know of ``T`` is here. A kind is chosen from the shapes (:func:`transition_of`), states being
``[..., K, V]``:

* :class:`Diagonal`: ``T = Diag(gamma)``, ``gamma [..., K]``: gated linear attention. The decay acts
  row by row, so the state's rows are independent: pipeline blocks are blocks of rows.
* :class:`Dense`: ``T = M``, ``M [..., K, K]``: the gated delta rule, whose pieces map a state by
  ``M = prod_t exp(g_t) (I - beta_t k_t k_t^T)``. A row of ``M S`` reads every row of ``S``, a column
  only the same column: pipeline blocks are blocks of columns.

Maps compose as ``(T2, d2) o (T1, d1) = (T2 T1, T2 d1 + d2)``. The backward scan runs the same
combine over the transposed transitions (:meth:`transpose`; a diagonal is its own). A map travels as
one message ``[..., K, V + width]``: the state, then the transition's columns (fla's ``[h | M]``).
"""

from typing import Tuple, Type, Union

import torch

Tensor = torch.Tensor


class Diagonal:
    """``T = Diag(gamma)``, ``gamma [..., K]``."""

    block_dim = -2  # rows of the state are independent

    @staticmethod
    def combine(gamma: Tensor, delta: Tensor, x: Tensor, block: slice = slice(None), out: Tensor = None) -> Tensor:
        """``delta + T x`` on ``block`` of the state (rows), ``x`` that block of the entering state (into
        ``out`` if given)."""
        return torch.addcmul(delta[..., block, :], gamma[..., block].unsqueeze(-1), x, out=out)

    @staticmethod
    def apply(gamma: Tensor, x: Tensor) -> Tensor:
        return gamma.unsqueeze(-1) * x

    @staticmethod
    def compose(later: Tensor, earlier: Tensor) -> Tensor:
        return later * earlier

    @staticmethod
    def identity(like: Tensor) -> Tensor:
        return torch.ones_like(like)

    @staticmethod
    def transpose(gamma: Tensor) -> Tensor:
        return gamma

    @staticmethod
    def pack(gamma: Tensor, state: Tensor) -> Tensor:
        return torch.cat([state, gamma.unsqueeze(-1)], dim=-1)

    @staticmethod
    def unpack(message: Tensor, V: int) -> Tuple[Tensor, Tensor]:
        """``(gamma, state)`` from a message of :meth:`pack`."""
        return message[..., V], message[..., :V]

    @staticmethod
    def width(K: int) -> int:
        return 1


class Dense:
    """``T = M``, ``M [..., K, K]`` (``S_out = M S_in + delta``)."""

    block_dim = -1  # columns of the state are independent

    @staticmethod
    def combine(M: Tensor, delta: Tensor, x: Tensor, block: slice = slice(None), out: Tensor = None) -> Tensor:
        """``delta + M x`` on ``block`` of the state (columns), ``x`` that block of the entering state (into
        ``out`` if given)."""
        return torch.matmul(M, x, out=out).add_(delta[..., block])

    @staticmethod
    def apply(M: Tensor, x: Tensor) -> Tensor:
        return torch.matmul(M, x)

    @staticmethod
    def compose(later: Tensor, earlier: Tensor) -> Tensor:
        return torch.matmul(later, earlier)

    @staticmethod
    def identity(like: Tensor) -> Tensor:
        eye = torch.eye(like.shape[-1], dtype=like.dtype, device=like.device)
        return eye.expand(like.shape).clone()

    @staticmethod
    def transpose(M: Tensor) -> Tensor:
        return M.transpose(-1, -2)

    @staticmethod
    def pack(M: Tensor, state: Tensor) -> Tensor:
        return torch.cat([state, M], dim=-1)

    @staticmethod
    def unpack(message: Tensor, V: int) -> Tuple[Tensor, Tensor]:
        """``(M, state)`` from a message of :meth:`pack`."""
        return message[..., V:], message[..., :V]

    @staticmethod
    def width(K: int) -> int:
        return K


Kind = Union[Type[Diagonal], Type[Dense]]


def transition_of(transition: Tensor, state: Tensor) -> Kind:
    """The kind of ``transition`` for states like ``state`` (``[..., K, V]``): ``[..., K]`` is a
    diagonal, ``[..., K, K]`` a dense matrix; ValueError otherwise."""
    if transition.shape == state.shape[:-1]:
        return Diagonal
    if transition.shape == (*state.shape[:-1], state.shape[-2]):
        return Dense
    raise ValueError(f"a scan's transition must be [..., K] (diagonal) or [..., K, K] (dense) for states "
                     f"[..., K, V] = {tuple(state.shape)}; got {tuple(transition.shape)}")
