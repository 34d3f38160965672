"""Input checks that agree across ranks.

A bad input on one rank must not leave the others waiting in a scan forever.
Each rank describes its inputs (and any local problem) without raising; the
descriptions are all-gathered; then every rank runs the same checks on the
same table and raises the same ``ValueError``.
"""

import os
from typing import List, Optional

import torch
import torch.distributed as dist

from ..comm import Layout, as_layout
from ..comm.peer import TRANSPORT_ENV, TRANSPORTS

STRATEGIES = ("zeco", "lasp1", "lasp2", "a2a", "none")
# What the local GLA runs (fla's kernels on CUDA, chunk.py elsewhere and for float64). float8 and
# complex dtypes are not: the op has no fp8 path (with --fp8-format only the layer's linears use it).
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_DTYPE_NAMES = "float64, float32, bfloat16 or float16"


def _local_problems(q, k, v, g, initial_state, num_blocks, pieces_per_rank, beta=None) -> List[str]:
    """This rank's problems with its tensors; ``beta`` given: the gated delta rule's inputs
    (``g`` and ``beta`` ``[B, T, H]``, the state pipelined in blocks of columns)."""
    delta_rule = beta is not None
    tensors = {"q": q, "k": k, "v": v, "g": g, **({"beta": beta} if delta_rule else {})}
    problems = [f"{n} must be a torch.Tensor, got {type(t).__name__}"
                for n, t in tensors.items() if not isinstance(t, torch.Tensor)]
    if problems:
        return problems
    for name, t in tensors.items():
        if delta_rule and name in ("g", "beta"):
            if t.dim() != 3:
                problems.append(f"{name} must have 3 dims [B, T, H], got shape {tuple(t.shape)}")
        elif t.dim() != 4:
            problems.append(f"{name} must have 4 dims [B, T, H, D], got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            problems.append(f"{name} must be {_DTYPE_NAMES}, got {t.dtype}")
    if problems:
        return problems
    if delta_rule:
        if k.shape != q.shape:
            problems.append(f"q and k must have one shape [B, T, H, K], got {tuple(q.shape)}, {tuple(k.shape)}")
        if g.shape != q.shape[:3] or beta.shape != q.shape[:3]:
            problems.append(f"g and beta must be [B, T, H] with B, T, H of q {tuple(q.shape[:3])}, got "
                            f"{tuple(g.shape)}, {tuple(beta.shape)}")
    elif k.shape != q.shape or g.shape != q.shape:
        problems.append(f"q, k and g must have one shape [B, T, H, K], got "
                        f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(g.shape)}")
    if v.shape[:3] != q.shape[:3]:
        problems.append(f"v must be [B, T, H, V] with B, T, H of q {tuple(q.shape[:3])}, got {tuple(v.shape)}")
    dtypes = {n: t.dtype for n, t in tensors.items()}
    # the gated delta rule's log decays may stay float32 beside lower-precision inputs, as fla takes them
    shared = {n: d for n, d in dtypes.items() if not (delta_rule and n == "g" and d == torch.float32)}
    if len(set(shared.values())) > 1:
        problems.append(f"{', '.join(tensors)} must share one dtype{' (g may be float32)' if delta_rule else ''}, "
                        f"got {dtypes}")
    devices = {n: t.device for n, t in tensors.items()}
    if initial_state is not None:
        devices["initial_state"] = initial_state.device
        B, _, H, K = q.shape
        expected = (B, H, K, v.shape[-1])
        if tuple(initial_state.shape) != expected:
            problems.append(f"initial_state must be [B, H, K, V] = {expected}, got {tuple(initial_state.shape)}")
        if initial_state.dtype not in DTYPES:
            problems.append(f"initial_state must be {_DTYPE_NAMES}, got {initial_state.dtype}")
    if len(set(devices.values())) > 1:
        problems.append(f"inputs must be on one device, got {{{', '.join(f'{n}: {d}' for n, d in devices.items())}}}")
    T, K = q.shape[1], q.shape[-1]
    if T == 0:
        problems.append("the local sequence is empty (T = 0)")
    elif T % pieces_per_rank:
        problems.append(f"the zigzag layout splits each rank's T = {T} tokens into {pieces_per_rank} "
                        f"equal pieces; T must be divisible by {pieces_per_rank}")
    if delta_rule:
        V = v.shape[-1]
        if not isinstance(num_blocks, int) or num_blocks < 1 or V % num_blocks:
            problems.append(f"num_blocks = {num_blocks!r} must be a positive divisor of the value dim V = {V} "
                            "(the gated delta rule's state is pipelined in blocks of columns)")
    elif not isinstance(num_blocks, int) or num_blocks < 1 or K % num_blocks:
        problems.append(f"num_blocks = {num_blocks!r} must be a positive divisor of the key dim K = {K}")
    return problems


def document_pieces(layout: Layout, world: int, per_document: bool) -> int:
    """Equal pieces every document of a packed sequence is cut into (1: documents are not cut)."""
    return layout.num_pieces(world) if per_document and world > 1 else 1


def cu_seqlens_problems(cu: List[int], total: int, pieces: int) -> List[str]:
    """What is wrong with document offsets ``cu`` of a packed sequence of ``total`` tokens
    whose documents are each cut into ``pieces`` equal pieces (1: not cut)."""
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total:
        return [f"cu_seqlens must run from 0 to the whole packed sequence's length (the group's "
                f"tokens, {total}); got {_short(cu)}"]
    if any(b < a for a, b in zip(cu, cu[1:])):
        return [f"cu_seqlens must be nondecreasing; got {_short(cu)}"]
    uneven = [b - a for a, b in zip(cu, cu[1:]) if (b - a) % pieces]
    if uneven:
        return [f"per_document splits each document into {pieces} equal pieces, but some lengths are not "
                f"multiples of {pieces}: {_short(uneven)} (pad each document, as Megatron's THD CP split "
                "does with cu_seqlens_padded, or split the whole sequence: per_document=False)"]
    return []


def _short(values, limit=12):
    return str(values) if len(values) <= limit else f"[{', '.join(map(str, values[:limit]))}, ...] ({len(values)})"


def packed_problems(q, cu_seqlens, per_document, initial_state, output_final_state, strategy, world) -> List[str]:
    """This rank's problems with the packed-sequence arguments (not the offsets' values)."""
    if cu_seqlens is None:
        return ["per_document applies to packed sequences: pass cu_seqlens"] if per_document else []
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() \
            or cu_seqlens.is_complex():
        got = f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor) \
            else type(cu_seqlens).__name__
        return [f"cu_seqlens must be a 1-D integer tensor, got {got}"]
    problems = []
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[0] != 1:
        problems.append(f"packed sequences (cu_seqlens) have batch size 1, got B = {q.shape[0]}")
    if initial_state is not None or output_final_state:
        problems.append("packed sequences (cu_seqlens) start every document from a zero state: "
                        "initial_state and output_final_state are not supported with them")
    if strategy == "lasp1" and world > 1:
        problems.append("strategy 'lasp1' does not support packed sequences (cu_seqlens); use zeco, lasp2 or a2a")
    return problems


