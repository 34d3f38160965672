"""zeco_gla on real gloo process groups against GLA over the whole sequence (float64 loop).

Every strategy, both layouts, several All-Scan block counts, every gate regime (at P = 8: zeco and
lasp2, two regimes), with and without initial/final state, pieces run as sub-pieces (down to one
token each); piece lengths are not multiples of the chunk size. Outputs, final states and all
gradients must agree to 1e-10.
"""

import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_zeco import Layout, zeco_gla
from tests.helpers.checks import above, assert_no_failures
from tests.helpers.distributed import run_ranks
from tests.helpers.marks import slow_except
from tests.helpers.reference import GATES, problem, reference, rel_err

TOL = 1e-10
K, V, B = 8, 4, 2


def _cases(world):
    """(strategy, layout, num_blocks, gate, initial_state, output_final_state, transport, piece_split)."""
    cases = []
    # every gate regime (the local math's edge cases) and strategy up to P = 4; at P = 8 (the long
    # chain) two regimes, and the strategies that pass states (LASP-1's ring and the all-to-all have
    # no part that lengthens with P beyond what P = 3 and 4 exercise)
    gates = GATES if world <= 4 else ("normal", "mixed")
    strategies = ("zeco", "lasp1", "lasp2", "a2a") if world <= 4 else ("zeco", "lasp2")
    for strategy, layout in itertools.product(strategies, Layout):
        for gate in gates:
            cases.append((strategy, layout, 2 if strategy == "zeco" else 1, gate, True, True, "auto", None))
        cases.append((strategy, layout, 1, "normal", False, False, "auto", None))
        cases.append((strategy, layout, 1, "normal", True, False, "auto", None))
        cases.append((strategy, layout, 1, "normal", False, True, "auto", None))
        if strategy == "zeco":
            cases += [(strategy, layout, nb, "normal", True, True, "auto", None) for nb in (1, 4, K)]
            # All-Scan through peer memory (the Triton hop kernel, interpreted on the CPU: two thirds of
            # the P = 8 case's time, so up to P = 4, as tests/comm/test_all_scan.py runs it)
            cases += [(strategy, layout, nb, "strong", True, True, "peer_memory", None)
                      for nb in ((1, 4) if world <= 4 else ())]
    # Pieces whole (the default runs zeco's contiguous pieces as two halves of 19 tokens), and
    # zigzag pieces as 19 sub-pieces of one token each
    cases += [("zeco", Layout.CONTIGUOUS, 2, "normal", True, True, "auto", 1),
              ("zeco", Layout.ZIGZAG, 1, "mixed", True, True, "auto", 19),
              ("lasp2", Layout.CONTIGUOUS, 1, "normal", True, True, "auto", 19)]
    return cases


def _check_all(rank, world, seed, local_len):
    group = dist.new_group(list(range(world)))
    heads = world if world > 2 else 2  # a2a needs H divisible by the group size
    failures, problems, references = [], {}, {}
    for n, (strategy, layout, nb, gate, with_h0, with_ht, transport, split) in enumerate(_cases(world)):
        if (gate, with_h0) not in problems:
            problems[gate, with_h0] = problem(seed + len(problems), B, world * local_len, heads, K, V, gate, with_h0)
        x = problems[gate, with_h0]
        if (gate, with_h0, with_ht) not in references:  # the float64 loop once per problem and loss
            references[gate, with_h0, with_ht] = reference(x, output_final_state=with_ht)
        ref = references[gate, with_h0, with_ht]
        # Each rank's loss sees its own tokens; the final-state term is split over the ranks
        # with random weights summing to one (its gradient must be summed onto the owner).
        weights = torch.rand(world, generator=torch.Generator().manual_seed(seed + n), dtype=torch.float64)
        weights /= weights.sum()
        local = {name: layout.shard(x[name], rank, world).requires_grad_() for name in ("q", "k", "v", "g")}
        h0 = x["h0"].clone().requires_grad_() if with_h0 else None
        o, ht = zeco_gla(local["q"], local["k"], local["v"], local["g"], group=group, strategy=strategy,
                         layout=layout, num_blocks=nb, initial_state=h0, output_final_state=with_ht,
                         transport=transport, piece_split=split)
        loss = (o * layout.shard(x["do"], rank, world)).sum()
        if with_ht:
            loss = loss + weights[rank] * (ht * x["dht"]).sum()
        leaves = list(local.values()) + ([h0] if with_h0 else [])
        grads = dict(zip(["q", "k", "v", "g", "h0"], torch.autograd.grad(loss, leaves)))
        if with_h0:
            dist.all_reduce(grads["h0"], group=group)  # gradient of a replicated input: sum over ranks
        errors = {"o": rel_err(o, layout.shard(ref["o"], rank, world))}
        if with_ht:
            errors["ht"] = rel_err(ht, ref["ht"])
        for name, grad in grads.items():
            full = ref["d" + name]
            errors["d" + name] = rel_err(grad, full if name == "h0" else layout.shard(full, rank, world))
        bad = above(errors, TOL)
        if bad:
            failures.append(f"{strategy} {layout.value} blocks={nb} gates={gate} h0={with_h0} ht={with_ht} "
                            f"transport={transport} piece_split={split}: {bad}")
    return failures


@pytest.mark.parametrize("world", slow_except([1, 2, 3, 4, 8], 1, 2))
def test_every_strategy_matches_whole_sequence_reference(seed, world):
    # 38 tokens per rank: zigzag pieces of 19, contiguous pieces of 38; chunks are 32.
    assert_no_failures(run_ranks(_check_all, world, seed, 38))


def _default_splits(rank, world, seed):
    """For each case: does the default piece_split give bit for bit what piece_split=s gives?"""
    group = dist.new_group(list(range(world)))
    out = {}
    for strategy, layout, local_len in (("zeco", Layout.CONTIGUOUS, 40), ("zeco", Layout.ZIGZAG, 40),
                                        ("zeco", Layout.CONTIGUOUS, 39), ("lasp2", Layout.CONTIGUOUS, 40)):
        x = problem(seed, B, world * local_len, 2, K, V, "normal", True)
        local = {n: layout.shard(x[n], rank, world) for n in ("q", "k", "v", "g", "do")}
        results = {}
        for split in (None, 1, 2):
            leaves = [local[n].clone().requires_grad_() for n in "qkvg"]
            if split == 2 and local_len % 2:
                continue
            o, _ = zeco_gla(*leaves, group=group, strategy=strategy, layout=layout, piece_split=split)
            results[split] = [o, *torch.autograd.grad((o * local["do"]).sum(), leaves)]
        out[strategy, layout.value, local_len] = {
            s: all(torch.equal(a, b) for a, b in zip(results[None], results[s])) for s in results if s is not None}
    return out


def test_default_piece_split_is_two_for_zeco_contiguous_only(seed):
    """piece_split=None runs zeco's contiguous pieces as two halves (when T is even) and leaves
    zigzag, odd lengths and the other strategies whole; 1 and 2 round differently, so a wrong
    choice shows up bit for bit."""
    got = run_ranks(_default_splits, 2, seed)[0]
    assert got == {("zeco", "contiguous", 40): {1: False, 2: True}, ("zeco", "zigzag", 40): {1: True, 2: False},
                   ("zeco", "contiguous", 39): {1: True}, ("lasp2", "contiguous", 40): {1: True, 2: False}}, got
