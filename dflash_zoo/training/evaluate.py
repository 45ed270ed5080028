"""Acceptance statistics of a target + drafter pair over a prompt set, through the real engine.

Each prompt runs through `Pipeline.generate` (speculative) and, unless disabled, `Pipeline.generate_autoregressive`
(the baseline for tokens/s and speedup). Prompts come from `data.prompt_ids`: text lines use a prefix of
`min(prompt_tokens, len // 2)` tokens; prompt/messages lines go through the chat template unless raw.

Reported: mean acceptance length (tau, bonus token included), the accepted-length histogram, per-position
acceptance (the fraction of steps whose draft slot i was accepted, over steps that proposed slot i), decode
tokens/s of both modes, the speedup, and for greedy decoding how many outputs equal the autoregressive ones.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash_zoo.engine.results import GenerationResult, first_difference

log = logging.getLogger("dflash_zoo")


@dataclass
class EvalResult:
    """Aggregate over all prompts; `to_dict` is the `eval --json` schema."""

    prompts: int
    block_size: int
    temperature: float
    generated_tokens: int
    steps: int
    mean_acceptance_length: float
    histogram: dict[int, int]
    per_position_acceptance: list[float]
    spec_tokens_per_second: float
    ar_tokens_per_second: float | None = None
    speedup: float | None = None
    outputs_match_autoregressive: int | None = None
    per_prompt_acceptance: list[float] = field(default_factory=list)
    # greedy with a baseline: per prompt, the index of the first output token unlike autoregressive (None: same)
    first_divergence: list[int | None] | None = None
    # DFlash 2: tau of the same drafter proposing each slot's own argmax / sample (its selector switched off)
    mean_acceptance_length_without_selector: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["histogram"] = {str(k): v for k, v in self.histogram.items()}
        return out


def per_position_acceptance(results: list[GenerationResult], block_size: int) -> list[float]:
    """[B-1]: for slot i (1-based), accepted steps / steps that proposed at least i drafts."""
    hits, seen = [0] * (block_size - 1), [0] * (block_size - 1)
    for res in results:
        for st in res.steps:
            for i in range(len(st.proposed)):
                seen[i] += 1
                hits[i] += st.accepted > i
    return [h / s if s else 0.0 for h, s in zip(hits, seen, strict=True)]


def _rate(results: list[GenerationResult]) -> float:
    """Decode tokens/s over all prompts (prefill excluded, as in `GenerationResult.tokens_per_second`)."""
    tokens = sum(max(len(r.output_ids) - 1, 0) for r in results)
    seconds = sum(r.decode_seconds for r in results)
    return tokens / seconds if seconds > 0 else 0.0


def evaluate(
    pipe: Any,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    block_size: int | None = None,
    baseline: bool = True,
    seed: int = 0,
    on_prompt: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """Run every prompt (token ids) speculatively and, with `baseline`, autoregressively.

    The longest prompt runs once first, both ways, so one-time costs (sizing the fast engine, CUDA-graph
    capture, `torch.compile`) land on no measured prompt.
    """
    kw = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "block_size": block_size,
        "seed": seed,
    }
    ar_kw = {k: v for k, v in kw.items() if k != "block_size"}
    longest = max(prompts, key=len)
    pipe.generate(longest, **kw)
    if baseline:
        pipe.generate_autoregressive(longest, **ar_kw)
    spec, ar = [], []
    for n, ids in enumerate(prompts, start=1):
        spec.append(pipe.generate(ids, **kw))
        if baseline:
            ar.append(pipe.generate_autoregressive(ids, **ar_kw))
        if on_prompt is not None:
            on_prompt(n, len(prompts))
    block = spec[0].block_size
    lengths = [a for r in spec for a in r.acceptance_lengths]
    res = EvalResult(
        prompts=len(prompts),
        block_size=block,
        temperature=temperature,
        generated_tokens=sum(len(r.output_ids) for r in spec),
        steps=len(lengths),
        mean_acceptance_length=sum(lengths) / len(lengths) if lengths else 0.0,
        histogram=dict(sorted(Counter(lengths).items())),
        per_position_acceptance=per_position_acceptance(spec, block),
        spec_tokens_per_second=_rate(spec),
        per_prompt_acceptance=[r.mean_acceptance_length for r in spec],
    )
    res.mean_acceptance_length_without_selector = _without_selector(pipe, prompts, kw)
    if baseline:
        res.ar_tokens_per_second = _rate(ar)
        res.speedup = (
            res.spec_tokens_per_second / res.ar_tokens_per_second if res.ar_tokens_per_second else None
        )
        if temperature == 0:
            res.first_divergence = [
                first_difference(s.output_ids, a.output_ids) for s, a in zip(spec, ar, strict=True)
            ]
            res.outputs_match_autoregressive = res.first_divergence.count(None)
    return res


def _without_selector(pipe: Any, prompts: list[list[int]], kw: dict) -> float | None:
    """For a drafter with a candidate selector (DFlash 2): the mean acceptance length of the same prompts with
    the selector off, so `eval` shows what the selector adds; None for other drafters."""
    if not pipe.drafter.has_selector:
        return None
    with pipe.drafter.selector_off():
        lengths = [a for ids in prompts for a in pipe.generate(ids, **kw).acceptance_lengths]
    return sum(lengths) / len(lengths) if lengths else 0.0


# how to fix a line of a prompt file that the target cannot hold (eval --data, bench --prompts)
LONG_LINE_HINT = "shorten or drop that line (text lines use their first --prompt-tokens tokens)"


def refuse_long_prompts(lengths: list[int], names: list[str], positions: int | None, hint: str) -> None:
    """Refuse, naming it, the first prompt that is empty or that the target cannot hold (`positions`:
    max_position_embeddings)."""
    from dflash_zoo.errors import InvalidArgumentError

    for n, name in zip(lengths, names, strict=True):
        if n == 0:
            raise InvalidArgumentError(
                f"{name}: the prompt is empty (0 tokens)", hint="give the line some text, or remove it"
            )
        if positions is not None and n >= positions:
            raise InvalidArgumentError(
                f"{name}: the prompt is {n:,} tokens; the target holds {positions:,} positions", hint=hint
            )


def load_prompts(
    path: str, tokenizer: Any, raw: bool, chat_kwargs: dict, prompt_tokens: int, limit: int | None,
    positions: int | None = None,
) -> list[list[int]]:  # fmt: skip
    """Prompt token ids for every record of a JSONL file (see `data.prompt_ids`); a prompt of `positions`
    tokens or more (the target's max_position_embeddings) is refused before any is run, naming its line."""
    from dflash_zoo.training.data import prompt_ids, read_jsonl

    if tokenizer is None:
        from dflash_zoo.training.data import DataError

        raise DataError("the target has no tokenizer; eval needs one to read text prompts")
    records = read_jsonl(path, limit)
    ids = [prompt_ids(r, tokenizer, raw, chat_kwargs, prompt_tokens) for r in records]
    refuse_long_prompts(
        [len(i) for i in ids], [f"{path}:{r.line}" for r in records], positions, LONG_LINE_HINT
    )
    return ids