def split_problems(q, piece_split, cu_seqlens, pieces_per_rank) -> List[str]:
    """This rank's problems with ``piece_split`` (sub-pieces per piece)."""
    if piece_split is None:  # chosen by zeco_gla, always valid
        return []
    if not isinstance(piece_split, int) or isinstance(piece_split, bool) or piece_split < 1:
        return [f"piece_split = {piece_split!r} must be a positive integer or None"]
    if piece_split == 1:
        return []
    if cu_seqlens is not None:
        return ["piece_split applies to unpacked sequences; packed ones (cu_seqlens) run their documents' "
                "segments as a batch already"]
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] % (pieces_per_rank * piece_split):
        return [f"piece_split = {piece_split} cuts each of the rank's {pieces_per_rank} piece(s) into equal "
                f"sub-pieces: T = {q.shape[1]} must be divisible by {pieces_per_rank * piece_split}"]
    return []


def _describe(x: Optional[torch.Tensor]):
    return None if not isinstance(x, torch.Tensor) else (tuple(x.shape), str(x.dtype), x.device.type)


def check_inputs(q, k, v, g, initial_state, *, group, strategy, layout, num_blocks, output_final_state,
                 cu_seqlens=None, per_document=False, transport="auto", piece_split=None, beta=None, op="zeco_gla"):
    """Raise the same ``ValueError`` on every rank of ``group`` if any rank's inputs are unusable.
    ``beta`` given: the gated delta rule's inputs (``op`` names the operator in the message)."""
    world = 1 if group is None else dist.get_world_size(group)
    problems = []
    try:
        layout = as_layout(layout)
    except ValueError as e:
        problems.append(str(e))
        layout = Layout.CONTIGUOUS
    if strategy not in STRATEGIES:
        problems.append(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    if transport not in TRANSPORTS:
        problems.append(f"unknown All-Scan transport {transport!r}; expected one of {', '.join(TRANSPORTS)}")
    if beta is not None and strategy == "lasp1":
        problems.append("strategy 'lasp1' is not offered for the gated delta rule; use zeco, lasp2 or a2a")
    # Per document, each document is cut into pieces, not each rank's tokens.
    problems += _local_problems(q, k, v, g, initial_state, num_blocks,
                                1 if per_document else len(layout.pieces(0, world)), beta)
    problems += split_problems(q, piece_split, cu_seqlens, len(layout.pieces(0, world)))
    packed = packed_problems(q, cu_seqlens, per_document, initial_state, output_final_state, strategy, world)
    cu = None
    if cu_seqlens is not None and not packed:
        cu = [int(c) for c in cu_seqlens.tolist()]
        if not problems:
            packed = cu_seqlens_problems(cu, world * q.shape[1], document_pieces(layout, world, per_document))
    row = {
        "problems": problems + packed, "cu_seqlens": cu, "per_document": bool(per_document),
        "q": _describe(q), "v": _describe(v), "initial_state": _describe(initial_state),
        "strategy": strategy, "layout": layout.value, "num_blocks": num_blocks, "piece_split": piece_split,
        "output_final_state": bool(output_final_state),
        "transport": (transport, os.environ.get(TRANSPORT_ENV)),
    }
    if group is None:
        rows = [row]
    else:
        rows = [None] * world
        dist.all_gather_object(rows, row, group=group)

    errors = [f"rank {r}: {p}" for r, each in enumerate(rows) for p in each["problems"]]
    for key, what in (("q", "q's shape, dtype and device (so local lengths)"),
                      ("v", "v's shape, dtype and device"),
                      ("initial_state", "initial_state (given or not, shape, dtype)"),
                      ("strategy", "strategy"), ("layout", "layout"), ("num_blocks", "num_blocks"),
                      ("piece_split", "piece_split"),
                      ("output_final_state", "output_final_state"), ("cu_seqlens", "cu_seqlens"),
                      ("per_document", "per_document"),
                      ("transport", f"transport (argument, ${TRANSPORT_ENV})")):
        values = [each[key] for each in rows]
        if any(val != values[0] for val in values):
            listing = "; ".join(f"rank {r}: {_short(val) if isinstance(val, list) else val}"
                                for r, val in enumerate(values))
            errors.append(f"{what} must be the same on every rank of the context-parallel group ({listing})")
    if strategy == "none" and world > 1:
        errors.append(f"strategy 'none' runs on one rank, but the group has {world}; "
                      "pick a context-parallel strategy or pass group=None")
    if strategy == "a2a" and not errors and q.shape[2] % world:
        errors.append(f"strategy 'a2a' splits heads over the group: H = {q.shape[2]} heads "
                      f"is not divisible by the group size {world}")
    if errors:
        raise ValueError(f"{op}: invalid input:\n  " + "\n  ".join(errors))
