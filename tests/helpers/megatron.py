"""Small Megatron-Core models on the CPU and the comparisons the Megatron-facing tests share.

* :func:`transformer_config`: the tests' small ``TransformerConfig`` (CPU initialisation, no
  dropout), any field overridden.
* :func:`host_as_cuda`, :func:`host_rope`: the host standing in for CUDA where megatron-core 0.16
  assumes it (dist-checkpointing, collectives, rotary tables).
* :func:`train_steps`, :func:`check_training_matches`: a GLA GPTModel of the main job trained a few
  SGD steps, and the check that another parallel layout trains it the same.
* :func:`cp_summed_grads`, :func:`documents_alone`, :func:`check_loss_and_grads`: one model's loss
  and gradients under CP against one process's, and a packed batch against every document alone.

megatron-core is imported inside the functions: modules that never build a model do not import it.
"""

from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_zeco.mcore.host import host_as_cuda
from .reference import rel_err


def transformer_config(**overrides):
    """A ``TransformerConfig`` of one layer, hidden size 32 and 4 heads, initialised on the CPU, without
    dropout; ``overrides`` replace or add fields."""
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                hidden_dropout=0.0, attention_dropout=0.0)
    return TransformerConfig(**{**base, **overrides})


def _cpu_rope_pos_emb(pos_emb, seq_dim, cp_group):
    """megatron-core 0.16's get_pos_emb_on_this_cp_rank without its CUDA copy: this rank's zigzag pieces."""
    from megatron_zeco import Layout

    return Layout.ZIGZAG.shard(pos_emb, cp_group.rank(), cp_group.size(), dim=seq_dim)


def host_rope():
    """megatron-core 0.16's rotary embedding assumes CUDA (its tables and CP split): the host stands in."""
    stack = host_as_cuda()
    stack.enter_context(mock.patch(
        "megatron.core.models.common.embeddings.rotary_pos_embedding.get_pos_emb_on_this_cp_rank", _cpu_rope_pos_emb))
    return stack


# --- a GLA GPTModel of the main job, trained a few steps ---------------------------------------------

STEPS = 4
TRAIN_TOL = 1e-5  # float32
BASE = dict(layers=2, hidden=32, heads=4, seq_len=48, batch=4, task="mock", lr=1e-2, log_interval=10**6)


def train_steps(rank, world, overrides, dtypes=("float64", "float32")):
    """Per dtype: losses and gradient norms of STEPS SGD steps of the main job's model (``BASE`` with
    ``overrides``: ``megatron_zeco.train.TrainConfig`` fields), the step-1 gradients and the parameters
    after the last step."""
    from megatron.core import parallel_state

    from megatron_zeco import train as T

    out = {}
    for dtype in dtypes:
        cfg = T.TrainConfig(steps=STEPS, dtype=dtype, **{**BASE, **overrides})
        device = T.init_distributed(cfg)
        task = T.make_task(cfg)
        model = T.build_model(cfg, task.vocab_size, device)
        # Plain SGD: Adam would turn rounding noise in tiny gradients into full-size steps.
        optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
        losses, norms, first = [], [], None
        for step in range(1, STEPS + 1):
            optimizer.zero_grad()
            loss, _ = T.loss_and_accuracy(model, T.local_batch(cfg, T.global_batch(cfg, task, step)), device)
            loss.backward()
            T.reduce_gradients(model)
            if step == 1:
                first = _full_grads(model)
            norms.append(float(T.grad_norm(model)))
            optimizer.step()
            total = loss.detach().double()
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            losses.append(float(total))
        out[dtype] = (losses, norms, first, {n: p.detach().clone() for n, p in model.named_parameters()})
        parallel_state.destroy_model_parallel()
    return out


def _full_grads(model):
    """Every parameter's gradient, TP shards gathered (in-projection layouts are per head, so
    gathering along the partition dim gives the TP = 1 tensor)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_group()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if getattr(p, "tensor_model_parallel", False) and tp.size() > 1:
            parts = [torch.empty_like(g) for _ in range(tp.size())]
            dist.all_gather(parts, g.contiguous(), group=tp)
            g = torch.cat(parts, dim=p.partition_dim)
        grads[name] = g
    return grads


def rel(a, b):
    """|a - b| / |b| of two numbers."""
    return abs(a - b) / max(abs(b), 1e-30)


def _vec_rel(grads, ref):
    diff = sum(float((grads[n].double() - ref[n].double()).pow(2).sum()) for n in ref)
    return (diff / sum(float(ref[n].double().pow(2).sum()) for n in ref)) ** 0.5


def check_training_matches(results, reference):
    """``results``: every rank's :func:`train_steps`; ``reference``: one process's. float64: every
    loss and gradient element to 1e-10 (the CP model is exact). float32: every step's loss and the
    first step's gradient to 1e-5; later gradient norms to 1e-4 (rounding)."""
    for dtype, tol in (("float64", 1e-10), ("float32", TRAIN_TOL)):
        ref_losses, ref_norms, ref_grads, _ = reference[dtype]
        for rank, result in enumerate(results):
            losses, norms, grads, _ = result[dtype]
            for step, (a, b) in enumerate(zip(losses, ref_losses), 1):
                assert rel(a, b) < tol, f"{dtype} rank {rank} step {step}: loss {a} vs {b}"
            for step, (a, b) in enumerate(zip(norms, ref_norms), 1):
                # In fp32 the weights after a step differ by rounding; later gradients amplify it.
                bound = tol if dtype == "float64" or step == 1 else 10 * tol
                assert rel(a, b) < bound, f"{dtype} rank {rank} step {step}: |grad| {a} vs {b}"
            assert _vec_rel(grads, ref_grads) < tol, f"{dtype} rank {rank}: step-1 gradient"
            if dtype == "float64":
                for name, g in grads.items():
                    err = float((g - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-300))
                    assert err < tol, f"rank {rank}: grad of {name} off by {err:.1e}"


# --- one model under CP against one process -----------------------------------------------------------

def cp_summed_grads(model, group, name=lambda n: n):
    """Every parameter's gradient summed over the CP ``group``, by ``name(parameter name)``."""
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=group)
        grads[name(n)] = g
    return grads


def cross_entropy(logits, labels):
    """Summed cross-entropy in float64 over the whole vocabulary (Megatron's own loss runs in float32)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def documents_alone(model, tokens, labels, cu):
    """A packed batch's loss (mean over its tokens) and every parameter's gradient, from every document
    run alone, unpacked, through ``model`` (one process)."""
    model.zero_grad()
    loss = 0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        loss = loss + cross_entropy(model(tokens[:, a:b], None, None), labels[:, a:b])
    loss = loss / int(cu[-1])
    loss.backward()
    return float(loss.detach()), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def check_loss_and_grads(results, reference, where, tol):
    """Each of ``results`` (``(loss, {parameter: gradient})`` first) has ``reference``'s loss and
    gradients of the same parameters, to ``tol`` (relative)."""
    ref_loss, ref_grads = reference[:2]
    for rank, (loss, grads) in enumerate(r[:2] for r in results):
        here = where if len(results) == 1 else f"{where} rank {rank}"
        assert abs(loss - ref_loss) <= tol * abs(ref_loss), f"{here}: loss {loss} vs {ref_loss}"
        assert set(grads) == set(ref_grads), f"{here}: parameters {set(grads) ^ set(ref_grads)}"
        for name, g in grads.items():
            err = rel_err(g, ref_grads[name])
            assert err < tol, f"{here}: gradient of {name} off by {err:.1e}"
