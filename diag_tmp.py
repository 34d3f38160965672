import faulthandler, os, sys, time, json
faulthandler.dump_traceback_later(float(os.environ.get("DUMP", 60)), repeat=True)
t0 = time.perf_counter()
def say(*a):
    print(f"[{os.getpid()} {time.perf_counter()-t0:7.1f}s]", *a, flush=True)
import torch
say("torch", torch.__version__, torch.get_num_threads(), torch.cuda.get_arch_list())
torch.cuda.init(); torch.zeros(1, device="cuda"); say("cuda ready")
from megatron_zeco.common import tuning
tuning.configure()
import triton
old = triton.knobs.compilation.listener
def listener(*, src, metadata, metadata_group, times, cache_hit):
    fn = getattr(src, "fn", None)
    st = {"ir": times.ir_initialization / 1e6, **{e: us / 1e6 for e, us in times.lowering_stages}}
    say("compile", getattr(fn, "__name__", None), "hit" if cache_hit else "MISS", {k: round(v, 2) for k, v in st.items()})
triton.knobs.compilation.listener = listener
sys.path.insert(0, ".")
from tests.helpers.reference import problem, reference
x = problem(1, B=2, T=300, H=4, K=64, V=64, gate="normal")
say("problem")
r = reference(x); say("reference")
a = torch.randn(4096, 4096, device="cuda", dtype=torch.float64); (a @ a).sum().item(); say("cuda fp64 matmul")
from tests.gla.test_gpu import _run
got = _run(x, torch.float32); say("_run fp32 #1")
got = _run(x, torch.float32); say("_run fp32 #2")
got = _run(x, torch.bfloat16); say("_run bf16 #1")
got = _run(x, torch.bfloat16); say("_run bf16 #2")
