"""The context-parallel strategies, one object each, by name.

=========  ==============================================  ==========================
strategy   what crosses ranks per layer                    where
=========  ==============================================  ==========================
zeco       one state per piece, pipelined All-Scan         scan.py (+ comm/all_scan)
lasp2      all-gather of every piece's state (and map)     scan.py (+ comm/all_scan)
lasp1      one state per piece, sequential ring            ring.py
a2a        the inputs and outputs, all-to-all over heads   a2a.py
none       nothing (one rank)                              local.py
=========  ==============================================  ==========================

A strategy runs one call of an operator (:class:`~megatron_zeco.cp.operator.Operator`) under a plan:
``strategy.run(op, plan, call, inputs, h0) -> (o, final)``. Which strategies an operator allows is its
rules' business (``cp.config.RULES``); the plan holds the strategy its config names.
"""

from typing import Optional, Tuple

import torch

from .a2a import head_all_to_all
from .local import initial_state_to
from .ring import RingOp
from .scan import ScanOp

Tensor = torch.Tensor


class Strategy:
    """A way to run an operator over a sequence split across the CP group.

    Attributes:
        name: the ``strategy`` knob's value.
        passes_states: the final state comes back only on the rank holding the last piece (scan, ring).
        all_scan: its states travel by All-Scan (the ``transport``, ``num_blocks`` and ``node_size``
            knobs apply; a contiguous piece runs as two batched halves unless ``piece_split`` says).
        packed: it runs packed documents (``cu_seqlens``).
        splits_heads: it splits the heads over the group (their count must divide).
    """

    name = ""
    passes_states = False
    all_scan = False
    packed = True
    splits_heads = False

    def run(self, op, plan, call, inputs: Tuple[Tensor, ...], h0: Optional[Tensor]):
        """``(o, final)`` of ``op`` over this rank's ``inputs`` (``final``: where ``passes_states``, the
        last piece's rank holds it and the others zeros)."""
        raise NotImplementedError

    def __repr__(self):
        return f"<strategy {self.name}>"


class Local(Strategy):
    """``none``: the operator's local op on one rank (every strategy is this at a group of one)."""

    name = "none"

    def run(self, op, plan, call, inputs, h0):
        return op.run_local(inputs, initial_state_to(h0, inputs[0]), call)


class Scan(Strategy):
    """``zeco`` (All-Scan) and ``lasp2`` (all-gather scan): each rank summarises its pieces, the scan gives
    each piece its entering state, the piece's output follows (``scan.py``)."""

    passes_states = True

    def __init__(self, name: str):
        self.name = name
        self.all_scan = name == "zeco"

    def run(self, op, plan, call, inputs, h0):
        return ScanOp.apply(op.make_piece, plan, call, h0, *inputs)


class Ring(Strategy):
    """``lasp1``: the ranks run one after another, each from the state the previous one passes (``ring.py``)."""

    name = "lasp1"
    passes_states = True
    packed = False

    def run(self, op, plan, call, inputs, h0):
        return RingOp.apply(op.ring, plan, call, h0, *inputs)


class HeadAllToAll(Strategy):
    """``a2a``: trade the sequence split for a head split around the local op (``a2a.py``)."""

    name = "a2a"
    splits_heads = True

    def run(self, op, plan, call, inputs, h0):
        return head_all_to_all(op, plan, call, inputs, h0)


LOCAL = Local()
# Every strategy object by its name (``cp.STRATEGIES`` lists the names).
BY_NAME = {s.name: s for s in (Scan("zeco"), Ring(), Scan("lasp2"), HeadAllToAll(), LOCAL)}
