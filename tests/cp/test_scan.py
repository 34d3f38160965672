"""cp/scan.py: the side stream the scans run on beside the local work."""

import torch

from megatron_zeco.cp import scan
from tests.helpers.streams import made_streams


def test_the_scans_side_stream_is_one_per_device_at_the_highest_priority(monkeypatch):
    """Its hop kernels, on few programs, are to be dispatched ahead of the local work's pending blocks:
    the stream is asked for at the highest priority (torch clamps -1 to the device's range), once per
    device."""
    made = made_streams(monkeypatch)
    monkeypatch.setattr(scan, "_SIDE_STREAMS", {})
    a, b = torch.device("cuda", 0), torch.device("cuda", 1)
    first = scan.scan_stream(a)
    assert scan.scan_stream(a) is first and scan.scan_stream(b) is not first
    assert made == [(a, -1), (b, -1)]
