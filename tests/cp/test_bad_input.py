"""Bad input raises the same clear ValueError on every rank, and never hangs."""

import pytest
import torch
import torch.distributed as dist

from megatron_zeco import zeco_gla

pytestmark = pytest.mark.slow

# Two processes for every case: each case's checks end in the same error on both ranks, so the
# processes stay in step (a case that fails or hangs restarts them).
RANK_POOL = dict(world=2, timeout=120)


def _inputs(T=12, H=2, K=8, V=4, dtype=torch.float64):
    return [torch.randn(1, T, H, K, dtype=dtype), torch.randn(1, T, H, K, dtype=dtype),
            torch.randn(1, T, H, V, dtype=dtype), -torch.rand(1, T, H, K, dtype=dtype)]


def _one_rank_differs(rank, **bad):
    """Keyword arguments for zeco_gla where only the last rank gets ``bad``."""
    return bad if rank == dist.get_world_size() - 1 else {}


CASES = {
    "lengths differ": (lambda r: ([*_inputs(T=10 if r == 1 else 12)], {}), "same on every rank"),
    "zigzag length odd": (lambda r: (_inputs(T=11 if r == 0 else 12), {"layout": "zigzag"}),
                          "divisible by 2"),
    "blocks do not divide K": (lambda r: (_inputs(), {"num_blocks": 3}), "cp_num_blocks 3 must divide the key head dim (8)"),
    "a2a heads": (lambda r: (_inputs(H=3), {"strategy": "a2a"}), "not divisible by the group size"),
    "strategy none on a group": (lambda r: (_inputs(), {"strategy": "none"}), "runs on one rank"),
    "mixed dtypes on one rank": (lambda r: ([*_inputs()[:3], -torch.rand(1, 12, 2, 8)] if r == 1 else _inputs(), {}),
                                 "share one dtype"),
    "dtype differs across ranks": (lambda r: (_inputs(dtype=torch.float32 if r == 0 else torch.float64), {}),
                                   "same on every rank"),
    "device differs on one rank": (lambda r: ([*_inputs()[:2], torch.empty(1, 12, 2, 4, device="meta", dtype=torch.float64),
                                               _inputs()[3]] if r == 1 else _inputs(), {}), "one device"),
    "unknown strategy on one rank": (lambda r: (_inputs(), {"strategy": "zec0" if r == 0 else "zeco"}),
                                     "cp_strategy 'zec0' is not one of zeco, lasp1, lasp2, a2a for GLA"),
    "unknown layout on one rank": (lambda r: (_inputs(), {"layout": "zig-zag" if r == 1 else "zigzag"}),
                                   "cp_layout 'zig-zag' is not one of contiguous, zigzag"),
    "initial state only on one rank": (lambda r: (_inputs(), {"initial_state": torch.zeros(1, 2, 8, 4, dtype=torch.float64)
                                                              if r == 0 else None}), "initial_state"),
    "unknown transport on one rank": (lambda r: (_inputs(), {"transport": "nvlink" if r == 0 else "auto"}),
                                      "cp_transport 'nvlink' is not one of auto, send_recv, peer_memory, nvshmem"),
    "transport differs across ranks": (lambda r: (_inputs(), {"transport": "send_recv" if r == 0 else "peer_memory"}),
                                       "the context-parallel knobs (strategy, layout, num_blocks, transport, "
                                       "piece_split, node_size) must be the same on every rank"),
    "v has another length": (lambda r: ([*_inputs()[:2], torch.randn(1, 11, 2, 4, dtype=torch.float64), _inputs()[3]], {}),
                             "v must be [B, T, H, V]"),
    "sub-pieces do not divide the pieces": (lambda r: (_inputs(), {"layout": "zigzag", "piece_split": 4}),
                                            "T = 12 must be divisible by 8"),
    "piece_split not positive": (lambda r: (_inputs(), {"piece_split": 0}), "must be a positive integer"),
    "piece_split differs across ranks": (lambda r: (_inputs(), {"piece_split": 2 if r == 0 else 3}),
                                         "knobs (strategy, layout, num_blocks, transport, piece_split, node_size) must "
                                         "be the same on every rank"),
}


