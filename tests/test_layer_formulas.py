"""Each token mixer's Megatron-Core layer on one rank against its formula, written out here from the
layer's parameters as a loop over the tokens (float64): GLA (megatron_zeco/gla/layer.py), KDA
(megatron_zeco/kda/layer.py) and, on megatron-core >= 0.19, Gated DeltaNet
(megatron_zeco/gated_delta_rule/layer.py, Megatron's GatedDeltaNet with ZeCO's CP).

Every other layer test compares the layer under CP with the same layer at CP = 1; these say what the
layer computes: the projections' layouts, the short convolution, the norms, the gates (a decay without
its ``exp``, a gate without its bias, a sigmoid for a SiLU fail here), the recurrence and the output
gate. Random parameters (not the layers' initialisation, so that every term weighs). And the layers'
initialisation knobs (``conv_init``, ``gate_timescales``) as the main job sets them. And, first in that
fresh process, what importing the specs into user code shows: none of megatron-core's notices about its
missing optional packages (Apex, TransformerEngine), and no filter of them left behind. One launch of one
process for all.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_zeco.training.arguments import GDN_PATH, megatron_core_has
from tests.helpers.distributed import run_ranks
from tests.helpers.megatron import transformer_config
from tests.helpers.reference import rel_err

pytestmark = pytest.mark.megatron

HAVE_GDN = megatron_core_has(GDN_PATH)  # 0.19 (looked up without importing megatron-core)
TOL = 1e-10
S, B, HIDDEN, HEADS, W = 12, 2, 24, 3, 4  # tokens, sequences, hidden size, heads (of 8), convolution taps
D = HIDDEN // HEADS


# --- the formulas (x: [S, B, hidden]; p: the layer's parameters by name) ---------------------------

def rms_norm(x, weight, eps):
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def l2_normalised(x, eps=1e-6):
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + eps)


def causal_conv_silu(x, taps):
    """x: [S, B, C]; taps: [C, W], the last tap on the current token, zeros before the first."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for i in range(taps.shape[1]):
            source = t - (taps.shape[1] - 1) + i
            if source >= 0:
                out[t] += taps[:, i] * x[source]
    return F.silu(out)


def gla_formula(p, x, eps):
    """GLA (fla's GatedLinearAttention): per head [q k v r] rows of in_proj; g = logsigmoid(gate) / 16 per
    key channel; S_t = Diag(exp g_t) S_(t-1) + k_t v_t^T, o_t = S_t^T q_t / sqrt(D); out_proj(RMSNorm(o) SiLU(r))."""
    qkvr = (x @ p["in_proj.weight"].T).view(S, B, HEADS, 4, D)
    q, k, v, r = qkvr.unbind(3)
    gate = (x @ p["gate_down"].T) @ p["gate_up.weight"].T + p["gate_up.bias"]
    g = F.logsigmoid(gate.view(S, B, HEADS, D)) / 16
    state = torch.zeros(B, HEADS, D, D, dtype=x.dtype)
    o = torch.empty(S, B, HEADS, D, dtype=x.dtype)
    for t in range(S):
        state = g[t].exp().unsqueeze(-1) * state + k[t].unsqueeze(-1) * v[t].unsqueeze(-2)
        o[t] = torch.einsum("bhk,bhkv->bhv", q[t], state) * D ** -0.5
    y = rms_norm(o, p["out_norm_weight"], eps) * F.silu(r)
    return y.reshape(S, B, HIDDEN) @ p["out_proj.weight"].T


def delta_rule(q, k, v, decay, beta):
    """S_t = (I - beta_t k_t k_t^T) Diag(decay_t) S_(t-1) + beta_t k_t v_t^T, o_t = S_t^T q_t / sqrt(K), with
    q, k, v, decay: [S, B, H, K or V] (decay per key channel) and beta: [S, B, H]."""
    state = torch.zeros(B, q.shape[2], q.shape[3], v.shape[3], dtype=q.dtype)
    o = torch.empty_like(v)
    eye = torch.eye(q.shape[3], dtype=q.dtype)
    for t in range(q.shape[0]):
        kt, bt = k[t], beta[t][..., None, None]
        state = (eye - bt * kt.unsqueeze(-1) * kt.unsqueeze(-2)) @ (decay[t].unsqueeze(-1) * state) \
            + bt * kt.unsqueeze(-1) * v[t].unsqueeze(-2)
        o[t] = torch.einsum("bhk,bhkv->bhv", q[t], state) * q.shape[3] ** -0.5
    return o


