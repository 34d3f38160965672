"""One home for the CP knobs: every bad value fails with the same message whichever entry point it
comes through (the operator's keywords, a layer spec, a layer, the main job's flags), and each
operator's rules say which strategies and knobs it takes."""

import pytest
import torch

from megatron_zeco.cp import RULES, CPConfig

# knob -> (a bad value, what the message says), for every knob of CPConfig
BAD = {
    "strategy": ("ring", "cp_strategy 'ring' is not one of zeco, lasp1, lasp2, a2a for GLA"),
    "layout": ("diagonal", "cp_layout 'diagonal' is not one of contiguous, zigzag"),
    "num_blocks": (0, "cp_num_blocks 0 must be a positive integer"),
    "transport": ("nvlink", "cp_transport 'nvlink' is not one of auto, send_recv, peer_memory, nvshmem"),
    "overlap": ("yes", "cp_overlap_scan 'yes' must be True, False or None"),
    "piece_split": (0, "cp_piece_split 0 must be a positive integer or None"),
    "packed_split": ("docs", "cp_packed_split 'docs' is not one of auto, document, sequence"),
    "node_size": (-2, "cp_node_size -2 must be a positive integer"),
}
# The main job's flags for the knobs it has.
FLAGS = {"strategy": "strategy", "layout": "layout", "num_blocks": "num_blocks", "transport": "transport",
         "piece_split": "piece_split"}


@pytest.mark.parametrize("knob", sorted(BAD))
def test_a_bad_knob_fails_the_same_way_through_every_entry_point(knob):
    """The config itself, the operator, a spec and the layer's keywords give the knob's one message; so does
    the main job where it has a flag for the knob."""
    bad, message = BAD[knob]
    with pytest.raises(ValueError) as config_error:
        CPConfig(**{knob: bad})
    assert message in str(config_error.value)
    x = torch.zeros(1, 4, 2, 4, dtype=torch.float64)
    keyword = {"overlap": "overlap", "packed_split": None}.get(knob, knob)
    if keyword is not None:  # the operator takes every knob but the packed split (it takes cu_seqlens)
        from megatron_zeco import zeco_gla

        with pytest.raises(ValueError) as op_error:
            zeco_gla(x, x, x, -x.abs(), **{keyword: bad})
        assert message in str(op_error.value), op_error.value
    from megatron_zeco.cp.config import KEYWORDS
    from megatron_zeco.specs import gla_layer_spec

    with pytest.raises(ValueError) as spec_error:
        gla_layer_spec(**{KEYWORDS[knob]: bad})
    assert message in str(spec_error.value), spec_error.value
    from megatron_zeco.cp.config import config_of, split_keywords

    with pytest.raises(ValueError) as layer_error:  # what the layer does with its cp_* keywords
        config_of("gla", None, split_keywords({KEYWORDS[knob]: bad, "cp_comm_type": "p2p"})[0],
                  "GatedLinearAttention")
    assert message in str(layer_error.value), layer_error.value
    if knob in FLAGS:
        from megatron_zeco import train as T

        with pytest.raises(ValueError) as job_error:
            T.resolve(T.TrainConfig(**{FLAGS[knob]: bad}), 2)
        assert message in str(job_error.value), job_error.value


def test_knobs_an_operator_does_not_take_are_named():
    """The gated delta rule takes no sub-pieces and no node size: set, they are named, not ignored."""
    with pytest.raises(ValueError, match="cp_piece_split applies to GLA only; keep its default"):
        CPConfig(operator="gated_delta_rule", piece_split=2)
    with pytest.raises(ValueError, match="cp_strategy 'lasp1' is not one of zeco, lasp2, a2a for the gated delta"):
        CPConfig(operator="gated_delta_rule", strategy="lasp1")
    assert CPConfig(operator="gated_delta_rule", overlap=True).overlap is True


def test_every_operator_has_rules_and_a_folder():
    """A rules entry names its strategies (none of them 'none'), the axis its blocks cut and what auto means."""
    import importlib

    from megatron_zeco.comm.transport import Transport

    for key, rules in RULES.items():
        assert rules.strategies and "none" not in rules.strategies, key
        assert rules.blocks in ("rows", "columns"), key
        assert rules.auto_transport is None or isinstance(rules.auto_transport, Transport), key
        importlib.import_module(f"megatron_zeco.{key}.op")


def test_a_config_is_frozen_and_normalised():
    config = CPConfig(layout="contiguous")
    assert config.layout.value == "contiguous"
    with pytest.raises(Exception):
        config.strategy = "lasp2"


def test_the_backend_variable_keeps_its_earlier_name(monkeypatch):
    """$MEGATRON_ZECO_BACKEND picks the local ops' backend; $MEGATRON_ZECO_GLA_BACKEND, its earlier name, still
    does, with a deprecation warning, and the new name wins where both are set."""
    from megatron_zeco.common import backend

    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    monkeypatch.delenv(backend.DEPRECATED_BACKEND_ENV, raising=False)
    assert backend.backend_choice() == "auto"
    monkeypatch.setenv(backend.DEPRECATED_BACKEND_ENV, "torch")
    backend._warn_deprecated.cache_clear()
    with pytest.warns(DeprecationWarning, match="MEGATRON_ZECO_BACKEND"):
        assert backend.backend_choice() == "torch"
    monkeypatch.setenv(backend.BACKEND_ENV, "auto")
    assert backend.backend_choice() == "auto"


@pytest.mark.parametrize("operator, old", [("gated_delta_rule", "require_gdn_backend"), ("kda", "require_kda_backend")])
def test_each_operator_names_its_backend_check_require_backend(operator, old):
    """``megatron_zeco.<operator>.require_backend`` (the module names the operator, the symbol its role, as
    fla names them); the earlier name still works, with a deprecation warning."""
    import importlib

    module = importlib.import_module(f"megatron_zeco.{operator}")
    assert module.require_backend("cpu", torch.float32) is None
    with pytest.warns(DeprecationWarning, match=f"megatron_zeco.{operator}.require_backend"):
        getattr(module, old)("cpu", torch.float32)


@pytest.mark.parametrize("op", ["gated_delta_rule", "kda"])
def test_the_delta_rules_take_the_overlap_as_gla_does(op):
    """``overlap`` on the delta rules' operators: a bad value fails with the knob's one message; True and
    False give the same result (on the CPU no side stream runs; on CUDA the scan's hops go beside the local
    work, tests/gated_delta_rule/test_gpu.py)."""
    from megatron_zeco import zeco_gated_delta_rule, zeco_kda

    fn = {"gated_delta_rule": zeco_gated_delta_rule, "kda": zeco_kda}[op]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    g = -torch.rand(1, 6, 2, *((4,) if op == "kda" else ()), generator=gen, dtype=torch.float64)
    beta = torch.rand(1, 6, 2, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(k, dim=-1)
    with pytest.raises(ValueError, match=BAD["overlap"][1]):
        fn(q, k, v, g, beta, overlap="yes")
    on, _ = fn(q, k, v, g, beta, overlap=True)
    off, _ = fn(q, k, v, g, beta, overlap=False)
    assert torch.equal(on, off)
