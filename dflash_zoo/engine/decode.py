"""The decode loop: prefill -> draft a block -> verify it in one target forward -> accept -> roll back.

One loop for every family; the adapter owns embeddings, logits, taps and cache rollback. Per step:
1. the drafter fills `[bonus] + mask x (b-1)` in one pass, conditioned on the tapped features of every
   committed token not yet in its context cache;
2. the target verifies `[bonus] + drafts` (b tokens) in one forward, with taps on;
3. the acceptance rule (sampling.py) picks `na` accepted drafts and the new bonus token;
4. the target cache drops the `b - (na + 1)` rejected positions (adapter.rollback);
5. the tapped features of the `na + 1` kept inputs become the drafter's next new context.
`b` shrinks near `max_new_tokens` so no step produces tokens past the limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dflash_zoo.engine.drafter import DFlashDrafter, DraftKV, Span
from dflash_zoo.engine.results import (
    GREEDY_RULE,
    SAMPLING_RULE,
    GenerationConfig,
    GenerationResult,
    StepRecord,
)
from dflash_zoo.engine.sampling import accept_greedy, accept_rejection, processed_probs, sample

# Optional override of the accept decision: (step index, proposed drafts) -> forced accepted count.
# Used by `bench --what-if-acceptance`; None means the real acceptance rule.
AcceptOverride = Callable[[int, int], int]


class _Picker:
    """Token selection for drafts and targets under one GenerationConfig."""

    def __init__(self, cfg: GenerationConfig, device: torch.device):
        self.cfg = cfg
        self.gen = None
        if not cfg.greedy:
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed(cfg.seed if cfg.seed is not None else torch.seed())

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return processed_probs(logits, self.cfg.temperature, self.cfg.top_k, self.cfg.top_p)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] -> [N]"""
        return logits.argmax(-1) if self.cfg.greedy else sample(self.probs(logits), self.gen)


def _truncate(tokens: list[int], stops: set[int], room: int) -> tuple[list[int], str | None]:
    """Cut at the first stop token (kept) or at `room` tokens; returns (tokens, stop reason or None)."""
    for i, t in enumerate(tokens[:room]):
        if t in stops:
            return tokens[: i + 1], "stop_token"
    if len(tokens) >= room:
        return tokens[:room], "max_new_tokens"
    return tokens, None


