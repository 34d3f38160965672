"""Random GLA, gated-delta-rule and KDA problems and their float64 reference (the step-by-step loops, with
autograd); packed documents and their reference; the sequential fold the scans are checked against."""

import os
import random

import torch
import torch.nn.functional as F

from megatron_zeco.gated_delta_rule import naive_recurrent_gated_delta_rule
from megatron_zeco.gla import naive_recurrent_gla
from megatron_zeco.kda import naive_recurrent_kda


def draw_seed():
    """A fresh random seed, or ``$ZECO_SEED``; printed (pytest shows it beside a failure), so a failure
    can be replayed with ``ZECO_SEED=...``."""
    value = int(os.environ.get("ZECO_SEED", random.SystemRandom().randrange(2**31)))
    print(f"ZECO_SEED={value}")
    return value


def token_batch(seed, vocab, rows, length, offsets=None):
    """Tokens and labels ``[rows, length]`` drawn from ``seed``, or (``offsets``: a packed batch's
    document offsets) one packed sequence ``[1, offsets[-1]]``; and the offsets as int32 (or None)."""
    gen = torch.Generator().manual_seed(seed)
    cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32)
    shape = (rows, length) if cu is None else (1, int(cu[-1]))
    tokens, labels = (torch.randint(0, vocab, shape, generator=gen) for _ in range(2))
    return tokens, labels, cu


GATES = ("normal", "zero", "tiny", "strong", "underflow", "mixed")


def gates(shape, kind, gen, dtype=torch.float64):
    """Log forget gates of one regime: 'zero'/'tiny' = no decay, 'strong' = decay ~1e-13..1e-26,
    'underflow' = exp(g) == 0 in float64, 'mixed' = a random regime per element."""
    u = torch.rand(shape, generator=gen, dtype=dtype)
    if kind == "normal":
        return F.logsigmoid(torch.randn(shape, generator=gen, dtype=dtype) * 2)
    if kind == "zero":
        return torch.zeros(shape, dtype=dtype)
    if kind == "tiny":
        return -1e-6 * u
    if kind == "strong":
        return -(30 + 30 * u)
    if kind == "underflow":
        return -(800 + 200 * u)
    if kind == "mixed":
        pick = torch.randint(0, 5, shape, generator=gen)
        options = [gates(shape, k, gen, dtype) for k in ("normal", "zero", "tiny", "strong", "underflow")]
        return torch.stack(options).gather(0, pick.unsqueeze(0)).squeeze(0)
    raise ValueError(kind)


def problem(seed, B, T, H, K, V, gate="normal", initial_state=True, dtype=torch.float64):
    """Inputs, output gradients and the initial state of one random problem over the full sequence."""
    gen = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(B, T, H, K, generator=gen, dtype=dtype),
        "k": torch.randn(B, T, H, K, generator=gen, dtype=dtype),
        "v": torch.randn(B, T, H, V, generator=gen, dtype=dtype),
        "g": gates((B, T, H, K), gate, gen, dtype),
        "do": torch.randn(B, T, H, V, generator=gen, dtype=dtype),
        "dht": torch.randn(B, H, K, V, generator=gen, dtype=dtype),
        "h0": torch.randn(B, H, K, V, generator=gen, dtype=dtype) if initial_state else None,
    }
    return x


def delta_problem(seed, B, T, H, K, V, gate="normal", initial_state=True, dtype=torch.float64):
    """A gated-delta-rule problem: L2-normalised keys, one log decay per head and token (``gate``
    regimes as :func:`gates`), beta uniform in [0, 1] and exactly 0 or 1 at about a fifth of the
    tokens each; output gradients and an initial state as :func:`problem`."""
    gen = torch.Generator().manual_seed(seed)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    pick = torch.randint(0, 5, (B, T, H), generator=gen)
    x = {
        "q": torch.randn(B, T, H, K, generator=gen, dtype=dtype),
        "k": F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1),
        "v": torch.randn(B, T, H, V, generator=gen, dtype=dtype),
        "g": gates((B, T, H), gate, gen, dtype),
        "beta": torch.where(pick == 0, 0.0, torch.where(pick == 1, 1.0, beta)),
        "do": torch.randn(B, T, H, V, generator=gen, dtype=dtype),
        "dht": torch.randn(B, H, K, V, generator=gen, dtype=dtype),
        "h0": torch.randn(B, H, K, V, generator=gen, dtype=dtype) if initial_state else None,
    }
    return x


def kda_problem(seed, B, T, H, K, V, gate="normal", initial_state=True, HV=None, dtype=torch.float64):
    """A KDA problem: L2-normalised keys, a log decay per key channel, value head and token (``gate``
    regimes as :func:`gates`, drawn per channel), beta uniform in [0, 1] and exactly 0 or 1 at about a
    fifth of the tokens each; output and final-state gradients and an initial state. ``HV``: value heads
    (default ``H``)."""
    HV = HV or H
    gen = torch.Generator().manual_seed(seed)
    beta = torch.rand(B, T, HV, generator=gen, dtype=dtype)
    pick = torch.randint(0, 5, (B, T, HV), generator=gen)
    return {
        "q": torch.randn(B, T, H, K, generator=gen, dtype=dtype),
        "k": F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1),
        "v": torch.randn(B, T, HV, V, generator=gen, dtype=dtype),
        "g": gates((B, T, HV, K), gate, gen, dtype),
        "beta": torch.where(pick == 0, 0.0, torch.where(pick == 1, 1.0, beta)),
        "do": torch.randn(B, T, HV, V, generator=gen, dtype=dtype),
        "dht": torch.randn(B, HV, K, V, generator=gen, dtype=dtype),
        "h0": torch.randn(B, HV, K, V, generator=gen, dtype=dtype) if initial_state else None,
    }


