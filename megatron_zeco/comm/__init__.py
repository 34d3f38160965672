"""Communication: sequence layouts over a CP group and the state scans (All-Scan, all-gather)."""

from .all_scan import Route, all_scan, chain_scan, gather_scan
from .layout import Layout, as_layout
from .watch import ScanTimeoutError, check_scans

__all__ = ["Layout", "Route", "as_layout", "all_scan", "chain_scan", "gather_scan", "check_scans", "ScanTimeoutError"]
