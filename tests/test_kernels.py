"""Triton kernels against float64 PyTorch (on the CPU through TRITON_INTERPRET=1)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from megatron_zeco.kernels.decayed_add import add_decayed_states_  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Error relative to the summands' magnitude: a few float32 roundings, or one rounding to bf16
# (up to one unit, 2^-7: Triton's interpreter truncates where the GPU rounds to nearest).
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7}


@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                             (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("C,H,K,V,N", [
    (7, 3, 12, 20, 2),     # K, V not powers of 2
    (5, 2, 128, 64, 5),    # several key tiles (64 each)
    (1, 1, 8, 8, 1),
    (0, 2, 8, 8, 1),       # no chunks: nothing to do
])
def test_add_decayed_states_matches_float64(seed, dtype, out_dtype, C, H, K, V, N):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(C, H, K, V, generator=gen).to(dtype)
    # log2-decays from 0 (no decay) down to -200 (exp2 underflows to 0 in float32)
    w = -torch.rand(C, H, K, generator=gen) * torch.tensor([0.0, 1e-3, 1.0, 30.0, 200.0])[
        torch.randint(0, 5, (C, H, K), generator=gen)]
    S = torch.randn(N, H, K, V, generator=gen)
    index = torch.randint(0, N, (C,), generator=gen)
    term = torch.exp2(w.double())[..., None] * S.double()[index]
    want, size = h.double() + term, h.double().abs() + term.abs()
    h = h.to(DEVICE)
    got = add_decayed_states_(h, w.to(DEVICE), S.to(DEVICE), index.to(DEVICE), out_dtype=out_dtype)
    assert got.dtype == (out_dtype or dtype) and (got is h) == (out_dtype is None)
    err = ((got.cpu().double() - want).abs() / size.clamp(min=1e-30)).max().item() if C else 0.0
    assert err <= TOLERANCE[got.dtype], f"max relative error {err:.1e}"


def test_add_decayed_states_flattens_leading_dims_and_checks_shapes(seed):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 3, 2, 8, 8, generator=gen)  # fla's [B, NT, H, K, V]
    w, S = -torch.rand(6, 2, 8, generator=gen), torch.randn(2, 2, 8, 8, generator=gen)
    index = torch.arange(6) // 3
    want = h + (torch.exp2(w)[..., None] * S[index]).view(2, 3, 2, 8, 8)
    got = add_decayed_states_(h.clone().to(DEVICE), w.to(DEVICE), S.to(DEVICE), index.to(DEVICE)).cpu()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        add_decayed_states_(h.to(DEVICE), w[:5].to(DEVICE), S.to(DEVICE), index.to(DEVICE))
    with pytest.raises(ValueError, match="contiguous: False"):
        add_decayed_states_(h.transpose(-1, -2).to(DEVICE), w.to(DEVICE), S.to(DEVICE), index.to(DEVICE))

