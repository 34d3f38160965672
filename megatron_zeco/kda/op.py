"""Context-parallel Kimi Delta Attention (Kimi Linear's token mixer): ``zeco_kda``.

Per head ``S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``, ``o_t = scale * S_t^T q_t``,
with ``g_t`` a log decay per key channel (the gated delta rule's scalar gate made a K-vector). A rank's
piece maps the state entering it to the state leaving it by ``S_out = M S_in + E`` with ``M`` a dense
K x K matrix, as in the gated delta rule, so the same strategies carry over:

=========  ===================================================  ===========================
strategy   what crosses ranks per layer                          as
=========  ===================================================  ===========================
zeco       one K x V state per piece, pipelined All-Scan         cp/scan.py (+ comm/all_scan);
           (blocks of value columns; M stays on its rank)        backward through M^T
lasp2      all-gather of every piece's ``[E | M]``               as fla 0.6's own CP
a2a        q, k, v, g, beta and o by all-to-all over heads
none       nothing (one rank)                                    the local operator
=========  ===================================================  ===========================
"""

from typing import Optional, Tuple, Union

import torch

from ..comm import Layout
from ..cp.operator import Arguments, Operator, call_operator
from .local import kda_local, kda_piece

# KDA's hooks into the context-parallel strategies (its rules: cp.config.RULES["kda"]).
KDA = Operator(
    key="kda", name="zeco_kda",
    inputs=(("q", "BTHK"), ("k", "BTHK"), ("v", "BTHV"), ("g", "BTHK"), ("beta", "BTH")),
    local=kda_local, piece=kda_piece, float32=("g",))


def zeco_kda(
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
    name: str = "zeco_kda",
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Kimi Delta Attention over a sequence split across the ranks of ``group``.

    Computes exactly fla's ``chunk_kda`` (``g`` the log decays, as fla takes them with
    ``use_gate_in_kernel=False``) over the whole (unsplit) sequence; each rank passes and gets back
    its own part of it. Differentiable in q, k, v, g, beta and ``initial_state``.

    Args:
        q, k: ``[B, T, H, K]`` this rank's tokens (T the same on every rank; q and k usually
            L2-normalised).
        v: ``[B, T, H, V]``.
        g: ``[B, T, H, K]`` log decay per head, token and key channel (``g <= 0``).
        beta: ``[B, T, H]`` write strength in ``[0, 1]``. q, k, v, g, beta share one floating dtype
            (float64, float32, bfloat16, float16) and device; g may also be float32 beside another.
        group: the context-parallel process group, or None for no context parallelism.
        strategy: ``"zeco"`` (All-Scan), ``"lasp2"`` (all-gather of every piece's ``[E | M]``),
            ``"a2a"`` (head all-to-all; H divisible by the group size) or ``"none"`` (one rank).
        layout: ``"contiguous"`` or ``"zigzag"`` (Megatron's split), as :func:`megatron_zeco.zeco_gla`.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` state before the first token, the same on every rank; its
            gradient is split over the ranks (their sum is the gradient).
        output_final_state: also return the state after the last token (on every rank).
        cu_seqlens, per_document: packed documents, as :func:`megatron_zeco.zeco_gla` takes them.
        num_blocks: ``zeco`` only: blocks of value columns (a divisor of V) the All-Scan pipelines.
        transport: ``zeco`` only: ``send_recv``, ``peer_memory`` or ``nvshmem`` (the dense hop
            kernel); ``auto``: what ``cp.config.RULES["kda"]`` says.
        overlap: ``zeco`` and ``lasp2`` on CUDA: the scan runs on a side stream beside the local work
            that needs no entering state (the piece's ``before_output`` and ``before_grads``). None (default): what
            ``cp.config.RULES`` says for this operator (off).
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
    return call_operator(KDA, knobs, args, group, validate, name)
