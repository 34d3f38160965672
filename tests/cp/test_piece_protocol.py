"""Every operator's pieces implement ``cp.operator.Piece``, and a piece that does not is refused where it is made."""

import inspect

import pytest
import torch

from megatron_zeco.cp.chunked_piece import ChunkedPiece
from megatron_zeco.cp.operator import PIECE_MEMBERS, Operator, Piece
from megatron_zeco.gated_delta_rule.op import GATED_DELTA_RULE
from megatron_zeco.gla.local import _TorchPiece
from megatron_zeco.gla.op import GLA
from megatron_zeco.kda.op import KDA
from tests.helpers.reference import delta_problem, kda_problem, problem


def _fla_pieces():
    """The CUDA pieces, by class: their modules import without fla (fla's kernels load on first use)."""
    from megatron_zeco.gated_delta_rule.fla_piece import FlaPiece as GatedDeltaRulePiece
    from megatron_zeco.gla.fla_piece import FlaPiece as GLAPiece
    from megatron_zeco.kda.fla_piece import FlaPiece as KDAPiece

    return [GLAPiece, GatedDeltaRulePiece, KDAPiece]


def test_members():
    assert PIECE_MEMBERS == ("E", "transition", "before_output", "output", "entering_grad", "before_grads", "grads")


@pytest.mark.parametrize("cls", [_TorchPiece, ChunkedPiece, *_fla_pieces()],
                         ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_piece_classes_implement_the_protocol(cls):
    """Each piece class subclasses Piece (issubclass does not apply to a protocol with a data member) and
    defines every method and property it declares abstract (the two hooks may stay Piece's no-ops)."""
    assert Piece in cls.__mro__, f"{cls.__name__} does not subclass Piece"
    assert not inspect.isabstract(cls), f"{cls.__name__} lacks {sorted(cls.__abstractmethods__)}"
    for name in PIECE_MEMBERS[1:]:
        assert callable(getattr(cls, name)) or isinstance(getattr(cls, name), property), name


def _inputs(op):
    if op is GLA:
        x = problem(0, B=2, T=12, H=2, K=4, V=3)
    elif op is KDA:
        x = kda_problem(0, B=2, T=12, H=2, K=4, V=3)
    else:
        x = delta_problem(0, B=2, T=12, H=2, K=4, V=3)
    return tuple(x[name] for name, _ in op.inputs)


@pytest.mark.parametrize("op", [GLA, GATED_DELTA_RULE, KDA], ids=lambda op: op.key)
def test_operators_make_pieces(op):
    """Each operator's pieces on the CPU are Pieces, made through Operator.make_piece as the scan makes them, and
    behave as the protocol says: output from S_in, then A and the inputs' gradients in the inputs' order."""
    inputs = _inputs(op)
    piece = op.make_piece(*inputs, scale=0.5)
    assert isinstance(piece, Piece)
    N, H, K, V = piece.E.shape
    assert piece.transition.shape[:3] == (N, H, K)
    piece.before_output()
    o = piece.output(torch.zeros_like(piece.E))
    assert o.shape == (*inputs[0].shape[:3], V)
    A = piece.entering_grad(torch.ones_like(o))
    assert A.shape == piece.E.shape
    piece.before_grads()
    grads = piece.grads(torch.zeros_like(A))
    assert [g.shape for g in grads] == [x.shape for x in inputs]


class _Incomplete:
    """A piece lacking ``grads`` (and not subclassing Piece)."""

    def __init__(self, q, *rest):
        self.E = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], q.shape[3])
        self.transition = q.new_ones(q.shape[0], q.shape[2], q.shape[3])

    def before_output(self):
        pass

    def output(self, S_in):
        return S_in

    def entering_grad(self, do):
        return do

    def before_grads(self):
        pass


def test_incomplete_piece_is_refused_where_made():
    op = Operator(key="gla", name="zeco_incomplete", inputs=GLA.inputs, local=GLA.local,
                  piece=lambda *inputs, cu_seqlens=None, cu_seqlens_cpu=None: _Incomplete(*inputs))
    refusal = r"zeco_incomplete: its piece \(_Incomplete\) lacks grads: .*megatron_zeco\.cp\.operator\.Piece"
    with pytest.raises(TypeError, match=refusal):
        op.make_piece(*_inputs(GLA), scale=0.5)


def test_subclass_missing_a_member_cannot_be_made():
    class NoOutput(Piece):
        def __init__(self):
            self.E = torch.zeros(1, 1, 1, 1)

        @property
        def transition(self):
            return torch.ones(1, 1, 1)

        def entering_grad(self, do):
            return do

        def grads(self, D):
            return ()

    with pytest.raises(TypeError, match="abstract method.*output"):
        NoOutput()


def test_a_hook_kept_as_the_protocols_no_op_is_no_local_work():
    """``local_work``: a piece class that keeps ``before_output`` or ``before_grads`` as Piece's no-op has no such
    work (the scan then puts nothing beside it, and keeps its hops on the current stream); one that defines it
    has, also structurally. The CUDA pieces hide work in both directions (the delta rules' backward: what fla's
    backward computes before it first reads the leaving state's gradient)."""
    from megatron_zeco.cp.piece import local_work

    class Bare(Piece):
        E = None
        transition = None
        output = entering_grad = grads = lambda self, x: x

    class Forward(Bare):
        def before_output(self):
            self.ran = True

    class Structural:
        def before_grads(self):
            pass

    assert local_work(Bare(), "before_output") is None and local_work(Bare(), "before_grads") is None
    work = local_work(Forward(), "before_output")
    work()
    assert work.__self__.ran and local_work(Forward(), "before_grads") is None
    assert local_work(Structural(), "before_grads") is not None
    gla, gdn, kda = _fla_pieces()
    hides = {cls.__name__ + cls.__module__: [getattr(cls, hook) is not getattr(Piece, hook)
                                             for hook in ("before_output", "before_grads")] for cls in (gla, gdn, kda)}
    assert list(hides.values()) == [[True, True]] * 3, hides
