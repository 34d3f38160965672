"""Packed sequences (Megatron's THD format) under context parallelism.

A packed sequence holds documents one after another; ``cu_seqlens`` gives their
offsets in the whole (unsplit) sequence, and GLA restarts from a zero state at each
document's first token. Two splits over the CP group are handled:

* whole sequence (``per_document=False``): the layout cuts the packed sequence like
  any other (Megatron-LM's split with ``--dataloader-inter-document-masking``). A
  piece may hold several documents and parts of documents.
* per document (``per_document=True``): the layout cuts every document (its length a
  multiple of the number of pieces) and a rank holds its pieces of each document,
  document by document. With the zigzag layout this is Megatron's THD split
  (Transformer Engine's ``thd_get_partitioned_indices``).

Either way a rank's tokens are a row of *pieces*, each one layout piece of one
*chain* (the whole sequence, or one document), chain by chain. Pieces are cut into
*segments* at document starts: the unit of the local varlen GLA. For the scan a piece
still maps the state entering it to the state leaving it, ``S_out = Diag(gamma) S_in + E``:

* ``E`` = the final state of its last segment (from a zero state);
* ``gamma`` = the piece's decay if no document starts in it, else 0 (a reset);
* ``S_in`` enters its first segment only, unless a document starts at its first token.

Per document, every chain is a full layout chain (document pieces 0..n-1 on their
owners), so the chains of all documents travel through one scan as a batch of states.
"""

import functools
from bisect import bisect_left, bisect_right
from collections import deque
from typing import List, Sequence, Tuple

import torch

from ..comm import Layout
from .checks import cu_seqlens_problems, document_pieces

Tensor = torch.Tensor


def _pieces(bounds: Sequence[int], layout: Layout, world: int, rank: int, per_document: bool
            ) -> List[Tuple[int, int]]:
    """Global token ranges ``[start, end)`` of ``rank``'s pieces, in its local order."""
    if world == 1:  # nothing is split: one rank holds everything in order
        return [(bounds[0], bounds[-1])]
    n = layout.num_pieces(world)
    chains = zip(bounds[:-1], bounds[1:]) if per_document else [(bounds[0], bounds[-1])]
    ranges = []
    for a, b in chains:
        size = (b - a) // n
        ranges += [(a + p * size, a + (p + 1) * size) for p in layout.pieces(rank, world)]
    return ranges


