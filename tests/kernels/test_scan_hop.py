"""The All-Scan hop kernels (megatron_zeco/kernels/scan_hop.py) compile for the GPU. What they compute
is tested through the scans that launch them (tests/comm/test_all_scan.py, test_faults.py: peer memory
under TRITON_INTERPRET=1)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

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
    (scan_hop.all_scan_dense_hop_kernel, dense,  # float32 through tl.dot
        dict(HAS_SRC=True, HAS_INIT=True, HAS_DST=True, KEEP_Y=True, TWO=True, COLS=32, BC=32, BK=64, DOT=True)),
    (scan_hop.all_scan_dense_hop_kernel, {**dense, **{name: "*fp64" for name in ("M", "delta", "s_in", "M2", "delta2",
                                                                                   "s_in2", "y_out")}},
        dict(HAS_SRC=True, HAS_INIT=False, HAS_DST=True, KEEP_Y=False, TWO=False, COLS=8, BC=8, BK=64, BR=8,
             DOT=False)),  # float64, products summed elementwise
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
