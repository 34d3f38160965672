"""Triton kernels against the float64 PyTorch reference (on the CPU through TRITON_INTERPRET=1)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from megatron_zeco.kernels.state import chunk_state, chunk_state_grad  # noqa: E402
from megatron_zeco.ops import chunk_gla_state, chunk_gla_state_grad  # noqa: E402
from reference import GATES, problem, rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T,K,V,chunk", [(37, 12, 20, 16), (64, 16, 16, 16), (5, 8, 8, 16)])
def test_state_kernels_match_reference(seed, dtype, gate, T, K, V, chunk):
    x = problem(seed, B=2, T=T, H=3, K=K, V=V, gate=gate)
    # The reference sees the same (rounded) inputs, in float64.
    q, k, v, g, do = (x[n].to(dtype) for n in ("q", "k", "v", "g", "do"))
    E_ref, gamma_ref = chunk_gla_state(k.double(), v.double(), g.double())
    A_ref = chunk_gla_state_grad(q.double(), g.double(), do.double(), 0.3)
    E, gamma = chunk_state(*(t.to(DEVICE) for t in (k, v, g)), chunk_size=chunk)
    A = chunk_state_grad(*(t.to(DEVICE) for t in (q, g, do)), 0.3, chunk_size=chunk)
    assert E.dtype == gamma.dtype == A.dtype == torch.float32
    for name, got, want in (("E", E, E_ref), ("gamma", gamma, gamma_ref), ("A", A, A_ref)):
        want = want.float()  # the outputs are float32: decays below its range are 0 (gamma ~1e-100)
        assert rel_err(got.cpu(), want) < 1e-5, f"{name}: {rel_err(got.cpu(), want):.1e}"
