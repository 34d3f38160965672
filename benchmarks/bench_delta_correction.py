"""The gated delta rule's piece correction (``kernels/delta_correction.py``) on one GPU: exactness
against fla and float64, and time against fla's forward and its summary kernel.

    PYTHONPATH=. python benchmarks/bench_delta_correction.py --tokens 16384 32768 --out delta-correction.json

Check (packed segments of 3000, 37, 1100 and 64 tokens, H heads of K = V = ``--dim``, q, k, v, beta
bf16, g float32): fla's own G (base 2) and w feed K1..K3; ``o^0`` is fla's ``chunk_gated_delta_rule``
from a zero state. Against the float64 chunked PyTorch path (``gated_delta_rule/chunk.py``) and beside fla's
current piece (``ops/fla_delta_piece.py``: ``chunk_cp_fwd_h``'s M, the output from S_in, the dh pass's A):
the output ``o^0 + R X``, the segments' ``M`` and ``A``.

Time (one segment of T tokens, the same dtypes): fla's forward (no initial or final state), fla's
``chunk_cp_fwd_h`` (the summary the correction replaces), and K1 (reads), K2 (maps), K3 (prefix),
K4 (fold + output), K5 (gradient), per precision and K2 column block; CUDA events, median of
``--iters`` after the autotuning call. Prints tables; writes ``--out`` (JSON).
"""

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

NAMES = ("q", "k", "v", "g", "beta")


