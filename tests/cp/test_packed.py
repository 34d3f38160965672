"""Packed sequences (cu_seqlens, Megatron's THD format; cp/packed.py) through zeco_gla on real gloo groups.

Reference: every document alone through the float64 loop. Random document lengths
(fresh seeds): one-token documents, documents shorter than a piece, one longer than
half of the whole packed sequence (so spanning every rank), documents starting exactly
at piece boundaries. Both splits: the layout over the whole packed sequence, and per
document (Megatron's THD split with zigzag). Outputs and all gradients to 1e-10. (Packed batches
through the Megatron layers: tests/mcore/test_packed.py.)
"""

import pytest
import torch
import torch.distributed as dist

from megatron_zeco import Layout, packed_positions, zeco_gla
from megatron_zeco.cp.packed import Packing
from tests.helpers.checks import above, assert_no_failures
from tests.helpers.distributed import run_ranks
from tests.helpers.marks import slow, slow_except
from tests.helpers.reference import SPLITS, document_lengths, packed_reference, problem, rel_err

TOL = 1e-10
K, V = 8, 4


def _check(rank, world, seed, local_len):
    group = dist.new_group(list(range(world)))
    heads = world if world > 2 else 2  # a2a needs H divisible by the group size
    failures = []
    for n_split, (layout, per_document) in enumerate(SPLITS):
        for n_case, lengths in enumerate(document_lengths(seed + n_split, world, local_len, per_document)):
            case_seed = seed + 100 * n_split + n_case
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            x = problem(case_seed, 1, world * local_len, heads, K, V, gate="mixed" if n_case == 1 else "normal",
                        initial_state=False)
            ref = packed_reference(x, cu)  # every document alone
            mine = packed_positions(cu, layout, world, rank, per_document)
            runs = [(s, v, "auto") for s in ("zeco", "lasp2", "a2a") for v in (True, False)]
            if per_document and layout == "zigzag" and world <= 3:  # Megatron's THD split as on one GPU
                runs.append(("zeco", True, "peer_memory"))  # node: zeco over peer memory (hop kernel, interpreted)
            for strategy, validate, transport in runs:
                local = {n: x[n][:, mine].requires_grad_() for n in ("q", "k", "v", "g")}
                o, _ = zeco_gla(*local.values(), group=group, strategy=strategy, layout=layout,
                                num_blocks=2 if strategy == "zeco" else 1, cu_seqlens=cu,
                                per_document=per_document, validate=validate, transport=transport)
                grads = torch.autograd.grad((o * x["do"][:, mine]).sum(), list(local.values()))
                errors = {"o": rel_err(o, ref["o"][:, mine])}
                errors.update({"d" + n: rel_err(d, ref["d" + n][:, mine]) for n, d in zip(local, grads)})
                bad = above(errors, TOL)
                if bad:
                    failures.append(f"{strategy} {layout} per_document={per_document} validate={validate} "
                                    f"transport={transport} lengths={lengths}: {bad}")
    return failures


@pytest.mark.parametrize("world", slow_except([1, 2, 3, 4], 2))
def test_packed_documents_match_each_document_alone(seed, world):
    # 16 tokens per rank: zigzag pieces of 8; per-document pieces from 1 token up.
    assert_no_failures(run_ranks(_check, world, seed, 16))


@slow
def test_offsets_are_read_again_after_an_in_place_change(seed):
    """The layers of a step share one reading of cu_seqlens; changing the tensor in place is seen."""
    x = problem(seed, B=1, T=24, H=2, K=K, V=V, gate="normal")
    cu = torch.tensor([0, 10, 24])
    args = (x["q"], x["k"], x["v"], x["g"])
    zeco_gla(*args, cu_seqlens=cu)
    cu[1] = 5  # now documents [0, 5) and [5, 24)
    o, _ = zeco_gla(*args, cu_seqlens=cu)
    want = torch.cat([zeco_gla(*(t[:, a:b] for t in args))[0] for a, b in ((0, 5), (5, 24))], dim=1)
    assert rel_err(o, want) < 1e-12
    same = [Packing.cached(cu, Layout.ZIGZAG, 2, 1, 12, False, "cpu") for _ in range(2)]
    assert same[0] is same[1]


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


@slow
def test_bad_packed_input_fails_on_every_rank():
    results = run_ranks(_bad, 2, timeout=120)
    for (name, validate), message in results[0].items():
        expected = BAD[name][1]
        for rank, messages in enumerate(results):
            assert messages[name, validate] is not None, f"{name} (validate={validate}): rank {rank} accepted it"
            assert expected in messages[name, validate], f"{name}: rank {rank}: {messages[name, validate]}"
        if validate:
            assert results[1][name, validate] == message, name  # the same message everywhere


@slow
def test_positions_are_transformer_engines_thd_split():
    """per_document + zigzag gives each rank the tokens TE's thd_get_partitioned_indices gives it
    (its CUDA kernel, transcribed: token i of rank r's part of a document of length L lies in the
    first half-piece at rank r's piece, else at piece 2P-1-r)."""
    cu = torch.tensor([0, 8, 40, 48, 72])
    for world in (1, 2, 4):
        for rank in range(world):
            want = []
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
                half = (b - a) // (2 * world)
                for i in range(2 * half):
                    piece = rank if i < half else 2 * world - 2 - rank
                    want.append(a + half * piece + i)
            assert packed_positions(cu, "zigzag", world, rank, True).tolist() == want, (world, rank)
