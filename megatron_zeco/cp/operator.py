"""What an operator gives the context-parallel strategies, and one call through them.

An operator (GLA, the gated delta rule, ...) is a folder of its own (``megatron_zeco/gla/``,
``megatron_zeco/gated_delta_rule/``) that describes itself to the strategies with an
:class:`Operator`: its per-token inputs and their shapes, its local op over a piece from a given
state (strategies ``none`` and ``a2a``; a :class:`LocalOp`, fla's calling convention), its *piece*
(``zeco`` and ``lasp2``: a :class:`Piece`, the summary of a piece before the scan, the output after
it), and for ``lasp1`` its forward from a state and backward to one. Its context-parallel rules are
its entry in :data:`megatron_zeco.cp.config.RULES`. :class:`LocalOp` and :class:`Piece` are the
extension points a new operator implements; the strategies use nothing else of it.

:func:`call_operator` is what the public functions (``zeco_gla``, ``zeco_gated_delta_rule``) do:
make the config from their keywords, check the inputs on every rank alike, plan, run.
:func:`run_planned` is the same under a plan built beforehand (a layer's).
"""

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Tuple

import torch

from ..comm.transport import TRANSPORT_ENV
from .checks import check_inputs, local_call_problems
from .config import CPConfig
from .packed import Packing
from .piece import PIECE_MEMBERS, Piece  # the piece protocol, declared in cp/piece.py
from .plan import CPPlan, final_state_everywhere, make_plan

Tensor = torch.Tensor


