"""Time the ZeCO state kernels against a plain read of their inputs, over split sizes.

    python benchmarks/tune_state.py [--tokens 16384] [--heads 16] [--dim 128]

The read floor is ``torch.sum`` over the same inputs (one pass at the GPU's bandwidth).
"""

import argparse

import torch
import triton

from megatron_zeco.kernels import state


def ms(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=40)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    a = p.parse_args()
    shape = (1, a.tokens, a.heads, a.dim)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    g = torch.nn.functional.logsigmoid(torch.randn(shape, device="cuda")).div(16).bfloat16()
    print(torch.cuda.get_device_name(), f"T={a.tokens} H={a.heads} D={a.dim} bf16")
    print(f"read floor (k, v, g summed): {ms(lambda: (k.sum(), v.sum(), g.sum())) * 1000:7.1f} us")
    for split in (128, 256, 512, 1024, 2048, 4096):
        t_s = ms(lambda: state.chunk_state(k, v, g, split_size=split))
        t_g = ms(lambda: state.chunk_state_grad(q, g, do, 0.1, split_size=split))
        print(f"split {str(split):>5}: state {t_s * 1000:7.1f} us   state_grad {t_g * 1000:7.1f} us   "
              f"best {state._state_kernel.best_config} / {state._state_grad_kernel.best_config}")


if __name__ == "__main__":
    main()
