"""On a GPU: the Triton state kernels against the float64 reference, and zeco_gla on one GPU
(CUDA path: Triton state passes + fla's chunk_gla) against the CPU float64 result.

    python benchmarks/gpu_check_kernels.py
"""

import torch

from megatron_zeco import zeco_gla
from megatron_zeco.ops import chunk_gla_state, chunk_gla_state_grad, gla_state, gla_state_grad


def rel(a, b):
    """Relative error against b as the output dtype holds it (float32 flushes decays below 1e-38)."""
    b = b.to(a.dtype).double().cpu()
    return float((a.double().cpu() - b).norm() / b.norm().clamp_min(1e-300))


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for dtype in (torch.float32, torch.bfloat16):
        B, T, H, K, V = 1, 4096 + 17, 16, 128, 128
        q, k, v, do = (torch.randn(B, T, H, d, device="cuda").to(dtype) for d in (K, K, V, V))
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device="cuda")).div(16).to(dtype)
        E, gamma = gla_state(k, v, g)
        A = gla_state_grad(q, g, do, K ** -0.5)
        E_ref, gamma_ref = chunk_gla_state(k.double().cpu(), v.double().cpu(), g.double().cpu())
        A_ref = chunk_gla_state_grad(q.double().cpu(), g.double().cpu(), do.double().cpu(), K ** -0.5)
        print(f"{dtype}: state kernel rel err E {rel(E, E_ref):.1e} gamma {rel(gamma, gamma_ref):.1e} "
              f"A {rel(A, A_ref):.1e}")
        for name, f in (("state", lambda: gla_state(k, v, g)), ("state_grad", lambda: gla_state_grad(q, g, do, 0.1))):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            f()
            torch.cuda.synchronize()
            start.record()
            for _ in range(20):
                f()
            end.record()
            torch.cuda.synchronize()
            print(f"  {name}: {start.elapsed_time(end) / 20:.3f} ms at T={T}, H={H}, K=V={K}")
    x = [torch.randn(2, 300, 4, 32, dtype=torch.float64) for _ in range(4)]
    x[3] = torch.nn.functional.logsigmoid(x[3])
    want, _ = zeco_gla(*x)
    got, _ = zeco_gla(*(t.float().cuda() for t in x))
    print(f"zeco_gla on CUDA (fp32) vs CPU float64: rel err {rel(got, want):.1e}")


if __name__ == "__main__":
    main()
