"""A ZeCO piece of any delta-rule-like operator built from its local op alone, by linearity in the state.

A piece maps the state entering it to the state leaving it by ``S_out = M S_in + E``. Run the local op
once with the values extended by K zero columns, ``[v | 0]``, from the entering state ``[0 | I]`` (the
identity in the new columns): the state it leaves is ``[E | M]``, the piece's whole summary, in one call
(the columns of a state never mix). After the scan the op runs again from ``S_in``; the entering-state
gradient ``A`` and the inputs' gradients are autograd's of that call, ``A`` from the outputs alone,
the rest once the leaving state's gradient ``D`` is known.

So any local op with an initial and a final state serves (fla's kernels on CUDA: two forwards and two
backwards of the op, the first forward over V + K columns). An operator with kernels of its own for
the summary and the correction (``gated_delta_rule/fla_piece.py``) does less.

:class:`ChunkedPiece` is the same protocol on an operator's chunked PyTorch form (the CPU and float64
path), whose summary and entering-state gradient are passes of their own.
"""

from typing import Callable, NamedTuple, Optional, Tuple

import torch

from .backend import record, replay
from .chunked import state_dtype

Tensor = torch.Tensor


class LocalOpPiece:
    """The piece protocol (``cp.operator.Operator.piece``) on ``local(q, k, v, g, beta, scale=,
    initial_state=, output_final_state=, cu_seqlens=, cu_seqlens_cpu=) -> (o, final)``.

    ``E [N, H, K, V]`` and ``M [N, H, K, K]`` in the local op's state dtype (N = B, or one per segment
    with ``cu_seqlens``); ``output(S_in)``, ``entering_grad(do)``, ``grads(D)`` in that order.
    """

    def __init__(self, local: Callable, inputs: Tuple[Tensor, ...], scale: float,
                 cu_seqlens: Optional[Tensor] = None, cu_seqlens_cpu: Optional[Tensor] = None):
        self.local, self.inputs, self.scale = local, inputs, scale
        self.documents = {} if cu_seqlens is None else dict(cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        q, k, v, g, beta = inputs
        N = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
        H, K, V = v.shape[2], k.shape[-1], v.shape[-1]
        wide = torch.cat([v, v.new_zeros(*v.shape[:-1], K)], dim=-1)
        dtype = state_dtype(q.dtype)
        h0 = torch.zeros(N, H, K, V + K, dtype=dtype, device=q.device)
        h0[..., V:] = torch.eye(K, dtype=dtype, device=q.device)
        with torch.no_grad():
            _, summary = local(q, k, wide, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                               **self.documents)
        self.E, self.M = summary[..., :V].contiguous(), summary[..., V:].contiguous()

    @property
    def transition(self) -> Tensor:
        return self.M

    def before_output(self) -> None:
        pass

    def before_grads(self) -> None:
        pass

    def output(self, S_in: Tensor) -> Tensor:
        o, _, self.saved = record(self.local, self.inputs, S_in, scale=self.scale, output_final_state=True,
                                  **self.documents)
        return o

    def entering_grad(self, do: Tensor) -> Tensor:
        self.do = do
        (A,) = torch.autograd.grad(self.saved.o, self.saved.leaves[-1], do, retain_graph=True)
        return A

    def grads(self, D: Tensor) -> Tuple[Tensor, ...]:
        grads, _ = replay(self.saved, self.do, D.to(self.saved.ht.dtype))
        del self.saved  # the local op's graph, no longer needed
        return grads


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


class ChunkedPiece:
    """The piece protocol (``cp.operator.Operator.piece``) on an operator's :class:`ChunkedForms`: the
    summary and ``A`` as passes of their own, the output and the gradients through autograd of the
    chunked form started from ``S_in``.

    Holds the summary ``E [N, H, K, V]`` and ``M [N, H, K, K]`` (state dtype; ``S_out = M S_in + E``;
    N = B, or one per segment with ``cu_seqlens``), ``transition`` (= ``M``), and, called in this order:

    * ``before_output()``: work that needs no entering state (a no-op here);
    * ``output(S_in) -> o``: the output given the entering state ``[N, H, K, V]``;
    * ``entering_grad(do) -> A [N, H, K, V]``: the gradient of ``<do, o>`` with respect to ``S_in``
      (that of the whole loss is ``A + M^T D``);
    * ``before_grads()``: likewise (a no-op here);
    * ``grads(D) -> (dq, dk, dv, dg, dbeta)``: the inputs' gradients given ``D``, the gradient of the
      state leaving the piece.
    """

    def __init__(self, forms: ChunkedForms, inputs: Tuple[Tensor, ...], scale: float,
                 cu_seqlens: Optional[Tensor] = None):
        self.forms, self.inputs, self.scale, self.cu = forms, inputs, scale, cu_seqlens
        _, k, v, g, beta = inputs
        self.E, self.M = forms.state(k, v, g, beta, cu_seqlens=cu_seqlens)

    @property
    def transition(self) -> Tensor:
        return self.M

    def before_output(self) -> None:
        pass

    def before_grads(self) -> None:
        pass

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
