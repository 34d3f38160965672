"""``all_scan_rounds_kernel`` in one process: a run of steps looped back through regions of the process's own
(a send into one of them, then a receive from it, composed or taken as it is), against float64 compositions,
over several calls (the call counters and acknowledgements carry from one to the next). On the CPU under
TRITON_INTERPRET=1; compiled where a GPU is. Across ranks: tests/comm/test_peer_hierarchical.py."""

import pytest
import torch

from megatron_zeco.comm.peer import region_bytes
from megatron_zeco.comm.watch import watch
from megatron_zeco.kernels import scan_hop

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _compose(later, earlier, V):
    """``later o earlier`` of diagonal maps ``[N, K, V + 1]``: ``[t E' + E | t t']``."""
    t = later[..., V:]
    return torch.cat([t * earlier[..., :V] + later[..., :V], t * earlier[..., V:]], dim=-1)


def _loop_back(N, K, W, tiles, name):
    """Six regions of this process for maps ``[N, K, W]`` in ``tiles`` tiles (their buffer and flag bytes, the
    buffer, the regions' addresses), the watch bounding the waits and a launch id per step of six."""
    dtype = torch.float64 if DEVICE == "cpu" else torch.float32
    data, flags, size = region_bytes(N, K, W, dtype, tiles, False)
    regions = torch.zeros(6 * size, dtype=torch.uint8, device=DEVICE)
    w = watch(regions.device)
    whos = [w.launch_id((name, N, s), lambda s=s: (f"{name} step {s}", (None, None))) for s in range(6)]
    return dtype, data, flags, regions, [regions.data_ptr() + i * size for i in range(6)], w, whos


