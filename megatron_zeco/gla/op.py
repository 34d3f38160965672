"""``zeco_gla``: gated linear attention over a sequence split across a context-parallel group."""

from typing import Optional, Tuple, Union

import torch

from ..comm import Layout
from ..cp.operator import Arguments, Operator, call_operator
from .local import gla_local, gla_piece, gla_ring_backward, gla_ring_forward

# GLA's hooks into the context-parallel strategies (its rules: cp.config.RULES["gla"]).
GLA = Operator(key="gla", name="zeco_gla", inputs=(("q", "BTHK"), ("k", "BTHK"), ("v", "BTHV"), ("g", "BTHK")),
               local=gla_local, piece=gla_piece, ring=(gla_ring_forward, gla_ring_backward))


def zeco_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    group=None,
    strategy: str = "zeco",
    layout: Union[str, Layout] = "contiguous",
    scale: Optional[float] = None,
    num_blocks: int = 1,
    overlap: Optional[bool] = None,
    transport: str = "auto",
    node_size: Optional[int] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    per_document: bool = False,
    piece_split: Optional[int] = None,
    validate: bool = True,
    name: str = "zeco_gla",
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated linear attention over a sequence split across the ranks of ``group``.

    Computes exactly ``chunk_gla`` over the whole (unsplit) sequence; each rank
    passes and gets back its own part of it. Differentiable in q, k, v, g and
    ``initial_state``.

    Args:
        q, k: ``[B, T, H, K]`` this rank's tokens (T = local length, the same on every rank).
        v: ``[B, T, H, V]``.
        g: ``[B, T, H, K]`` log forget gates, ``g <= 0``. q, k, v, g share one
            floating dtype (float64, float32, bfloat16, float16) and device.
        group: the context-parallel process group (Megatron's CP group), or None
            for no context parallelism.
        strategy: ``"zeco"`` (All-Scan), ``"lasp2"`` (all-gather), ``"lasp1"``
            (ring), ``"a2a"`` (head all-to-all; H divisible by the group size) or
            ``"none"`` (one rank). (A layer's ``cp_strategy``; the keywords below are likewise a
            layer's ``cp_*`` knobs: :class:`~megatron_zeco.cp.config.CPConfig`.)
        layout: which tokens this rank holds. ``"contiguous"``: rank r holds
            tokens ``[r*T, (r+1)*T)``. ``"zigzag"`` (Megatron's default CP split):
            the sequence is cut into 2P equal pieces and rank r holds pieces r
            and 2P-1-r, concatenated (T must be even).
        scale: output scale, default ``K ** -0.5``.
        num_blocks: ``zeco`` only: blocks of key rows the state is cut into and
            pipelined in (a divisor of K).
        overlap: ``zeco`` and ``lasp2`` on CUDA: the scan runs on a side stream (of the highest
            priority) beside the local work that does not need its result (forward and backward):
            over peer memory or NVSHMEM every hop kernel, on a few SMs (the first hop that waits for
            a peer spins there while the in-chunk work runs), otherwise the messages. None (default): on for ``zeco`` over peer
            memory or NVSHMEM, off otherwise; off, that local work is issued where the rank would
            first wait for a peer.
        transport: ``zeco`` only: how All-Scan moves its blocks. ``send_recv``: the group's
            point-to-point messages (NCCL, gloo). ``peer_memory``: one-sided stores into the
            peers' memory with flags on the device (torch symmetric memory over NVLink; all
            ranks on one node). ``nvshmem``: the same kernels and flags, tiles moved by
            device-initiated NVSHMEM puts, to any rank on this node or another (torch symmetric
            memory's NVSHMEM backend; one symmetric-memory backend per process). ``auto``:
            ``$MEGATRON_ZECO_TRANSPORT`` if set, else
            ``peer_memory`` for CUDA tensors when the group is on one node, else ``send_recv``.
            The same numbers either way (up to a fused multiply-add's rounding).
        node_size: ranks of ``group`` per node, consecutive in group rank order (None: from the
            hosts, or ``$MEGATRON_ZECO_NODE_SIZE``): where hops between nodes cost most.
        initial_state: ``[B, H, K, V]`` state before the first token, the same on
            every rank; its gradient is split over the ranks (their sum is the
            gradient), as Megatron's CP gradient reduction expects.
        output_final_state: also return the state after the last token.
        cu_seqlens: packed documents (Megatron's THD format): ``[N+1]`` integer offsets
            (any integer dtype and device; read on the host) of N documents in the whole
            packed sequence, all ranks' tokens together in sequence order, from 0 to
            ``P*T``; the same on every rank; B must be 1. Each document starts from a
            zero state (empty documents are skipped). Not with ``initial_state`` or
            ``output_final_state``; strategies zeco, lasp2, a2a.
        per_document: with ``cu_seqlens``: ``layout`` cuts each document rather than the
            whole packed sequence, and a rank holds its pieces of every document, one
            document after another. ``layout="zigzag", per_document=True`` is Megatron's
            THD CP split (documents padded to multiples of 2P, ``cu_seqlens_padded``);
            ``per_document=False`` is Megatron-LM's split of a packed sequence with
            ``--dataloader-inter-document-masking``. :func:`packed_positions` gives a
            rank's tokens under either.
        piece_split: ``zeco`` and ``lasp2`` at CP > 1, not packed: run each of the rank's
            pieces as this many consecutive sub-pieces, batched (each rank's T must divide into
            pieces x piece_split). Exact; on GPUs fla's sequential state kernels then get
            piece_split times more independent sequences, which pays where B x H x pieces is small.
            None (default): 2 for ``zeco`` on an unpacked contiguous split with T even (a
            contiguous piece then runs as two halves, the shape zigzag gives a rank anyway),
            else 1.
        validate: all-gather a description of every rank's inputs and raise the same ``ValueError``
            on all ranks if any is unusable (one small collective), at the first call of each group,
            knobs and input shapes, dtypes and devices; later calls alike reuse that check and the plan
            (no collective, no host read), packed calls (``cu_seqlens``) are checked every time.
            A call that needs no check (an earlier one alike, or off) can be captured in a CUDA
            graph (no CP, or zeco over peer memory; warm up first).
        name: names the caller in communication errors (the layer passes its number).

    Returns:
        ``o`` ``[B, T, H, V]`` in the input dtype, and the final state
        ``[B, H, K, V]`` in float32 (float64 for float64 inputs) on every rank, or None.
    """
    args = Arguments((q, k, v, g), initial_state, output_final_state, cu_seqlens, per_document, scale)
    knobs = dict(strategy=strategy, layout=layout, num_blocks=num_blocks, overlap=overlap, transport=transport,
                 node_size=node_size, piece_split=piece_split)
    return call_operator(GLA, knobs, args, group, validate, name)
