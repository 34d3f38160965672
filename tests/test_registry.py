"""Operators register themselves (``megatron_zeco.cp.registry``): an operator defined outside the package
(``tests/helpers/stub_operator``) runs through the op entry point at CP = 2, and its mixer appears among the
specs' mixers and the main job's ``--mixer`` choices, with no shared file naming it."""

import importlib
import sys

import pytest
import torch
import torch.distributed as dist

from megatron_zeco import mixers
from megatron_zeco.cp import registry
from megatron_zeco.cp.config import RULES, Rules
from megatron_zeco.cp.registry import Mixer
from tests.helpers.checks import above, assert_no_failures
from tests.helpers.distributed import run_ranks

STUB = "tests.helpers.stub_operator"
TOL = 1e-12


@pytest.fixture(scope="module")
def stub():
    """The stub operator registered (by importing it), and the registry as it was afterwards."""
    mixers_before, rules_before = dict(registry._MIXERS), dict(RULES)
    module = importlib.reload(sys.modules[STUB]) if STUB in sys.modules else importlib.import_module(STUB)
    yield module
    registry._MIXERS.clear()
    registry._MIXERS.update(mixers_before)
    RULES.clear()
    RULES.update(rules_before)


def test_the_builtin_mixers_are_registered():
    assert dict(mixers.OPERATORS) == {"gla": "gla", "gdn": "gated_delta_rule", "kda": "kda"}
    assert dict(mixers.KNOBS) == {"gla": ("gate_low_rank_dim", "gate_timescales"),
                                  "gdn": ("gate_timescales", "conv_init"), "kda": ("gate_timescales", "conv_init")}
    assert dict(mixers.KNOB_DEFAULTS) == dict(gate_low_rank_dim=16, gate_timescales=None, conv_init=None)
    assert mixers.owners("conv_init") == "Gated DeltaNet and KDA"


def _loop(q, k, v, h0, scale):
    """The float64 token loop: ``S_t = S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t``."""
    S, out = h0.clone(), []
    for t in range(q.shape[1]):
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
        out.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(out, 1), S


def _check(rank, world, strategies):
    from tests.helpers.stub_operator import zeco_cumsum

    group = dist.new_group(list(range(world)))
    gen = torch.Generator().manual_seed(7)
    B, T, H, K, V = 2, 8 * world, 2, 4, 3
    x = {n: torch.randn(B, T, H, K if n in "qk" else V, dtype=torch.float64, generator=gen) for n in "qkv"}
    h0 = torch.randn(B, H, K, V, dtype=torch.float64, generator=gen)
    do = torch.randn(B, T, H, V, dtype=torch.float64, generator=gen)
    dht = torch.randn(B, H, K, V, dtype=torch.float64, generator=gen)
    leaves = [x[n].clone().requires_grad_() for n in "qkv"] + [h0.clone().requires_grad_()]
    o, ht = _loop(*leaves, K ** -0.5)
    ref = dict(o=o, ht=ht, **dict(zip(("dq", "dk", "dv", "dh0"),
                                      torch.autograd.grad((o * do).sum() + (ht * dht).sum(), leaves))))
    mine = slice(rank * 8, (rank + 1) * 8)
    failures = []
    for strategy in strategies:
        local = [x[n][:, mine].clone().requires_grad_() for n in "qkv"] + [h0.clone().requires_grad_()]
        o, ht = zeco_cumsum(*local[:3], group=group, strategy=strategy, layout="contiguous",
                            initial_state=local[3], output_final_state=True)
        # each rank's loss sees its own tokens and a share of the final-state term (every rank has ht)
        grads = torch.autograd.grad((o * do[:, mine]).sum() + (ht * dht).sum() / world, local)
        dh0 = grads[3].clone()
        dist.all_reduce(dh0, group=group)  # the gradient of a replicated input: summed over the ranks
        errors = {"o": (o - ref["o"][:, mine]).abs().max().item(), "ht": (ht - ref["ht"]).abs().max().item(),
                  "dh0": (dh0 - ref["dh0"]).abs().max().item()}
        errors.update({"d" + n: (g - ref["d" + n][:, mine]).abs().max().item() for n, g in zip("qkv", grads)})
        bad = above(errors, TOL)
        if bad:
            failures.append(f"{strategy}: {bad}")
    return failures


def test_stub_operator_runs_at_cp2(stub):
    """The stub's piece through the zeco and lasp2 scans on two gloo ranks: outputs, final state and every
    gradient those of the float64 token loop over the whole sequence."""
    assert_no_failures(run_ranks(_check, 2, ("zeco", "lasp2")))


def test_stub_mixer_is_among_the_specs_mixers(stub):
    from megatron_zeco import specs

    assert mixers.OPERATORS["stub"] == "stub_cumsum" and mixers.NAMES["stub"] == "Stub cumulative sum"
    spec = specs.hybrid_layer_spec("G*", mixer="stub", cp_strategy="lasp2")
    config = spec.submodules.gla.self_attention.params["cp_config"]
    assert (config.operator, config.strategy) == ("stub_cumsum", "lasp2")
    with pytest.raises(ValueError, match="mixer 'nonesuch' is not one of gla, gdn, kda, stub"):
        specs.hybrid_layer_spec("G*", mixer="nonesuch")


def test_stub_mixer_is_among_the_main_jobs_choices(stub, capsys):
    from megatron_zeco import train

    cfg = train.parse_args(["--mixer", "stub", "--strategy", "lasp2"])
    train.resolve_mixer(cfg)
    assert train.cp_config(cfg).operator == "stub_cumsum"
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    assert "{gla,gdn,kda,stub}" in capsys.readouterr().out


def test_clashes_are_refused(stub):
    gla = registry.mixer("gla")
    with pytest.raises(ValueError, match="mixer 'gla' is registered already"):
        registry.register(Mixer(name="gla", title="Another", operator="gla", layer_spec="m:f"))
    with pytest.raises(ValueError, match="knob 'gate_low_rank_dim' defaults to 16 for GLA and 8"):
        registry.register(Mixer(name="other", title="Other", operator="gla", layer_spec="m:f",
                                knobs=dict(gate_low_rank_dim=8)))
    with pytest.raises(ValueError, match="operator 'nowhere', which has no entry in cp.config.RULES"):
        registry.register(Mixer(name="other", title="Other", operator="nowhere", layer_spec="m:f"))
    with pytest.raises(ValueError, match="RULES has 'gla' already"):
        registry.register(Mixer(name="other", title="Other", operator="gla", layer_spec="m:f"),
                          rules=Rules("x", ("zeco",), blocks="rows", auto_transport=None))
    with pytest.raises(ValueError, match="knob 'gate_low_rank_dim' defaults to 16 for GLA and 8"):
        registry.register(Mixer(name="other", title="Other", operator="other_op", layer_spec="m:f",
                                knobs=dict(gate_low_rank_dim=8)),
                          rules=Rules("x", ("zeco",), blocks="rows", auto_transport=None))
    assert registry.register(stub.MIXER, rules=stub.RULES) is stub.MIXER  # the same again: a no-op
    assert registry.mixer("gla") is gla and "other" not in registry.mixers() and "other_op" not in RULES
