"""KDA's CUDA path (fla's chunk_kda for the local op; for a piece fla's KDA forward from a zero state plus the
correction kernels, kda/fla_piece.py; NCCL) against the float64 token loop and against fla's chunk_kda on one
GPU; the KDA layer on CUDA against the same layer in float64 on the CPU with the same weights.

Skipped without CUDA; the two-rank test needs two GPUs. float32 results are held to a tolerance; bf16 ones
to the bound of fla's own bf16 error on the same tokens (tests/helpers/bounds.py).
"""

import pytest
import torch
import torch.distributed as dist

from megatron_zeco import Layout, zeco_kda
from tests.helpers.bounds import assert_float32_piece_as_close_as_fla, fla_results, joined_errors, over_bounds
from tests.helpers.distributed import run_ranks
from tests.helpers.reference import kda_problem, reference, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 3e-2}
NAMES = ("q", "k", "v", "g", "beta")
RESULTS = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def _fla(x, dtype=torch.bfloat16, h0=None, dht=None, cu_seqlens=None):
    """fla's chunk_kda alone on this GPU over ``x`` (g in float32), from ``h0`` (default ``x``'s)."""
    from fla.ops.kda import chunk_kda

    return fla_results(chunk_kda, x, NAMES, dtype, 64 ** -0.5, x["h0"] if h0 is None else h0,
                       x["dht"] if dht is None else dht, cu_seqlens, g_dtype=torch.float32)


def _check(errors, dtype, fla):
    """float32: within the tolerance; bf16: within the bound of fla's own error ``fla``."""
    if dtype == torch.float32:
        assert max(errors.values()) < TOLERANCE[dtype], errors
    else:
        assert not over_bounds(errors, fla), (over_bounds(errors, fla), errors, fla)


