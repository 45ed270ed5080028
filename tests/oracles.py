"""Test drafters that know the answer: an oracle proposing the target's own greedy continuation, and a
one-error oracle that corrupts one slot per block. They replace only `SpeculativeDecoder._draft`."""

from __future__ import annotations

import random

import torch

from dflash_zoo.engine.decode import SpeculativeDecoder


class OracleDecoder(SpeculativeDecoder):
    """Proposes `reference[...]` (the target's greedy continuation); `error_rate` corrupts one slot per block."""

    def __init__(self, *args, reference: list[int], error_rate: float = 0.0, seed: int = 0, **kw):
        super().__init__(*args, **kw)
        self.reference, self.error_rate, self.rng = reference, error_rate, random.Random(seed)

    def _draft(self, bonus, feats, dkv, pos, b, picker):
        start = pos - len(self.prompt) + 1  # output index of the first draft slot
        drafts = list(self.reference[start : start + b - 1])
        drafts += [0] * (b - 1 - len(drafts))
        if drafts and self.rng.random() < self.error_rate:
            i = self.rng.randrange(len(drafts))
            drafts[i] = (drafts[i] + 1) % 200
        return torch.tensor(drafts, dtype=torch.long, device=self.device), None


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy decoding through transformers' `generate` (independent of our loop)."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()