def kda_formula(p, x, eps):
    """KDA (fla's KimiDeltaAttention): per head [q k v b] rows of in_proj; q, k, v through the causal convolution
    and SiLU, q and k L2-normalised; g = -exp(A_log) softplus(gate + dt_bias) per head and key channel,
    beta = sigmoid(b); the delta rule; out_proj(RMSNorm(o) sigmoid(output gate))."""
    proj = (x @ p["in_proj.weight"].T).view(S, B, HEADS, 3 * D + 1)
    qkv = causal_conv_silu(proj[..., :3 * D].reshape(S, B, HEADS * 3 * D), p["conv_weight"])
    q, k, v = qkv.view(S, B, HEADS, 3 * D).split(D, dim=-1)
    gate = ((x @ p["gate_down"].T) @ p["gate_up.weight"].T).view(S, B, HEADS, D)
    g = -p["A_log"].exp()[:, None] * F.softplus(gate + p["dt_bias"].view(HEADS, D))
    o = delta_rule(l2_normalised(q), l2_normalised(k), v, g.exp(), torch.sigmoid(proj[..., 3 * D]))
    out_gate = (x @ p["out_gate_down"].T) @ p["out_gate_up.weight"].T + p["out_gate_up.bias"]
    y = rms_norm(o, p["out_norm_weight"], eps) * torch.sigmoid(out_gate.view(S, B, HEADS, D))
    return y.reshape(S, B, HIDDEN) @ p["out_proj.weight"].T


def gdn_formula(p, x, eps):
    """Gated DeltaNet (Megatron's GatedDeltaNet): in_proj rows [q (all heads) k (all heads) v (all heads) | z |
    b | a]; q, k, v through the causal convolution and SiLU, q and k L2-normalised; g = -exp(A_log)
    softplus(a + dt_bias), beta = sigmoid(b), per head; the delta rule; out_proj(LayerNorm(o) SiLU(z))."""
    proj = x @ p["in_proj.weight"].T
    qkv, z, b, a = proj.split([3 * HIDDEN, HIDDEN, HEADS, HEADS], dim=-1)
    qkv = causal_conv_silu(qkv, p["conv1d.weight"].squeeze(1))
    q, k, v = (part.view(S, B, HEADS, D) for part in qkv.split(HIDDEN, dim=-1))
    g = -p["A_log"].exp() * F.softplus(a + p["dt_bias"])
    o = delta_rule(l2_normalised(q), l2_normalised(k), v, g.exp().unsqueeze(-1).expand(S, B, HEADS, D),
                   torch.sigmoid(b))
    mean, var = o.mean(-1, keepdim=True), o.var(-1, unbiased=False, keepdim=True)
    normed = (o - mean) / torch.sqrt(var + eps) * p["out_norm.weight"] + p["out_norm.bias"]
    y = normed * F.silu(z.view(S, B, HEADS, D))
    return y.reshape(S, B, HIDDEN) @ p["out_proj.weight"].T


FORMULAS = {"gla": gla_formula, "kda": kda_formula, "gdn": gdn_formula}


# --- the layers ------------------------------------------------------------------------------------

def _build(mixer, **knobs):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_zeco import specs

    linear = dict(linear_num_key_heads=HEADS, linear_num_value_heads=HEADS, linear_key_head_dim=D,
                  linear_value_head_dim=D, linear_conv_kernel_dim=W, activation_func=F.silu)
    config = transformer_config(hidden_size=HIDDEN, num_attention_heads=HEADS, params_dtype=torch.float64,
                                **(linear if mixer == "gdn" else {}))
    spec = getattr(specs, f"{mixer}_layer_spec")(**knobs).submodules.self_attention
    return build_module(spec, config=config, layer_number=1).double(), config


def _import_notices():
    """The warnings importing megatron_zeco.specs (and .models) shows in a process that has not imported
    megatron-core yet, the filters it leaves that hide megatron-core's notices, and whether a notice megatron-core
    raises after the import still shows."""
    import sys
    import warnings

    assert not any(m.split(".")[0] == "megatron" for m in sys.modules), "megatron-core imported already"
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        import megatron_zeco.specs  # noqa: F401
        if HAVE_GDN:
            import megatron_zeco.models  # noqa: F401
        left = [f for f in warnings.filters if f[1] is not None and "not installed" in f[1].pattern]
        warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning, "backends.py", 1,
                               module="megatron.core.models.backends")
    return [f"{w.category.__name__}: {w.message}" for w in shown if w.category is UserWarning], left


