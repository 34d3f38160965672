"""The gated delta rule's CUDA path (fla's kernels and the correction kernels through gated_delta_rule/fla_piece.py, NCCL) against the
float64 token loop.

Skipped without CUDA; the two-rank test needs two GPUs. Tolerances are those of the input dtype
(fp32 inputs go through TF32 tensor-core products in fla). fla 0.6 refuses the gated delta rule's
backward on Hopper with Triton >= 3.4, < 3.7.1 (its issue 640: wrong results) unless tilelang is
installed; the tests that need it are skipped there with fla's message.
"""

import importlib.util

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_ranks
from megatron_zeco import Layout, packed_positions, zeco_gated_delta_rule
from megatron_zeco.gated_delta_rule import gdn_piece
from tests.helpers.bounds import assert_float32_piece_as_close_as_fla, fla_results, joined_errors, over_bounds
from tests.helpers.reference import delta_problem, reference, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 3e-2}
NAMES = ("q", "k", "v", "g", "beta")
RESULTS = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def _backward(fn, refused):
    """``fn()``; where fla refuses the gated delta rule's backward on this GPU and Triton (its #640),
    None, with fla's message appended to ``refused``: the test checks the forward and then skips."""
    try:
        return fn()
    except RuntimeError as e:
        if "#640" not in str(e):
            raise
        refused.append(str(e))
        return None


def _check(errors, dtype, refused, fla=None):
    """float32: every error within the tolerance; bf16: within the bound of fla's own error ``fla``
    (tests/helpers/bounds.py). Then skip, naming fla's refusal, if the backward was refused."""
    if dtype == torch.float32:
        assert max(errors.values()) < TOLERANCE[dtype], errors
    else:
        assert not over_bounds(errors, fla), (over_bounds(errors, fla), errors, fla)
    if refused:
        pytest.skip(f"forward checked; fla refuses the gated delta rule's backward here: {refused[0]}")


