"""Triton kernels against the float64 PyTorch reference (on the CPU through TRITON_INTERPRET=1)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from megatron_zeco.kernels.state import chunk_state, chunk_state_grad  # noqa: E402
from megatron_zeco.ops import chunk_gla_state, chunk_gla_state_grad  # noqa: E402
from reference import GATES, problem, rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 inputs: products run on tensor cores in bf16 (k * decay and q * decay rounded once), as in fla.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # bf16: a few units of 2^-8


def _strided(tensors):
    """The same values as views of one packed buffer (how the layer's q, k, v arrive)."""
    packed = torch.cat(tensors, dim=-1)
    return packed.split([t.shape[-1] for t in tensors], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T,K,V,chunk,split,strided", [
    (37, 12, 20, 16, 32, False),   # 2 splits, the last one partial; K, V not powers of 2
    (64, 16, 16, 16, 16, True),    # 4 splits of one chunk each; strided views
    (5, 8, 8, 16, 1024, False),    # shorter than a chunk
    (200, 16, 8, 16, 48, True),    # 5 splits of 3 chunks, last chunk partial
])
def test_state_kernels_match_reference(seed, dtype, gate, T, K, V, chunk, split, strided):
    x = problem(seed, B=2, T=T, H=3, K=K, V=V, gate=gate)
    # The reference sees the same (rounded) inputs, in float64.
    q, k, v, g, do = (x[n].to(dtype) for n in ("q", "k", "v", "g", "do"))
    E_ref, gamma_ref = chunk_gla_state(k.double(), v.double(), g.double())
    A_ref = chunk_gla_state_grad(q.double(), g.double(), do.double(), 0.3)
    q, k, v, g, do = (t.to(DEVICE) for t in (q, k, v, g, do))
    if strided:
        q, k, v, g = _strided([q, k, v, g])
        do = do.transpose(0, 1).contiguous().transpose(0, 1)
    E, gamma = chunk_state(k, v, g, chunk_size=chunk, split_size=split)
    A = chunk_state_grad(q, g, do, 0.3, chunk_size=chunk, split_size=split)
    assert E.dtype == gamma.dtype == A.dtype == torch.float32
    for name, got, want in (("E", E, E_ref), ("gamma", gamma, gamma_ref), ("A", A, A_ref)):
        want = want.float()  # the outputs are float32: decays below its range are 0 (gamma ~1e-100)
        tol = TOLERANCE[torch.float32 if name == "gamma" else dtype]  # gamma: fp32 sums, no products
        assert rel_err(got.cpu(), want) < tol, f"{name}: {rel_err(got.cpu(), want):.1e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", ["normal", "mixed"])
@pytest.mark.parametrize("host_offsets", [False, True])
def test_state_kernels_packed_segments(seed, dtype, gate, host_offsets):
    """cu_seqlens: one E, gamma and A per segment (empty, shorter than a chunk, several splits);
    launch tables from the device offsets or from their host copy (cu_seqlens_cpu)."""
    lengths = [0, 5, 16, 1, 70, 0, 33]  # chunk 16, splits of 32 tokens
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = problem(seed, B=1, T=int(cu[-1]), H=2, K=12, V=20, gate=gate)
    q, k, v, g, do = (x[n].to(dtype) for n in ("q", "k", "v", "g", "do"))
    E_ref, gamma_ref = chunk_gla_state(k.double(), v.double(), g.double(), cu_seqlens=cu)
    A_ref = chunk_gla_state_grad(q.double(), g.double(), do.double(), 0.3, cu_seqlens=cu)
    q, k, v, g, do = _strided([t.to(DEVICE) for t in (q, k, v, g, do)])
    offsets = {"cu_seqlens": cu.to(DEVICE), "cu_seqlens_cpu": cu if host_offsets else None}
    E, gamma = chunk_state(k, v, g, chunk_size=16, split_size=32, **offsets)
    A = chunk_state_grad(q, g, do, 0.3, chunk_size=16, split_size=32, **offsets)
    assert E.shape == (len(lengths), 2, 12, 20) and gamma.shape == (len(lengths), 2, 12)
    for name, got, want in (("E", E, E_ref), ("gamma", gamma, gamma_ref), ("A", A, A_ref)):
        tol = TOLERANCE[torch.float32 if name == "gamma" else dtype]
        for n in range(len(lengths)):  # rel_err is exact zero against the empty segments' zeros
            err = rel_err(got[n].cpu(), want[n].float())
            assert err < tol, f"{name} of segment {n}: {err:.1e}"
