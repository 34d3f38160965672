"""The All-Scan hop kernels (megatron_zeco/kernels/scan_hop.py) compile for the GPU. What they compute
is tested through the scans that launch them (tests/comm/test_all_scan.py, test_faults.py: peer memory
under TRITON_INTERPRET=1); here, the dense hop's row blocks and precisions on one state without peers (on
the GPU where there is one: ``benchmarks/gpu_check.py`` runs this file)."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

_COMPILE_SCAN_KERNELS = r'''
import triton
from triton.backends.compiler import GPUTarget
from megatron_zeco.kernels import scan_hop

ptr, addr = "*fp32", "i64"
tiles = dict(INNER=4, K=64, V=64, ROWS=32, BR=32, BV=64, DATA=65536, FLAGS=64, TILES=2, INTERPRETED=False,
             NVSHMEM=False)
watched = dict(watch=addr, report=addr, timeout_ns="i64", who="i32", src_pe="i32", dst_pe="i32")
narrow = dict(D_STRIDE="i32", D_ROW="i32", DV="i32")  # a delta of its own strides and columns
lane = dict(LANE="i32", LANES="i32")  # the hierarchical scan's lane of states (runtime: one compiled kernel)
dense = dict(x_init=addr, M=ptr, delta=ptr, s_in=ptr, M2=ptr, delta2=ptr, s_in2=ptr, y_out=ptr, here=addr,
             sent=addr, src=addr, dst=addr, M_STRIDE="i32", S_STRIDE="i32", NT="i32", M_ROW="i32", **narrow, **watched,
             **lane)
kernels = [
    (scan_hop.all_scan_hop_kernel,
        dict(x_init=addr, gamma=ptr, delta=ptr, s_in=ptr, gamma2=ptr, delta2=ptr, s_in2=ptr, y_out=ptr, here=addr,
             sent=addr, src=addr, dst=addr, G_STRIDE="i32", S_STRIDE="i32", NT="i32", G_ROW="i32", **narrow,
             **watched, **lane),
        dict(HAS_SRC=True, HAS_INIT=True, HAS_DST=True, KEEP_Y=True, TWO=True)),
    (scan_hop.all_scan_dense_hop_kernel, dense,  # float32 through tl.dot, in three TF32 passes
        dict(HAS_SRC=True, HAS_INIT=True, HAS_DST=True, KEEP_Y=True, TWO=True, COLS=32, BC=32, BK=64, BR=64,
             DOT=True, PRECISION="tf32x3")),
    (scan_hop.all_scan_dense_hop_kernel, dense,  # ... and in one (pieces of 16-bit inputs)
        dict(HAS_SRC=True, HAS_INIT=False, HAS_DST=True, KEEP_Y=False, TWO=False, COLS=32, BC=32, BK=64, BR=64,
             DOT=True, PRECISION="tf32")),
    (scan_hop.all_scan_dense_hop_kernel, {**dense, **{name: "*fp64" for name in ("M", "delta", "s_in", "M2", "delta2",
                                                                                   "s_in2", "y_out")}},
        dict(HAS_SRC=True, HAS_INIT=False, HAS_DST=True, KEEP_Y=False, TWO=False, COLS=8, BC=8, BK=64, BR=8,
             DOT=False, PRECISION="tf32x3")),  # float64, products summed elementwise
    (scan_hop.all_scan_map_kernel,
        dict(gamma_a=ptr, delta_a=ptr, gamma_b=ptr, delta_b=ptr, here=addr, sent=addr, dst=addr, G_STRIDE="i32",
             S_STRIDE="i32", G_OFF="i32", NT="i32", **watched),
        dict(HAS_SRC=True)),
    (scan_hop.all_scan_close_kernel,
        dict(y_a=ptr, s_in=ptr, gamma_b=ptr, delta_b=ptr, y_out=ptr, here=addr, src=addr, G_STRIDE="i32",
             S_STRIDE="i32", G_OFF="i32", NT="i32", **watched),
        dict(LAST=True)),
    (scan_hop.all_scan_rounds_kernel,  # a leader's rounds: the steps' regions read from a device table
        dict(own=ptr, y_out=ptr, table="*i64", counters=addr, NT="i32", watch=addr, report=addr, timeout_ns="i64",
             who="i32", **lane),
        dict(W=65, E=64, BV=128, STEPS=3, COPY=True)),
    (scan_hop.all_scan_rounds_kernel,  # dense maps in column tiles, passed on
        dict(own=ptr, y_out=ptr, table="*i64", counters=addr, NT="i32", watch=addr, report=addr, timeout_ns="i64",
             who="i32", **lane),
        dict(W=128, E=127, ROWS=64, BR=64, BV=32, COLS=32, STEPS=3, COPY=True)),
]
for kernel, signature, flags in kernels:
    constexprs = {**tiles, **flags}
    constexprs = {name: value for name, value in constexprs.items() if name in kernel.arg_names}
    signature = {name: signature.get(name, "constexpr") for name in kernel.arg_names}
    compiled = triton.compile(triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    ptx = compiled.asm["ptx"]
    assert "%globaltimer" in ptx and "atom" in ptx and ".sys" in ptx, kernel.__name__
print("ok")
'''


def test_scan_kernels_compile_for_hopper():
    """The All-Scan kernels' compiled path (the GPU clock bounding every wait, system-scope atomics)
    builds for sm_90 here, without a GPU: a kernel that only the interpreter has run can still fail
    to compile. Runs in a fresh interpreter without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCAN_KERNELS], env=env, capture_output=True, text=True,
                          timeout=300)
    if "ptxas" in done.stderr and "not found" in done.stderr:
        pytest.skip("Triton's CUDA backend has no ptxas here")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def _dense_hop_alone(x, M, delta, tiles, **kw):
    """``M x + delta`` by one dense hop with no peers (the state read from memory, the result kept)."""
    from megatron_zeco.comm import peer
    from megatron_zeco.comm.watch import watch
    from megatron_zeco.kernels import scan_hop

    H, K, V = x.shape[-3:]
    data, flags, size = peer.region_bytes(H, K, V, x.dtype, tiles, nvshmem=False)
    region = torch.zeros(size, dtype=torch.uint8, device=x.device)
    w = watch(x.device)
    bounded = w.arguments(w.launch_id(("test_scan_hop", id(region)), lambda: ("test", (None, None))), 60.0)
    y, s_in = torch.empty_like(x), torch.empty_like(x)
    here = region.data_ptr()
    scan_hop.all_scan_dense_hop(x.data_ptr(), [M], [delta], [s_in], y, (here, here, 0, 0), K * K, K * V, tiles, data,
                                flags, has_src=False, has_init=True, has_dst=False, watch=bounded, **kw)
    if x.is_cuda:
        torch.cuda.synchronize()
    w.check()
    assert torch.equal(s_in, x)  # the state it took in, as a hop keeps it for the piece
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block_rows", [None, 16, 32, 64])
def test_dense_hop_row_blocks_match_float64(dtype, block_rows, seed):
    """Every choice of rows per product (the default :func:`dense_block_rows`: 64 for float32 on tensor cores)
    gives ``M x + delta`` of a 2 x 64 x 64 state in two column tiles, to float32's accuracy (three TF32 passes)
    or float64's (products summed elementwise)."""
    from megatron_zeco.kernels import scan_hop

    x, M, delta = _state_map_delta(seed)
    want = M @ x + delta
    y = _dense_hop_alone(*(t.to(DEVICE, dtype) for t in (x, M, delta)), tiles=2, block_rows=block_rows).cpu()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert (y.double() - want).abs().max() <= tol * want.abs().max()
    if block_rows is None:
        assert scan_hop.dense_block_rows(64, 32, dtype) == (64 if dtype == torch.float32 else 32)