def _run(x, dtype, ht_weight=1.0, refused=None, **kw):
    """Outputs and gradients of zeco_gated_delta_rule (initial and final state); ``ht_weight``: this
    rank's share of the final-state term of the loss. Only the forward's results where fla refuses
    the backward (``refused``)."""
    leaves = {n: x[n].to("cuda", dtype).requires_grad_() for n in NAMES}
    h0 = x["h0"].to("cuda", torch.float32).requires_grad_()
    o, ht = zeco_gated_delta_rule(*leaves.values(), initial_state=h0, output_final_state=True, **kw)
    loss = (o.float() * x["do"].cuda()).sum() + ht_weight * (ht * x["dht"].cuda()).sum()
    grads = _backward(lambda: torch.autograd.grad(loss, [*leaves.values(), h0]), [] if refused is None else refused)
    results = (o, ht) if grads is None else (o, ht, *grads)
    return dict(zip(RESULTS, [t.detach().cpu() for t in results]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", ["normal", "zero"])
def test_one_gpu_matches_float64(seed, dtype, gate):
    """The local operator (fla's chunk_gated_delta_rule): T off fla's chunk of 64."""
    x = delta_problem(seed, B=2, T=300, H=4, K=64, V=64, gate=gate)
    refused = []
    ref, got = reference(x), _run(x, dtype, refused=refused)
    fla = None if dtype == torch.float32 else {n: rel_err(t, ref[n]) for n, t in _fla(x, []).items()}
    _check({n: rel_err(got[n], ref[n]) for n in got}, dtype, refused, fla)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [None, [1, 70, 300, 5, 100, 164]], ids=["dense", "packed"])
def test_piece_matches_float64(seed, dtype, lengths):
    """gdn_piece on CUDA: the summary (E from fla's zero-state pass, M from the correction kernels),
    the output from a given entering state (fla's zero-state output plus the correction), A + M^T D,
    and every input's gradient from D (fla's backward from S_in); per sequence or packed segment, each
    result's error over all of them. bf16: within the bound of fla's own error (tests/helpers/bounds.py),
    fla's chunk_gated_delta_rule run on the same segments from the same entering states."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    B, T = (2, 300) if lengths is None else (1, sum(lengths))
    x = delta_problem(seed, B=B, T=T, H=4, K=64, V=64, gate="normal")
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    spans = [(b, 0, T) for b in range(B)] if cu is None else \
        [(0, a, e) for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    N = len(spans)
    S_in, D = (torch.randn(N, 4, 64, 64, dtype=torch.float64) for _ in range(2))
    piece = gdn_piece(*(x[n].to("cuda", dtype) for n in NAMES), 64 ** -0.5,
                      cu_seqlens=None if cu is None else cu.cuda(), cu_seqlens_cpu=cu)
    assert piece.M.shape == (N, 4, 64, 64) and piece.E.dtype == torch.float32
    S_out = piece.M @ S_in.cuda().float() + piece.E
    o = piece.output(S_in.cuda().float())
    refused = []
    A = _backward(lambda: piece.entering_grad(x["do"].to("cuda", dtype)), refused)
    grads = None if refused else _backward(lambda: piece.grads(D.cuda().float()), refused)
    got = {"o": o, "ht": S_out}
    if grads is not None:
        got.update(dh0=A + piece.M.transpose(-1, -2) @ D.cuda().float(), **{"d" + m: t for m, t in zip(NAMES, grads)})
    results = {"ours": got}
    if dtype != torch.float32:  # the bound's measure: fla on the same segments from the same entering states
        results["fla"] = fla_results(chunk_gated_delta_rule, x, NAMES, dtype, 64 ** -0.5, S_in, D, cu,
                                     backward=grads is not None)
    parts = {who: {m: [] for m in got} for who in (*results, "ref")}
    for n, (b, a, e) in enumerate(spans):
        ref = reference({**{m: x[m][b:b + 1, a:e] for m in (*NAMES, "do")}, "h0": S_in[n:n + 1], "dht": D[n:n + 1]})
        for m in got:
            parts["ref"][m].append(ref[m])
            for who, result in results.items():  # a state per segment; tokens in their rows
                parts[who][m].append(result[m][n:n + 1] if m in ("ht", "dh0") else result[m][b:b + 1, a:e])
    fla = joined_errors(parts["fla"], parts["ref"]) if "fla" in parts else None
    _check(joined_errors(parts["ours"], parts["ref"]), dtype, refused, fla)


def _fla(x, refused, cu_seqlens=None):
    """fla's chunk_gated_delta_rule on this GPU over ``x`` in bf16 (``tests/helpers/bounds.py``): the
    forward alone where fla refuses the backward (``refused``)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    args = (chunk_gated_delta_rule, x, NAMES, torch.bfloat16, 64 ** -0.5, x["h0"], x["dht"], cu_seqlens)
    return _backward(lambda: fla_results(*args), refused) or fla_results(*args, backward=False)


def _two_ranks(rank, world, seed, strategy, packed=True, transport="auto", overlap=None):
    """``strategy`` in both layouts, unpacked (initial and final state) and, with ``packed``, packed (both
    splits), bf16: ``{case: (each result's relative error over the whole sequence, fla's on one GPU over the
    same tokens)}``. ``transport``, ``overlap``: the unpacked cases' (zeco_gated_delta_rule's keywords)."""
    group = dist.new_group(list(range(world)))
    x = delta_problem(seed, B=2, T=2 * 320, H=4, K=64, V=64)
    ref = reference(x)
    out, refused = {}, []
    theirs = _fla(x, refused)
    fla = {n: rel_err(theirs[n], ref[n]) for n in theirs}
    for layout in Layout:
        shard = {n: layout.shard(x[n], rank, world) if n in (*NAMES, "do") else x[n] for n in x}
        got = _run(shard, torch.bfloat16, ht_weight=1 / world, refused=refused, group=group, strategy=strategy,
                   layout=layout, num_blocks=2 if strategy == "zeco" else 1, transport=transport, overlap=overlap)
        whole = {"ht": got["ht"]}
        for n in (n for n in ("o", "dq", "dk", "dv", "dg", "dbeta") if n in got):
            parts = [torch.empty_like(got[n]).cuda() for _ in range(world)]
            dist.all_gather(parts, got[n].cuda().contiguous(), group=group)
            whole[n] = layout.unshard([p.cpu() for p in parts], dim=1)
        if "dh0" in got:
            dh0 = got["dh0"].cuda()
            dist.all_reduce(dh0, group=group)
            whole["dh0"] = dh0.cpu()
        out[strategy, layout.value] = ({n: rel_err(whole[n], ref[n]) for n in whole}, fla)
    if not packed:
        return out, refused[:1]
    p = delta_problem(seed + 1, B=1, T=640, H=4, K=64, V=64, initial_state=False)
    p.update(h0=None, dht=None)
    for per_document, docs in ((False, [1, 70, 300, 5, 100, 164]), (True, [120, 8, 400, 112])):
        cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()])
        alone = [reference({**{m: p[m][:, a:b] for m in (*NAMES, "do")}, "h0": None}, output_final_state=False)
                 for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
        want = {n: torch.cat([a[n] for a in alone], 1) for n in ("o", "dq", "dk", "dv", "dg", "dbeta")}
        mine = packed_positions(cu, "zigzag", world, rank, per_document)
        theirs = _fla(p, refused, cu)  # the whole packed sequence on this GPU, measured at this rank's tokens
        fla = {n: rel_err(theirs[n][:, mine], want[n][:, mine]) for n in want if n in theirs}
        leaves = {n: p[n][:, mine].to("cuda", torch.bfloat16).requires_grad_() for n in NAMES}
        o, _ = zeco_gated_delta_rule(*leaves.values(), group=group, strategy=strategy, layout="zigzag",
                                     cu_seqlens=cu.cuda(), per_document=per_document)
        grads = _backward(lambda: torch.autograd.grad((o.float() * p["do"][:, mine].cuda()).sum(),
                                                      list(leaves.values())), refused)
        got = dict(zip(want, (o, *(grads or ()))))
        out[strategy, f"packed per_document={per_document}"] = (
            {n: rel_err(got[n].cpu(), want[n][:, mine]) for n in got}, fla)
    return out, refused[:1]


def _within_fla(results):
    """Every rank's every case within the bound of fla's own error (``_two_ranks``' results); a skip naming
    fla's refusal where only the forward could be checked."""
    bad = {(r, case): over for r, (each, _) in enumerate(results) for case, (errors, fla) in each.items()
           if (over := over_bounds(errors, fla))}
    assert not bad, bad
    refused = [m for _, refused in results for m in refused]
    if refused:
        pytest.skip(f"forward checked; fla refuses the gated delta rule's backward here: {refused[0]}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("strategy", ["zeco", "lasp2", "a2a"])
def test_two_gpus_every_strategy_matches_float64(seed, strategy):
    """Each case's bf16 results within the bound of fla's own error on one GPU over the same tokens (a test
    per strategy: on a cold machine their compiles run side by side under pytest-xdist)."""
    results = run_ranks(_two_ranks, 2, seed, strategy, backend="nccl", timeout=900)
    _within_fla(results)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("overlap", [None, False], ids=["overlap_as_built", "no_overlap"])
def test_two_gpus_over_peer_memory_match_float64(seed, overlap):
    """zeco over peer memory (the dense hop kernel, its products on tensor cores), both layouts, the scan
    beside the piece's work as built (``overlap=None``: on) and after it, within the bound of fla's own error
    on one GPU."""
    results = run_ranks(_two_ranks, 2, seed, "zeco", False, "peer_memory", overlap, backend="nccl", timeout=900)
    _within_fla(results)


@pytest.mark.slow
def test_piece_in_float32_at_a_million_tokens_is_as_close_to_float64_as_fla(seed):
    """A float32 piece of 8 packed segments of 128K tokens (H = 2 heads of 64) against the chunked form in
    float64 on the same GPU: the state leaving it and its output from a random entering state no further off
    than twice fla's own op in float32 on one GPU over the same tokens and entering states (fla's state pass,
    whose E the piece takes, multiplies in TF32); its transition M, from this package's kernels (float32
    accuracy), to 1e-4."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

    from megatron_zeco.gated_delta_rule import chunk_gated_delta_rule, chunk_gated_delta_rule_state

    lengths = [128 * 1024] * 8
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = delta_problem(seed, B=1, T=sum(lengths), H=2, K=64, V=64, gate="normal", initial_state=False)
    S_in = torch.randn(len(lengths), 2, 64, 64, dtype=torch.float64)
    piece = gdn_piece(*(x[n].to("cuda", torch.float32) for n in NAMES), 64 ** -0.5, cu_seqlens=cu.cuda(),
                      cu_seqlens_cpu=cu)
    o = piece.output(S_in.cuda().float())
    exact = {n: x[n].cuda() for n in NAMES}
    E, M = chunk_gated_delta_rule_state(exact["k"], exact["v"], exact["g"], exact["beta"], cu_seqlens=cu.cuda())
    o_ref, _ = chunk_gated_delta_rule(*exact.values(), 64 ** -0.5, S_in.cuda(), cu_seqlens=cu.cuda())
    theirs = fla_results(fla_chunk_gated_delta_rule, x, NAMES, torch.float32, 64 ** -0.5, S_in, torch.zeros_like(S_in),
                         cu, backward=False)
    assert_float32_piece_as_close_as_fla(piece, S_in, o, E, M, o_ref, theirs, TOLERANCE[torch.float32])


@pytest.mark.parametrize("world", [1, 2])
def test_cuda_graph_replays_match_eager(seed, world):
    """forward + backward captured in one CUDA graph, at one rank and at CP = 2 over peer memory (the
    scan's counters and signals on the device), replayed on fresh inputs between eager calls: each
    replay equals the eager op on the same inputs (tests/helpers/graphs.py)."""
    from tests.helpers.graphs import replays

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    failures = run_ranks(replays, world, seed, "gated_delta_rule", "peer_memory", backend="nccl", timeout=900)
    assert not any(failures), failures


# --- the Megatron-Core layer (megatron_zeco.gated_delta_rule.layer): fla's kernels under it ---------------

HAVE_FLA = importlib.util.find_spec("fla") is not None
HAVE_HYBRID_MODEL = importlib.util.find_spec("megatron.core.models.hybrid") is not None
needs_gpu = pytest.mark.skipif(not (HAVE_HYBRID_MODEL and HAVE_FLA and torch.cuda.is_available()),
                               reason="needs CUDA, flash-linear-attention (fla-core) and megatron-core >= 0.19")
GPU_T, GPU_B = 512, 2


def _gpu_modules(dtype, cp_size):
    """Megatron's GatedDeltaNet (only at CP = 1: fla's kernels, its own forward) and ours, on the GPU in
    ``dtype``, both with the same seeded weights; Megatron-Core linears, 4 q/k and 8 value heads of 64."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_zeco.gated_delta_rule.layer import ZecoGatedDeltaNet
    from tests.gated_delta_rule.test_layer import _case, _config

    linear = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                  linear_value_head_dim=64, linear_conv_kernel_dim=4)
    config = _config(_case("gpu", "G", linear=linear), cp_size, params_dtype=dtype, use_cpu_initialization=False,
                     perform_initialization=False, hidden_size=256, num_attention_heads=4)
    submodules = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                         out_proj=RowParallelLinear)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    modules = [ZecoGatedDeltaNet(config, submodules, layer_number=1, pg_collection=pgs).cuda().to(dtype)]
    if cp_size == 1:
        modules.append(GatedDeltaNet(config, submodules, layer_number=1, pg_collection=pgs).cuda().to(dtype))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in modules[0].named_parameters():
            value = torch.randn(p.shape, generator=gen) * (0.5 if name in ("A_log", "dt_bias") else 0.05)
            for module in modules:
                dict(module.named_parameters())[name].copy_(value)
    return modules


