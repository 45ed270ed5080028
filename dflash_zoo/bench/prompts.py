"""Prompt sets for `bench`: the demo pair's held-out stdlib files or a JSONL file, and a whole set's result.

The demo target was trained on Python 3.12.3's standard library minus the files whose sha1(relative path) is
0 mod 20 (`HELD_OUT`, dflash_zoo/demo/PROVENANCE.md). Those files ship with every Python, so `bench` on the
demo pair measures on them by default: one chunk per file at an offset drawn from `random.Random(2)`, the same
draw as `scripts/build_demo_pair.py` (on Python 3.12.3 the chunks equal docs/records/demo-held-out.jsonl, the
prompts of the README's numbers). A JSONL file (`--prompts`) has `eval --data`'s line formats
(`dflash_zoo.training.data`): text lines use a prefix of `min(prompt_tokens, len // 2)` tokens, prompt /
messages lines go through the chat template unless raw.

A repeat of a prompt set decodes every prompt once; `SetResult` sums them as eval does (decode tokens after
the first of each prompt over summed decode time), so one repeat is one tok/s figure.
"""

from __future__ import annotations

import random
import statistics
import sysconfig
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_zoo.engine.results import GenerationResult, StepRecord
from dflash_zoo.errors import NotFoundError

# files held out of the demo target's training (PROVENANCE.md); removed modules (crypt, uu, xdrlib in 3.13)
# and a Python installed without its test package simply give fewer prompts
HELD_OUT: tuple[str, ...] = (
    "asyncio/threads.py", "base64.py", "copy.py", "crypt.py", "difflib.py", "email/_encoded_words.py",
    "encodings/cp1026.py", "encodings/cp857.py", "encodings/cp875.py", "encodings/cp932.py",
    "encodings/gb2312.py", "encodings/koi8_t.py", "encodings/shift_jis_2004.py", "enum.py", "gzip.py",
    "imaplib.py", "locale.py", "multiprocessing/connection.py", "multiprocessing/util.py", "site.py",
    "sre_parse.py", "test/libregrtest/cmdline.py", "test/libregrtest/worker.py",
    "test/support/warnings_helper.py", "test/typinganndata/ann_module8.py", "uu.py", "xdrlib.py",
    "xml/dom/pulldom.py",
)  # fmt: skip
MIN_CHARS, CHUNK_CHARS = 600, 3000  # build_demo_pair.py: files of <= 600 characters give no chunk
PROMPT_TOKENS, NEW_TOKENS = 32, 256  # a prompt set's defaults: those of `eval` (and of the README's numbers)
WIDE_SPREAD = 1.25  # max / min tok/s over repeats above this: the numbers are not to be trusted


@dataclass(frozen=True)
class PromptSet:
    """Records to tokenise (`training.data.Record`) and a description for the bench record."""

    name: str
    records: tuple[Any, ...]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def held_out_stdlib(root: Path | None = None, limit: int | None = None) -> PromptSet:
    """One text record per held-out stdlib file present under `root` (default: this Python's stdlib)."""
    from dflash_zoo.training.data import Record

    root = root or stdlib_root()
    rng, records = random.Random(2), []
    for rel in HELD_OUT:
        path = root / rel
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) > MIN_CHARS:
            start = rng.randrange(len(text) - MIN_CHARS)
            records.append(Record(len(records) + 1, text=text[start : start + CHUNK_CHARS]))
    if not records:
        raise NotFoundError(
            f"none of the demo pair's held-out standard-library files is under {root}",
            hint="pass a prompt file: dflash-zoo bench --prompts FILE.jsonl",
        )
    records = records[:limit] if limit else records
    return PromptSet(f"held-out stdlib files ({len(records)}, {root})", tuple(records))


def from_jsonl(path: str | Path, limit: int | None = None) -> PromptSet:
    """A JSONL prompt file with `eval --data`'s line formats (raises `DataError` naming a bad line)."""
    from dflash_zoo.training.data import read_jsonl

    return PromptSet(str(path), tuple(read_jsonl(path, limit, option="--prompts")))


def token_ids(
    ps: PromptSet, tokenizer: Any, prompt_tokens: int, raw: bool = False, chat: dict | None = None
) -> list[list[int]]:
    """Prompt token ids of every record (`data.prompt_ids`); a target without a tokenizer cannot read text."""
    from dflash_zoo.training.data import DataError, prompt_ids

    if tokenizer is None:
        raise DataError("the target has no tokenizer; bench needs one to read a prompt set")
    return [prompt_ids(r, tokenizer, raw, chat, prompt_tokens) for r in ps.records]


def past_positions(longest: int, new_tokens: int, positions: int | None) -> str | None:
    """A warning when the longest prompt plus `new_tokens` runs past the target's positions, else None."""
    if positions is None or longest + new_tokens <= positions:
        return None
    return (
        f"warning: the longest prompt ({longest:,} tokens) plus {new_tokens:,} new tokens runs past the "
        f"target's {positions:,} positions, where its output is not to be trusted; "
        f"--max-new-tokens {positions - longest} stays inside them"
    )


def check_positions(
    prompt: list[int], prompts: list[list[int]], ps: PromptSet | None, new_tokens: int, positions: int | None
) -> str | None:
    """Refuse a prompt of the bench (one fixed `prompt`, or `prompts` read from `ps`) the target cannot hold;
    a warning when the longest plus `new_tokens` runs past its positions (None when all fit)."""
    from dflash_zoo.training.evaluate import LONG_LINE_HINT, refuse_long_prompts

    if ps is None:
        refuse_long_prompts([len(prompt)], ["the fixed bench prompt"], positions, "lower --prompt-tokens")
    else:
        names = [f"{ps.name}:{r.line}" for r in ps.records]
        refuse_long_prompts([len(p) for p in prompts], names, positions, LONG_LINE_HINT)
    return past_positions(len(prompt), new_tokens, positions)


@dataclass(frozen=True)
class SetResult:
    """One repeat over a prompt set, with the fields of `GenerationResult` that `bench` reads."""

    results: tuple[GenerationResult, ...]

    @property
    def output_ids(self) -> list[int]:
        return [t for r in self.results for t in r.output_ids]

    @property
    def steps(self) -> list[StepRecord]:
        return [s for r in self.results for s in r.steps]

    @property
    def mean_acceptance_length(self) -> float:
        steps = self.steps
        return sum(s.acceptance_length for s in steps) / len(steps) if steps else 0.0

    @property
    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(s.acceptance_length for s in self.steps).items()))

    @property
    def tokens_per_second(self) -> float:
        tokens = sum(max(len(r.output_ids) - 1, 0) for r in self.results)
        seconds = sum(r.decode_seconds for r in self.results)
        return tokens / seconds if seconds > 0 else 0.0

    @property
    def prefill_seconds(self) -> float:
        """Time to first token of one prompt (the mean over the set)."""
        return statistics.fmean(r.prefill_seconds for r in self.results)


def over_set(
    fn: Callable[[list[int]], GenerationResult], prompts: list[list[int]]
) -> Callable[[], SetResult]:
    """A repeat of `fn(prompt)` over every prompt, as one `SetResult`."""
    return lambda: SetResult(tuple(fn(p) for p in prompts))


@dataclass(frozen=True)
class Spread:
    """tok/s over the repeats of one measurement."""

    low: float
    median: float
    high: float

    @property
    def wide(self) -> bool:
        return self.low <= 0 or self.high / self.low > WIDE_SPREAD


def spread(runs: list[float]) -> Spread:
    return Spread(min(runs), statistics.median(runs), max(runs))
