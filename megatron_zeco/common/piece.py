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
"""

from typing import Callable, Optional, Tuple

import torch

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
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
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
        with torch.enable_grad():
            self.leaves = tuple(x.detach().requires_grad_() for x in (*self.inputs, S_in))
            self.o, self.final = self.local(*self.leaves[:5], scale=self.scale, initial_state=self.leaves[5],
                                            output_final_state=True, **self.documents)
        return self.o.detach()

    def entering_grad(self, do: Tensor) -> Tensor:
        self.do = do
        (A,) = torch.autograd.grad(self.o, self.leaves[5], do, retain_graph=True)
        return A

    def grads(self, D: Tensor) -> Tuple[Tensor, ...]:
        grads = torch.autograd.grad([self.o, self.final], self.leaves[:5], [self.do, D.to(self.final.dtype)])
        del self.o, self.final, self.leaves
        return grads
