"""benchmarks/green_context.py's SM partitions (what ``bench_overlap.py --scan-sms`` times): streams of disjoint SMs."""

import pytest
import torch

from tests.helpers.benchmarks import load

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _sms_used(stream, programs=4096):
    """The SMs a Triton kernel of ``programs`` programs ran on, launched on ``stream``."""
    import triton
    import triton.language as tl

    @triton.jit
    def smid_kernel(out_ptr, sink_ptr, spin):
        pid = tl.program_id(0)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32, is_pure=False, pack=1)
        acc = pid
        for _ in range(spin):  # long enough that the programs spread over every SM they may use
            acc = acc * 1103515245 + 12345
        tl.store(out_ptr + pid, sm)
        tl.store(sink_ptr + pid, acc)

    out = torch.full((programs,), -1, dtype=torch.int32, device="cuda")
    sink = torch.empty_like(out)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        smid_kernel[(programs,)](out, sink, 20000)
    stream.synchronize()
    assert (out >= 0).all()
    return set(out.tolist())


@pytest.mark.parametrize("scan_sms", [8, 16])
def test_partitions_are_disjoint(scan_sms):
    gc = load("green_context")
    device = torch.device("cuda", 0)

    total = torch.cuda.get_device_properties(0).multi_processor_count
    (scan_ctx, scan_n), (work_ctx, work_n) = gc.split_sms(device, scan_sms)
    assert scan_n >= scan_sms and scan_n + work_n <= total
    scan_stream, work_stream = gc.green_stream(scan_ctx, device), gc.green_stream(work_ctx, device)
    scan, work, every = _sms_used(scan_stream), _sms_used(work_stream), _sms_used(torch.cuda.current_stream())
    assert len(scan) <= scan_n and len(work) <= work_n, (len(scan), len(work))
    assert not scan & work, sorted(scan & work)
    assert len(every) == total  # the primary context's streams keep every SM
    # torch's own kernels run there too, and streams order against the primary context's
    x = torch.randn(512, 512, device="cuda")
    work_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(work_stream):
        y = x @ x
    torch.cuda.current_stream().wait_stream(work_stream)
    torch.testing.assert_close(y, x @ x)
    # more streams on either side run there too
    assert _sms_used(gc.green_stream(work_ctx, device)) <= work


def test_refuses_what_cannot_split():
    split_sms = load("green_context").split_sms

    total = torch.cuda.get_device_properties(0).multi_processor_count
    for sms, groups in ((0, 1), (total, 1), (8, 0), (total // 2, 2)):
        with pytest.raises(ValueError, match="must leave some"):
            split_sms(torch.device("cuda", 0), sms, groups)


def test_groups_are_disjoint():
    gc = load("green_context")

    parts = gc.split_sms(torch.device("cuda", 0), 8, groups=2)
    used = [_sms_used(gc.green_stream(ctx, torch.device("cuda", 0))) for ctx, _ in parts]
    assert [len(u) <= n for u, (_, n) in zip(used, parts)] == [True] * 3
    assert not (used[0] & used[1] or used[0] & used[2] or used[1] & used[2])