def _gpu_forward(module, x, dy):
    """Output and gradients (input, then each parameter) of one module, on the host in float64."""
    leaf = x.clone().requires_grad_()
    y, _ = module(leaf, None)
    params = dict(module.named_parameters())
    grads = torch.autograd.grad((y.float() * dy).sum(), [leaf, *params.values()])
    return {n: t.detach().double().cpu() for n, t in zip(["output", "input", *params], [y, *grads])}


def _gpu_layer(rank, world, dtype, seed):
    """CP = 1: ours against Megatron's module on the same weights. CP = world (if > 1): ours on this
    rank's zigzag share against ours at CP = 1 (input gradients on this rank's tokens, parameter
    gradients summed over CP). Relative errors; {"skip": why} where fla refuses its backward."""
    try:
        return _gpu_layer_errors(rank, world, dtype, seed)
    except RuntimeError as e:
        if "#640" in str(e):  # fla 0.6 on Hopper with Triton >= 3.4, < 3.7.1 (see tests/gated_delta_rule/test_gpu.py)
            return {"skip": str(e)}
        raise


def _gpu_layer_errors(rank, world, dtype, seed):
    from megatron.core import parallel_state as ps

    from megatron_zeco import Layout

    gen = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(GPU_T, GPU_B, 256, generator=gen).to("cuda", dtype) for _ in range(2))
    errors = {}
    ps.initialize_model_parallel(1, 1)
    try:
        ours, theirs = _gpu_modules(dtype, 1)
        want, got = _gpu_forward(theirs, x, dy), _gpu_forward(ours, x, dy)
        errors["against Megatron"] = {n: rel_err(got[n], want[n]) for n in want}
    finally:
        ps.destroy_model_parallel()
    if world > 1:
        ps.initialize_model_parallel(1, 1, context_parallel_size=world)
        try:
            (ours,) = _gpu_modules(dtype, world)
            mine = Layout.ZIGZAG.shard(torch.arange(GPU_T), rank, world, dim=0).cuda()
            cp = _gpu_forward(ours, x[mine], dy[mine])
            for name, g in cp.items():
                if name not in ("output", "input"):
                    g = g.cuda()
                    dist.all_reduce(g, group=ps.get_context_parallel_group())
                    cp[name] = g.cpu()
            errors["CP"] = {n: rel_err(g, got[n][mine.cpu()] if n in ("output", "input") else got[n])
                            for n, g in cp.items()}
        finally:
            ps.destroy_model_parallel()
    return errors


@needs_gpu
@pytest.mark.megatron
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_gpu_matches_megatron_gated_deltanet(seed, dtype):
    """fla's convolution, L2 norm and gated delta rule under the layer: the output and every gradient
    of Megatron's own module (its fla path), on the same weights, within the dtype's tolerance."""
    (errors,) = run_ranks(_gpu_layer, 1, dtype, seed, backend="nccl")
    if "skip" in errors:
        pytest.skip(f"fla refuses the gated delta rule's backward here: {errors['skip']}")
    assert max(errors["against Megatron"].values()) < TOLERANCE[dtype], errors


@needs_gpu
@pytest.mark.megatron
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_cp_matches_one_gpu(seed):
    """CP = 2 over NCCL (halo exchange and All-Scan, zigzag) against CP = 1, bf16."""
    for rank, errors in enumerate(run_ranks(_gpu_layer, 2, torch.bfloat16, seed, backend="nccl")):
        if "skip" in errors:
            pytest.skip(f"fla refuses the gated delta rule's backward here: {errors['skip']}")
        assert max(errors["CP"].values()) < TOLERANCE[torch.bfloat16], f"rank {rank}: {errors}"
