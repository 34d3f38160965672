"""How a sequence is laid out over the ranks of a context-parallel group.

The sequence is cut into equal *pieces*; each rank holds some of them, in
increasing order, concatenated along the sequence dimension:

* ``contiguous``: P pieces, rank r holds piece r.
* ``zigzag``: Megatron's load-balanced split, 2P pieces, rank r holds pieces r
  and 2P-1-r (so causal work is balanced).

The recurrent state walks the pieces in order 0, 1, ..., n-1; :func:`owner`
says which rank (and which of its local slots) holds each one.
"""

from dataclasses import dataclass
from enum import Enum
from typing import List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class ChainLink:
    """One of a rank's pieces in the walk of the chain (peers as ranks of the group)."""

    slot: int  # the piece's local slot
    piece: int
    src: Optional[int]  # rank holding the previous piece (None: no previous piece, or it is ours)
    src_slot: Optional[int]  # the previous piece's slot there
    dst: Optional[int]  # rank holding the next piece (None: no next piece, or it is ours)
    dst_slot: Optional[int]
    first: bool  # no predecessor: the incoming state is the scan's initial state
    last: bool  # no successor: the outgoing state is the scan's result


class Layout(str, Enum):
    CONTIGUOUS = "contiguous"
    ZIGZAG = "zigzag"

    def num_pieces(self, world: int) -> int:
        return world if self is Layout.CONTIGUOUS else 2 * world

    def pieces(self, rank: int, world: int) -> Tuple[int, ...]:
        """Pieces held by ``rank``, in local (= sequence) order."""
        if self is Layout.CONTIGUOUS:
            return (rank,)
        return (rank, 2 * world - 1 - rank)

    def owner(self, piece: int, world: int) -> Tuple[int, int]:
        """``(rank, local slot)`` holding ``piece``."""
        if self is Layout.CONTIGUOUS or piece < world:
            return piece, 0
        return 2 * world - 1 - piece, 1

    def links(self, rank: int, world: int, reverse: bool = False) -> List[ChainLink]:
        """``rank``'s pieces in the order a chain visits them (pieces 0, 1, ..., or backwards)."""
        n, step = self.num_pieces(world), (-1 if reverse else 1)
        links = []
        for slot, piece in enumerate(self.pieces(rank, world)):
            prev, nxt = piece - step, piece + step
            first, last = not 0 <= prev < n, not 0 <= nxt < n
            src, src_slot = (None, None) if first else self.owner(prev, world)
            dst, dst_slot = (None, None) if last else self.owner(nxt, world)
            links.append(ChainLink(slot, piece, None if src == rank else src, src_slot, None if dst == rank else dst,
                              dst_slot, first, last))
        return sorted(links, key=lambda link: link.piece, reverse=reverse)

    @staticmethod
    def first_wait(walk: Sequence[ChainLink]) -> int:
        """Index in a rank's walk (``links``) of its first piece whose state comes from another
        rank (``len(walk)`` if none): where the rank first waits on the chain. Local work that needs
        no scan result is best issued just before it: the rank computes while the chain reaches it
        (then finds its state there), and what it sent before (a chain's first piece) is on its way."""
        return next((i for i, link in enumerate(walk) if link.src is not None), len(walk))

    def shard(self, x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
        """This rank's part of a full sequence ``x`` (length divisible by the number of pieces)."""
        pieces = x.chunk(self.num_pieces(world), dim=dim)
        return torch.cat([pieces[p] for p in self.pieces(rank, world)], dim=dim)

    def unshard(self, parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of :meth:`shard`: the full sequence from every rank's part (in group rank order)."""
        world = len(parts)
        slots: List[Tuple[torch.Tensor, ...]] = [
            p.chunk(len(self.pieces(r, world)), dim=dim) for r, p in enumerate(parts)
        ]
        ordered = []
        for piece in range(self.num_pieces(world)):
            rank, slot = self.owner(piece, world)
            ordered.append(slots[rank][slot])
        return torch.cat(ordered, dim=dim)


def as_layout(layout) -> Layout:
    """``Layout`` from a name or a ``Layout``; a clear error otherwise."""
    try:
        return Layout(layout)
    except ValueError:
        names = ", ".join(repr(m.value) for m in Layout)
        raise ValueError(f"unknown context-parallel layout {layout!r}; expected one of {names}") from None
