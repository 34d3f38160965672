"""Bounds of the GPU tests' bf16 results, tied to fla's own bf16 error on the same inputs.

A bf16 result cannot be closer to the float64 loop than fla's own kernels get on the same problem; a
fixed tolerance is either loose enough to hide a wrong term or tight enough to trip on a seed. So each
bf16 result ``n`` must satisfy ``error[n] <= FACTOR * fla[n] + FLOOR``, where ``fla[n]`` is the error of
fla's op (``chunk_gla``, ``chunk_gated_delta_rule``, ``chunk_kda``) run alone on one GPU over the same
tokens from the same entering states, against the same float64 reference.

Errors are relative and measured over whole tensors: every document or sequence of a result joined
before taking the norm, so that a one- or five-token document, whose own norm is tiny, is weighed
against the scale of the whole result (``joined_errors``).
"""

from typing import Dict, Iterable, List, Optional

import torch

from tests.helpers.reference import rel_err

FACTOR = 1.5
FLOOR = 1e-3


def joined_errors(got: Dict[str, List[torch.Tensor]], ref: Dict[str, List[torch.Tensor]]) -> Dict[str, float]:
    """``rel_err`` per result over its parts joined (each part a document's or a sequence's slice)."""
    join = lambda parts: torch.cat([p.detach().double().cpu().reshape(-1) for p in parts])  # noqa: E731
    return {n: rel_err(join(got[n]), join(ref[n])) for n in got}


def bf16_bounds(fla: Dict[str, float]) -> Dict[str, float]:
    return {n: FACTOR * e + FLOOR for n, e in fla.items()}


def over_bounds(errors: Dict, fla: Dict[str, float]) -> Dict:
    """The results whose error exceeds its bound: ``{name: (error, bound, fla's error)}`` (keys of
    ``errors`` are result names, or tuples ending in one)."""
    bounds = bf16_bounds(fla)
    name = lambda key: key[-1] if isinstance(key, tuple) else key  # noqa: E731
    return {k: (e, bounds[name(k)], fla[name(k)]) for k, e in errors.items() if not e <= bounds[name(k)]}


def fla_results(op, x: Dict[str, torch.Tensor], inputs: Iterable[str], dtype: torch.dtype, scale: float,
                h0: Optional[torch.Tensor] = None, dht: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, g_dtype: Optional[torch.dtype] = None, backward=True,
                device="cuda"):
    """fla's ``op`` on one GPU over ``x`` (float64 on the CPU: inputs ``inputs`` and the output gradient
    ``do``) cast to ``dtype`` (the gate to ``g_dtype`` if given), entered from ``h0`` (float32; per
    sequence, or per document with ``cu_seqlens``): ``o``, the final state ``ht`` where ``dht`` is given,
    and (``backward``) the gradients of ``sum(o * do) + sum(ht * dht)``: ``d<input>`` and ``dh0``; on the CPU."""
    inputs = tuple(inputs)
    leaves = [x[n].to(device, g_dtype if n == "g" and g_dtype else dtype).requires_grad_() for n in inputs]
    h = None if h0 is None else h0.to(device, torch.float32).requires_grad_()
    kw = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens.to(device, torch.int32)}
    o, ht = op(*leaves, scale=scale, initial_state=h, output_final_state=dht is not None, **kw)
    if not backward:
        return {n: t.detach().cpu() for n, t in (("o", o), ("ht", ht)) if t is not None}
    loss = (o.float() * x["do"].to(device)).sum()
    if dht is not None:
        loss = loss + (ht * dht.to(device, torch.float32)).sum()
    wrt = leaves + ([h] if h is not None else [])
    grads = torch.autograd.grad(loss, wrt)
    out = {"o": o, **({"ht": ht} if dht is not None else {}), **{f"d{n}": g for n, g in zip(inputs, grads)}}
    if h is not None:
        out["dh0"] = grads[-1]
    return {n: t.detach().cpu() for n, t in out.items()}


def assert_float32_piece_as_close_as_fla(piece, S_in: torch.Tensor, o: torch.Tensor, E: torch.Tensor,
                                         M: torch.Tensor, o_ref: torch.Tensor, theirs: Dict[str, torch.Tensor],
                                         tolerance: float) -> None:
    """A float32 delta-rule piece entered by ``S_in`` (float64) with output ``o`` against the float64 chunked
    form (``E``, ``M``, ``o_ref``) and fla's own float32 op on one GPU from the same entering states
    (``theirs``: its ``o`` and ``ht``, :func:`fla_results`): the piece's transition to 1e-4 (this package's
    kernels keep float32 accuracy); its leaving state and output no further off than twice fla's (whose
    state pass, which gives the piece its ``E``, multiplies in TF32), fla's within ``tolerance``."""
    S_ref = (M @ S_in.to(M.device) + E).cpu()
    S_out = (piece.M @ S_in.to(piece.M.device, torch.float32) + piece.E).cpu()
    ours = {"S_out": rel_err(S_out, S_ref), "o": rel_err(o.cpu(), o_ref.cpu())}
    fla = {"S_out": rel_err(theirs["ht"], S_ref), "o": rel_err(theirs["o"], o_ref.cpu())}
    assert rel_err(piece.M, M) < 1e-4
    assert max(fla.values()) < tolerance, fla
    assert all(ours[n] <= 2 * fla[n] + 1e-6 for n in ours), (ours, fla)
