"""The piece protocol: what the scan strategies (``zeco``, ``lasp2``; ``cp/scan.py``) use of an operator's piece
of a sequence, declared apart from the rest of an operator's hooks (``cp/operator.py``, which re-exports it) so
that the scan reads it without importing the strategies' callers."""

from abc import abstractmethod
from typing import Callable, Optional, Protocol, Tuple, runtime_checkable

import torch

Tensor = torch.Tensor


@runtime_checkable
class Piece(Protocol):
    """A piece of a sequence whose entering state comes later, from a scan (strategies ``zeco`` and
    ``lasp2``, ``cp/scan.py``): an operator's forward and backward cut in two around the scan.

    A piece maps the state entering it to the state leaving it by ``S_out = T S_in + E``. N below is the
    batch (one entry per piece and sub-piece) or, packed, one entry per document segment; states are
    ``[N, H, K, V]`` in the state dtype (float32; float64 for float64 inputs). The scan uses these
    members and no others, in this order: ``E`` and ``transition`` once the piece is made;
    ``before_output``, then ``output``; in backward ``entering_grad``, ``before_grads``, then ``grads``.

    Implement it by subclassing (the two hooks default to no-ops) or structurally; an operator's
    ``piece`` that returns an object lacking a member is refused where the piece is made
    (:meth:`Operator.make_piece`). A subclass that keeps a hook's no-op has no such work
    (:func:`local_work`): its scan in that direction then runs on the current stream, on every
    program, with nothing beside it (the scan's overlap is for hiding that work).

    Attributes:
        E: ``[N, H, K, V]``: the state leaving the piece when it is entered by a zero state.
        transition: the linear part ``T`` of the piece's map: decays ``[N, H, K]`` (``T = Diag(gamma)``,
            GLA) or a dense ``[N, H, K, K]`` matrix (the delta rules' ``M``) (``comm/transition.py``).
    """

    E: Tensor

    @property
    @abstractmethod
    def transition(self) -> Tensor:
        """The linear part of the piece's map (see the class docstring)."""

    def before_output(self) -> None:
        """Work that needs no entering state, issued while the scan is in flight (no-op by default);
        ``output`` must run it itself if it has not run."""

    @abstractmethod
    def output(self, S_in: Tensor) -> Tensor:
        """``o [B, T, H, V]`` (the input dtype) of the piece entered by ``S_in [N, H, K, V]``."""

    @abstractmethod
    def entering_grad(self, do: Tensor) -> Tensor:
        """``A [N, H, K, V]``: the gradient of ``<do, o>`` with respect to ``S_in`` (that of the whole
        loss is ``A + T^T D``, which the reverse scan forms)."""

    def before_grads(self) -> None:
        """Work that needs no gradient of the leaving state, issued while the reverse scan is in flight
        (no-op by default); ``grads`` must run it itself if it has not run."""

    @abstractmethod
    def grads(self, D: Tensor) -> Tuple[Tensor, ...]:
        """The inputs' gradients (``Operator.inputs`` order, the inputs' dtypes) given ``D [N, H, K, V]``,
        the gradient of the state leaving the piece."""


def local_work(piece: Piece, hook: str) -> Optional[Callable[[], None]]:
    """``piece``'s hook ``before_output`` or ``before_grads`` (work that needs no scan result), or None where the
    piece keeps the protocol's no-op: it has no such work."""
    if getattr(type(piece), hook, None) is getattr(Piece, hook):
        return None
    return getattr(piece, hook)


# Piece's members, what a structural piece must have (named in the error that refuses one lacking any).
PIECE_MEMBERS = tuple(n for n in (*Piece.__annotations__, *vars(Piece)) if not n.startswith("_"))
