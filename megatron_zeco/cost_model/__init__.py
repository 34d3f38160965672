"""Cost model of linear-attention context parallelism as built: the time of one layer per strategy as P grows.

Times are seconds of one layer, forward + backward, on each of P GPUs holding ``tokens`` tokens
each (weak scaling). Efficiency is ``t(none) / t(strategy)`` at the same tokens per GPU.
The operator (``OPERATORS``: GLA, the gated delta rule, KDA) sets what crosses ranks through one
:class:`Operator`: its piece maps' transition, diagonal (a K-vector per head, GLA) or dense (K x K,
the delta rules), gives the state and map bytes, the blocks' dim and the matrix products a hop
computes (charged at the stated ``FP32_FLOPS`` over send/recv, and over the device transports at the
dense hop kernel's measured time beyond a diagonal one's, ``hop_rows``, where timed; a diagonal's
elementwise work is inside the measured hop). The equations, the figures and their sources are in
``docs/scaling.md``; in short:

* ``none``:  ``t_op``, the measured one-GPU time of the local op (an input).
* ``zeco``:  ``t_op (1 + extra + piece) + passes + sum over fwd/bwd of max(0, scan - hidden * t_dir / aside)
  + spin * min(aside * scan, hidden * t_dir)``, ``piece`` what a delta rule's ZeCO piece adds to its one-GPU
  op (measured, ``piece_rows``; 0 for GLA), ``hidden`` the share of a direction's local op its scan runs
  beside, ``spin`` how much slower the spinning hops make it and ``aside`` how many times longer a hop takes
  beside it than alone (measured, ``overlap_rows``; over the device transports where the operator's rules
  turn the overlap on, else no overlap),
  the scan one All-Scan of a *shape* over a *transport* (both as built, ``comm/``):

  - ``chain`` (``all_scan``): the K blocks of the state walk every piece;
    ``call + sum_i tau_i + (K - 1) pace`` with ``tau = hop + latency + (S / K) / bandwidth``
    per hop of the walk (``chain_hops``) and ``pace = max(message, (S / K) / bandwidth)``: a
    block follows the previous one at the pace of its issue or its transfer; the latency is
    paid once per hop. Over peer memory a zigzag walk runs as two legs of P - 1 hops at once.
  - ``hierarchical`` (``comm/hierarchical.py``): its schedule of messages step by step (prefix
    maps along each node's run of pieces, a Kogge-Stone scan of the runs' maps between nodes,
    the state into each run), replayed (``hierarchical_steps``) and timed along its critical
    path (``critical_path``); over send/recv one message per step carries every block.

  The hop counts, the replayed schedule, the links and the transports' structure are those the
  run-time choice of shape uses: ``megatron_zeco.comm.shape`` (re-exported here).

  Transports (``TRANSPORTS``): ``send_recv`` (the group's messages, host-issued NCCL),
  ``peer_memory`` (one-sided stores and device flags, one node), ``nvshmem`` (device-initiated
  puts across nodes: *projected*, see ``NVSHMEM_PROJECTION``).
* ``lasp2``: as zeco (the same pieces) with an all-gather of every piece's state, ``(P-1)(latency + S/bandwidth)``
  on the slowest link, and a local fold over all pieces.
* ``lasp1``: the ranks run one after another: ``P t_op`` plus two K=1 chains.
* ``a2a``:   all-to-all of q, k, v, g and o (and their gradients) plus the copies around it.

Two regimes. ``eager``: a layer issued from Python and timed from an empty queue (what
``benchmarks/bench_op.py``'s eager rows measure); the host's per-call and per-message costs are
fitted on those rows' ``ms``. ``steady``: layers issued back to back as in training, the host
ahead of the GPU (bench_op's steady rows); only what the devices do counts, fitted on the scan
rows' ``gpu_ms``. Each calibration row is modelled in its regime (:func:`calibrate`).

Modules: ``model`` (the equations), ``calibration`` (the fit on result files; the package ships
its data), ``projection`` (projections and the command line); their names are re-exported here.
Run ``python -m megatron_zeco.cost_model --help`` for the command line. Standard library only,
no GPU (importing it through the ``megatron_zeco`` package imports torch with the package).
"""

from ..comm.shape import (HOP_COST, INFINIBAND, NVLINK, TRANSPORTS, Cluster, Link, chain_hops, critical_path,
                          hierarchical_steps, prefer_hierarchical, scan_choice, scan_path, walk_ranks)
from ..comm.transport import Transport
from .calibration import (BUILD, BUILD_META, DATA, DENSE_PRECISION, HOP, META, NVSHMEM_PROJECTION, ONE_GPU, OVERLAP,
                          PARTS, PASS_UNITS, PIECE, PIECE_CASES, PIECE_META, Calibration, Residual, calibrate,
                          calibration_rows, default_rows, file_rows, hop_rows, load_rows, op_time_rows, overlap_rows,
                          piece_rows)
from .model import (ACT_BYTES, CHUNK, DEVICE, FOLD_LAUNCH, FP32_FLOPS, FWD_FRACTION, GDN, GLA, HBM_BANDWIDTH, KDA,
                    LAYOUTS, OPERATORS, REGIMES, SHAPES, STRATEGIES, Dense, Diagonal, Operator, Software, Workload,
                    best_blocks, blocks, chain_time, efficiency, gather_time, hierarchical_phases, hierarchical_time,
                    layer_time, scan_time)
from .projection import (Choice, LayerShape, main, overlap_shares, piece_share, project, projection_workload,
                         zeco_choices)

__all__ = [
    # links, transports and the scan shapes (megatron_zeco.comm.shape)
    "HOP_COST", "INFINIBAND", "NVLINK", "TRANSPORTS", "Cluster", "Link", "Transport", "chain_hops", "critical_path",
    "hierarchical_steps", "prefer_hierarchical", "scan_choice", "scan_path", "walk_ranks",
    # the operators and the equations
    "ACT_BYTES", "CHUNK", "DEVICE", "FOLD_LAUNCH", "FP32_FLOPS", "FWD_FRACTION", "GDN", "GLA", "HBM_BANDWIDTH", "KDA",
    "LAYOUTS", "OPERATORS", "REGIMES", "SHAPES", "STRATEGIES", "Dense", "Diagonal", "Operator", "Software", "Workload",
    "best_blocks", "blocks", "chain_time", "efficiency", "gather_time", "hierarchical_phases", "hierarchical_time",
    "layer_time", "scan_time",
    # the calibration
    "BUILD", "BUILD_META", "DATA", "DENSE_PRECISION", "HOP", "META", "NVSHMEM_PROJECTION", "ONE_GPU", "OVERLAP",
    "PARTS", "PASS_UNITS",
    "PIECE", "PIECE_CASES", "PIECE_META", "Calibration", "Residual", "calibrate", "calibration_rows", "default_rows",
    "file_rows", "hop_rows", "load_rows", "op_time_rows", "overlap_rows", "piece_rows",
    # projections and the command line
    "Choice", "LayerShape", "main", "overlap_shares", "piece_share", "project", "projection_workload", "zeco_choices",
]