def _call(group, name):
    make, _ = CASES[name]
    tensors, kwargs = make(dist.get_rank(group))
    try:
        zeco_gla(*tensors, group=group, **kwargs)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_fails_on_every_rank(pool, name):
    messages = pool.run(_call, 2, name)
    expected = CASES[name][1]
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} accepted the input"
        assert expected in message, f"rank {rank}: {message}"
    assert len(set(messages)) == 1, messages  # the same message everywhere


def test_one_rank_groups_validate_locally():
    q, k, v, g = _inputs(T=7)
    with pytest.raises(ValueError, match="divisible by 2"):
        zeco_gla(q, k, v, g, layout="zigzag")
    with pytest.raises(ValueError, match="cp_strategy 'ring' is not one of"):
        zeco_gla(q, k, v, g, strategy="ring")
    with pytest.raises(ValueError, match="cp_strategy 'ring' is not one of"):
        zeco_gla(q, k, v, g, strategy="ring", validate=False)
    with pytest.raises(ValueError, match="T = 7 must be divisible by 2"):
        zeco_gla(q, k, v, g, piece_split=2, validate=False)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int32, torch.complex64])
def test_unsupported_dtypes_are_named(dtype):
    """The op runs float64, float32, bfloat16 and float16; anything else fails before any work."""
    q, k, v, g = (t.to(dtype) for t in _inputs())
    with pytest.raises(ValueError, match=f"q must be float64, float32, bfloat16 or float16, got {dtype}"):
        zeco_gla(q, k, v, g)
    q, k, v, g = _inputs()
    with pytest.raises(ValueError, match=f"initial_state must be float64, float32, bfloat16 or float16, got {dtype}"):
        zeco_gla(q, k, v, g, initial_state=torch.zeros(1, 2, 8, 4).to(dtype))


def _validations(group, T):
    """Calls of zeco_gla: three alike, one of another length, then the first again; how many ran the
    cross-rank check (all_gather_object)."""
    import megatron_zeco.cp.checks as checks

    calls = []
    gather = dist.all_gather_object

    def counted(*args, **kw):
        calls.append(1)
        return gather(*args, **kw)

    checks.dist.all_gather_object = counted
    try:
        for length in (T, T, T, T + 4, T):
            zeco_gla(*_inputs(T=length), group=group, name="validated once")
    finally:
        checks.dist.all_gather_object = gather
    return len(calls)


def test_calls_alike_check_once(pool):
    """A loop calling the op pays the cross-rank check once per shape (later calls alike reuse it)."""
    assert pool.run(_validations, 2, 12) == [2, 2]


def _bad_after_good(group):
    zeco_gla(*_inputs(T=12), group=group, name="bad after good")
    try:
        zeco_gla(*_inputs(T=12), group=group, name="bad after good", num_blocks=3)
    except ValueError as e:
        return str(e)
    return None


def test_a_bad_call_after_a_good_one_is_still_refused_on_every_rank(pool):
    messages = pool.run(_bad_after_good, 2)
    assert all(m is not None and "cp_num_blocks 3 must divide the key head dim" in m for m in messages), messages


def _under_capture(group):
    """What a CUDA-graph capture meets (the capture itself mocked: no GPU here): the first call of a shape,
    then, warm, an All-Scan over host-issued messages, then packed documents called alike before; each
    refused by name, on every rank."""
    import megatron_zeco.cp.operator as operator

    messages = []
    packed = dict(cu_seqlens=torch.tensor([0, 10, 32]))
    zeco_gla(*_inputs(T=16), group=group, name="warm")  # the plan of T = 16, made before the capture
    zeco_gla(*_inputs(T=16), group=group, name="warm", **packed)
    real = operator._capturing
    operator._capturing = lambda: True
    try:
        # a shape never called, then the warm one (over send/recv, gloo's messages), then the packed one
        for T, kw in ((20, {}), (16, {}), (16, packed)):
            try:
                zeco_gla(*_inputs(T=T), group=group, name="warm", **kw)
                messages.append(None)
            except RuntimeError as e:
                messages.append(str(e))
    finally:
        operator._capturing = real
    return messages


def test_a_capture_that_cannot_work_is_refused_by_name(pool):
    for first, warm, packed in pool.run(_under_capture, 2):
        assert first is not None and "cannot be captured in a CUDA graph: its first call" in first, first
        assert warm is not None and "All-Scan goes over send_recv" in warm and "'peer_memory'" in warm, warm
        assert packed is not None and "cannot be captured in a CUDA graph: packed documents" in packed, packed
