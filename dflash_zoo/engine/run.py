"""The engine interface, and the bookkeeping every decode loop shares.

An `Engine` turns prompt ids into a `GenerationResult`, speculatively or one token at a time; `start` gives a
`Generation` to iterate (each item is the list of tokens committed by one step, for streaming), `speculative`
and `autoregressive` run one to the end. Two engines implement it: the eager loop over the target's own
transformers forward (`engine/decode.py`) and the static-buffer engine with CUDA graphs
(`cuda/static/fast.py`); `engine/select.py` picks one and `engine/factory.py` builds it.

`Run` owns what must not differ between engines: stop tokens, truncation at `max_new_tokens`, the step
records and the timings. Its drafting rule is the upstream one: every step drafts the drafter's whole block
(the drafter attends bidirectionally inside the block, so a shorter block would change every proposal), and
near `max_new_tokens` only the slots that can still be committed count (`verify_width`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from dflash_zoo.engine.results import GenerationConfig, GenerationResult, StepRecord
from dflash_zoo.errors import ZooError

# Optional override of the accept decision: (step index, proposed drafts) -> forced accepted count.
# Used by `bench --what-if-acceptance`; None means the real acceptance rule.
AcceptOverride = Callable[[int, int], int]
OnTokens = Callable[[list[int]], None]


def truncate(tokens: list[int], stops: set[int], room: int) -> tuple[list[int], str | None]:
    """Cut at the first stop token (kept) or at `room` tokens; returns (tokens, stop reason or None)."""
    for i, t in enumerate(tokens[:room]):
        if t in stops:
            return tokens[: i + 1], "stop_token"
    if len(tokens) >= room:
        return tokens[:room], "max_new_tokens"
    return tokens, None


def verify_width(block: int, room: int, pos: int = 0, switch: int | None = None) -> int:
    """Verify slots of a step: the block, or fewer when only `room` tokens may still be committed, or when
    the rows from position `pos` would cross the target's rotary `switch` (`rope_switch`).

    A step commits at most (verified slots) tokens, so verifying `room` slots commits exactly what a
    full-block verify would, truncated to `room`.
    """
    v = max(1, min(block, room))
    if switch is not None and pos < switch < pos + v:  # rows on both sides: stop the block at the switch
        return switch - pos
    return v


def rope_switch(config: Any) -> int | None:
    """The position from which a target's rotary frequencies change with the length of each forward, None when
    they do not. transformers' longrope takes its long factors for a whole forward once its last position
    reaches `original_max_position_embeddings`, so a verify block must not hold rows on both sides of it:
    token-by-token decoding rotates the rows before it with the short factors."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if not isinstance(params, dict) or not params:
        return None
    per_layer_type = all(isinstance(v, dict) for v in params.values())  # {"full_attention": {...}, ...}
    for p in params.values() if per_layer_type else [params]:
        if p.get("rope_type", p.get("type")) == "longrope":
            value = p.get("original_max_position_embeddings")
            value = value or getattr(text, "original_max_position_embeddings", None)
            return int(value) if isinstance(value, int) and value > 0 else None
    return None


class Run:
    """Stop tokens, truncation, step records and timings of one generation (created when it starts)."""

    def __init__(self, cfg: GenerationConfig, prompt_tokens: int, rule: str, block_size: int = 0):
        self.cfg, self.stops = cfg, set(cfg.stop_token_ids)
        self.result = GenerationResult([], "", prompt_tokens, acceptance_rule=rule, block_size=block_size)
        self.done = False
        self._t0 = time.perf_counter()
        self._t1: float | None = None

    @property
    def room(self) -> int:
        """Tokens that may still be committed."""
        return self.cfg.max_new_tokens - len(self.result.output_ids)

    def first(self, token: int) -> list[int]:
        """The prefill's token: ends the prefill timing."""
        self._t1 = time.perf_counter()
        self.result.prefill_seconds = self._t1 - self._t0
        return self._commit([token])

    def token(self, token: int) -> list[int]:
        """One autoregressive step's token."""
        return self._commit([token])

    def step(self, proposed: list[int], accepted: int, new: list[int]) -> list[int]:
        """One verify step: `proposed` the verified drafts, `new` the accepted drafts plus the next token."""
        committed = self._commit(new)
        self.result.steps.append(StepRecord(proposed, min(accepted, len(proposed)), len(committed)))
        return committed

    def _commit(self, tokens: list[int]) -> list[int]:
        committed, reason = truncate(tokens, self.stops, self.room)
        self.result.output_ids += committed
        if reason is not None:
            self.close(reason)
        return committed

    def close(self, reason: str = "interrupted") -> None:
        """End the timings; `reason` applies only if the run had not ended by itself (e.g. Ctrl-C)."""
        if self.done:
            return
        self.done = True
        self.result.stop_reason = reason
        end = time.perf_counter()
        if self._t1 is None:  # stopped during prefill
            self.result.prefill_seconds, self._t1 = end - self._t0, end
        self.result.decode_seconds = end - self._t1