def _run(x, dtype, ht_weight=1.0, **kw):
    """Outputs and gradients of zeco_kda (initial and final state) on CUDA; g in float32."""
    leaves = {n: x[n].to("cuda", torch.float32 if n == "g" else dtype).requires_grad_() for n in NAMES}
    h0 = x["h0"].to("cuda", torch.float32).requires_grad_()
    o, ht = zeco_kda(*leaves.values(), initial_state=h0, output_final_state=True, **kw)
    loss = (o.float() * x["do"].cuda()).sum() + ht_weight * (ht * x["dht"].cuda()).sum()
    grads = torch.autograd.grad(loss, [*leaves.values(), h0])
    return dict(zip(RESULTS, [t.detach().cpu() for t in (o, ht, *grads)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", ["normal", "mixed"])
def test_one_gpu_matches_float64(seed, dtype, gate):
    """The local operator (fla's chunk_kda): T off fla's chunk of 64."""
    x = kda_problem(seed, B=2, T=300, H=4, K=64, V=64, gate=gate)
    ref, got = reference(x), _run(x, dtype)
    fla = None if dtype == torch.float32 else {n: rel_err(t, ref[n]) for n, t in _fla(x).items()}
    _check({n: rel_err(got[n], ref[n]) for n in got}, dtype, fla)


def test_one_gpu_is_fla_chunk_kda(seed):
    """zeco_kda with no group calls fla's chunk_kda: the same bf16 output, bit for bit."""
    from fla.ops.kda import chunk_kda

    x = kda_problem(seed, B=1, T=256, H=4, K=64, V=64, initial_state=False)
    inputs = [x[n].to("cuda", torch.float32 if n == "g" else torch.bfloat16) for n in NAMES]
    ours, _ = zeco_kda(*inputs)
    theirs, _ = chunk_kda(*inputs, scale=64 ** -0.5)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [None, [1, 70, 300, 5, 100, 164]], ids=["dense", "packed"])
@pytest.mark.parametrize("gate", ["normal", "mixed"])
def test_piece_matches_float64(seed, dtype, lengths, gate):
    """kda_piece on CUDA (FlaPiece: fla's forward from a zero state, the correction kernels, fla's backward
    from S_in): the summary (E from fla's zero-state pass, M from the correction kernels), the output from a
    given entering state, A + M^T D and every input's gradient from D; per sequence or packed segment, each
    result's error over all of them; gates per channel ``mixed``: none, ~1, strong and underflowing side by
    side. bf16: within the bound of fla's own error (tests/helpers/bounds.py), fla's chunk_kda run on the
    same segments from the same entering states."""
    from megatron_zeco.kda import kda_piece
    from megatron_zeco.kda.fla_piece import FlaPiece

    B, T = (2, 300) if lengths is None else (1, sum(lengths))
    x = kda_problem(seed, B=B, T=T, H=4, K=64, V=64, gate=gate)
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    spans = [(b, 0, T) for b in range(B)] if cu is None else \
        [(0, a, e) for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    S_in, D = (torch.randn(len(spans), 4, 64, 64, dtype=torch.float64) for _ in range(2))
    piece = kda_piece(*(x[n].to("cuda", torch.float32 if n == "g" else dtype) for n in NAMES), 64 ** -0.5,
                      cu_seqlens=None if cu is None else cu.cuda(), cu_seqlens_cpu=cu)
    assert isinstance(piece, FlaPiece) and piece.M.shape == (len(spans), 4, 64, 64)
    assert piece.E.dtype == piece.M.dtype == torch.float32
    S_out = piece.M @ S_in.cuda().float() + piece.E
    o = piece.output(S_in.cuda().float())
    dS_in = piece.entering_grad(x["do"].to("cuda", dtype)) + piece.M.transpose(-1, -2) @ D.cuda().float()
    grads = piece.grads(D.cuda().float())
    results = {"ours": {"o": o, "ht": S_out, "dh0": dS_in, **{"d" + m: t for m, t in zip(NAMES, grads)}}}
    if dtype != torch.float32:  # the bound's measure: fla on the same segments from the same entering states
        results["fla"] = _fla(x, dtype, S_in, D, cu)
    parts = {who: {m: [] for m in results["ours"]} for who in (*results, "ref")}
    for n, (b, a, e) in enumerate(spans):
        ref = reference({**{m: x[m][b:b + 1, a:e] for m in (*NAMES, "do")}, "h0": S_in[n:n + 1], "dht": D[n:n + 1]})
        for m in results["ours"]:
            parts["ref"][m].append(ref[m])
            for who, result in results.items():  # a state per segment; tokens in their rows
                parts[who][m].append(result[m][n:n + 1] if m in ("ht", "dh0") else result[m][b:b + 1, a:e])
    fla = joined_errors(parts["fla"], parts["ref"]) if "fla" in parts else None
    _check(joined_errors(parts["ours"], parts["ref"]), dtype, fla)


def _two_ranks(rank, world, seed, strategy):
    """``strategy`` in both layouts, bf16: each result's relative error over the whole sequence."""
    group = dist.new_group(list(range(world)))
    x = kda_problem(seed, B=2, T=2 * 320, H=4, K=64, V=64)
    ref = reference(x)
    fla = {n: rel_err(t, ref[n]) for n, t in _fla(x).items()}
    out = {}
    for layout in Layout:
        shard = {n: layout.shard(x[n], rank, world) if n in (*NAMES, "do") else x[n] for n in x}
        got = _run(shard, torch.bfloat16, ht_weight=1 / world, group=group, strategy=strategy, layout=layout,
                   num_blocks=2 if strategy == "zeco" else 1)
        whole = {"ht": got["ht"]}
        for n in ("o", "dq", "dk", "dv", "dg", "dbeta"):
            parts = [torch.empty_like(got[n]).cuda() for _ in range(world)]
            dist.all_gather(parts, got[n].cuda().contiguous(), group=group)
            whole[n] = layout.unshard([p.cpu() for p in parts], dim=1)
        dh0 = got["dh0"].cuda()
        dist.all_reduce(dh0, group=group)
        whole["dh0"] = dh0.cpu()
        out[strategy, layout.value] = {n: rel_err(whole[n], ref[n]) for n in whole}
    return out, fla


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("strategy", ["zeco", "lasp2", "a2a"])
def test_two_gpus_every_strategy_matches_float64(seed, strategy):
    """Each case's bf16 results within the bound of fla's own error on one GPU over the same tokens (a test
    per strategy: on a cold machine their compiles run side by side under pytest-xdist)."""
    results = run_ranks(_two_ranks, 2, seed, strategy, backend="nccl", timeout=900)
    bad = {(r, case): over for r, (each, fla) in enumerate(results) for case, errors in each.items()
           if (over := over_bounds(errors, fla))}
    assert not bad, bad


def _layer_outputs(rank, world, seed):
    """The KDA layer (kda_local_spec, H = 4 of 64, hidden 256, W = 4) on one rank: its output and input
    gradient in float64 on the CPU, then with the same weights in bf16 on CUDA (fla's kernels)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.spec_utils import build_module

    from megatron_zeco.specs import kda_local_spec
    from tests.helpers.megatron import transformer_config

    ps.initialize_model_parallel(1, 1)
    config = transformer_config(num_layers=1, hidden_size=256, num_attention_heads=4, kv_channels=64)
    layer = build_module(kda_local_spec.submodules.self_attention, config=config, layer_number=1).double()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(128, 2, 256, generator=gen, dtype=torch.float64)
    dy = torch.randn(128, 2, 256, generator=gen, dtype=torch.float64)
    out = {}
    for name, device, dtype in (("cpu", "cpu", torch.float64), ("cuda", "cuda", torch.bfloat16)):
        layer = layer.to(device, dtype)
        xi = x.to(device, dtype).requires_grad_()
        y, _ = layer(xi)
        (dx,) = torch.autograd.grad((y.float() * dy.to(device).float()).sum(), [xi])
        out[name] = (y.detach().double().cpu(), dx.double().cpu())
    ps.destroy_model_parallel()
    return out


def test_layer_on_cuda_matches_float64_on_the_cpu(seed):
    out = run_ranks(_layer_outputs, 1, seed, backend="nccl")[0]
    for a, b in zip(out["cuda"], out["cpu"]):
        assert rel_err(a, b) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("world", [1, 2])
def test_cuda_graph_replays_match_eager(seed, world):
    """forward + backward captured in one CUDA graph, at one rank and at CP = 2 over peer memory (the
    scan's counters and signals on the device), replayed on fresh inputs between eager calls: each
    replay equals the eager op on the same inputs (tests/helpers/graphs.py)."""
    from tests.helpers.graphs import replays

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    failures = run_ranks(replays, world, seed, "kda", "peer_memory", backend="nccl", timeout=900)
    assert not any(failures), failures


def test_piece_issues_without_host_sync(seed):
    """A piece's forward and backward, dense and packed, issue no device-to-host read (under CP a rank's
    host read stalls its peers' hops): ``torch.cuda.set_sync_debug_mode("error")``."""
    from megatron_zeco.kda import kda_piece

    x = kda_problem(seed, B=1, T=300, H=4, K=64, V=64)
    inputs = [x[n].to("cuda", torch.float32 if n == "g" else torch.bfloat16) for n in NAMES]
    S, D = (torch.randn(2, 4, 64, 64, device="cuda") for _ in range(2))
    do = x["do"].to("cuda", torch.bfloat16)
    cu = torch.tensor([0, 100, 300])

    def forward_and_backward(kw, n):
        piece = kda_piece(*inputs, 64 ** -0.5, **kw)
        piece.before_output()
        piece.output(S[:n])
        piece.entering_grad(do)
        piece.before_grads()
        piece.grads(D[:n])

    for kw, n in (({}, 1), (dict(cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu), 2)):
        forward_and_backward(kw, n)  # first call: compiling, autotuning and the per-shape tables
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            forward_and_backward(kw, n)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.slow
def test_piece_in_float32_over_long_segments_is_as_close_to_float64_as_fla(seed):
    """A float32 piece of 4 packed segments of 64K tokens (H = 2 heads of 64) against the chunked form in float64
    on the same GPU (the float64 form holds a decay per pair of tokens and key channel, which bounds the
    length): the state leaving it and its output from a random entering state no further off than twice fla's
    own chunk_kda in float32 on one GPU over the same tokens and entering states (fla's state pass, whose E the
    piece takes, multiplies in TF32); its transition M, from this package's kernels (float32 accuracy), to 1e-4."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    from megatron_zeco.kda import chunk_kda, chunk_kda_state, kda_piece

    lengths = [64 * 1024] * 4
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = kda_problem(seed, B=1, T=sum(lengths), H=2, K=64, V=64, gate="normal", initial_state=False)
    S_in = torch.randn(len(lengths), 2, 64, 64, dtype=torch.float64)
    piece = kda_piece(*(x[n].to("cuda", torch.float32) for n in NAMES), 64 ** -0.5, cu_seqlens=cu.cuda(),
                      cu_seqlens_cpu=cu)
    o = piece.output(S_in.cuda().float())
    exact = {n: x[n].cuda() for n in NAMES}
    E, M = chunk_kda_state(exact["k"], exact["v"], exact["g"], exact["beta"], cu_seqlens=cu.cuda())
    o_ref, _ = chunk_kda(*exact.values(), 64 ** -0.5, S_in.cuda(), cu_seqlens=cu.cuda())
    theirs = fla_results(fla_chunk_kda, x, NAMES, torch.float32, 64 ** -0.5, S_in, torch.zeros_like(S_in), cu,
                         g_dtype=torch.float32, backward=False)
    assert_float32_piece_as_close_as_fla(piece, S_in, o, E, M, o_ref, theirs, TOLERANCE[torch.float32])
