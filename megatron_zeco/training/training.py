"""The main job's training loop: the recall task's batches, the loss and accuracy under TP x CP x DP,
gradient reduction, the step, logging and the summary (Megatron-LM's megatron/training/training.py)."""

import math
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import mixers
from ..comm import Layout, check_scans
from ..cp.config import RULES
from ..recall import RecallTask
from .arguments import TrainConfig, check_device, make_task, startup_errors, stall_of
from .checkpointing import resume, save_checkpoint
from .initialize import init_distributed
from .model import build_model


def global_batch(cfg: TrainConfig, task: RecallTask, step: int) -> dict:
    """The whole step's batch (all data-parallel ranks), the same on every rank: a function of
    the seed and the step alone, so a resumed run sees the same data."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    batch = task.batch(cfg.batch, gen)
    if cfg.task == "mock":
        batch["loss_mask"] = torch.ones_like(batch["loss_mask"])
    elif cfg.task != "recall":
        raise ValueError(f"--task must be recall or mock, got {cfg.task!r}")
    return batch


def local_batch(cfg: TrainConfig, batch: dict) -> dict:
    """This rank's share: its data-parallel rows, then its context-parallel tokens."""
    from megatron.core import parallel_state

    if cfg.batch % cfg.dp:
        raise ValueError(f"--batch {cfg.batch} must be divisible by --dp {cfg.dp}")
    dp_rank = parallel_state.get_data_parallel_rank()
    rows = slice(dp_rank * cfg.batch // cfg.dp, (dp_rank + 1) * cfg.batch // cfg.dp)
    batch = {k: v[rows] for k, v in batch.items()}
    # zigzag is exactly Megatron's get_batch_on_this_cp_rank split (tests/mcore/test_gpt_model.py),
    # whose signature changes between megatron-core releases.
    cp_rank = parallel_state.get_context_parallel_rank()
    return {k: Layout(cfg.layout).shard(v, cp_rank, cfg.cp, dim=1) for k, v in batch.items()}


def loss_and_accuracy(model, batch: dict, device):
    """Masked mean cross-entropy over the whole global batch (so gradients sum over DP x CP),
    and the summed (answer count, correct answers) over DP x CP."""
    from megatron.core import parallel_state

    tokens, labels, mask = (batch[k].to(device) for k in ("tokens", "labels", "loss_mask"))
    logits = model(tokens, None, None)  # [b, s, vocab / tp]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    token_loss = _vocab_parallel_cross_entropy(logits, labels)
    mask = mask.to(logits.dtype)
    correct = (_vocab_parallel_argmax(logits.detach()) == labels).to(mask.dtype)
    stats = torch.stack([mask.sum(), (correct * mask).sum()])
    dist.all_reduce(stats, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return (token_loss * mask).sum() / stats[0], stats


def _vocab_parallel_cross_entropy(logits, labels):
    """Per-token cross-entropy of ``[b, s, vocab / tp]`` logits, in their own dtype
    (Megatron's version computes in float32 and allocates on CUDA)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region as tp_sum

    tp = parallel_state.get_tensor_model_parallel_group()
    if tp.size() == 1:
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    peak = logits.detach().amax(dim=-1, keepdim=True)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=tp)
    shifted = logits - peak
    local = labels - tp.rank() * logits.shape[-1]
    inside = (local >= 0) & (local < logits.shape[-1])
    target = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * inside
    return tp_sum(shifted.exp().sum(-1), group=tp).log() - tp_sum(target, group=tp)


def _vocab_parallel_argmax(logits):
    """argmax over a vocabulary split across tensor-parallel ranks."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_group()
    best, index = logits.max(dim=-1)
    if tp.size() == 1:
        return index
    index = index + tp.rank() * logits.shape[-1]
    bests = [torch.empty_like(best) for _ in range(tp.size())]
    indices = [torch.empty_like(index) for _ in range(tp.size())]
    dist.all_gather(bests, best.contiguous(), group=tp)
    dist.all_gather(indices, index.contiguous(), group=tp)
    return torch.stack(indices).gather(0, torch.stack(bests).argmax(0, keepdim=True)).squeeze(0)


def reduce_gradients(model):
    """Sum gradients over the data x context parallel group (parameters are replicated there)."""
    from megatron.core import parallel_state

    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if dp_cp.size() > 1 and grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=dp_cp)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def _log(message: str):
    print(message, flush=True)  # progress must show up in redirected logs as it happens


def grad_norm(model) -> torch.Tensor:
    """Norm of the whole (TP-unsharded) gradient, the same on every rank (call after reduce_gradients)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_group()
    total = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    for p in model.parameters():  # TP-sharded gradients from every TP rank, replicated ones once
        if p.grad is not None and (getattr(p, "tensor_model_parallel", False) or tp.rank() == 0):
            total += p.grad.double().pow(2).sum()
    dist.all_reduce(total, group=tp)
    return total.sqrt()


def lr_schedule(cfg: TrainConfig):
    """Linear warm-up over 5% of the steps, then cosine decay to a tenth."""
    warmup = max(1, cfg.steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, cfg.steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return factor


# --- the loop -------------------------------------------------------------------------------------

def train(cfg: TrainConfig, log=_log):
    """Run the training loop (resuming from ``--load``, saving to ``--save``); returns the per-step
    (loss, accuracy) of the steps it ran. A misconfiguration found while starting (flags, model
    build, checkpoint, first step) raises ConfigError, the same on every rank."""
    try:
        with startup_errors():
            device = init_distributed(cfg, log)  # checks the flags (resolve) first
            check_device(cfg)
            task = make_task(cfg)
            model = build_model(cfg, task.vocab_size, device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg))
            first = resume(cfg, model, optimizer, scheduler, device, log) + 1 if cfg.load else 1
        return _loop(cfg, task, model, optimizer, scheduler, device, first, log)
    finally:
        parallel_state = sys.modules.get("megatron.core.parallel_state")  # none if the flags stopped the job
        if parallel_state is not None:
            parallel_state.destroy_model_parallel()


def _loop(cfg, task, model, optimizer, scheduler, device, first, log):
    from megatron.core import parallel_state

    rank0 = dist.get_rank() == 0
    if rank0:
        log(_describe_run(cfg, task, device))
    history, step, saved_at = [], first - 1, None
    start = window_start = time.time()
    window_steps, saving = 0, 0.0  # steps since the last log line; seconds spent saving checkpoints
    stall = stall_of(cfg)
    for step in range(first, cfg.steps + 1):
        if stall is not None and stall[:2] == (dist.get_rank(), step):
            time.sleep(stall[2])
        with startup_errors() if step == first else nullcontext():  # the first forward checks the CP inputs
            batch = local_batch(cfg, global_batch(cfg, task, step))
            optimizer.zero_grad(set_to_none=True)
            loss, stats = loss_and_accuracy(model, batch, device)
        loss.backward()
        reduce_gradients(model)
        norm = grad_norm(model)
        finite = bool(norm.isfinite())  # waits for the step's backward pass: every scan has ended by now
        check_scans()  # a scan that gave up (its results NaN): ScanTimeoutError naming it, before the update
        if not finite:
            raise FloatingPointError(f"step {step}: the gradient norm is {float(norm)}; not applying it (lower "
                                     f"--lr, or check the inputs)")
        if cfg.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), cfg.clip_grad, norm)
        optimizer.step()
        scheduler.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        accuracy = float(stats[1] / stats[0])
        history.append((float(global_loss), accuracy))
        window_steps += 1
        exiting = cfg.exit_interval > 0 and step % cfg.exit_interval == 0 and step < cfg.steps
        if rank0 and (step % cfg.log_interval == 0 or step == cfg.steps or exiting):
            now = time.time()
            log(f"step {step:5d}/{cfg.steps} | loss {history[-1][0]:.4f} | recall acc {accuracy:.3f} | "
                f"grad norm {float(norm):.3f} | lr {scheduler.get_last_lr()[0]:.2e} | "
                f"{window_steps * cfg.batch * cfg.seq_len / (now - window_start):8.0f} tokens/s | {cfg.strategy}")
            window_start, window_steps = now, 0
        if cfg.save and (step == cfg.steps or exiting or (cfg.save_interval and step % cfg.save_interval == 0)):
            began = time.time()
            save_checkpoint(cfg, step, model, optimizer, scheduler, device, log)
            saved_at, spent = step, time.time() - began
            saving, window_start = saving + spent, window_start + spent  # tokens/s counts training time only
        if exiting:
            break
    if rank0:
        _summary(cfg, task, history, (first, step), time.time() - start, saving, saved_at, log)
    return history


def _describe_run(cfg, task, device) -> str:
    """The job's first log line: the model, the parallel layout, the CP strategy and the task."""
    name = mixers.NAMES[cfg.mixer]
    if cfg.model == "hybrid":
        kind = f"HybridModel {cfg.hybrid_layer_pattern!r} (G = {name}),"
    else:
        kind = (name if cfg.pattern == "G" else f"hybrid ({cfg.pattern!r}, G = {name})") + " GPTModel"
    split = (f", piece split {cfg.piece_split or 'auto'}"
             if RULES[mixers.OPERATORS[cfg.mixer]].applies("piece_split") else "")
    return (f"megatron_zeco: {kind} {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads | "
            f"TP {cfg.tp} x CP {cfg.cp} x DP {cfg.dp} on {device.type} | CP strategy {cfg.strategy}, "
            f"layout {cfg.layout}{split} | seq {cfg.seq_len}, batch {cfg.batch}, task {cfg.task} "
            f"(chance accuracy {task.chance:.3f})")


def _summary(cfg, task, history, steps, elapsed, saving, saved_at, log):
    first, last = steps
    if not history:
        log(f"done: nothing to run (resumed after step {first - 1}, --steps {cfg.steps})")
        return
    tail = history[-min(20, len(history)):]
    ran = f"steps {first}-{last}" if first > 1 else "steps"
    stopped = f" (stopped by --exit-interval {cfg.exit_interval})" if last < cfg.steps else ""
    kept = f" | saved step {saved_at} under {cfg.save} ({saving:.1f} s saving)" if saved_at is not None else ""
    log(f"done: {len(history)} {ran} of {cfg.steps}{stopped} in {elapsed:.1f} s, "
        f"{len(history) * cfg.batch * cfg.seq_len / (elapsed - saving):.0f} tokens/s | final loss "
        f"{sum(h[0] for h in tail) / len(tail):.4f}, recall accuracy {sum(h[1] for h in tail) / len(tail):.3f} "
        f"(chance {task.chance:.3f}, mean of the last {len(tail)} steps){kept}")