def _state_map_delta(seed):
    """A 2 x 64 x 64 state, a map of norm about one and a delta, float64."""
    g = torch.Generator().manual_seed(seed)
    x, delta = (torch.randn(1, 2, 64, 64, generator=g, dtype=torch.float64) for _ in range(2))
    return x, torch.randn(1, 2, 64, 64, generator=g, dtype=torch.float64) / 8, delta


def test_dense_hop_multiplies_in_its_precision(seed):
    """float32 products in three TF32 passes keep float32's accuracy; in one (``"tf32"``, what the scans of pieces
    of 16-bit inputs run: ``dense_precision("input")``) TF32's, within 2^-11 of each operand. On the GPU one pass
    is measurably coarser than three, so the precision reaches the compiled kernel (the interpreter multiplies
    float32 exactly either way); a precision the kernel has not is refused."""
    from megatron_zeco.kernels import scan_hop

    x, M, delta = _state_map_delta(seed)
    want = M @ x + delta
    errors = {}
    for precision in scan_hop.DENSE_PRECISIONS:
        y = _dense_hop_alone(*(t.to(DEVICE, torch.float32) for t in (x, M, delta)), tiles=2, precision=precision)
        errors[precision] = ((y.cpu().double() - want).abs().max() / want.abs().max()).item()
    assert errors["tf32x3"] <= 1e-5 and errors["tf32"] <= 4e-3, errors
    if DEVICE == "cuda":
        assert errors["tf32"] > 10 * errors["tf32x3"], errors
    with pytest.raises(ValueError, match="precision must be one of"):
        _dense_hop_alone(*(t.to(DEVICE, torch.float32) for t in (x, M, delta)), tiles=2, precision="bf16")


def test_dense_block_rows_falls_back_off_tensor_cores():
    """Tiles too narrow for ``tl.dot`` (under 16 columns) and float64 take 32 rows at a time (their products
    are held elementwise in registers); a block-rows request that is not a power of two is refused."""
    from megatron_zeco.kernels import scan_hop

    assert scan_hop.dense_block_rows(128, 32, torch.float32) == 64
    assert scan_hop.dense_block_rows(128, 8, torch.float32) == 32
    assert scan_hop.dense_block_rows(16, 32, torch.float32) == 16
    assert scan_hop.dense_block_rows(128, 32, torch.float64) == 32
    x = torch.zeros(1, 1, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        _dense_hop_alone(x, torch.zeros(1, 1, 16, 16, device=DEVICE), x, tiles=1, block_rows=48)
