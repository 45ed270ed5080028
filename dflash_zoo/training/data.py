"""Training / evaluation data: JSONL records, tokenisation with loss spans, target regeneration.

Line formats (one JSON object per line; blank lines are skipped):
- `{"text": "..."}`: raw text; every token is supervised. As a *prompt* (eval, `--regenerate`) the first
  `min(prompt_tokens, len // 2)` tokens are used and the rest is the reference continuation.
- `{"prompt": "...", "response": "..."}` (`response` optional): the prompt goes through the chat template
  (raw with `--raw` or when the tokenizer has none); only response tokens are supervised.
- `{"messages": [{"role": ..., "content": ...}, ...]}`: a trailing assistant message is the response; the
  messages before it are the prompt (earlier assistant turns are context, never supervised).

A malformed line raises `DataError` naming the file and line number.

`regenerate` replaces responses with the target's own (greedy or sampled, batched with left padding), the
DFlash recipe (paper §4.2: the drafter learns the target's distribution). Results are cached on disk under
`$DFLASH_ZOO_HOME/regen` (default `~/.cache/dflash-zoo/regen`), keyed by a hash of target, data and settings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_zoo.errors import ZooError

log = logging.getLogger("dflash_zoo")


class DataError(ZooError):
    """A data file is missing or a line is malformed."""

    exit_code = 2


@dataclass(frozen=True)
class Record:
    """One data line: `prompt` is a string, a message list, or None (text lines); `text` only for text lines."""

    line: int
    text: str | None = None
    prompt: str | list[dict] | None = None
    response: str | None = None


@dataclass(frozen=True)
class Example:
    """Token ids of one training sequence; positions >= `start` are supervised."""

    ids: tuple[int, ...]
    start: int


def read_jsonl(path: str | os.PathLike, limit: int | None = None, option: str = "--data") -> list[Record]:
    """Parse a JSONL data file; raises `DataError` naming the file and the first bad line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"no such data file: {path}", hint=f"check the {option} path")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read data file {path}: {exc.strerror or exc}") from exc
    records: list[Record] = []
    # split bytes, not text: str.splitlines would also break lines at U+2028 etc. inside JSON strings
    for n, raw in enumerate(data.split(b"\n"), start=1):
        line = _decode(raw, n, path)
        if not line.strip():
            continue
        records.append(_parse(line, n, path))
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise DataError(f"{path} holds no records", hint="one JSON object per line: text, prompt or messages")
    return records


def _decode(raw: bytes, n: int, path: Path) -> str:
    try:
        return raw.decode("utf-8-sig" if n == 1 else "utf-8")  # a leading byte-order mark is tolerated
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}:{n}: not valid UTF-8 (byte {exc.start + 1} of the line)",
            hint="convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8",
        ) from exc


_LINE_HINT = (
    'fix that line: one JSON object per line, {"text": ...}, {"prompt": ..., "response": ...} or '
    '{"messages": [{"role": ..., "content": ...}]}'
)