def reference(x, scale=None, output_final_state=True):
    """float64 loop: output, final state and the gradients of ``sum(o * do) + sum(ht * dht)`` with
    respect to q, k, v, g, h0 (and beta, for problems with a ``beta``: the gated delta rule, or KDA
    where ``g`` has a decay per key channel)."""
    inputs = ("q", "k", "v", "g", "beta") if "beta" in x else ("q", "k", "v", "g")
    if "beta" not in x:
        loop = naive_recurrent_gla
    else:
        loop = naive_recurrent_kda if x["g"].dim() == 4 else naive_recurrent_gated_delta_rule
    leaves = {n: x[n].double().detach().requires_grad_() for n in inputs}
    if x["h0"] is not None:
        leaves["h0"] = x["h0"].double().detach().requires_grad_()
    o, ht = loop(*(leaves[n] for n in inputs), scale, leaves.get("h0"), output_final_state=True)
    loss = (o * x["do"].double()).sum()
    if output_final_state:
        loss = loss + (ht * x["dht"].double()).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    out = {"o": o.detach(), "ht": ht.detach()}
    out.update({"d" + n: g for n, g in zip(leaves, grads)})
    return out


def rel_err(a, b):
    """||a - b|| / ||b|| (the absolute error where b is exactly zero)."""
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm()
    return float((a - b).norm() / denom) if denom > 0 else float(a.norm())


def packed_reference(x, cu):
    """The float64 loop over a packed problem without initial state (``x`` of :func:`problem` or
    :func:`delta_problem`, one row): every document alone, its output and its inputs' gradients,
    joined again along the sequence (keys ``o``, ``dq``, ``dk``, ``dv``, ``dg``, and ``dbeta``)."""
    names = ("q", "k", "v", "g", "beta") if "beta" in x else ("q", "k", "v", "g")
    parts = {name: [] for name in ("o", *("d" + n for n in names))}
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = reference({**{n: x[n][:, a:b] for n in (*names, "do")}, "h0": None}, output_final_state=False)
        for name in parts:
            parts[name].append(alone[name])
    return {name: torch.cat(p, dim=1) for name, p in parts.items()}


# The packed splits: (layout, per_document). Per document is Megatron's THD split under zigzag.
SPLITS = (("contiguous", False), ("zigzag", False), ("zigzag", True), ("contiguous", True))


def _lengths(gen, total, short, multiple):
    """Random document lengths (multiples of ``multiple``) summing to ``total``: one longer than
    half of it, the rest between one unit and ``short`` tokens."""
    units, short = total // multiple, max(short // multiple, 1)
    long = units // 2 + 1 + int(torch.randint(0, max(units // 4, 1), (1,), generator=gen))
    rest = []
    while sum(rest) < units - long:
        rest.append(min(int(torch.randint(1, short + 1, (1,), generator=gen)), units - long - sum(rest)))
    rest.insert(int(torch.randint(0, len(rest) + 1, (1,), generator=gen)), long)
    return [n * multiple for n in rest]


def document_lengths(seed, world, local_len, per_document):
    """Document lengths of each packed case over ``world`` ranks of ``local_len`` tokens: random draws
    (one document longer than half of everything, so spanning every rank; the others short, so
    starting inside pieces); per document, also the shortest documents (one token per piece); else
    many one- to three-token documents, documents a zigzag piece and a half long (whatever the draws,
    a document starts inside a piece that a state enters and leaves: under zigzag from P = 2, under
    the contiguous split from P = 3) and one document per zigzag piece (documents start at every
    piece's first token); and one document over everything."""
    gen = torch.Generator().manual_seed(seed)
    total, pieces = world * local_len, 2 * world
    if per_document:
        cases = [_lengths(gen, total, total // 2, pieces) for _ in range(2)] + [[pieces] * (total // pieces)]
    else:
        step = max(3 * (total // pieces) // 2, 1)
        staggered = [step] * (total // step) + ([total % step] if total % step else [])
        cases = [_lengths(gen, total, total // pieces, 1) for _ in range(2)]
        cases += [_lengths(gen, total, 3, 1), staggered, [total // pieces] * pieces]
    return cases + [[total]]


def fold(transitions, deltas, init, order):
    """The sequential scan the parallel ones must equal: walking the pieces in ``order`` from ``init``
    (None: zeros) through ``S_out = T S_in + delta``, ``T`` a decay ``[..., K]`` (diagonal) or a matrix
    ``[..., K, K]`` (dense). Returns the state entering each piece ``{piece: S_in}`` and the state
    leaving the walk. (The scans may round differently, fused multiply-adds: compare to ~1e-12.)"""
    x, entering = (torch.zeros_like(deltas[0]) if init is None else init), {}
    for p in order:
        entering[p] = x
        T = transitions[p]
        x = (T @ x if T.dim() == x.dim() else T.unsqueeze(-1) * x) + deltas[p]
    return entering, x
