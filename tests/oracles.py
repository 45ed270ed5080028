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

    def _draft(self, bonus, feats, dkv, pos, b, gen):
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


def reference_dflash(adapter, drafter, prompt: list[int], max_new: int, mask_id: int):
    """The upstream DFlash loop (greedy), written without any cache: every step drafts the whole block, the
    target verifies the whole block by a forward over the full sequence, and the output is cut at `max_new`
    at the end. Returns (output ids, [(proposed drafts, accepted count)] per step)."""
    from dflash_zoo.engine.drafter import DraftKV, Span

    block, model = drafter.cfg.block_size, adapter.model
    dtype = drafter.fc.weight.dtype
    with torch.inference_mode(), adapter.tap(drafter.cfg.target_layer_ids) as taps:
        logits = model(input_ids=torch.tensor([prompt])).logits[0]
        feats = taps.take()  # [1, P, K*H]
        out, steps = [int(logits[-1].argmax())], []
        while len(out) < max_new:
            pos = len(prompt) + len(out) - 1  # tokens with target features: all but the newest (out[-1])
            ids = torch.tensor([[out[-1]] + [mask_id] * (block - 1)])
            span = Span(q_pos=torch.arange(pos, pos + block), ctx_pos=torch.arange(pos))
            h = drafter(adapter.embed(ids).to(dtype), feats[:, :pos].to(dtype), span, DraftKV())
            drafts = adapter.logits(h[0, 1:]).argmax(-1).tolist()
            logits = model(input_ids=torch.tensor([prompt + out + drafts])).logits[0]
            feats = taps.take()
            target = logits[pos : pos + block].argmax(-1).tolist()  # the target's token after each input
            na = 0
            while na < block - 1 and drafts[na] == target[na]:
                na += 1
            steps.append((drafts, na))
            out += drafts[:na] + [target[na]]
    return out[:max_new], steps