def _bounds(cu_seqlens: Tensor, layout: Layout, world: int, total: int, per_document: bool,
            who: str = "packed documents") -> List[int]:
    """Document offsets as a sorted list without empty documents; ValueError naming ``who`` if unusable."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    problems = cu_seqlens_problems(cu, total, document_pieces(layout, world, per_document))
    if problems:
        raise ValueError(f"{who}: invalid input: " + "; ".join(problems))
    return sorted(set(cu))


def packed_positions(cu_seqlens: Tensor, layout, world: int, rank: int, per_document: bool) -> Tensor:
    """Global indices of the tokens ``rank`` holds, in its local order (``[T]`` int64).

    ``x[:, packed_positions(...)]`` is a rank's part of a full packed sequence ``x``: with
    ``per_document=True`` and the zigzag layout, what Megatron's THD split gives it.
    """
    layout = Layout(layout)
    bounds = _bounds(cu_seqlens, layout, world, int(cu_seqlens[-1]), per_document, "packed_positions")
    return _positions(_pieces(bounds, layout, world, rank, per_document))


def _positions(ranges: Sequence[Tuple[int, int]]) -> Tensor:
    return torch.cat([torch.arange(a, b) for a, b in ranges] + [torch.zeros(0, dtype=torch.long)])


class Packing:
    """A rank's pieces of a packed sequence and their segments (see the module docstring).

    Used by the scan strategies in place of the dense view (``scan._Pieces``): the local
    operations run on ``[1, T, ...]`` with ``cu`` (segment offsets), and these methods map
    per-segment results to per-piece ones (chain-major, ``[C*n, ...]``) and back.
    """

    _cache: deque = deque(maxlen=8)  # (cu_seqlens, its version, key, Packing): one per step, not per layer

    def __init__(self, cu_seqlens: Tensor, layout: Layout, world: int, rank: int, local_len: int,
                 per_document: bool, device):
        bounds = _bounds(cu_seqlens, layout, world, world * local_len, per_document)
        self.world, self.layout, self.per_document, self.bounds = world, layout, per_document, bounds
        starts = bounds[:-1]
        first_tokens = set(starts)
        seg, head, tail, entered, through = [0], [], [], [], []
        for a, b in _pieces(bounds, layout, world, rank, per_document):
            cuts = starts[bisect_right(starts, a):bisect_left(starts, b)]  # documents starting inside
            head.append(len(seg) - 1)
            seg += [seg[-1] + c - a for c in cuts] + [seg[-1] + b - a]
            tail.append(len(seg) - 2)
            entered.append(a not in first_tokens)  # no document starts at the piece's first token
            through.append(entered[-1] and not cuts)
        # host copies of the segment and document offsets, for host-side launch tables
        self.cu_cpu, self.documents_cpu = torch.tensor(seg), torch.tensor(bounds)
        # Per document, every piece is one segment and every chain one document, whose first piece
        # the scan enters with its initial state (zeros: packed input has none) and whose backward
        # result out of that piece is dropped: the maps below are the identity there.
        self.identity = per_document
        # One host-to-device copy that does not wait for the GPU (a pageable copy would).
        tables = [bounds, seg, head, tail, entered, through]
        flat = torch.tensor([x for t in tables for x in t], dtype=torch.long)
        if torch.device(device).type == "cuda":
            flat = flat.pin_memory()
        self.documents, self.cu, self.head, self.tail, entered, through = \
            flat.to(device, non_blocking=True).split([len(t) for t in tables])
        self.entered, self.through = entered.bool(), through.bool()

    @classmethod
    def cached(cls, cu_seqlens: Tensor, layout: Layout, world: int, rank: int, local_len: int,
               per_document: bool, device) -> "Packing":
        """The Packing of these arguments, reused while ``cu_seqlens`` is the same unmodified tensor:
        every layer of a step gets the same ``cu_seqlens`` and pays for reading it once."""
        key = (layout, world, rank, local_len, per_document, torch.device(device))
        for tensor, version, k, packing in cls._cache:
            if tensor is cu_seqlens and version == cu_seqlens._version and k == key:
                return packing
        packing = cls(cu_seqlens, layout, world, rank, local_len, per_document, device)
        cls._cache.append((cu_seqlens, cu_seqlens._version, key, packing))
        return packing

    def local(self, x: Tensor) -> Tensor:
        """Inputs of the local operations: the rank's tokens as they are (``[1, T, ...]``)."""
        return x

    def summaries(self, E: Tensor, gamma: Tensor) -> Tuple[Tensor, Tensor]:
        """Per-segment ``(E, gamma)`` -> per-piece: the last segment's E; gamma 0 at a document start
        (gamma the decays ``[N, H, K]`` or a dense transition ``[N, H, K, K]``)."""
        if self.identity:
            return E, gamma
        through = self.through.view(-1, *(1,) * (gamma.dim() - 1))
        return E[self.tail], torch.where(through, gamma[self.head], 0)

    def initial_states(self, S_in: Tensor) -> Tensor:
        """Per-piece ``S_in`` -> per-segment initial states (zero where a document starts)."""
        if self.identity:
            return S_in
        entering = torch.where(self.entered[:, None, None, None], S_in, 0)
        return S_in.new_zeros(len(self.cu) - 1, *S_in.shape[1:]).index_copy(0, self.head, entering)

    def entering_grads(self, A: Tensor) -> Tensor:
        """Per-segment local ``dL/dS_in`` -> per-piece (what reaches the state entering the piece)."""
        if self.identity:
            return A
        return torch.where(self.entered[:, None, None, None], A[self.head], 0)

    def final_grads(self, D: Tensor) -> Tensor:
        """Per-piece gradient of the state leaving it -> per-segment final-state gradients."""
        if self.identity:
            return D
        return D.new_zeros(len(self.cu) - 1, *D.shape[1:]).index_copy(0, self.tail, D)

    @functools.cached_property
    def gathered(self) -> Tuple[Tensor, Tensor, List[int]]:
        """Every rank's tokens gathered rank by rank (a head all-to-all, softmax attention's K/V all-gather):
        their global indices (``order``), the permutation that puts them in sequence order (``inverse``,
        ``whole[:, inverse]``), and each rank's token count. Made once per Packing, so once per step."""
        parts = [_positions(_pieces(self.bounds, self.layout, self.world, r, self.per_document))
                 for r in range(self.world)]
        order = torch.cat(parts)
        flat = torch.cat([order, order.argsort()])
        if self.cu.device.type == "cuda":
            flat = flat.pin_memory()
        order, inverse = flat.to(self.cu.device, non_blocking=True).split(len(order))
        return order, inverse, [len(p) for p in parts]

    def positions(self, rank: int) -> Tensor:
        """Global indices of ``rank``'s tokens in its local order."""
        order, _, sizes = self.gathered
        return order.split(sizes)[rank]
