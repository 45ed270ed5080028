"""Typed generation settings and results. Always the same result type, whatever the options."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from dflash_zoo.errors import InvalidArgumentError

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
        """Check ranges; raises `InvalidArgumentError` with a one-line message."""
        if self.max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise InvalidArgumentError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be >= 0, got {self.top_k}")
        block = self.block_size if self.block_size is not None else trained_block_size
        if block < 2:
            raise InvalidArgumentError(f"block_size must be >= 2, got {block}")
        if block > trained_block_size:
            raise InvalidArgumentError(
                f"block_size {block} exceeds the drafter's trained block size {trained_block_size}",
                hint="a drafter can run smaller blocks than it was trained with, not larger",
            )
        return GenerationConfig(**{**asdict(self), "block_size": block})

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
