"""The step check in a Megatron training step (mcore/common.py): after a scan over peer memory gave up,
Megatron's gradient finalisation and the optimizer step raise ``ScanTimeoutError`` before any parameter
changes (real gloo processes; the scans' own give-up: tests/comm/test_faults.py)."""

import os
import time

import pytest
import torch

from tests.helpers.distributed import run_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

STALL = 8  # s the late rank stays away: past the 2 s bound of step 2's waits


def _megatron_step_checks(rank, world, nan_check):
    """A GLA GPTModel (megatron-core, this package's spec) over peer memory at CP = 2, float64. Megatron-LM's
    training loop sets ``config.finalize_model_grads_func`` before the first step; here a stand-in for
    Megatron's gradient finalisation that refuses NaN gradients (``nan_check``), as its
    ``--check-for-nan-in-loss-and-grad`` does, or one that returns whatever the gradients hold. Step 1 together; in step 2 rank 1 stalls past the 2 s bound before the backward pass, so the
    step's last scan, the first (only) layer's backward, gives up on rank 0: no later scan of the step
    notices, as in a model of any depth. Returns, per step, what the finalisation and an optimizer step
    raised, and whether the parameters changed."""
    from megatron.core import parallel_state

    from megatron_zeco import train as T

    cfg = T.TrainConfig(layers=1, hidden=16, heads=2, seq_len=16, batch=2, task="mock", dtype="float64",
                        transport="peer_memory", log_interval=10**6)
    device = T.init_distributed(cfg)
    task = T.make_task(cfg)
    model = T.build_model(cfg, task.vocab_size, device)
    config = model.config

    def megatron_finalize(models, num_tokens=None):
        if nan_check and any(p.grad.isnan().any() for m in models for p in m.parameters() if p.grad is not None):
            raise RuntimeError("found NaN in local grad norm")
        return "finalized"

    config.finalize_model_grads_func = megatron_finalize  # as megatron.training.training.train does
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in (1, 2):
        if step == 2:
            os.environ["MEGATRON_ZECO_SCAN_TIMEOUT"] = "2"
        before = [p.detach().clone() for p in model.parameters()]
        loss, _ = T.loss_and_accuracy(model, T.local_batch(cfg, T.global_batch(cfg, task, step)), device)
        if step == 2 and rank == 1:
            time.sleep(STALL)
        loss.backward()
        raised = {}
        for name, call in (("finalize", lambda: config.finalize_model_grads_func([model])),
                           ("optimizer", optimizer.step)):
            try:
                call()
                raised[name] = None
            except Exception as e:  # noqa: BLE001  (the test checks which)
                raised[name] = (type(e).__name__, str(e), type(e.__cause__).__name__)
        changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        out.append((raised, changed))
        optimizer.zero_grad()
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.parametrize("nan_check", [True, pytest.param(False, marks=pytest.mark.variant)],
                         ids=["nan-check", "no-nan-check"])
def test_megatron_gradient_finalisation_and_optimizer_step_raise_after_a_give_up(nan_check):
    """Step 1 finalises and updates normally. In step 2 rank 0's last scan gave up: the finalisation
    names it (ScanTimeoutError, from Megatron's NaN error where Megatron checks for NaN, else after its
    finalisation returned) and the optimizer step raises it before any parameter changes. Rank 1, back
    late, finds the give-up recorded: under the zigzag layout its second piece waits on rank 0 in the
    backward scan, which rank 0 has marked failed, so rank 1 raises in that step too, unchanged."""
    rank0, rank1 = run_ranks(_megatron_step_checks, 2, nan_check, timeout=240)
    (first0, changed0), (second0, changed0_2) = rank0
    assert first0 == {"finalize": None, "optimizer": None} and changed0, first0
    kind, message, cause = second0["finalize"]
    assert kind == "ScanTimeoutError" and "All-Scan (backward)" in message, second0
    assert cause == ("RuntimeError" if nan_check else "NoneType"), second0
    assert "from global rank 1" in message, message
    kind, message, _ = second0["optimizer"]
    assert kind == "ScanTimeoutError" and "All-Scan (backward)" in message, second0
    assert not changed0_2, "rank 0: parameters changed in the step whose scan gave up"
    (first1, changed1), (second1, changed1_2) = rank1
    assert first1 == {"finalize": None, "optimizer": None} and changed1, first1
    assert {kind for kind, _, _ in second1.values()} == {"ScanTimeoutError"}, second1
    assert not changed1_2, "rank 1: parameters changed in the step whose scan gave up"