def _layers(rank, world, mixers):
    """What importing the specs shows (:func:`_import_notices`); per mixer: the layer's output and the
    formula's, for random parameters and input (float64); and the initial parameters of the layers with a
    short convolution, by their initialisation knobs."""
    notices = _import_notices()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    out = {"import": notices}
    try:
        for mixer in mixers:
            layer, config = _build(mixer)
            with torch.no_grad():
                for param in layer.parameters():  # every term away from its initial value
                    param.copy_(torch.randn_like(param) * 0.5)
            x = torch.randn(S, B, HIDDEN, dtype=torch.float64)
            y, bias = layer(x)
            assert bias is None, mixer
            params = {name: param.detach() for name, param in layer.named_parameters()}
            out[mixer] = y.detach(), FORMULAS[mixer](params, x, config.layernorm_epsilon)
        for mixer in set(mixers) - {"gla"}:
            for knobs in (dict(), dict(conv_init="identity", gate_timescales=(2.0, 32.0))):
                layer, _ = _build(mixer, **knobs)
                out[mixer, bool(knobs)] = {name: param.detach() for name, param in layer.named_parameters()}
    finally:
        parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def outputs():
    return run_ranks(_layers, 1, ["gla", "kda"] + (["gdn"] if HAVE_GDN else []))[0]


NEEDS_GDN = pytest.mark.skipif(not HAVE_GDN, reason="Gated DeltaNet needs megatron-core >= 0.19 (.ci/run's second "
                                                     "pass runs it)")


@pytest.mark.parametrize("mixer", ["gla", "kda", pytest.param("gdn", marks=NEEDS_GDN)])
def test_layer_computes_its_formula(outputs, mixer):
    layer, formula = outputs[mixer]
    assert layer.shape == (S, B, HIDDEN)
    assert rel_err(layer, formula) < TOL, (mixer, rel_err(layer, formula))


@pytest.mark.parametrize("mixer", ["kda", pytest.param("gdn", marks=NEEDS_GDN)])
def test_initialisation_knobs(outputs, mixer):
    """By default, the layer's own initialisation: KDA as fla's KDA models (A uniform in [1, 16], dt =
    softplus(dt_bias) log-uniform in [0.001, 0.1]), Gated DeltaNet as Megatron's (A uniform in [1, 16],
    dt_bias = 1), the convolution as nn.Conv1d's (uniform in +-1/2 for 4 taps). With conv_init="identity" and
    gate_timescales=(2, 32): the taps pass the current token on, A = 1, and dt = 1 / tau with tau log-uniform
    in [2, 32] per channel (KDA) or evenly spaced in log over the heads (Gated DeltaNet: 2 x 16 ** (1/6, 1/2,
    5/6))."""
    conv = "conv_weight" if mixer == "kda" else "conv1d.weight"
    default, knobs = outputs[mixer, False], outputs[mixer, True]
    A, dt, taps = default["A_log"].exp(), F.softplus(default["dt_bias"]), default[conv].reshape(-1, W)
    assert A.min() >= 1 and A.max() <= 16, A
    if mixer == "kda":
        assert dt.min() >= 1e-3 and dt.max() <= 0.1 and dt.max() / dt.min() > 10, dt
    else:
        assert torch.equal(default["dt_bias"], torch.ones_like(dt))
    assert taps.abs().max() <= W ** -0.5 and taps[:, :-1].abs().max() > 0.1, taps
    taps = knobs[conv].reshape(-1, W)
    assert torch.equal(taps[:, -1], torch.ones_like(taps[:, -1])) and not taps[:, :-1].any(), taps
    assert not knobs["A_log"].any()
    dt = F.softplus(knobs["dt_bias"])
    if mixer == "kda":
        assert dt.min() >= 1 / 32 and dt.max() <= 1 / 2 and dt.max() / dt.min() > 8, dt
    else:
        tau = 2.0 * 16.0 ** torch.tensor([1 / 6, 1 / 2, 5 / 6], dtype=torch.float64)
        assert torch.allclose(dt, 1 / tau, rtol=1e-12, atol=0), (dt, 1 / tau)


def test_importing_the_specs_shows_no_notice_of_megatron_core(outputs):
    """megatron-core's notices about Apex and TransformerEngine, printed when it is first imported, are hidden
    while this package imports it (they are not the user's to act on), and only then: the one user warning
    shown is the notice megatron-core's own code raises after the import."""
    shown, left = outputs["import"]
    assert shown == ["UserWarning: Apex is not installed. Falling back to Torch Norm"], shown
    assert left == [], left
