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

from ..comm import Layout
from ..comm.transport import TRANSPORT_ENV
from .strategies import BY_NAME

# What the local ops run (fla's kernels on CUDA, the PyTorch forms elsewhere and for float64). float8
# and complex dtypes are not: the ops have no fp8 path (with --fp8-format only the layers' linears use it).
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_DTYPE_NAMES = "float64, float32, bfloat16 or float16"
_DIMS = {"BTHK": "[B, T, H, K]", "BTHV": "[B, T, H, V]", "BTH": "[B, T, H]"}


def _tensor_problems(op, tensors) -> List[str]:
    """This rank's problems with the per-token tensors of ``op`` (shapes, dtypes, devices)."""
    named = dict(zip((n for n, _ in op.inputs), tensors))
    problems = [f"{n} must be a torch.Tensor, got {type(t).__name__}" for n, t in named.items()
                if not isinstance(t, torch.Tensor)]
    if problems:
        return problems
    for (n, dims), t in zip(op.inputs, tensors):
        if t.dim() != len(dims):
            problems.append(f"{n} must have {len(dims)} dims {_DIMS[dims]}, got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            problems.append(f"{n} must be {_DTYPE_NAMES}, got {t.dtype}")
    if problems:
        return problems
    q, v = named["q"], named["v"]
    B, T, H, K = q.shape
    expected = {"BTHK": (B, T, H, K), "BTHV": (B, T, H, v.shape[-1]), "BTH": (B, T, H)}
    keys = [n for n, dims in op.inputs if dims == "BTHK"]
    if any(named[n].shape != q.shape for n in keys):
        problems.append(f"{', '.join(keys)} must have one shape [B, T, H, K], got "
                        f"{', '.join(str(tuple(named[n].shape)) for n in keys)}")
    if v.shape[:3] != q.shape[:3]:
        problems.append(f"v must be [B, T, H, V] with B, T, H of q {tuple(q.shape[:3])}, got {tuple(v.shape)}")
    scalars = [n for n, dims in op.inputs if dims == "BTH"]
    if any(named[n].shape != expected["BTH"] for n in scalars):
        problems.append(f"{' and '.join(scalars)} must be [B, T, H] with B, T, H of q {tuple(q.shape[:3])}, got "
                        f"{', '.join(str(tuple(named[n].shape)) for n in scalars)}")
    dtypes = {n: t.dtype for n, t in named.items()}
    shared = {n: d for n, d in dtypes.items() if not (n in op.float32 and d == torch.float32)}
    if len(set(shared.values())) > 1:
        loose = f" ({' and '.join(op.float32)} may be float32)" if op.float32 else ""
        problems.append(f"{', '.join(named)} must share one dtype{loose}, got {dtypes}")
    return problems


def _local_problems(op, config, args, group_size) -> List[str]:
    """This rank's problems with its inputs and with the knobs that depend on their shapes."""
    problems = _tensor_problems(op, args.tensors)
    if problems:
        return problems
    q, v = args.tensors[0], args.tensors[2]
    devices = {n: t.device for (n, _), t in zip(op.inputs, args.tensors)}
    h0 = args.initial_state
    if h0 is not None:
        devices["initial_state"] = h0.device
        B, _, H, K = q.shape
        expected = (B, H, K, v.shape[-1])
        if tuple(h0.shape) != expected:
            problems.append(f"initial_state must be [B, H, K, V] = {expected}, got {tuple(h0.shape)}")
        if h0.dtype not in DTYPES:
            problems.append(f"initial_state must be {_DTYPE_NAMES}, got {h0.dtype}")
    if len(set(devices.values())) > 1:
        problems.append(f"inputs must be on one device, got {{{', '.join(f'{n}: {d}' for n, d in devices.items())}}}")
    T = q.shape[1]
    # Per document, each document is cut into pieces, not each rank's tokens.
    pieces = 1 if (args.per_document or config is None) else len(config.layout.pieces(0, group_size))
    if T == 0:
        problems.append("the local sequence is empty (T = 0)")
    elif T % pieces:
        problems.append(f"the zigzag layout splits each rank's T = {T} tokens into {pieces} "
                        f"equal pieces; T must be divisible by {pieces}")
    if config is not None:
        problems += config.dims_problems(q.shape[-1], v.shape[-1])
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


def packed_problems(args, strategy: Optional[str], world: int) -> List[str]:
    """This rank's problems with the packed-sequence arguments of a call (``args``: its
    :class:`~megatron_zeco.cp.operator.Arguments`; not the offsets' values) under ``strategy``."""
    q, cu_seqlens, per_document = args.tensors[0], args.cu_seqlens, args.per_document
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
    if args.initial_state is not None or args.output_final_state:
        problems.append("packed sequences (cu_seqlens) start every document from a zero state: "
                        "initial_state and output_final_state are not supported with them")
    if strategy is not None and not BY_NAME[strategy].packed and world > 1:
        problems.append(f"strategy {strategy!r} does not support packed sequences (cu_seqlens); use "
                        f"{', '.join(s.name for s in BY_NAME.values() if s.packed and s.name != 'none')}")
    return problems


def split_problems(q, piece_split, cu_seqlens, pieces_per_rank) -> List[str]:
    """This rank's problems with ``piece_split`` (sub-pieces per piece; a value ``CPConfig`` has checked)."""
    if piece_split is None or piece_split == 1:  # None: chosen by zeco_gla, always valid
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


def local_call_problems(plan, args, piece_split: int) -> List[str]:
    """The cheap, rank-local checks of a call under a plan whose inputs were not validated across ranks
    (a layer after its first step): the packed-sequence arguments and the sub-pieces."""
    if args.cu_seqlens is None and not args.per_document and piece_split == 1:
        return []
    q = args.tensors[0]
    return packed_problems(args, plan.config.strategy, plan.world) + \
        split_problems(q, piece_split, args.cu_seqlens, plan.pieces_per_rank)


def check_inputs(op, config, config_problems: List[str], args, group, name: str) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` if any rank's inputs or knobs are unusable.

    ``config``: the call's :class:`~megatron_zeco.cp.config.CPConfig`, or None where making it failed
    (``config_problems`` say why); ``args``: its :class:`~megatron_zeco.cp.operator.Arguments`; ``name``
    names the operator (or layer) in the message."""
    world = 1 if group is None else dist.get_world_size(group)
    layout = Layout.CONTIGUOUS if config is None else config.layout
    strategy = None if config is None else config.strategy
    q = args.tensors[0]
    problems = list(config_problems) + _local_problems(op, config, args, world)
    pieces = len(layout.pieces(0, world))
    piece_split = None if config is None else config.piece_split
    problems += split_problems(q, piece_split, args.cu_seqlens, pieces)
    packed = packed_problems(args, strategy, world)
    cu = None
    if args.cu_seqlens is not None and not packed:
        cu = [int(c) for c in args.cu_seqlens.tolist()]
        if not problems:
            packed = cu_seqlens_problems(cu, world * q.shape[1], document_pieces(layout, world, args.per_document))
    knobs = None if config is None else {f: getattr(config, f) for f in ("strategy", "layout", "num_blocks",
                                                                          "transport", "piece_split", "node_size")}
    row = {
        "problems": problems + packed, "cu_seqlens": cu, "per_document": bool(args.per_document),
        "q": _describe(q), "v": _describe(args.tensors[2]), "initial_state": _describe(args.initial_state),
        "knobs": knobs, "output_final_state": bool(args.output_final_state),
        "transport env": os.environ.get(TRANSPORT_ENV),
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
                      ("knobs", "the context-parallel knobs (strategy, layout, num_blocks, transport, piece_split, "
                                "node_size)"),
                      ("output_final_state", "output_final_state"), ("cu_seqlens", "cu_seqlens"),
                      ("per_document", "per_document"), ("transport env", f"${TRANSPORT_ENV}")):
        values = [each[key] for each in rows]
        if any(val != values[0] for val in values):
            listing = "; ".join(f"rank {r}: {_short(val) if isinstance(val, list) else _knobs(val)}"
                                for r, val in enumerate(values))
            errors.append(f"{what} must be the same on every rank of the context-parallel group ({listing})")
    if strategy == "none" and world > 1:
        errors.append(f"strategy 'none' runs on one rank, but the group has {world}; "
                      "pick a context-parallel strategy or pass group=None")
    if strategy is not None and BY_NAME[strategy].splits_heads and not errors and q.shape[2] % world:
        errors.append(f"strategy {strategy!r} splits heads over the group: H = {q.shape[2]} heads "
                      f"is not divisible by the group size {world}")
    if errors:
        raise ValueError(f"{name}: invalid input:\n  " + "\n  ".join(errors))


def _knobs(value):
    """A row's value as the message lists it (knobs: only those that differ matter, all are shown)."""
    if isinstance(value, dict):
        return ", ".join(f"{k}={getattr(v, 'value', v)!r}" for k, v in value.items())
    return value