@pytest.mark.parametrize("programs", [None, 3])
@pytest.mark.parametrize("N, K, V, tiles", [(2, 8, 5, 2), (3, 4, 3, 1)])
def test_rounds_looped_back_through_own_regions(seed, programs, N, K, V, tiles):
    """Steps: send the map to region B, receive it there and compose it under the map (``own o own``),
    send that to region C and take it from C as it is, send it to D, receive it and compose it again: the
    map ends as ``(own o own) o (own o own)``, every call with fresh maps, on one program per tile or on
    fewer programs than tiles."""
    W = V + 1
    dtype, data, flags, regions, (A, B, C, D, E_, F), w, whos = _loop_back(N, K, W, tiles, f"loop-back {seed}")
    # (here, sent, src, dst, src_pe, dst_pe, compose, 0): send A -> B; B receives (compose); send E -> C;
    # C receives (as it is); send F -> D; D receives (compose)
    rows = [(A, A, 0, B, -1, -1, 0, 0), (B, 0, A, 0, -1, -1, 1, 0), (E_, E_, 0, C, -1, -1, 0, 0),
            (C, 0, E_, 0, -1, -1, 0, 0), (F, F, 0, D, -1, -1, 0, 0), (D, 0, F, 0, -1, -1, 1, 0)]
    table = torch.tensor(rows, dtype=torch.int64, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    for call in range(3):
        own = torch.cat([torch.randn(N, K, V, generator=gen, dtype=torch.float64),
                         torch.rand(N, K, 1, generator=gen, dtype=torch.float64)], dim=-1)
        y = torch.full((N, K, W), float("nan"), dtype=dtype, device=DEVICE)
        bounded = w.arguments(whos[0], 30.0)
        scan_hop.all_scan_rounds(own.to(DEVICE, dtype), y, table, A, tiles, data, flags, watch=bounded,
                                 programs=programs)
        twice = _compose(own, own, V)
        want = _compose(twice, twice, V)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        assert torch.allclose(y.cpu().double(), want, rtol=tol, atol=tol), (call, (y.cpu().double() - want).abs().max())
    w.check()


@pytest.mark.parametrize("programs", [None, 2])
@pytest.mark.parametrize("N, K, V, tiles", [(3, 4, 4, 2), (2, 3, 6, 3), (2, 5, 2, 1)])
def test_dense_rounds_pass_column_tiles_on(seed, programs, N, K, V, tiles):
    """Dense maps ``[N, K, V + K]`` in column tiles: a leader's lanes handed out (each step moving one lane's
    states of two, received as it is), then the whole map sent on and taken back as it is. Each region's tiles
    are where the dense hop kernel puts and reads them (``[K, columns]`` together, tile by tile), so that a
    rounds launch and a dense hop exchange maps, and a lane's region holds that lane's states only; the map ends
    as it started, every call with fresh maps."""
    W = V + K
    dtype, data, flags, regions, (A, B, C, D, E_, F), w, whos = _loop_back(N, K, W, tiles, f"dense {seed}")
    lane = [scan_hop.lane_part((g, 2)) for g in range(2)]
    # lane 0's states A -> B, lane 1's E -> C, every state F -> D, each received as it is
    rows = [(A, A, 0, B, -1, -1, 0, lane[0]), (B, 0, A, 0, -1, -1, 0, lane[0]), (E_, E_, 0, C, -1, -1, 0, lane[1]),
            (C, 0, E_, 0, -1, -1, 0, lane[1]), (F, F, 0, D, -1, -1, 0, 0), (D, 0, F, 0, -1, -1, 0, 0)]
    table = torch.tensor(rows, dtype=torch.int64, device=DEVICE)
    cols = W // tiles
    gen = torch.Generator().manual_seed(seed)
    for call in range(3):
        own = torch.randn(N, K, W, generator=gen, dtype=torch.float64)
        y = torch.full((N, K, W), float("nan"), dtype=dtype, device=DEVICE)
        bounded = w.arguments(whos[0], 30.0)
        scan_hop.all_scan_rounds(own.to(DEVICE, dtype), y, table, A, tiles, data, flags, watch=bounded,
                                 programs=programs, dense=True)
        assert torch.equal(y.cpu().double(), own.to(dtype).double()), call
        # a region's buffer as the dense hop kernel lays it out: state n's column tile b at (n K W + b K cols)
        as_tiles = own.to(dtype).reshape(N, K, tiles, cols).permute(0, 2, 1, 3).reshape(N, K * W)
        for address, g in ((B, 0), (C, 1)):
            got = regions[address - A:address - A + data].view(dtype)[:N * K * W].reshape(N, K * W)
            assert torch.equal(got[g::2].cpu(), as_tiles[g::2]), (call, g)
            assert not got[1 - g::2].any(), (call, g)  # the other lane's states never go there
    w.check()


def _gives_up(rank, world, seed):
    """Three steps: a send that arrives, a receive nobody sends, a send; the waits bounded at 0.2 s."""
    from megatron_zeco.comm import ScanTimeoutError

    N, K, V, tiles = 2, 8, 5, 2
    dtype = torch.float64 if DEVICE == "cpu" else torch.float32
    data, flags, size = region_bytes(N, K, V + 1, dtype, tiles, False)
    regions = torch.zeros(5 * size, dtype=torch.uint8, device=DEVICE)
    A, B, C, D, E_ = (regions.data_ptr() + i * size for i in range(5))
    w = watch(regions.device)
    whos = [w.launch_id(("gives up", s), lambda s=s: (f"loop-back step {s}", (7, 8))) for s in range(3)]
    table = torch.tensor([(A, A, 0, C, -1, -1, 0, 0), (B, 0, A, 0, -1, -1, 1, 0), (E_, E_, 0, D, -1, -1, 0, 0)],
                         dtype=torch.int64, device=DEVICE)
    bounded = w.arguments(whos[0], 0.2)  # the kernel's: the first step's; each later step's limit for its report
    for who in whos[1:]:
        w.arguments(who, 0.2)
    own = torch.rand(N, K, V + 1, dtype=dtype, device=DEVICE)
    y = torch.zeros_like(own)
    scan_hop.all_scan_rounds(own, y, table, A, tiles, data, flags, watch=bounded)
    if DEVICE == "cuda":
        torch.cuda.synchronize()  # the launch has given up (its report is written) when it ends
    try:
        w.check()
    except ScanTimeoutError as e:
        sent = regions[3 * size:4 * size].view(dtype)[:N * K * (V + 1)]
        return str(e), bool(y.isnan().all()), bool(sent.isnan().all())
    return None, False, False


def test_a_rounds_wait_that_gives_up_names_its_step_and_delivers_nan(seed):
    """A step whose map never comes gives up after its bounded wait: the error names that step's launch and its
    peer, the map the launch composes is NaN, and so is what it sends on after it (run in a process of its
    own: a process that gave up stays so)."""
    from tests.helpers.distributed import run_ranks

    [(message, y_nan, sent_nan)] = run_ranks(_gives_up, 1, seed)
    assert message is not None and message.startswith("loop-back step 1:") and "global rank 7" in message, message
    assert y_nan and sent_nan