class SpeculativeDecoder:
    """Iterate to get each step's committed tokens; `result` holds the typed result afterwards."""

    def __init__(
        self,
        adapter: Any,
        drafter: DFlashDrafter,
        prompt_ids: list[int],
        cfg: GenerationConfig,
        mask_token_id: int,
        accept_override: AcceptOverride | None = None,
        prefill_inputs: dict[str, Any] | None = None,
    ):
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        self.adapter, self.drafter, self.prompt = adapter, drafter, list(prompt_ids)
        self.cfg = cfg.validated(drafter.cfg.block_size)
        self.mask_id = mask_token_id
        self.override = accept_override
        self.prefill_inputs = prefill_inputs or {}  # e.g. pixel_values: the image is seen at prefill only
        self.device = next(drafter.parameters()).device
        self.result = GenerationResult(
            output_ids=[],
            text="",
            prompt_tokens=len(prompt_ids),
            acceptance_rule=GREEDY_RULE if self.cfg.greedy else SAMPLING_RULE,
            block_size=self.cfg.block_size,
        )

    def __iter__(self) -> Iterator[list[int]]:
        with torch.inference_mode(), self.adapter.tap(self.drafter.cfg.target_layer_ids) as taps:
            yield from self._run(taps)

    def _run(self, taps) -> Iterator[list[int]]:
        res, cfg, stops = self.result, self.cfg, set(self.cfg.stop_token_ids)
        picker = _Picker(cfg, self.device)
        t0 = time.perf_counter()
        cache = self.adapter.new_cache()
        ids = torch.tensor([self.prompt], device=self.device)
        logits = self.adapter.forward(ids, cache, logits_to_keep=1, **self.prefill_inputs)  # [1, 1, V]
        feats = taps.take()  # [1, P, K*H]: context for the first draft
        bonus = picker.pick(logits[0, -1:])  # [1]
        first = int(bonus)
        res.prefill_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        committed, reason = _truncate([first], stops, cfg.max_new_tokens)
        res.output_ids += committed
        yield committed
        self.adapter.start_decoding(cache)
        dkv, pos, step = DraftKV(), len(self.prompt), 0
        while reason is None:
            room = cfg.max_new_tokens - len(res.output_ids)
            b = min(cfg.block_size, room)  # never verify more slots than tokens still allowed
            drafts, q = self._draft(bonus, feats, dkv, pos, b, picker)
            verify = torch.cat([bonus, drafts])[None]  # [1, b]
            snap = self.adapter.snapshot(cache)
            logits = self.adapter.forward(verify, cache)[0]  # [b, V]
            vfeats = taps.take()  # [1, b, K*H]
            na, nxt = self._accept(drafts, q, logits, picker, step)
            with taps.pause():  # a replaying rollback must not overwrite the verify features
                self.adapter.rollback(cache, b - (na + 1), snap, verify[:, : na + 1])
            feats, bonus = vfeats[:, : na + 1], nxt[None]
            new = drafts[:na].tolist() + [int(nxt)]
            committed, reason = _truncate(new, stops, room)
            res.steps.append(StepRecord(drafts.tolist(), na, len(committed)))
            res.output_ids += committed
            pos, step = pos + na + 1, step + 1
            yield committed
        res.decode_seconds = time.perf_counter() - t1
        res.stop_reason = reason

    def _draft(self, bonus, feats, dkv: DraftKV, pos: int, b: int, picker: _Picker):
        """Returns (drafts [b-1], draft probs [b-1, V] or None). b == 1 drafts nothing (a plain AR step)."""
        if b == 1:
            return bonus[:0], None
        block = torch.full((b,), self.mask_id, device=self.device, dtype=torch.long)
        block[0] = bonus[0]
        emb = self.adapter.embed(block[None])  # [1, b, H]
        span = Span(
            q_pos=torch.arange(pos, pos + b, device=self.device),
            ctx_pos=torch.arange(0, pos, device=self.device),
        )
        h = self.drafter(
            emb.to(self.drafter.fc.weight.dtype), feats.to(self.drafter.fc.weight.dtype), span, dkv
        )
        dlogits = self.adapter.logits(h[0, 1:].to(emb.dtype))  # [b-1, V]
        if picker.cfg.greedy:
            return dlogits.argmax(-1), None
        q = picker.probs(dlogits)
        return sample(q, picker.gen), q

    def _accept(self, drafts, q, logits, picker: _Picker, step: int) -> tuple[int, torch.Tensor]:
        if picker.cfg.greedy:
            na, nxt = accept_greedy(drafts, logits)
        else:
            na, nxt = accept_rejection(drafts, q, picker.probs(logits), picker.gen)
        na = int(na)  # the one host sync per step
        if self.override is not None:
            forced = min(self.override(step, len(drafts)), len(drafts))
            # what-if mode: commit the first `forced` proposals as if accepted, then the target's own token
            na, nxt = forced, picker.pick(logits[forced : forced + 1])[0]
        return na, nxt


def speculative_generate(
    adapter: Any,
    drafter: DFlashDrafter,
    prompt_ids: list[int],
    cfg: GenerationConfig,
    mask_token_id: int,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Run the whole loop; `on_tokens` is called with each step's committed tokens."""
    dec = SpeculativeDecoder(adapter, drafter, prompt_ids, cfg, mask_token_id)
    for tokens in dec:
        if on_tokens is not None:
            on_tokens(tokens)
    return dec.result


def autoregressive_generate(
    adapter: Any, prompt_ids: list[int], cfg: GenerationConfig, device: torch.device | str = "cpu"
) -> GenerationResult:
    """Plain one-token-at-a-time decoding with the same cache and sampling code (the baseline)."""
    picker = _Picker(cfg, torch.device(device))
    stops = set(cfg.stop_token_ids)
    res = GenerationResult(
        output_ids=[], text="", prompt_tokens=len(prompt_ids), acceptance_rule="autoregressive"
    )
    with torch.inference_mode():
        t0 = time.perf_counter()
        cache = adapter.new_cache()
        logits = adapter.forward(torch.tensor([prompt_ids], device=device), cache, logits_to_keep=1)
        tok = picker.pick(logits[0, -1:])
        res.prefill_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        while True:
            t = int(tok)
            res.output_ids.append(t)
            if t in stops or len(res.output_ids) >= cfg.max_new_tokens:
                res.stop_reason = "stop_token" if t in stops else "max_new_tokens"
                break
            tok = picker.pick(adapter.forward(tok[None], cache)[0, -1:])
        res.decode_seconds = time.perf_counter() - t1
    return res