def _parse(line: str, n: int, path: Path) -> Record:
    where = f"{path}:{n}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not valid JSON ({exc.msg})", hint=_LINE_HINT) from exc
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with text, prompt or messages", hint=_LINE_HINT)
    if isinstance(obj.get("text"), str):
        return Record(n, text=obj["text"])
    if isinstance(obj.get("prompt"), str):
        resp = obj.get("response")
        if resp is not None and not isinstance(resp, str):
            raise DataError(f"{where}: response must be a string", hint=_LINE_HINT)
        return Record(n, prompt=obj["prompt"], response=resp)
    msgs = obj.get("messages")
    if isinstance(msgs, list) and msgs and all(_is_message(m) for m in msgs):
        if msgs[-1]["role"] == "assistant":
            return Record(
                n, prompt=msgs[:-1] or [{"role": "user", "content": ""}], response=msgs[-1]["content"]
            )
        return Record(n, prompt=msgs)
    raise DataError(
        f"{where}: expected a string 'text', a string 'prompt' or a non-empty 'messages' list of {{role, content}}",
        hint=_LINE_HINT,
    )


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def prompt_ids(
    rec: Record, tokenizer: Any, raw: bool = False, chat_kwargs: dict | None = None, prompt_tokens: int = 32
) -> list[int]:
    """Token ids of a record's prompt (text lines: a prefix of `min(prompt_tokens, len // 2)` tokens)."""
    if rec.text is not None:
        ids = tokenizer.encode(rec.text, add_special_tokens=False)
        return ids[: max(1, min(prompt_tokens, len(ids) // 2))]
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(rec.prompt, str) and (raw or not template):
        return tokenizer.encode(rec.prompt, add_special_tokens=False)
    msgs = rec.prompt if isinstance(rec.prompt, list) else [{"role": "user", "content": rec.prompt}]
    if raw or not template:  # a message list without a template: plain concatenation of the contents
        return tokenizer.encode("\n".join(m["content"] for m in msgs), add_special_tokens=False)
    text = tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, **(chat_kwargs or {})
    )
    return tokenizer.encode(text, add_special_tokens=False)


NO_RESPONSE, CUT = "no response", "cut"  # why a record gives no example (`to_example`)


def to_example(
    rec: Record, tokenizer: Any, raw: bool, max_length: int, chat_kwargs: dict | None = None
) -> Example | str:
    """Tokenise a record for training; when it has nothing to supervise, why: `NO_RESPONSE` (none, or under
    two tokens) or `CUT` (`max_length` cut its response to fewer than two tokens)."""
    if rec.text is not None:
        ids = tokenizer.encode(rec.text, add_special_tokens=False)[:max_length]
        return Example(tuple(ids), 0) if len(ids) >= 2 else NO_RESPONSE
    if rec.response is None:
        return NO_RESPONSE
    prompt = prompt_ids(rec, tokenizer, raw, chat_kwargs)
    resp = tokenizer.encode(rec.response, add_special_tokens=False)
    if tokenizer.eos_token_id is not None:
        resp = resp + [tokenizer.eos_token_id]
    if len(resp) < 2:
        return NO_RESPONSE
    ids = (prompt + resp)[:max_length]
    return Example(tuple(ids), len(prompt)) if len(ids) - len(prompt) >= 2 else CUT


def tokenize_records(
    records: list[Record], tokenizer: Any, raw: bool, max_length: int, chat_kwargs: dict | None = None
) -> list[Example]:
    """All usable examples; records without a response (and no --regenerate), or whose response
    `max_length` cut away, are skipped with a warning saying which."""
    made = [to_example(rec, tokenizer, raw, max_length, chat_kwargs) for rec in records]
    out = [ex for ex in made if isinstance(ex, Example)]
    empty, cut = made.count(NO_RESPONSE), made.count(CUT)
    if empty:
        log.warning("skipped %d record(s) with nothing to supervise (no response? use --regenerate)", empty)
    if cut:
        log.warning("skipped %d record(s) whose response --max-length %d cut away (raise --max-length, or "
                    "shorten their prompts)", cut, max_length)  # fmt: skip
    if not out:
        hint = "prompt-only data needs --regenerate" if empty else "raise --max-length"
        raise DataError("no usable training examples", hint=hint)
    return out


def cut_regenerated(exs: list[Example], prompts: int, max_length: int) -> list[Example]:
    """Regenerated examples cut to `max_length` tokens, those left with fewer than two supervised tokens
    dropped; `prompts`: how many were sent (`regenerate` drops responses under two tokens). None usable
    is a `DataError` saying why."""
    out = [Example(e.ids[:max_length], e.start) for e in exs if min(len(e.ids), max_length) - e.start >= 2]
    short, cut = prompts - len(exs), len(exs) - len(out)
    why = [f"{short} response(s) under 2 tokens (raise --max-new-tokens)"] if short else []
    why += [f"{cut} prompt(s) at or past --max-length {max_length} (raise --max-length)"] if cut else []
    if why and out:
        log.warning("skipped %d of %d regenerated example(s): %s", short + cut, prompts, "; ".join(why))
    if not out:
        raise DataError(
            f"no usable training examples: {'; '.join(why) or 'no prompt'}",
            hint="a regenerated example needs its prompt and at least 2 response tokens within --max-length",
        )
    return out


def template_settings(tokenizer: Any, raw: bool, chat_kwargs: dict) -> dict:
    """What renders the prompts besides the data, for the regeneration key: the chat template text as the
    tokenizer holds it (transformers 5 saves it as chat_template.jinja, which `regen_key` does not hash)
    and the adapter's template switches."""
    template = None if raw else getattr(tokenizer, "chat_template", None)
    return {"chat_template": template, "chat": chat_kwargs}


def regen_key(target_id: str, data_path: str | os.PathLike, settings: dict) -> str:
    """Cache key: target identity (config + weight file sizes), data bytes and generation settings."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    h.update(Path(data_path).read_bytes())
    tdir = Path(target_id)
    if tdir.is_dir():
        for f in sorted(tdir.glob("*.json")) + sorted(tdir.glob("*.safetensors")):
            h.update(
                f.name.encode() + (f.read_bytes() if f.suffix == ".json" else str(f.stat().st_size).encode())
            )
    else:
        h.update(str(target_id).encode())
    return h.hexdigest()[:24]


def _stop_ids(model: Any, tokenizer: Any) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))


def _generate_batch(
    model: Any, prompts: list[list[int]], pad: int, stops: list[int], gen: dict
) -> list[list[int]]:
    """Left-padded batched `generate`; each response is cut after its first stop token."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)  # [B, P]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(
        input_ids=ids, attention_mask=mask, pad_token_id=pad, eos_token_id=stops or None, **gen
    )
    responses = []
    for row in out[:, width:].tolist():  # [B, N] new tokens
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        responses.append(row[:cut])
    return responses


def regenerate(
    records: list[Record],
    model: Any,
    tokenizer: Any,
    *,
    raw: bool = False,
    chat_kwargs: dict | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    batch_size: int = 16,
    prompt_tokens: int = 32,
    seed: int = 0,
    cache_file: Path | None = None,
    on_batch: Any = None,
) -> list[Example]:
    """Examples whose responses the target wrote itself; read from / written to `cache_file` when given.

    `on_batch(done, total)` reports progress. Prompts are batched by length to limit padding.
    """
    if cache_file is not None and cache_file.is_file():
        log.info("regenerated data from cache %s", cache_file)
        rows = [json.loads(line) for line in cache_file.read_text().splitlines() if line]
        return [Example(tuple(r["ids"]), r["start"]) for r in rows]
    import torch

    prompts = [prompt_ids(r, tokenizer, raw, chat_kwargs, prompt_tokens) for r in records]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    gen: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0}
    if temperature > 0:
        gen.update(temperature=temperature, top_k=None, top_p=None)
    torch.manual_seed(seed)
    stops, examples = _stop_ids(model, tokenizer), {}
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            idx = order[b : b + batch_size]
            for i, resp in zip(
                idx, _generate_batch(model, [prompts[i] for i in idx], pad, stops, gen), strict=True
            ):
                examples[i] = Example(tuple(prompts[i] + resp), len(prompts[i]))
            if on_batch is not None:
                on_batch(min(b + batch_size, len(order)), len(order))
    out = [examples[i] for i in range(len(prompts)) if len(examples[i].ids) - examples[i].start >= 2]
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps({"ids": list(e.ids), "start": e.start}) + "\n" for e in out))
        tmp.replace(cache_file)
    return out