class Generation:
    """One generation in progress: iterate for each step's committed tokens; `result` is filled as it goes."""

    def __init__(self, run: Run, steps: Iterator[list[int]]):
        self.run, self._steps = run, iter(steps)
        self._superseded = False

    @property
    def result(self) -> GenerationResult:
        return self.run.result

    def supersede(self) -> None:
        """Another generation takes the engine (its static buffers, the target's tap hooks): end this one
        now, and make resuming it an error instead of steps computed on the other one's state."""
        self._superseded = True
        try:
            self._steps.close()  # runs its cleanup: the eager loop's hooks come off the target
        except ValueError:
            pass  # it is running (its own callback started the new one): it stops before its next step

    def __iter__(self) -> Iterator[list[int]]:
        try:
            while True:
                if self._superseded:
                    raise ZooError(
                        "this generation was ended by a newer one on the same pipeline: a pipeline runs one "
                        "generation at a time",
                        hint="finish (or close) a stream before starting another, or load a second pipeline",
                    )
                try:
                    tokens = next(self._steps)
                except StopIteration:
                    return
                yield tokens
        finally:  # a consumer that stops early (Ctrl-C, a closed pipe) still gets consistent timings
            self.run.close()

    def drain(self, on_tokens: OnTokens | None = None) -> GenerationResult:
        """Run to the end, calling `on_tokens` with each step's committed tokens."""
        for tokens in self:
            if on_tokens is not None and tokens:
                on_tokens(tokens)
        return self.result


class Engine(ABC):
    """Speculative and autoregressive decoding of one (target, drafter) pair, for any number of prompts."""

    name: ClassVar[str]

    def start(
        self,
        prompt_ids: list[int],
        cfg: GenerationConfig,
        *,
        speculative: bool = True,
        accept_override: AcceptOverride | None = None,
        prefill_inputs: dict[str, Any] | None = None,
    ) -> Generation:
        """A generation to iterate; `speculative=False` is the target alone (the baseline)."""
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if not speculative:
            return self._autoregressive(list(prompt_ids), cfg)
        return self._speculative(list(prompt_ids), cfg, accept_override, prefill_inputs or {})

    @abstractmethod
    def _speculative(
        self,
        prompt_ids: list[int],
        cfg: GenerationConfig,
        accept_override: AcceptOverride | None,
        prefill_inputs: dict[str, Any],
    ) -> Generation: ...

    @abstractmethod
    def _autoregressive(self, prompt_ids: list[int], cfg: GenerationConfig) -> Generation: ...

    def speculative(
        self,
        prompt_ids: list[int],
        cfg: GenerationConfig,
        on_tokens: OnTokens | None = None,
        accept_override: AcceptOverride | None = None,
    ) -> GenerationResult:
        """DFlash decoding to the end; `on_tokens` receives each step's committed tokens."""
        return self.start(prompt_ids, cfg, accept_override=accept_override).drain(on_tokens)

    def autoregressive(
        self, prompt_ids: list[int], cfg: GenerationConfig, on_tokens: OnTokens | None = None
    ) -> GenerationResult:
        """The target alone, one token per forward, on the same engine (like-for-like speedups)."""
        return self.start(prompt_ids, cfg, speculative=False).drain(on_tokens)
