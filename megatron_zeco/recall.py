"""Multi-query associative recall with the pairs at the start and the queries at the end.

A sequence is ``[k1:v1] [k2:v2] ... [kn:vn]  <filler ...>  k_a v_a k_b v_b ...``:
n random bindings (keys distinct, values random, each stored as one pair token),
random filler, then the keys again in another order, each to be answered with
its value. The loss and the accuracy count only those answers. Under context
parallelism the pairs sit in the first rank's piece and the queries in the last
piece, so the only way to answer is through the recurrent state passed between
ranks: accuracy above chance (1 / num_values) shows the state crossed them.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RecallTask:
    seq_len: int = 256
    num_pairs: int = 8
    num_keys: int = 16
    num_values: int = 16
    num_filler: int = 32

    # Token ids: pair tokens, then key tokens, value tokens, filler tokens.
    @property
    def key_base(self) -> int:
        return self.num_keys * self.num_values

    @property
    def value_base(self) -> int:
        return self.key_base + self.num_keys

    @property
    def vocab_size(self) -> int:
        return self.value_base + self.num_values + self.num_filler

    @property
    def chance(self) -> float:
        return 1.0 / self.num_values

    def __post_init__(self):
        n, s = self.num_pairs, self.seq_len
        if 3 * n + 1 > s:
            raise ValueError(f"RecallTask: {n} pairs need a sequence of more than {3 * n} tokens, got {s}")
        if n > self.num_keys:
            raise ValueError(f"RecallTask: {n} pairs need at least as many keys, got {self.num_keys}")

    def batch(self, batch_size: int, generator: torch.Generator) -> dict:
        """``tokens``, ``labels`` (next token) and ``loss_mask`` (1 where the label is an answer), ``[b, s]``."""
        n, s = self.num_pairs, self.seq_len
        keys = torch.rand(batch_size, self.num_keys, generator=generator).argsort(dim=1)[:, :n]
        values = torch.randint(0, self.num_values, (batch_size, n), generator=generator)
        filler = self.value_base + self.num_values
        tokens = torch.randint(filler, filler + self.num_filler, (batch_size, s + 1), generator=generator)
        tokens[:, :n] = keys * self.num_values + values
        order = torch.rand(batch_size, n, generator=generator).argsort(dim=1)
        start = s + 1 - 2 * n
        tokens[:, start::2] = self.key_base + keys.gather(1, order)
        tokens[:, start + 1::2] = self.value_base + values.gather(1, order)
        loss_mask = torch.zeros(batch_size, s + 1)
        loss_mask[:, start + 1::2] = 1.0
        return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                "loss_mask": loss_mask[:, 1:].contiguous()}