class LocalOp(Protocol):
    """An operator's local op, in flash-linear-attention's calling convention (``chunk_gla``,
    ``chunk_gated_delta_rule``, ``chunk_kda``): the operator over this device's tokens from a given state,
    differentiable in every input and ``initial_state``.

    Args:
        *inputs: the per-token tensors ``[B, T, H, ...]`` in ``Operator.inputs`` order (q first).
        scale: the output scale.
        initial_state: ``[B, H, K, V]`` (``[N, H, K, V]`` with ``cu_seqlens``) in the state dtype
            (float32; float64 for float64 inputs), or None for a zero state.
        output_final_state: whether the state after the last token is returned.
        cu_seqlens: ``[N+1]`` int64 offsets of N packed documents (B = 1), each from a zero state, or None.
        cu_seqlens_cpu: the same offsets on the host (fla builds its launch tables from them), or None.
    Returns:
        ``o [B, T, H, V]`` in the input dtype and the final state (state dtype), or None when not asked for.
    """

    def __call__(self, *inputs: Tensor, scale: float, initial_state: Optional[Tensor] = None,
                 output_final_state: bool = False, cu_seqlens: Optional[Tensor] = None,
                 cu_seqlens_cpu: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        ...


@dataclass(frozen=True)
class Operator:
    """An operator's hooks into the strategies (see the module docstring).

    Attributes:
        key: its entry in ``cp.config.RULES``.
        name: its public function's name (errors name it).
        inputs: per-token inputs in call order, each with its dims: ``BTHK`` (a key-sized vector
            per token and head), ``BTHV`` (value-sized) or ``BTH`` (a scalar per token and head).
        local: the op over this rank's tokens from a given state, a :class:`LocalOp` (strategies
            ``none`` and ``a2a`` call it through :meth:`run_local`).
        piece: ``piece(*inputs, scale, cu_seqlens=, cu_seqlens_cpu=) -> Piece``: a piece whose entering
            state comes from a scan (:class:`Piece`; strategies ``zeco`` and ``lasp2`` make it through
            :meth:`make_piece`).
        ring: ``(forward, backward)`` for ``lasp1``: ``forward(inputs, scale, h0) -> (o, final, saved)``,
            ``backward(saved, do, dht) -> (*grads, dh0)``; None where the operator has no lasp1.
        float32: inputs that may be float32 beside lower-precision others (log decays, as fla takes them).
    """

    key: str
    name: str
    inputs: Tuple[Tuple[str, str], ...]
    local: LocalOp
    piece: Callable[..., Piece]
    ring: Optional[Tuple[Callable, Callable]] = None
    float32: Tuple[str, ...] = ()

    def run_local(self, inputs: Tuple[Tensor, ...], h0: Optional[Tensor], call: "Call"
                  ) -> Tuple[Tensor, Optional[Tensor]]:
        """``(o, final state or None)`` of :attr:`local` over ``inputs`` from ``h0`` (state dtype), the
        call's scale, final state and packed documents (each from a zero state) passed as fla takes them."""
        cu_seqlens, cu_seqlens_cpu = call.documents or (None, None)
        o, final = self.local(*inputs, scale=call.scale, initial_state=h0,
                              output_final_state=call.output_final_state, cu_seqlens=cu_seqlens,
                              cu_seqlens_cpu=cu_seqlens_cpu)
        return o, (final if call.output_final_state else None)

    def make_piece(self, *inputs: Tensor, scale: float, cu_seqlens: Optional[Tensor] = None,
                   cu_seqlens_cpu: Optional[Tensor] = None) -> Piece:
        """:attr:`piece` over ``inputs``, refused with a ``TypeError`` naming what it lacks if it is not a
        :class:`Piece` (rather than an ``AttributeError`` in the middle of the scan)."""
        piece = self.piece(*inputs, scale, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        if not isinstance(piece, Piece):
            missing = [n for n in PIECE_MEMBERS if not hasattr(piece, n)]
            raise TypeError(f"{self.name}: its piece ({type(piece).__qualname__}) lacks {', '.join(missing)}: an "
                            "operator's piece must implement megatron_zeco.cp.operator.Piece (subclass it for "
                            "the no-op hooks)")
        return piece


@dataclass(frozen=True)
class Call:
    """One call's arguments as the strategies take them.

    Attributes:
        scale: the output scale.
        output_final_state: whether the state after the last token is returned.
        packing: this rank's packed documents (:class:`~megatron_zeco.cp.packed.Packing`), or None.
        piece_split: sub-pieces per piece (``zeco``, ``lasp2``).
    """

    scale: float
    output_final_state: bool = False
    packing: Optional[Packing] = None
    piece_split: int = 1

    @property
    def documents(self) -> tuple:
        """The document offsets a local op over the whole packed sequence takes (device, host), or ()."""
        return () if self.packing is None else (self.packing.documents, self.packing.documents_cpu)


@dataclass
class Arguments:
    """A call of an operator as its user made it: the per-token tensors (``Operator.inputs`` order)
    and the rest of the public function's arguments."""

    tensors: Tuple[Tensor, ...]
    initial_state: Optional[Tensor] = None
    output_final_state: bool = False
    cu_seqlens: Optional[Tensor] = None
    per_document: bool = False
    scale: Optional[float] = None


# Plans of the public functions' calls, by what the cross-rank check compares: a loop calling an op with
# the same shapes and knobs checks and plans once (no collective, no host read after its first call).
_PLANS: "OrderedDict[tuple, Tuple[CPPlan, bool]]" = OrderedDict()
_PLANS_KEPT = 256


def _describe(x) -> Optional[tuple]:
    return None if x is None else (tuple(x.shape), x.dtype, x.device)


def _call_key(op: Operator, knobs: dict, args: Arguments, group, name: str) -> Optional[tuple]:
    """What makes two calls alike for the checks: None for packed calls (their offsets change per batch
    and are checked every call)."""
    if args.cu_seqlens is not None:
        return None
    return (op.key, group, name, tuple(sorted(knobs.items(), key=lambda kv: kv[0])),
            tuple(_describe(x) for x in args.tensors), _describe(args.initial_state), bool(args.output_final_state),
            bool(args.per_document), args.scale, os.environ.get(TRANSPORT_ENV))


def call_operator(op: Operator, knobs: dict, args: Arguments, group, validate: bool = True,
                  name: Optional[str] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """The public operator function: ``knobs`` (the CP keywords) into a config, the inputs checked
    (``validate``: on every rank alike, one small collective; else the local checks only), a plan over
    ``group``, the call run. Returns ``(o, final state or None)``.

    Calls alike in group, knobs and the inputs' shapes, dtypes and devices (unpacked ones) reuse the
    plan of the first, and with it its cross-rank check: only a call unlike every one before it (on this
    rank) runs the collective."""
    name = name or op.name
    refuse_packed_capture(name, args.cu_seqlens is not None)
    key = _call_key(op, knobs, args, group, name)
    plan, checked = _PLANS.get(key, (None, False)) if key is not None else (None, False)
    if plan is None or (validate and not checked):
        refuse_capture(name, "its first call with these shapes and knobs checks the inputs across ranks and makes "
                              "its plan (collectives, host reads): make one call before capturing")
        try:
            config, problems = CPConfig(operator=op.key, **knobs), []
        except ValueError as e:
            config, problems = None, [str(e)]
        if validate:
            check_inputs(op, config, problems, args, group, name)
        elif problems:
            raise ValueError(f"{name}: invalid input: " + "; ".join(problems))
        plan, checked = make_plan(config, group, like=args.tensors[0], name=name), validate
        if key is not None:
            _PLANS[key] = (plan, checked)
            while len(_PLANS) > _PLANS_KEPT:
                _PLANS.popitem(last=False)
    return run_planned(op, plan, args, checked=checked)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def refuse_capture(name: str, why: str) -> None:
    """RuntimeError naming ``why`` if the current CUDA stream is being captured into a graph: a path that
    cannot be captured fails at once, by name, rather than hang or fail inside the capture."""
    if _capturing():
        raise RuntimeError(f"{name}: cannot be captured in a CUDA graph: {why}")


def refuse_packed_capture(name: str, packed: bool) -> None:
    """RuntimeError if a packed call (``packed``) is being captured in a CUDA graph (:func:`refuse_capture`)."""
    if packed:
        refuse_capture(name, "packed documents (cu_seqlens) are read on the host at every call (where each "
                              "rank's documents start and end; fla's varlen kernels read them too): capture "
                              "dense batches, and run packed ones eagerly")


def _check_capture(plan: CPPlan) -> None:
    """The paths of a planned call that a CUDA graph cannot hold (see :func:`refuse_capture`)."""
    if not _capturing():
        return
    if plan.world > 1 and plan.strategy.all_scan and not plan.transport.device:
        refuse_capture(plan.name, f"its All-Scan goes over {plan.transport.value} (host-issued messages); the "
                                   "device transports are capturable: cp_transport / transport='peer_memory' (one "
                                   "node) or 'nvshmem'")


def run_planned(op: Operator, plan: CPPlan, args: Arguments, checked: bool = False
                ) -> Tuple[Tensor, Optional[Tensor]]:
    """One call under a plan built beforehand (:func:`~megatron_zeco.cp.plan.make_plan`, once per layer). ``checked``: the
    inputs passed :func:`check_inputs` (else the cheap local checks of the call's shape run here)."""
    q = args.tensors[0]
    packed = args.cu_seqlens is not None
    refuse_packed_capture(plan.name, packed)
    piece_split = plan.piece_split(q.shape[1], packed)
    if not checked:
        problems = local_call_problems(plan, args, piece_split)
        if problems:
            raise ValueError(f"{plan.name}: invalid input: " + "; ".join(problems))
    _check_capture(plan)
    scale = q.shape[-1] ** -0.5 if args.scale is None else args.scale
    packing = None if not packed else Packing.cached(args.cu_seqlens, plan.layout, plan.world, plan.rank,
                                                     q.shape[1], args.per_document, q.device)
    call = Call(scale, args.output_final_state, packing, piece_split)
    o, final = plan.strategy.run(op, plan, call, args.tensors, args.initial_state)
    if not args.output_final_state:
        return o, None
    return o, (final if plan.world == 1 or not plan.strategy.passes_states else final_state_everywhere(plan, final))
