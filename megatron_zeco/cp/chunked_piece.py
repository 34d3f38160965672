"""A ZeCO piece of a delta-rule-like operator on its chunked PyTorch forms (the CPU and float64 path).

A piece maps the state entering it to the state leaving it by ``S_out = M S_in + E``. :class:`ChunkedPiece`
implements :class:`megatron_zeco.cp.operator.Piece` on an operator's chunked forms: its summary and its
entering-state gradient ``A`` as passes of their own, the output and the inputs' gradients through autograd
of the chunked form started from ``S_in``. On CUDA the delta rules' pieces run fla's kernels from
a zero state plus a correction for the entering state (``gated_delta_rule/fla_piece.py``,
``kda/fla_piece.py``).
"""

from typing import Callable, NamedTuple, Optional, Tuple

import torch

from ..common.backend import record, replay
from .operator import Piece

Tensor = torch.Tensor


class ChunkedForms(NamedTuple):
    """An operator's chunked PyTorch forms, what :class:`ChunkedPiece` runs on.

    * ``chunk(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens=) -> (o, final)``:
      the operator, differentiable;
    * ``state(k, v, g, beta, cu_seqlens=) -> (E, M)``: a piece's summary from a zero state;
    * ``state_grad(q, k, g, beta, do, scale, cu_seqlens=) -> A``: the gradient of ``<do, o>`` with
      respect to the entering state.
    """
    chunk: Callable
    state: Callable
    state_grad: Callable


class ChunkedPiece(Piece):
    """A :class:`~megatron_zeco.cp.operator.Piece` on an operator's :class:`ChunkedForms`: the summary
    ``E`` and ``M [N, H, K, K]`` (the transition) and ``A`` as passes of their own, the output and the
    gradients (dq, dk, dv, dg, dbeta) through autograd of the chunked form started from ``S_in``."""

    def __init__(self, forms: ChunkedForms, inputs: Tuple[Tensor, ...], scale: float,
                 cu_seqlens: Optional[Tensor] = None):
        self.forms, self.inputs, self.scale, self.cu = forms, inputs, scale, cu_seqlens
        _, k, v, g, beta = inputs
        self.E, self.M = forms.state(k, v, g, beta, cu_seqlens=cu_seqlens)

    @property
    def transition(self) -> Tensor:
        return self.M

    def output(self, S_in: Tensor) -> Tensor:
        o, _, self.saved = record(self.forms.chunk, self.inputs, S_in, scale=self.scale, output_final_state=True,
                                  cu_seqlens=self.cu)
        return o

    def entering_grad(self, do: Tensor) -> Tensor:
        q, k, _, g, beta = self.inputs
        self.do = do
        return self.forms.state_grad(q, k, g, beta, do, self.scale, cu_seqlens=self.cu)

    def grads(self, D: Tensor) -> Tuple[Tensor, ...]:
        return replay(self.saved, self.do, D)[0]
