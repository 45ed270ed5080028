"""Typed generation settings and results. Always the same result type, whatever the options."""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dflash_zoo.errors import InvalidArgumentError

log = logging.getLogger("dflash_zoo")

# the smallest sampling temperature and top_p: below, fp32 logits / temperature overflow, top_p rounds to 0
MIN_SAMPLING = 1e-6
GREEDY_RULE = "greedy-match"
SAMPLING_RULE = "speculative-sampling (p/q rejection, Leviathan et al. 2023)"


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding options. `temperature == 0` is greedy (lossless: equals the target's greedy output).

    `block_size` overrides the drafter's trained block size (smaller only: "train large, run small").
    `top_k = 0` and `top_p = 1.0` disable those filters.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    block_size: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def validated(self, trained_block_size: int) -> GenerationConfig:
        """Check types and ranges; raises `InvalidArgumentError` with a one-line message."""
        self._check_types()
        if self.max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature):  # NaN passes the range check below
            raise InvalidArgumentError(
                f"temperature must be a finite number >= 0, got {self.temperature}",
                hint="0 is greedy; sampling temperatures are usually 0.6 to 1.0",
            )
        if self.temperature < 0:
            raise InvalidArgumentError(f"temperature must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_SAMPLING:  # logits / temperature would overflow fp32
            raise InvalidArgumentError(
                f"temperature {self.temperature} is too small to sample with (>= {MIN_SAMPLING})",
                hint="use 0 for greedy decoding, which such a temperature approximates",
            )
        if not MIN_SAMPLING <= self.top_p <= 1:  # a top_p that rounds to 0 in fp32 would keep no token
            raise InvalidArgumentError(f"top_p must be in [{MIN_SAMPLING}, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # what torch.Generator takes
            raise InvalidArgumentError(f"seed must be an integer in [-2**63, 2**64), got {self.seed}")
        block = self.block_size if self.block_size is not None else trained_block_size
        if block < 2:
            raise InvalidArgumentError(f"block_size must be >= 2, got {block}")
        if block > trained_block_size:
            raise InvalidArgumentError(
                f"block_size {block} exceeds the drafter's trained block size {trained_block_size}",
                hint="a drafter can run smaller blocks than it was trained with, not larger",
            )
        return GenerationConfig(**{**asdict(self), "block_size": block})

    def _check_types(self) -> None:
        """Python API values of the wrong type get a message naming the field, not a TypeError deep inside."""
        ints = {"max_new_tokens": self.max_new_tokens, "top_k": self.top_k, "block_size": self.block_size,
                "seed": self.seed}  # fmt: skip
        for name, value in ints.items():
            if (value is not None or name in ("max_new_tokens", "top_k")) and (
                isinstance(value, bool) or not isinstance(value, int)
            ):
                raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
        for name, value in {"temperature": self.temperature, "top_p": self.top_p}.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
        stops = self.stop_token_ids
        if not isinstance(stops, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in stops
        ):
            raise InvalidArgumentError(
                f"stop_token_ids must be token ids (integers), got {self.stop_token_ids!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class StepRecord:
    """One draft-and-verify step.

    proposed: the `block_size - 1` draft tokens. accepted: how many of them matched / were accepted.
    acceptance_length: tokens committed this step including the bonus token (after stop truncation).
    """

    proposed: list[int]
    accepted: int
    acceptance_length: int


@dataclass
class GenerationResult:
    """What `generate` returns, for speculative and plain autoregressive decoding alike."""

    output_ids: list[int]
    text: str
    prompt_tokens: int
    steps: list[StepRecord] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = "max_new_tokens"
    acceptance_rule: str = GREEDY_RULE
    block_size: int = 0

    @property
    def acceptance_lengths(self) -> list[int]:
        return [s.acceptance_length for s in self.steps]

    @property
    def mean_acceptance_length(self) -> float:
        """tau: mean tokens committed per verify step (bonus included)."""
        return sum(self.acceptance_lengths) / len(self.steps) if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: tokens after the first (prefill makes the first) over decode time."""
        n = max(len(self.output_ids) - 1, 0)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def histogram(self) -> dict[int, int]:
        """acceptance length -> number of steps."""
        return dict(sorted(Counter(self.acceptance_lengths).items()))

    def to_dict(self) -> dict:
        """The JSON schema of `generate --json` (stable keys)."""
        return {
            "output_ids": self.output_ids,
            "text": self.text,
            "prompt_tokens": self.prompt_tokens,
            "acceptance_lengths": self.acceptance_lengths,
            "steps": [
                {"proposed": s.proposed, "accepted": s.accepted, "acceptance_length": s.acceptance_length}
                for s in self.steps
            ],
            "mean_acceptance_length": self.mean_acceptance_length,
            "histogram": {str(k): v for k, v in self.histogram.items()},
            "tokens_per_second": self.tokens_per_second,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "stop_reason": self.stop_reason,
            "acceptance_rule": self.acceptance_rule,
            "block_size": self.block_size,
        }


def fit_to_positions(
    cfg: GenerationConfig, prompt_tokens: int, max_positions: int | None
) -> GenerationConfig:
    """Refuse a prompt the target cannot hold, and cap `max_new_tokens` to the positions left after it.

    `max_positions` is the target's `max_position_embeddings` (None: unknown, nothing capped). A prompt that
    fits but leaves fewer than `max_new_tokens` positions runs with the cap and a warning: past its trained
    positions a target still computes (rope extrapolates) but its output is not to be trusted.
    """
    if prompt_tokens < 1:
        raise InvalidArgumentError(
            "the prompt is empty (0 tokens)", hint="give some text; with --raw nothing is added to the prompt"
        )
    if max_positions is None:
        return cfg
    if prompt_tokens >= max_positions:
        raise InvalidArgumentError(
            f"the prompt is {prompt_tokens:,} tokens; the target holds {max_positions:,} positions",
            hint="shorten the prompt (in chat, /clear forgets the conversation)",
        )
    room = max_positions - prompt_tokens
    if cfg.max_new_tokens <= room:
        return cfg
    log.warning(
        "max_new_tokens %d capped to %d: the prompt's %d tokens leave %d of the target's %d positions",
        cfg.max_new_tokens, room, prompt_tokens, room, max_positions,
    )  # fmt: skip
    return replace(cfg, max_new_tokens=room)


def target_positions(config: Any) -> int | None:
    """`max_position_embeddings` of a transformers config (its text config for a VLM), None when absent."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (a length difference counts); None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
