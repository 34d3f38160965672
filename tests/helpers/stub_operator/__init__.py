"""An operator defined outside the package, registering itself as a plugin would: causal linear attention
without decay, ``S_t = S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t`` (a cumulative sum, a linear
recurrence whose transition is the identity). Importing this module registers its mixer ``stub``
(``megatron_zeco.cp.registry``) and its CP rules; ``tests/test_registry.py`` runs it through the package's
entry points. Dense input only: a packed call is refused."""

from typing import Optional, Tuple

import torch

from megatron_zeco.cp.config import Rules
from megatron_zeco.cp.operator import Arguments, Operator, Piece, call_operator
from megatron_zeco.cp.registry import Mixer, register

Tensor = torch.Tensor


def _state_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _refuse_packed(cu_seqlens: Optional[Tensor]) -> None:
    if cu_seqlens is not None:
        raise ValueError("zeco_cumsum: packed input (cu_seqlens) is not supported; pass dense [B, T, ...] tensors")


def _outputs(q: Tensor, k: Tensor, v: Tensor, scale: float, S_in: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """``o`` and the final state from the entering state ``S_in`` (None: zero)."""
    dtype = _state_dtype(q)
    S = torch.einsum("bthk,bthv->bthkv", k.to(dtype), v.to(dtype)).cumsum(1)
    if S_in is not None:
        S = S + S_in.to(dtype)[:, None]
    o = scale * torch.einsum("bthk,bthkv->bthv", q.to(dtype), S)
    return o.to(q.dtype), S[:, -1]


def cumsum_local(*inputs: Tensor, scale: float, initial_state: Optional[Tensor] = None,
                 output_final_state: bool = False, cu_seqlens: Optional[Tensor] = None,
                 cu_seqlens_cpu: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """The local op (``cp.operator.LocalOp``), differentiable through autograd."""
    _refuse_packed(cu_seqlens)
    o, final = _outputs(*inputs, scale, initial_state)
    return o, (final if output_final_state else None)


class CumsumPiece(Piece):
    """The piece (``cp.operator.Piece``): ``E = sum_t k_t v_t^T``, the transition all ones (decay 1); the
    output and the gradients through autograd of :func:`_outputs` from ``S_in``."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, scale: float, cu_seqlens: Optional[Tensor] = None,
                 cu_seqlens_cpu: Optional[Tensor] = None):
        _refuse_packed(cu_seqlens)
        self.inputs, self.scale = (q, k, v), scale
        dtype = _state_dtype(q)
        self.E = torch.einsum("bthk,bthv->bhkv", k.to(dtype), v.to(dtype))
        self.gamma = self.E.new_ones(self.E.shape[:3])

    @property
    def transition(self) -> Tensor:
        return self.gamma

    def output(self, S_in: Tensor) -> Tensor:
        with torch.enable_grad():
            self.leaves = [x.detach().requires_grad_() for x in self.inputs]
            self.o, self.S_out = _outputs(*self.leaves, self.scale, S_in.detach())
        return self.o.detach()

    def entering_grad(self, do: Tensor) -> Tensor:
        q = self.inputs[0]
        self.do = do
        return self.scale * torch.einsum("bthk,bthv->bhkv", q.to(self.E.dtype), do.to(self.E.dtype))

    def grads(self, D: Tensor) -> Tuple[Tensor, ...]:
        return torch.autograd.grad([self.o, self.S_out], self.leaves, [self.do, D])


CUMSUM = Operator(key="stub_cumsum", name="zeco_cumsum", inputs=(("q", "BTHK"), ("k", "BTHK"), ("v", "BTHV")),
                  local=cumsum_local, piece=CumsumPiece)


def zeco_cumsum(q: Tensor, k: Tensor, v: Tensor, *, group=None, strategy: str = "zeco", layout: str = "contiguous",
                initial_state: Optional[Tensor] = None, output_final_state: bool = False):
    """The operator's public function, as ``zeco_gla`` is GLA's."""
    args = Arguments((q, k, v), initial_state, output_final_state)
    return call_operator(CUMSUM, dict(strategy=strategy, layout=layout), args, group)


def layer_spec(use_te: bool = False, cp_config=None, normalization=None):
    """The mixer's layer spec builder: Megatron's local GPT layer with the mixer's CP config on its
    self-attention (enough for the specs to wire it; no layer is built from it)."""
    from dataclasses import replace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    base = get_gpt_layer_local_spec(normalization=normalization)
    mixer = ModuleSpec(module=torch.nn.Identity, params={"cp_config": cp_config})
    return replace(base, submodules=replace(base.submodules, self_attention=mixer))


RULES = Rules("the stub cumulative sum", ("zeco", "lasp2"), blocks="rows", auto_transport=None)
MIXER = register(Mixer(name="stub", title="Stub cumulative sum", operator=CUMSUM.key,
                       layer_spec="tests.helpers.stub_operator:layer_spec"), rules=RULES)
