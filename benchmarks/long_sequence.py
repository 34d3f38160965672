"""Long sequences on GPUs: memory per GPU against tokens per GPU, and a 1M-token check.

    torchrun --nproc-per-node 2 benchmarks/long_sequence.py --out results/long.json

For each size T (tokens per GPU), one fwd+bwd of zeco_gla over a sequence of T * P tokens
(H heads of D, bf16) in each layout, and of the local op alone on T tokens (``none``): peak
memory allocated per GPU during the op (inputs included) and the time of the op. At the largest
size the ZeCO outputs and gradients are compared with a one-GPU fp32 reference over the whole
sequence (this package's PyTorch chunked GLA in segments, state carried, TF32 off, a few heads
at a time: see ``reference``), beside
fla's own bf16 chunk_gla on one GPU over the whole sequence against the same reference.
"""

import argparse
import os

import torch
import torch.distributed as dist

from bench_op import inputs, log, timed, write
from megatron_zeco import zeco_gla
from megatron_zeco.comm import as_layout
from megatron_zeco.gla import chunk_gla

NAMES = ("o", "dq", "dk", "dv", "dg")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[65536, 131072, 262144, 524288],
                   help="tokens per GPU (the last one is also checked against the reference)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layouts", nargs="+", default=["zigzag", "contiguous"])
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--ref-heads", type=int, default=2, help="heads per step of the fp32 reference")
    p.add_argument("--ref-segment", type=int, default=65536, help="tokens per step of the fp32 reference")
    p.add_argument("--parts", nargs="+", default=["memory", "check"], choices=["memory", "check"])
    p.add_argument("--out", default="long.json")
    return p.parse_args()


def fwd_bwd(x, group, strategy, layout):
    """One fwd+bwd of zeco_gla on this rank's tokens ``x``; returns o and the gradients."""
    leaves = [x[n].detach().requires_grad_() for n in "qkvg"]
    o, _ = zeco_gla(*leaves, group=group, strategy=strategy, layout=layout, validate=False)
    return [o.detach(), *torch.autograd.grad(o, leaves, x["o"])]


def local_part(full, layout, me, world):
    return {n: as_layout(layout).shard(t, me, world, dim=1).contiguous() for n, t in full.items()}


