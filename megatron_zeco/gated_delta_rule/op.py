"""Context-parallel gated delta rule (Gated DeltaNet's token mixer): ``zeco_gated_delta_rule``.

Per head ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = scale * S_t^T q_t``.
A rank's piece maps the state entering it to the state leaving it by ``S_out = M S_in + E`` with
``M = prod_t exp(g_t) (I - beta_t k_t k_t^T)`` a K x K matrix, so the strategies of ``zeco_gla``
carry over with a dense transition in place of the diagonal decay:

=========  ===================================================  ===========================
strategy   what crosses ranks per layer                          as
=========  ===================================================  ===========================
zeco       one K x V state per piece, pipelined All-Scan         scan.py (+ comm/all_scan);
           (blocks of columns; M stays on its rank)              backward through M^T
lasp2      all-gather of every piece's ``[E | M]``               fla 0.6's own context parallelism
a2a        q, k, v, g, beta and o by all-to-all over heads       Megatron-Core's GDN
none       nothing (one rank)                                    the local operator
=========  ===================================================  ===========================

All-Scan's combine here is a K x K by K x V product per head and block of columns. It travels as
the group's point-to-point messages by default, or, asked for, through peer memory or NVSHMEM:
one Triton kernel per piece that waits for the previous rank's columns, multiplies and stores
the result into the next rank's buffer (``kernels/scan_hop.py``, ``all_scan_dense_hop``).
"""

from typing import Optional, Tuple, Union

import torch

from ..comm import Layout
from ..cp.operator import Arguments, Operator, call_operator
from .local import gdn_local, gdn_piece

# The gated delta rule's hooks into the context-parallel strategies (its rules: cp.config.RULES).
GATED_DELTA_RULE = Operator(
    key="gated_delta_rule", name="zeco_gated_delta_rule",
    inputs=(("q", "BTHK"), ("k", "BTHK"), ("v", "BTHV"), ("g", "BTH"), ("beta", "BTH")),
    local=gdn_local, piece=gdn_piece, float32=("g",))


def zeco_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    group=None,
    strategy: str = "zeco",
    layout: Union[str, Layout] = "contiguous",
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    per_document: bool = False,
    num_blocks: int = 1,
    transport: str = "auto",
    overlap: Optional[bool] = None,
    validate: bool = True,
    name: str = "zeco_gated_delta_rule",
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gated delta rule over a sequence split across the ranks of ``group``.

    Computes exactly fla's ``chunk_gated_delta_rule`` over the whole (unsplit) sequence; each rank
    passes and gets back its own part of it. Differentiable in q, k, v, g, beta and ``initial_state``.

    Args:
        q, k: ``[B, T, H, K]`` this rank's tokens (T the same on every rank; k usually L2-normalised).
        v: ``[B, T, H, V]``.
        g: ``[B, T, H]`` log decay per head and token (``g <= 0``).
        beta: ``[B, T, H]`` write strength in ``[0, 1]``. q, k, v, g, beta share one floating dtype
            (float64, float32, bfloat16, float16) and device; g may also be float32 beside another
            dtype (fla's convention, and Megatron-Core's GatedDeltaNet's: log decays kept in float32).
        group: the context-parallel process group, or None for no context parallelism.
        strategy: ``"zeco"`` (All-Scan), ``"lasp2"`` (all-gather of every piece's ``[E | M]``),
            ``"a2a"`` (head all-to-all; H divisible by the group size) or ``"none"`` (one rank).
        layout: ``"contiguous"`` (rank r holds tokens ``[r*T, (r+1)*T)``) or ``"zigzag"``
            (Megatron's split: 2P pieces, rank r holds pieces r and 2P-1-r; T even).
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` state before the first token, the same on every rank; its
            gradient is split over the ranks (their sum is the gradient).
        output_final_state: also return the state after the last token (on every rank).
        cu_seqlens, per_document: packed documents, as :func:`megatron_zeco.zeco_gla` takes them
            (``[N+1]`` offsets over the whole packed sequence; B = 1; no initial or final state).
        num_blocks: ``zeco`` only: blocks of value columns (a divisor of V) the All-Scan pipelines;
            a row of ``M S`` reads every row of ``S``, so the state is cut by columns.
        transport: ``zeco`` only: ``send_recv`` (the group's point-to-point messages), ``peer_memory``
            (one node; on the CPU under ``TRITON_INTERPRET=1``) or ``nvshmem``: the dense hop kernel;
            ``auto``: what ``cp.config.RULES["gated_delta_rule"]`` says.
        overlap: ``zeco`` and ``lasp2`` on CUDA: the scan runs on a side stream beside the local work
            that needs no entering state (the piece's ``before_output`` and ``before_grads``). None (default): what
            ``cp.config.RULES`` says for this operator (on over ``peer_memory`` and ``nvshmem``).
        validate: all-gather a description of every rank's inputs and raise the same ``ValueError``
            on all ranks if any is unusable (one small collective), at the first call of each group,
            knobs and input shapes, dtypes and devices; later calls alike reuse that check and the plan
            (no collective, no host read), packed calls (``cu_seqlens``) are checked every time.
        name: names the caller in communication errors.

    Returns:
        ``o [B, T, H, V]`` in the input dtype, and the final state ``[B, H, K, V]`` in float32
        (float64 for float64 inputs) on every rank, or None.
    """
    args = Arguments((q, k, v, g, beta), initial_state, output_final_state, cu_seqlens, per_document, scale)
    knobs = dict(strategy=strategy, layout=layout, num_blocks=num_blocks, transport=transport, overlap=overlap)
    return call_operator(GATED_DELTA_RULE, knobs, args, group, validate, name)
