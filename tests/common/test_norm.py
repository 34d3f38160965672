"""The gated output norm (megatron_zeco.common.norm.gated_rms_norm) against a float64 row-by-row reference:
its PyTorch form on the CPU, fla's fused kernel on a GPU; inputs from ~0 to large, rows where eps dominates."""

import importlib.util

import pytest
import torch

from megatron_zeco.common.norm import gated_rms_norm
from tests.helpers.reference import rel_err

HAVE_FLA = importlib.util.find_spec("fla") is not None
EPS = 1e-5


def _reference(x, gate, weight, eps, activation):
    """Row by row in float64: x / sqrt(mean(x^2) + eps) * weight * act(gate)."""
    rows = x.reshape(-1, x.shape[-1])
    gates = gate.reshape(-1, x.shape[-1])
    out = []
    for row, g in zip(rows, gates):
        rms = torch.sqrt((row ** 2).mean() + eps)
        act = g / (1 + torch.exp(-g)) if activation == "silu" else 1 / (1 + torch.exp(-g))
        out.append(row / rms * weight * act)
    return torch.stack(out).reshape(x.shape)


def _inputs(seed, shape, device="cpu", dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    # per row a scale from 1e-4 (eps dominates the mean square) to 1e2
    x = x * torch.logspace(-4, 2, x.shape[-2], dtype=torch.float64).unsqueeze(-1)
    gate = 3 * torch.randn(shape, generator=gen, dtype=torch.float64)
    weight = 1 + 0.5 * torch.randn(shape[-1], generator=gen, dtype=torch.float64)
    return [t.to(device, dtype).requires_grad_() for t in (x, gate, weight)]


def _grads(out, inputs, dy):
    return torch.autograd.grad((out.double() * dy).sum(), inputs)


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_form_matches_float64_rows(seed, activation, dtype):
    """Output and the gradients of x, gate and weight (the reference's by autograd in float64)."""
    x, gate, weight = _inputs(seed, (2, 5, 3, 16), dtype=dtype)
    want = [t.detach().double().requires_grad_() for t in (x, gate, weight)]
    ref = _reference(*want, EPS, activation)
    got = gated_rms_norm(x, gate, weight, EPS, activation)
    assert got.dtype == dtype
    dy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert rel_err(got, ref) < tol
    for name, g, r in zip(("x", "gate", "weight"), _grads(got, [x, gate, weight], dy), _grads(ref, want, dy)):
        assert rel_err(g, r) < tol, name


def test_eps_and_activation_are_used():
    """A mutation guard: another eps, or the other activation, is visible in float64."""
    x, gate, weight = _inputs(0, (1, 8, 16))
    out = gated_rms_norm(x, gate, weight, EPS, "silu")
    assert rel_err(gated_rms_norm(x, gate, weight, 1e-6, "silu"), out) > 1e-3
    assert rel_err(gated_rms_norm(x, gate, weight, EPS, "sigmoid"), out) > 1e-1


@pytest.mark.parametrize("bad, match", [(dict(activation="gelu"), "activation 'gelu'"),
                                        (dict(gate=torch.zeros(2, 4)), "differ in shape")])
def test_bad_arguments_name_the_problem(bad, match):
    args = dict(x=torch.zeros(2, 3), gate=torch.zeros(2, 3), weight=torch.ones(3), eps=EPS, activation="silu")
    with pytest.raises(ValueError, match=match):
        gated_rms_norm(**{**args, **bad})


@pytest.mark.skipif(not (HAVE_FLA and torch.cuda.is_available()), reason="needs CUDA and flash-linear-attention")
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_kernel_matches_float64_rows(seed, activation, dtype):
    """fla's fused kernel (CUDA): output and gradients within the dtype's rounding of the float64 rows."""
    x, gate, weight = _inputs(seed, (2, 64, 4, 128), "cuda", dtype)
    want = [t.detach().double().cpu().requires_grad_() for t in (x, gate, weight)]
    ref = _reference(*want, EPS, activation)
    got = gated_rms_norm(x, gate, weight, EPS, activation)
    assert got.dtype == dtype
    dy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(got.cpu(), ref) < tol
    for name, g, r in zip(("x", "gate", "weight"), _grads(got, [x, gate, weight], dy.cuda()), _grads(ref, want, dy)):
        assert rel_err(g.cpu(), r) < tol, name
    # the PyTorch form on the same inputs agrees with the kernel (the two forms the layers run)
    torch_form = gated_rms_norm(*(t.detach().cpu().float() for t in (x, gate, weight)), EPS, activation)
    assert rel_err(got.float().cpu(), torch_form) < tol
