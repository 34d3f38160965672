"""The main job: train a small GLA GPTModel (megatron-core) with ZeCO context parallelism.

    torchrun --nproc-per-node 4 -m megatron_zeco.train               # CPU, gloo, CP = 4
    torchrun --nproc-per-node 8 -m megatron_zeco.train --tp 2        # TP 2 x CP 4
    torchrun --nproc-per-node 4 -m megatron_zeco.train --pattern 'G*'  # hybrid: every 2nd layer softmax

Uses megatron-core directly (parallel_state, GPTModel, the layer spec of this
package); gradients of the parameters, replicated over data and context
parallel ranks, are summed over that group as Megatron's DDP does. Runs on GPUs
with NCCL when torch sees them (``--device auto``). Prints loss, recall
accuracy, tokens/s and the CP strategy every ``--log-interval`` steps.
"""

import argparse
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .comm import Layout, as_layout
from .recall import RecallTask


@dataclass
class TrainConfig:
    tp: int = 1
    cp: Optional[int] = None  # default: world / (tp * dp)
    dp: int = 1
    strategy: str = "zeco"
    layout: str = "zigzag"
    num_blocks: int = 1
    piece_split: Optional[int] = None  # batched sub-pieces per CP piece (zeco_gla's piece_split; None: auto)
    pattern: str = "G"  # layer symbols, repeated: G = GLA, * = softmax attention (megatron_zeco.hybrid)
    position_embedding: str = "none"  # or "rope" (softmax layers only; under CP > 1 megatron-core needs CUDA)
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    seq_len: int = 64
    batch: int = 16  # sequences per step over all data-parallel ranks
    steps: int = 500
    lr: float = 3e-3  # peak; warm-up then cosine decay to lr / 10
    clip_grad: float = 1.0  # global gradient norm clip (0: off)
    dtype: str = "float32"  # parameters and activations: float32, or float64 for exactness checks
    init_std: float = 0.1  # ~ hidden ** -0.5: Megatron's 0.02 is tuned for wide models
    seed: int = 1234
    task: str = "recall"  # or "mock": random tokens, loss on every token
    # Recall task (see recall.py): bindings per sequence, key/value/filler vocabularies.
    pairs: int = 4
    keys: int = 8
    values: int = 8
    filler: int = 8
    device: str = "auto"
    log_interval: int = 50
    deterministic: bool = False  # Megatron's --deterministic-mode: deterministic_mode + torch's deterministic algorithms


def parse_args(argv=None) -> TrainConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for name, default in vars(TrainConfig()).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=int if name in ("cp", "piece_split") else type(default), default=default)
    return TrainConfig(**vars(parser.parse_args(argv)))


def init_distributed(cfg: TrainConfig):
    """Process group (from torchrun's environment) and Megatron's model-parallel groups."""
    from megatron.core import parallel_state

    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.deterministic:
        # As Megatron-LM's --deterministic-mode (megatron/training/determinism.py); NCCL and cuBLAS
        # read these once, at their start.
        os.environ.setdefault("NCCL_ALGO", "Ring")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if not dist.is_initialized():
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if use_cuda else "gloo")
    world = dist.get_world_size()
    if cfg.cp is None:
        cfg.cp = world // (cfg.tp * cfg.dp)
    if cfg.tp * cfg.cp * cfg.dp != world:
        raise ValueError(f"--tp {cfg.tp} x --cp {cfg.cp} x --dp {cfg.dp} must equal the {world} processes")
    split = cfg.piece_split or 1
    pieces = as_layout(cfg.layout).num_pieces(cfg.cp) * (split if cfg.cp > 1 else 1)
    if cfg.cp > 1 and cfg.seq_len % pieces:
        raise ValueError(f"--seq-len {cfg.seq_len} must be a multiple of {pieces}: the {cfg.layout} layout cuts "
                         f"each sequence into {pieces} equal pieces over --cp {cfg.cp} ranks"
                         + (f" (x --piece-split {split})" if split > 1 else ""))
    parallel_state.initialize_model_parallel(cfg.tp, 1, context_parallel_size=cfg.cp)
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device):
    """GPTModel with the GLA (or hybrid) layer spec; identical initial weights for any TP/CP layout."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from .specs import gla_layer_spec, hybrid_layer_spec

    if cfg.position_embedding not in ("none", "rope"):
        raise ValueError(f"--position-embedding must be none or rope, got {cfg.position_embedding!r}")
    torch.manual_seed(cfg.seed)
    config = TransformerConfig(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
        tensor_model_parallel_size=cfg.tp, context_parallel_size=cfg.cp,
        use_cpu_initialization=True, params_dtype=getattr(torch, cfg.dtype),
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=cfg.init_std,
        deterministic_mode=cfg.deterministic,
    )
    gla = dict(cp_strategy=cfg.strategy, cp_layout=cfg.layout, cp_num_blocks=cfg.num_blocks,
               cp_piece_split=cfg.piece_split, gate_timescales=(1.0, 4.0 * cfg.seq_len))
    spec = gla_layer_spec(**gla) if cfg.pattern == "G" else hybrid_layer_spec(cfg.pattern, **gla)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                     max_sequence_length=cfg.seq_len, position_embedding_type=cfg.position_embedding)
    return model.to(device=device, dtype=getattr(torch, cfg.dtype))  # some norms ignore params_dtype


def make_task(cfg: TrainConfig) -> RecallTask:
    return RecallTask(seq_len=cfg.seq_len, num_pairs=cfg.pairs, num_keys=cfg.keys, num_values=cfg.values,
                      num_filler=cfg.filler)


def global_batch(cfg: TrainConfig, task: RecallTask, step: int) -> dict:
    """The whole step's batch (all data-parallel ranks), the same on every rank."""
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
    # zigzag is exactly Megatron's get_batch_on_this_cp_rank split (tests/test_megatron_model.py),
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
    bests, indices = [torch.empty_like(best) for _ in range(tp.size())], [torch.empty_like(index) for _ in range(tp.size())]
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


