"""Packed sequences (cu_seqlens, Megatron's THD format) through zeco_gla on real gloo groups.

Reference: every document alone through the float64 loop. Random document lengths
(fresh seeds): one-token documents, documents shorter than a piece, one longer than
half of the whole packed sequence (so spanning every rank), documents starting exactly
at piece boundaries. Both splits: the layout over the whole packed sequence, and per
document (Megatron's THD split with zigzag). Outputs and all gradients to 1e-10.
"""

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megatron_zeco import packed_positions, zeco_gla
from reference import problem, reference, rel_err

TOL = 1e-10
K, V = 8, 4
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


def _documents(seed, world, local_len, per_document):
    """Document lengths of each case: random draws; per document, also the shortest documents
    (one token per piece); else many one- to three-token documents and one document per zigzag
    piece (documents start at every piece's first token); and one document over everything."""
    gen = torch.Generator().manual_seed(seed)
    total, pieces = world * local_len, 2 * world
    if per_document:
        cases = [_lengths(gen, total, total // 2, pieces) for _ in range(2)] + [[pieces] * (total // pieces)]
    else:
        cases = [_lengths(gen, total, total // pieces, 1) for _ in range(2)]
        cases += [_lengths(gen, total, 3, 1), [total // pieces] * pieces]
    return cases + [[total]]


def _check(rank, world, seed, local_len):
    group = dist.new_group(list(range(world)))
    heads = world if world > 2 else 2  # a2a needs H divisible by the group size
    failures = []
    for n_split, (layout, per_document) in enumerate(SPLITS):
        for n_case, lengths in enumerate(_documents(seed + n_split, world, local_len, per_document)):
            case_seed = seed + 100 * n_split + n_case
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            x = problem(case_seed, 1, world * local_len, heads, K, V, gate="mixed" if n_case == 1 else "normal",
                        initial_state=False)
            ref = {name: [] for name in ("o", "dq", "dk", "dv", "dg")}
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):  # every document alone
                alone = reference({**{n: x[n][:, a:b] for n in ("q", "k", "v", "g", "do")}, "h0": None},
                                  output_final_state=False)
                for name in ref:
                    ref[name].append(alone[name])
            ref = {name: torch.cat(parts, dim=1) for name, parts in ref.items()}
            mine = packed_positions(cu, layout, world, rank, per_document)
            for strategy in ("zeco", "lasp2", "a2a"):
                for validate in (True, False):
                    local = {n: x[n][:, mine].requires_grad_() for n in ("q", "k", "v", "g")}
                    o, _ = zeco_gla(*local.values(), group=group, strategy=strategy, layout=layout,
                                    num_blocks=2 if strategy == "zeco" else 1, cu_seqlens=cu,
                                    per_document=per_document, validate=validate)
                    grads = torch.autograd.grad((o * x["do"][:, mine]).sum(), list(local.values()))
                    errors = {"o": rel_err(o, ref["o"][:, mine])}
                    errors.update({"d" + n: rel_err(d, ref["d" + n][:, mine]) for n, d in zip(local, grads)})
                    bad = {k: f"{e:.1e}" for k, e in errors.items() if not e < TOL}
                    if bad:
                        failures.append(f"{strategy} {layout} per_document={per_document} validate={validate} "
                                        f"lengths={lengths}: {bad}")
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_packed_documents_match_each_document_alone(seed, world):
    # 16 tokens per rank: zigzag pieces of 8; per-document pieces from 1 token up.
    failures = run_ranks(_check, world, seed, 16)
    assert not any(failures), "\n".join(f"rank {r}: {f}" for r, fs in enumerate(failures) for f in fs)


BAD = {  # name: (keyword arguments for rank r, expected message)
    "offsets do not end at the group's length": (lambda r: {"cu_seqlens": torch.tensor([0, 5, 20])}, "from 0 to"),
    "offsets decrease": (lambda r: {"cu_seqlens": torch.tensor([0, 9, 5, 24])}, "nondecreasing"),
    "offsets differ across ranks": (lambda r: {"cu_seqlens": torch.tensor([0, 4 + r, 24])}, "same on every rank"),
    "float offsets": (lambda r: {"cu_seqlens": torch.tensor([0.0, 24.0])}, "1-D integer tensor"),
    "document not a multiple of 2P": (lambda r: {"cu_seqlens": torch.tensor([0, 6, 24]), "per_document": True,
                                                 "layout": "zigzag"}, "multiples of 4"),
    "per_document without offsets": (lambda r: {"per_document": True}, "pass cu_seqlens"),
    "initial state": (lambda r: {"cu_seqlens": torch.tensor([0, 24]),
                                 "initial_state": torch.zeros(1, 2, K, V, dtype=torch.float64)}, "zero state"),
    "lasp1": (lambda r: {"cu_seqlens": torch.tensor([0, 24]), "strategy": "lasp1"}, "does not support packed"),
    "batch of two": (lambda r: {"cu_seqlens": torch.tensor([0, 24]), "batch": 2}, "batch size 1"),
}


def _bad(rank, world):
    messages = {}
    for name, (make, _) in BAD.items():
        kwargs = make(rank)
        batch = kwargs.pop("batch", 1)
        q, k, v, g = (torch.randn(batch, 12, 2, d, dtype=torch.float64) for d in (K, K, V, K))
        for validate in (True, False):
            if not validate and name == "offsets differ across ranks":
                continue  # only the all-gathered check can see that
            try:
                zeco_gla(q, k, v, -g.abs(), group=dist.group.WORLD, validate=validate, **kwargs)
                messages[name, validate] = None
            except ValueError as e:
                messages[name, validate] = str(e)
    return messages


def test_bad_packed_input_fails_on_every_rank():
    results = run_ranks(_bad, 2, timeout=120)
    for (name, validate), message in results[0].items():
        expected = BAD[name][1]
        for rank, messages in enumerate(results):
            assert messages[name, validate] is not None, f"{name} (validate={validate}): rank {rank} accepted it"
            assert expected in messages[name, validate], f"{name}: rank {rank}: {messages[name, validate]}"
        if validate:
            assert results[1][name, validate] == message, name  # the same message everywhere