def measure(args, T, world, me, group, rows):
    """Peak memory and time of the op at T tokens per GPU, for ``none`` and each layout.

    Each case holds only its own inputs (q, k, v, g and the output gradient), so the peak is
    what one rank needs for that op.
    """
    cases = [("none", "contiguous", None)] + [("zeco", lay, group) for lay in args.layouts]
    for strategy, layout, grp in cases:
        full = inputs(1, T * world, args.heads, args.dim, seed=11)
        x = local_part(full, layout, me, world) if grp is not None else \
            {n: t[:, :T].clone() for n, t in full.items()}  # a copy: a view would keep `full` alive
        del full
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        ms = timed(lambda: fwd_bwd(x, grp, strategy, layout), args.iters, warmup=1)
        peak = torch.tensor([torch.cuda.max_memory_allocated(), before], device="cuda", dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        row = {"part": "memory", "tokens_per_gpu": T, "cp": 1 if grp is None else world, "strategy": strategy,
               "layout": layout, "ms": ms, "peak_gib": peak[0].item() / 2 ** 30,
               "inputs_gib": peak[1].item() / 2 ** 30}
        rows.append(row)
        log(f"T/GPU={T:7d} {strategy:5s} CP={row['cp']} {layout:10s} {ms:9.2f} ms  peak {row['peak_gib']:6.2f} GiB "
            f"(inputs {row['inputs_gib']:.2f})")
        del x
        torch.cuda.empty_cache()


def check(args, T, world, me, group, rows):
    """ZeCO at T tokens per GPU, and fla's bf16 chunk_gla on one GPU, against the fp32 reference.

    The reference and fla run over the whole sequence a few heads at a time (heads are
    independent), on every rank; each rank compares its own tokens, fla is counted on rank 0.
    """
    full = inputs(1, T * world, args.heads, args.dim, seed=12)
    got = {}
    for layout in args.layouts:
        got[layout] = fwd_bwd(local_part(full, layout, me, world), group, "zeco", layout)
        torch.cuda.empty_cache()
    from fla.ops.gla import chunk_gla as fla_chunk_gla
    keys = ["fla", *args.layouts]
    sums = {key: torch.zeros(len(NAMES), 2, dtype=torch.float64, device="cuda") for key in keys}
    torch.backends.cuda.matmul.allow_tf32 = False
    for h in range(0, args.heads, args.ref_heads):
        heads = slice(h, h + args.ref_heads)
        ref = reference(full, heads, args.ref_segment)
        for layout in args.layouts:
            for i, r in enumerate(ref):
                sums[layout][i] += _err_sums(got[layout][i][:, :, heads], as_layout(layout).shard(r, me, world, dim=1))
        if me == 0:
            fla_out = fwd_bwd_whole(full, lambda *a: fla_chunk_gla(*a)[0], torch.bfloat16, heads)
            for i, r in enumerate(ref):
                sums["fla"][i] += _err_sums(fla_out[i], r)
            del fla_out
        del ref
        torch.cuda.empty_cache()
    for key in keys:
        s = sums[key]
        dist.all_reduce(s)
        errs = {n: float((s[i, 0] / s[i, 1]).sqrt()) for i, n in enumerate(NAMES)}
        rows.append(dict(part="accuracy", tokens_per_gpu=T, total_tokens=T * world,
                         strategy="fla" if key == "fla" else "zeco", cp=1 if key == "fla" else world,
                         layout="-" if key == "fla" else key, **errs))
        log(f"acc {T * world} tokens {'fla CP=1' if key == 'fla' else f'zeco CP={world} {key}':20s} "
            + " ".join(f"{n} {e:.2e}" for n, e in errs.items()))


def fwd_bwd_whole(full, fn, dtype, heads):
    """fn (q, k, v, g) -> o over the whole sequence, for the given heads: o and the gradients in fp32."""
    leaves = [full[n][:, :, heads].to(dtype).contiguous().requires_grad_() for n in "qkvg"]
    o = fn(*leaves)
    grads = torch.autograd.grad(o, leaves, full["o"][:, :, heads].to(dtype).contiguous())
    return [o.detach().float(), *(d.float() for d in grads)]


def reference(full, heads, segment):
    """The fp32 one-GPU reference for the given heads: o and the gradients of the whole sequence.

    This package's PyTorch chunked GLA, one segment of ``segment`` tokens at a time with the
    state carried from each to the next (the recurrence itself), and the backward walked the
    same way in reverse (each segment's graph rebuilt from its entering state), so memory is
    one segment's whatever the length.
    """
    q, k, v, g, do = (full[n][:, :, heads].float() for n in "qkvgo")
    starts = range(0, q.shape[1], segment)
    states, outs = [None], []
    with torch.no_grad():
        for s in starts:
            o, h = chunk_gla(*(x[:, s:s + segment] for x in (q, k, v, g)), initial_state=states[-1],
                             output_final_state=True)
            outs.append(o)
            states.append(h)
    grads, dh = [], None
    for i, s in reversed(list(enumerate(starts))):
        leaves = [x[:, s:s + segment].requires_grad_() for x in (q, k, v, g)]
        h0 = None if states[i] is None else states[i].requires_grad_()
        o, h1 = chunk_gla(*leaves, initial_state=h0, output_final_state=True)
        outputs, seeds = [o], [do[:, s:s + segment]]
        if dh is not None:
            outputs.append(h1)
            seeds.append(dh)
        result = torch.autograd.grad(outputs, leaves + ([h0] if h0 is not None else []), seeds)
        grads.append(result[:4])
        dh = result[4] if h0 is not None else None
    grads.reverse()
    return [torch.cat(outs, dim=1), *(torch.cat(parts, dim=1) for parts in zip(*grads))]


def _err_sums(a, ref):
    """(||a - ref||^2, ||ref||^2) in float64."""
    a, ref = a.double(), ref.double()
    return torch.stack([(a - ref).square().sum(), ref.square().sum()])


def main():
    args = parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    world, me = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(world)))
    log(f"{torch.cuda.get_device_name()} x{world}, torch {torch.__version__}, H={args.heads}, D={args.dim}, bf16")
    rows = []
    parts = [lambda T=T: measure(args, T, world, me, group, rows) for T in args.tokens] \
        if "memory" in args.parts else []
    if "check" in args.parts:
        parts.append(lambda: check(args, args.tokens[-1], world, me, group, rows))
    for part in parts:
        part()
        if me == 0:  # a run cut short keeps what it measured
            write(args, world, rows, script="long_sequence.py",
                  total_memory_gib=torch.cuda.get_device_properties(0).total_memory / 2 ** 30)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