def train(cfg: TrainConfig, log=_log):
    """Run the training loop; returns the list of per-step (loss, accuracy)."""
    from megatron.core import parallel_state

    device = init_distributed(cfg)
    task = make_task(cfg)
    model = build_model(cfg, task.vocab_size, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg))
    rank0 = dist.get_rank() == 0
    if rank0:
        kind = "GLA" if cfg.pattern == "G" else f"hybrid ({cfg.pattern!r})"
        log(f"megatron_zeco: {kind} GPTModel {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads | "
            f"TP {cfg.tp} x CP {cfg.cp} x DP {cfg.dp} on {device.type} | CP strategy {cfg.strategy}, "
            f"layout {cfg.layout}, piece split {cfg.piece_split or 'auto'} | "
            f"seq {cfg.seq_len}, batch {cfg.batch}, task {cfg.task} "
            f"(chance accuracy {task.chance:.3f})")
    history, start, window_start, tokens_seen = [], time.time(), time.time(), 0
    for step in range(1, cfg.steps + 1):
        batch = local_batch(cfg, global_batch(cfg, task, step))
        optimizer.zero_grad(set_to_none=True)
        loss, stats = loss_and_accuracy(model, batch, device)
        loss.backward()
        reduce_gradients(model)
        norm = grad_norm(model)
        if cfg.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), cfg.clip_grad, norm)
        optimizer.step()
        scheduler.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        accuracy = float(stats[1] / stats[0])
        history.append((float(global_loss), accuracy))
        tokens_seen += cfg.batch * cfg.seq_len
        if rank0 and (step % cfg.log_interval == 0 or step == cfg.steps):
            now = time.time()
            steps_in_window = cfg.log_interval if step % cfg.log_interval == 0 else step % cfg.log_interval
            rate = steps_in_window * cfg.batch * cfg.seq_len / (now - window_start)
            log(f"step {step:5d}/{cfg.steps} | loss {history[-1][0]:.4f} | recall acc {accuracy:.3f} | "
                f"grad norm {float(norm):.3f} | lr {scheduler.get_last_lr()[0]:.2e} | "
                f"{rate:8.0f} tokens/s | {cfg.strategy}")
            window_start = now
    elapsed = time.time() - start
    if rank0:
        tail = history[-min(20, len(history)):]
        log(f"done: {cfg.steps} steps in {elapsed:.1f} s ({tokens_seen / elapsed:.0f} tokens/s) | "
            f"final loss {sum(h[0] for h in tail) / len(tail):.4f}, recall accuracy "
            f"{sum(h[1] for h in tail) / len(tail):.3f} (chance {task.chance:.3f}, mean of last {len(tail)} steps)")
    return history


def main(argv=None):
    train(parse_args(argv))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
