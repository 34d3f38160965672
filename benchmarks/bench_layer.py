"""One Gated DeltaNet layer on one GPU: this package's ``ZecoGatedDeltaNet`` against Megatron-Core's own
``GatedDeltaNet`` on the same weights, forward + backward, and where their GPU time goes.

    python benchmarks/bench_layer.py --tokens 16384 32768 --out results/layer-gdn.json

Both modules are built as in the gdn-1b model (benchmarks/throughput.py): hidden 2048, 16 query/key and 16
value heads of 128, a convolution of 4 taps, SiLU, Megatron-Core linears and norms, bf16, one sequence of
T tokens (``[T, 1, hidden]``), CP = 1 (TP = 1, one process). Per module and T: the median GPU time of
``--iters`` forward + backward calls, each issued behind a GPU sleep long enough for the host to queue it
(GPU time, no host gaps), the median of the same calls back to back (``steady``: what a training loop
sees), and, under torch.profiler, the GPU time per kernel name per call, largest first, with the kernels
grouped as fla's and this package's Triton kernels, torch.compile's (``triton_``), GEMMs and the rest.
Needs CUDA, fla-core and megatron-core >= 0.19.
"""

import argparse
import collections
import datetime
import json
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from profile_piece import kernel_times  # noqa: E402  (benchmarks/, beside this script)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=12, help="kernels printed per module")
    p.add_argument("--out", default="layer-gdn.json")
    return p.parse_args()


def modules():
    """(name, module) for Megatron's GatedDeltaNet and ours, bf16 on the GPU, the same seeded weights."""
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_zeco.gated_delta_rule.layer import ZecoGatedDeltaNet

    config = TransformerConfig(
        num_layers=1, hidden_size=2048, num_attention_heads=16, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, activation_func=F.silu,
        gated_linear_unit=True, normalization="RMSNorm", add_bias_linear=False, params_dtype=torch.bfloat16,
        bf16=True, hidden_dropout=0.0, attention_dropout=0.0)
    submodules = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                         out_proj=RowParallelLinear)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    built = [("megatron", GatedDeltaNet(config, submodules, layer_number=1, pg_collection=pgs)),
             ("zeco", ZecoGatedDeltaNet(config, submodules, layer_number=1, pg_collection=pgs))]
    gen = torch.Generator().manual_seed(1)
    values = {n: torch.randn(p.shape, generator=gen) * (0.5 if n in ("A_log", "dt_bias") else 0.02)
              for n, p in built[0][1].named_parameters()}
    out = []
    for name, module in built:
        module = module.cuda().to(torch.bfloat16)
        with torch.no_grad():
            for n, p in module.named_parameters():
                p.copy_(values[n])
        out.append((name, module))
    return out


def step(module, x, dy):
    def run():
        leaf = x.detach().requires_grad_()
        y, _ = module(leaf, None)
        y.backward(dy)
    return run


def gpu_ms(run, iters):
    """Median GPU time of one call queued behind a sleep (no host gaps)."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(50_000_000)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def steady_ms(run, iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


GROUPS = (("compiled (triton_)", lambda k: k.startswith("triton_")),
          ("GEMM", lambda k: any(s in k.lower() for s in ("gemm", "cutlass", "nvjet", "sm90_xmma"))),
          ("torch (elementwise, norms, reductions, copies)", lambda k: "at::native" in k or k.startswith(("void ", "Memset", "Memcpy"))),
          ("Triton (fla, this package)", lambda k: True))


def kernels(run, iters=3):
    """Per kernel name its GPU time (µs) and launches per call (profile_piece.kernel_times), and the total per
    group of :data:`GROUPS`."""
    per_kernel, _ = kernel_times(run, iters)
    groups = collections.Counter()
    for name, v in per_kernel.items():
        groups[next(g for g, match in GROUPS if match(name))] += v["us"]
    ordered = dict(sorted(per_kernel.items(), key=lambda kv: -kv[1]["us"]))
    return ordered, {g: round(t, 1) for g, t in groups.most_common()}


def main():
    args = parse_args()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    built = modules()
    rows = []
    for T in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(T)
        x = torch.randn(T, 1, 2048, device="cuda", generator=gen).to(torch.bfloat16)
        dy = torch.randn(T, 1, 2048, device="cuda", generator=gen).to(torch.bfloat16)
        for name, module in built:
            run = step(module, x, dy)
            for _ in range(args.warmup):
                run()
            per_kernel, groups = kernels(run)
            row = dict(tokens=T, module=name, gpu_ms=gpu_ms(run, args.iters), steady_ms=steady_ms(run, args.iters),
                       kernel_groups_us=groups, kernels=per_kernel)
            rows.append(row)
            print(f"T={T:6d} {name:9s} gpu {row['gpu_ms']:7.3f} ms  steady {row['steady_ms']:7.3f} ms  "
                  + "  ".join(f"{g} {t / 1000:.3f}" for g, t in groups.items()), flush=True)
            for k, v in list(per_kernel.items())[:args.top]:
                print(f"    {v['us'] / 1000:7.3f} ms  x{v['calls']:<5g} {k[:110]}", flush=True)
            meta = {"command": f"python benchmarks/bench_layer.py {' '.join(sys.argv[1:])}",
                    "device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                    "torch": torch.__version__}
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