def inputs(T, H, K, V, seed, device):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = {
        "q": torch.randn(1, T, H, K, generator=gen),
        "k": F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1),
        "v": torch.randn(1, T, H, V, generator=gen),
        "g": F.logsigmoid(torch.randn(1, T, H, generator=gen)) / 16,
        "beta": torch.sigmoid(torch.randn(1, T, H, generator=gen)),
        "do": torch.randn(1, T, H, V, generator=gen),
    }
    return {n: (t if n == "g" else t.bfloat16()).to(device) for n, t in x.items()}


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def check(args, device):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn

    from megatron_zeco.kernels import delta_correction as dc
    from megatron_zeco.ops import delta_chunk
    from megatron_zeco.gated_delta_rule.fla_piece import FlaDeltaPiece

    lengths, H, K = [3000, 37, 1100, 64], args.heads, args.dim
    cu_cpu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    cu = cu_cpu.to(device)
    x = inputs(sum(lengths), H, K, K, args.seed, device)
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    S_in = torch.randn(len(lengths), H, K, K, generator=gen).to(device)
    scale = K ** -0.5
    piece = FlaDeltaPiece(*(x[n] for n in NAMES), scale, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    G, w = piece.g, piece.w
    o0, _ = fla_gdn(*(x[n] for n in NAMES), scale=scale, output_final_state=True, cu_seqlens=cu)
    xd = {n: x[n].double() for n in NAMES}
    o_true, _ = delta_chunk.chunk_gated_delta_rule(*xd.values(), scale, S_in.double(), chunk_size=64, cu_seqlens=cu)
    _, M_true = delta_chunk.chunk_gated_delta_rule_state(xd["k"], xd["v"], xd["g"], xd["beta"], 64, cu)
    A_true = delta_chunk.chunk_gated_delta_rule_state_grad(xd["q"], xd["k"], xd["g"], xd["beta"], x["do"].double(),
                                                           scale, 64, cu)
    o_fla, A_fla = piece.output(S_in), piece.entering_grad(x["do"])
    rows = {"fla piece": {"o": rel(o_fla, o_true), "M": rel(piece.M, M_true), "A": rel(A_fla, A_true)}}
    for precision in ("tf32x3", "tf32"):
        plan = dc.SubPieces(cu_cpu, 64, 3)
        R, P, M = dc.piece_transition(x["q"], x["k"], w, G, scale, plan, precision=precision)
        o = dc.output_correction(o0, R, P, S_in, plan, precision=precision)
        o32 = dc.output_correction(o0, R, P, S_in, plan, precision=precision, out_dtype=torch.float32)
        A = dc.entering_grad(R, P, x["do"], plan, precision=precision)
        rows[f"correction {precision}"] = {"o": rel(o, o_true), "o fp32": rel(o32, o_true), "M": rel(M, M_true),
                                           "A": rel(A, A_true)}
        rows[f"correction {precision} vs fla piece"] = {"o": rel(o, o_fla), "M": rel(M, piece.M), "A": rel(A, A_fla)}
    print("\nrelative errors against float64 (packed", lengths, f"H={H} K=V={K}):")
    for name, r in rows.items():
        print(f"  {name:28s} " + "  ".join(f"{k}={v:.2e}" for k, v in r.items()))
    return rows


def cuda_time(fn, iters):
    fn()  # autotune / compile
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


K2_VARIANTS = [  # (precision, rows per tile of M, columns of M per program, Qt dtype)
    ("tf32x3", 64, 64, torch.float32), ("tf32x3", 128, 64, torch.float32),
    ("tf32x3", 64, 64, torch.bfloat16), ("tf32", 64, 64, torch.float32), ("tf32", 128, 64, torch.float32),
]


def kernel_times(fn, iters=5):
    """CUDA time per kernel name (us per call of ``fn``) under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us:
            out[e.key[:60]] = round(us / iters, 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def timing(args, T, device):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn

    from megatron_zeco.kernels import delta_correction as dc
    from megatron_zeco.gated_delta_rule.fla_piece import FlaDeltaPiece, _fla

    H, K = args.heads, args.dim
    x = inputs(T, H, K, K, args.seed, device)
    scale = K ** -0.5
    cu_cpu = torch.tensor([0, T])
    cu = cu_cpu.to(device)
    piece = FlaDeltaPiece(*(x[n] for n in NAMES), scale, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    G, w, u = piece.g, piece.w, piece.u
    S_in = torch.randn(1, H, K, K, device=device)
    o0 = torch.randn_like(x["v"])
    out, profiles = {}, {}
    plan = dc.plan_sub_pieces(cu_cpu, 64, H, K, device)
    with torch.no_grad():
        fwd = lambda: fla_gdn(*(x[n] for n in NAMES), scale=scale)  # noqa: E731
        out["fla forward"] = cuda_time(fwd, args.iters)
        profiles["fla forward"] = kernel_times(fwd)
        hm = torch.zeros(1, H, K, 2 * K, device=device)
        out["fla chunk_cp_fwd_h"] = cuda_time(lambda: _fla().chunk_cp_fwd_h(
            k=x["k"], w=w, u=u, hm=hm, g=G, cu_seqlens=cu, chunk_size=64, multi_seqs=True), args.iters)
        base = None
        for precision, rows, cols, qt_dtype in K2_VARIANTS:
            qt = dc.correction_reads(x["q"], x["k"], w, G, scale, plan, out_dtype=qt_dtype, precision=precision)
            call = lambda: dc.sub_piece_maps(qt, x["k"], w, G, plan, block_cols=cols, block_rows=rows,  # noqa: E731
                                             precision=precision)
            R, L = call()
            tag = f"K2 {precision} rows={rows} cols={cols} qt={str(qt_dtype)[6:]}"
            base = base or (R, L)
            out[tag] = {"ms": cuda_time(call, args.iters), "finite": bool(L.isfinite().all() and R.isfinite().all()),
                        "L vs first": rel(L, base[1]), "R vs first": rel(R, base[0])}
        for precision in ("tf32x3", "tf32"):
            kw = dict(precision=precision)
            R, P, M = dc.piece_transition(x["q"], x["k"], w, G, scale, plan, **kw)
            qt = dc.correction_reads(x["q"], x["k"], w, G, scale, plan, **kw)
            _, L = dc.sub_piece_maps(qt, x["k"], w, G, plan, **kw)
            calls = {
                "K1 reads": lambda: dc.correction_reads(x["q"], x["k"], w, G, scale, plan, **kw),
                "K3 prefix": lambda: dc.prefix_maps(L, plan, **kw),
                "K4 output": lambda: dc.output_correction(o0, R, P, S_in, plan, **kw),
                "K5 grad": lambda: dc.entering_grad(R, P, x["do"], plan, **kw),
            }
            out[f"{precision} S={plan.counts()[0]}"] = {name: cuda_time(fn, args.iters) for name, fn in calls.items()}
            profiles[precision] = kernel_times(lambda: [fn() for fn in (
                *calls.values(), lambda: dc.sub_piece_maps(qt, x["k"], w, G, plan, **kw))])
    print(f"\nT={T} H={H} K=V={K} (ms, median of {args.iters} single calls, host launch included):")
    for name, r in out.items():
        print(f"  {name:42s} " + (f"{r:.3f}" if isinstance(r, float) else "  ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())))
    print("kernel CUDA time per call (us, torch.profiler):")
    for name, r in profiles.items():
        print(f"  {name}: " + ", ".join(f"{k} {v}" for k, v in list(r.items())[:10]))
    configs = {name: str(getattr(kern, "best_config", None)) for name, kern in (
        ("reads", dc.delta_reads_kernel), ("maps", dc.delta_maps_kernel), ("prefix", dc.delta_prefix_kernel),
        ("output", dc.delta_output_kernel), ("grad", dc.delta_grad_kernel))}
    print("  last autotuned configs:", configs)
    resources = {}
    for name, fn in dc.KERNELS.items():  # registers and spills of every compiled variant
        for caches in getattr(fn, "device_caches", {}).values():
            for compiled in caches[0].values():
                try:
                    c = compiled.metadata
                    resources.setdefault(name, []).append(
                        f"w{c.num_warps}s{c.num_stages} {dict(c.constants) if hasattr(c, 'constants') else ''}"[:60]
                        + f" regs={compiled.n_regs} spills={compiled.n_spills}")
                except Exception as e:  # noqa: BLE001
                    resources.setdefault(name, []).append(repr(e)[:80])
    for name, r in resources.items():
        print(f"  {name}: " + " | ".join(sorted(set(r))[:12]))
    return {"times_ms": out, "kernels_us": profiles, "configs": configs, "resources": resources}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--out", default="delta-correction.json")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    import triton
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "args": vars(args)}
    print(result)
    if not args.skip_check:
        result["check"] = check(args, device)
    for T in args.tokens:
        result[f"T={T}"] = timing(args, T, device)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
