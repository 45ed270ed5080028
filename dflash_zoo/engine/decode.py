"""The eager engine: prefill -> draft a block -> verify it in one target forward -> accept -> roll back.

It runs the target's own transformers forward, so it serves every family, device and placement; the adapter
owns embeddings, logits, taps and cache rollback. Per step:
1. the drafter fills `[bonus] + mask x (B-1)` in one pass (always the whole block B), conditioned on the
   tapped features of every committed token not yet in its context cache;
2. the target verifies `[bonus] + drafts` in one forward with taps on: all B slots, or near
   `max_new_tokens` only the `v = verify_width(B, room)` that can still be committed (and, for a longrope
   target, no block crosses the position where its rotary factors switch: `run.rope_switch`);
3. the acceptance rule (sampling.py) picks `na` accepted drafts and the next token;
4. the target cache drops the `v - (na + 1)` rejected positions (adapter.rollback);
5. the tapped features of the `na + 1` kept inputs become the drafter's next new context.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dflash_zoo.engine.drafter import DFlashDrafter, DraftKV, Span
from dflash_zoo.engine.results import GREEDY_RULE, SAMPLING_RULE, GenerationConfig, GenerationResult
from dflash_zoo.engine.run import AcceptOverride, Engine, Generation, Run, rope_switch, verify_width
from dflash_zoo.engine.sampling import Sampler, new_generator

if TYPE_CHECKING:
    from dflash_zoo.adapters.base import TargetAdapter

AR_RULE = "autoregressive"


def sampler_of(cfg: GenerationConfig) -> Sampler:
    return Sampler(cfg.temperature, cfg.top_k, cfg.top_p)


class SpeculativeDecoder(Generation):
    """One eager speculative generation: iterate for each step's committed tokens; `result` afterwards."""

    def __init__(
        self,
        adapter: TargetAdapter,
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
        self.sampler = sampler_of(self.cfg)
        rule = GREEDY_RULE if self.cfg.greedy else SAMPLING_RULE
        super().__init__(Run(self.cfg, len(prompt_ids), rule, self.cfg.block_size), self._steps_with_taps())

    def _steps_with_taps(self) -> Iterator[list[int]]:
        with torch.inference_mode(), self.adapter.tap(self.drafter.cfg.target_layer_ids) as taps:
            yield from self._run(taps)

    def _run(self, taps) -> Iterator[list[int]]:
        run, block = self.run, self.cfg.block_size
        switch = rope_switch(self.adapter.config)  # longrope: no verify block crosses its switch
        gen = None if self.cfg.greedy else new_generator(self.device, self.cfg.seed)
        cache = self.adapter.new_cache()
        ids = torch.tensor([self.prompt], device=self.device)
        logits = self.adapter.forward(ids, cache, logits_to_keep=1, **self.prefill_inputs)  # [1, 1, V]
        feats = taps.take()  # [1, P, K*H]: context for the first draft
        bonus = self.sampler.pick(logits[0, -1:], gen)  # [1]
        yield run.first(int(bonus))
        self.adapter.start_decoding(cache)
        dkv, pos, step = DraftKV(), len(self.prompt), 0
        while not run.done:
            v = verify_width(block, run.room, pos, switch)
            # v == 1 (one token left): nothing drafted could be committed, so the drafter is not run
            drafts, q = self._draft(bonus, feats, dkv, pos, block, gen) if v > 1 else (bonus[:0], None)
            drafts, q = drafts[: v - 1], None if q is None else q[: v - 1]  # [v-1], [v-1, V]
            verify = torch.cat([bonus, drafts])[None]  # [1, v]
            snap = self.adapter.snapshot(cache)
            logits = self.adapter.forward(verify, cache)[0]  # [v, V]
            vfeats = taps.take()  # [1, v, K*H]
            na, nxt = self._accept(drafts, q, logits, gen, step)
            with taps.pause():  # a replaying rollback must not overwrite the verify features
                self.adapter.rollback(cache, v - (na + 1), snap, verify[:, : na + 1])
            feats, bonus = vfeats[:, : na + 1], nxt
            yield run.step(drafts.tolist(), na, drafts[:na].tolist() + [int(nxt)])
            pos, step = pos + na + 1, step + 1

    def _draft(self, bonus, feats, dkv: DraftKV, pos: int, b: int, gen):
        """Returns (drafts [b-1], their distribution [b-1, V] or None when greedy)."""
        block = torch.full((b,), self.mask_id, device=self.device, dtype=torch.long)
        block[0] = bonus[0]
        emb = self.drafter.embed_block(block[None], self.adapter)  # [1, b, H]
        span = Span(
            q_pos=torch.arange(pos, pos + b, device=self.device),
            ctx_pos=torch.arange(0, pos, device=self.device),
        )
        dtype = self.drafter.fc.weight.dtype
        h = self.drafter(emb.to(dtype), feats.to(dtype), span, dkv)  # [1, b, H]
        # the architecture turns slots 1.. into proposals (DFlash: argmax / sample; DFlash 2: its selector)
        return self.drafter.propose(h[0, 1:].to(emb.dtype), bonus, self.adapter.head, self.sampler, gen)

    def _accept(self, drafts, q, logits, gen, step: int) -> tuple[int, torch.Tensor]:
        force = None
        if self.override is not None:
            forced = self.override(step, len(drafts))
            force = torch.tensor(forced, device=logits.device)
        if q is None and not self.sampler.greedy:  # nothing drafted: the next token is a plain sample
            q = logits.new_zeros(0, logits.shape[-1], dtype=torch.float32)
        na, nxt = self.sampler.accept(drafts, q, logits, gen, force)
        return int(na), nxt  # the one host sync per step


class _Autoregressive(Generation):
    """Plain one-token-at-a-time decoding with the same cache and sampling code (the baseline)."""

    def __init__(self, adapter: TargetAdapter, prompt_ids: list[int], cfg: GenerationConfig, device):
        self.adapter, self.prompt, self.cfg, self.device = (
            adapter,
            list(prompt_ids),
            cfg,
            torch.device(device),
        )
        super().__init__(Run(cfg, len(prompt_ids), AR_RULE), self._steps())

    def _steps(self) -> Iterator[list[int]]:
        sampler, run = sampler_of(self.cfg), self.run
        gen = None if self.cfg.greedy else new_generator(self.device, self.cfg.seed)
        with torch.inference_mode():
            cache = self.adapter.new_cache()
            ids = torch.tensor([self.prompt], device=self.device)
            tok = sampler.pick(self.adapter.forward(ids, cache, logits_to_keep=1)[0, -1:], gen)  # [1]
            yield run.first(int(tok))
            while not run.done:
                tok = sampler.pick(self.adapter.forward(tok[None], cache)[0, -1:], gen)
                yield run.token(int(tok))


class EagerEngine(Engine):
    """The eager loop as an `Engine`: any family, any device or placement, greedy or sampling."""

    name: ClassVar[str] = "eager"

    def __init__(self, adapter: TargetAdapter, drafter: DFlashDrafter, mask_token_id: int):
        self.adapter, self.drafter, self.mask_token_id = adapter, drafter, mask_token_id

    def _speculative(self, prompt_ids, cfg, accept_override, prefill_inputs) -> Generation:
        return SpeculativeDecoder(
            self.adapter, self.drafter, prompt_ids, cfg, self.mask_token_id, accept_override, prefill_inputs
        )

    def _autoregressive(self, prompt_ids, cfg) -> Generation:
        cfg = cfg.validated(self.drafter.cfg.block_size)
        return _Autoregressive(self.adapter, prompt_ids, cfg, next(self.drafter.parameters()).device)


def autoregressive_generate(
    adapter: TargetAdapter, prompt_ids: list[int], cfg: GenerationConfig, device: torch.device | str = "cpu"
) -> GenerationResult:
    """Plain decoding through the target's own forward (the eager baseline), to the end."""
    return _Autoregressive(adapter, prompt_ids, cfg, device).drain()
