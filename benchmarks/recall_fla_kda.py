"""The main job's recall task learnt by a model built as fla's ``KDAForCausalLM``, in plain PyTorch on the CPU.

The reference of what a KDA model initialised as flash-linear-attention initialises it does on this task
(docs/main-job.md, "The mixers"): fla's ``KDABlock`` (RMSNorm, ``KimiDeltaAttention``, RMSNorm, ``GatedMLP``
with SiLU), untied embeddings and head, and ``KDAPreTrainedModel._init_weights`` (every linear, embedding and
short convolution normal with ``initializer_range``; ``A_log = log U[1, 16]``; ``dt_bias = softplus^-1(dt)``,
dt log-uniform in [0.001, 0.1]). fla needs a GPU, so the recurrence is this package's chunked KDA
(``megatron_zeco.kda.chunk.chunk_kda``, float64-exact against the token loop) and the convolution its
PyTorch form. The batches, AdamW, learning-rate schedule and gradient clipping are the main job's::

    python benchmarks/recall_fla_kda.py --steps 300
    python benchmarks/recall_fla_kda.py --steps 300 --conv-init identity   # the taps as --conv-init identity
"""

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_zeco import train as T
from megatron_zeco.common.conv import causal_conv1d
from megatron_zeco.kda.chunk import chunk_kda


class KimiDeltaAttention(nn.Module):
    """fla's layer (``expand_v = 1``, one value head per key head, short convolutions of 4 taps)."""

    def __init__(self, hidden: int, heads: int, std: float, conv_init: str):
        super().__init__()
        self.heads, self.dim = heads, hidden // heads
        width = heads * self.dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, width, bias=False) for _ in range(3))
        self.taps = nn.ParameterList(nn.Parameter(torch.empty(width, 4)) for _ in range(3))
        for taps in self.taps:
            if conv_init == "identity":
                nn.init.zeros_(taps)
                taps.data[:, -1] = 1.0
            else:  # fla's model: normal with initializer_range, as its linears
                nn.init.normal_(taps, 0.0, std)
        self.f_proj = nn.Sequential(nn.Linear(hidden, self.dim, bias=False), nn.Linear(self.dim, width, bias=False))
        self.b_proj = nn.Linear(hidden, heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(heads).uniform_(1, 16).log())
        dt = torch.exp(torch.rand(width) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.g_proj = nn.Sequential(nn.Linear(hidden, self.dim, bias=False), nn.Linear(self.dim, width, bias=True))
        self.o_norm = nn.Parameter(torch.ones(self.dim))
        self.o_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (causal_conv1d(proj(x), taps, None, "silu").view(b, t, self.heads, self.dim)
                   for proj, taps in zip((self.q_proj, self.k_proj, self.v_proj), self.taps))
        q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
        gate = self.f_proj(x).view(b, t, self.heads, self.dim) + self.dt_bias.view(self.heads, self.dim)
        g = -self.A_log.exp().view(self.heads, 1) * F.softplus(gate)
        o, _ = chunk_kda(q, k, v, g, self.b_proj(x).sigmoid())
        o = F.rms_norm(o, (self.dim,), self.o_norm, 1e-6) * self.g_proj(x).view(b, t, self.heads, self.dim).sigmoid()
        return self.o_proj(o.reshape(b, t, -1))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        inner = 256 * -(-int(hidden * 4 * 2 / 3) // 256)  # fla's: 2/3 of 4 x hidden, a multiple of 256
        self.gate, self.up = nn.Linear(hidden, inner, bias=False), nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class KDAForCausalLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, std: float, conv_init: str):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            nn.ModuleList([nn.RMSNorm(hidden, eps=1e-6), KimiDeltaAttention(hidden, heads, std, conv_init),
                           nn.RMSNorm(hidden, eps=1e-6), GatedMLP(hidden)])
            for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        for module in self.modules():  # KDAPreTrainedModel._init_weights
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, tokens):
        x = self.embeddings(tokens)
        for attn_norm, attn, mlp_norm, mlp in self.blocks:
            x = x + attn(attn_norm(x))
            x = x + mlp(mlp_norm(x))
        return self.lm_head(self.norm(x))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--initializer-range", type=float, default=0.02, help="fla's KDAConfig default")
    parser.add_argument("--conv-init", choices=["fla", "identity"], default="fla")
    parser.add_argument("--log-interval", type=int, default=50)
    args = parser.parse_args()
    cfg = T.TrainConfig(steps=args.steps)  # the main job's task, sizes, seed, learning rate and schedule
    T.resolve(cfg, 1)
    task = T.make_task(cfg)
    torch.manual_seed(cfg.seed)
    model = KDAForCausalLM(task.vocab_size, cfg.hidden, cfg.heads, cfg.layers, args.initializer_range, args.conv_init)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, T.lr_schedule(cfg))
    history = []
    for step in range(1, cfg.steps + 1):
        batch = T.global_batch(cfg, task, step)
        logits = model(batch["tokens"])
        mask = batch["loss_mask"]
        loss = (F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none") * mask).sum() / mask.sum()
        accuracy = float(((logits.argmax(-1) == batch["labels"]) * mask).sum() / mask.sum())
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        optimizer.step()
        scheduler.step()
        history.append((float(loss.detach()), accuracy))
        if step % args.log_interval == 0:
            print(f"step {step:5d}/{cfg.steps} | loss {history[-1][0]:.4f} | recall acc {accuracy:.3f}", flush=True)
    tail = history[-20:]
    print(f"done: final loss {sum(h[0] for h in tail) / len(tail):.4f}, recall accuracy "
          f"{sum(h[1] for h in tail) / len(tail):.3f} (chance {task.chance:.3f}, mean of the last {len(tail)} steps)")


if __name__ == "__main__":
    main()
