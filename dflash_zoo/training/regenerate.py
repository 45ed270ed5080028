"""Regeneration through an OpenAI-compatible server (`train --regenerate-endpoint URL`): vLLM or SGLang,
started by the user, writes the responses; the trainer only tokenises them.

Requests (stdlib `urllib`, `concurrency` threads, at most twice that many prompts in flight):
- `/v1/completions` with the prompt as token ids, exactly the ids the built-in path would feed the target
  (chat template applied here, `--raw` and text lines as they are);
- `/v1/chat/completions` (`api="chat"`) for prompt / messages lines without `--raw`: the server applies its
  chat template (with the adapter's `chat_template_kwargs`); the training prompt is still our templated ids.
Sampling is explicit (`temperature`, `top_p` 1; when sampling also `top_k` -1, `min_p` 0, `repetition_penalty`
1 and a per-prompt `seed`, extensions vLLM and SGLang both take) so a server's generation defaults (vLLM
reads the model's `generation_config.json`) do not leak in. A response becomes `prompt ids + response ids (+ the stop token when the
server stopped on one)`; a `token_ids` list in the choice (vLLM `return_token_ids`) is used as it is,
otherwise the text is tokenised.

Failures: HTTP 429 and 5xx, timeouts and dropped connections are retried `retries` times with exponential
backoff (a `Retry-After` header is honoured); any other HTTP error, or a malformed answer, stops the run with
an error naming the prompt's line. Progress survives any stop: each finished prompt is appended to
`<key>.partial.jsonl` (fsynced after every batch of completions) and a rerun sends only the others; a line
torn by a kill is dropped. When every prompt is done, the result is written to a temporary sibling of
`<key>.jsonl`, fsynced and renamed (the format of the built-in path's cache), and the partial file removed.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_zoo.training.data import Example, Record, prompt_ids
from dflash_zoo.training.regen_state import RegenerationError, load_partial, read_examples, write_examples

log = logging.getLogger("dflash_zoo")
APIS = ("completions", "chat")
MAX_BACKOFF = 60.0


class _Retryable(Exception):
    """A failure worth another try (429, 5xx, timeout, connection); `wait` from Retry-After when given."""

    def __init__(self, why: str, wait: float | None = None):
        super().__init__(why)
        self.wait = wait


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send requests."""

    url: str  # server root or its /v1 (a full .../completions URL is also accepted)
    model: str | None = None  # served model name; None: the only one `/v1/models` lists
    api: str = "completions"
    concurrency: int = 16
    retries: int = 6
    timeout: float = 600.0  # seconds per request
    backoff: float = 1.0  # first retry delay; doubled each retry, capped at MAX_BACKOFF

    def root(self) -> str:
        url = self.url.rstrip("/")
        for tail in ("/chat/completions", "/completions"):
            url = url.removesuffix(tail)
        return url.removesuffix("/v1")


@dataclass(frozen=True)
class Generation:
    """Prompt and sampling settings (as the built-in path's)."""

    raw: bool = False
    chat_kwargs: dict | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    prompt_tokens: int = 32
    seed: int = 0


@dataclass(frozen=True)
class _Job:
    index: int
    record: Record
    ids: list[int]  # the training prompt


def _post(url: str, body: dict, timeout: float) -> dict:
    """POST JSON, return the parsed answer; raises `_Retryable` for what a retry may fix."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")[:300]
        if exc.code == 429 or exc.code >= 500:
            raise _Retryable(f"HTTP {exc.code}", _retry_after(exc.headers.get("Retry-After"))) from exc
        raise _Rejected(f"HTTP {exc.code}: {text}") from exc
    except (TimeoutError, urllib.error.URLError, ConnectionError) as exc:
        raise _Retryable(f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}") from exc
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise _Malformed(f"not JSON ({raw[:80]!r})") from exc


class _Malformed(Exception):
    """The server answered, but not with a usable completion."""


class _Rejected(Exception):
    """The server refused the request (an HTTP error a retry cannot fix: 400, 404, ...)."""


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None


def _body(job: _Job, ep: Endpoint, model: str, gen: Generation, chat: bool) -> dict:
    body: dict[str, Any] = {"model": model, "max_tokens": gen.max_new_tokens, "temperature": gen.temperature,
                            "top_p": 1.0, "n": 1}  # fmt: skip
    if gen.temperature > 0:  # plain temperature sampling, as the built-in path: the server's defaults off
        body |= {"seed": gen.seed + job.index, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    if chat:
        rec = job.record
        body["messages"] = (
            rec.prompt if isinstance(rec.prompt, list) else [{"role": "user", "content": rec.prompt}]
        )
        if gen.chat_kwargs:
            body["chat_template_kwargs"] = gen.chat_kwargs
    else:
        body["prompt"] = job.ids
    return body


def _answer(payload: Any, chat: bool) -> tuple[str, list[int] | None, int | str | None]:
    """(text, token ids or None, stop) of the first choice; stop: the stop token id the server names, "eos"
    when it stopped without naming one, None when it ran out of tokens. `_Malformed` when absent."""
    try:
        choice = payload["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
    except (KeyError, IndexError, TypeError) as exc:
        field = "choices[0].message.content" if chat else "choices[0].text"
        raise _Malformed(f"no {field} in the answer") from exc
    ids = choice.get("token_ids")
    if not isinstance(text, str) or (ids is not None and not all(isinstance(t, int) for t in ids)):
        raise _Malformed("the completion is not a string (or its token_ids not integers)")
    if choice.get("finish_reason") != "stop":
        return text, ids, None
    reason = choice.get("stop_reason", choice.get("matched_stop"))  # vLLM / SGLang
    return text, ids, reason if isinstance(reason, int) else "eos" if reason is None else None


class Regenerator:
    """Sends the prompts of `records` to an endpoint and keeps the results crash-safe on disk."""

    def __init__(
        self, records: list[Record], tokenizer: Any, ep: Endpoint, gen: Generation, cache_file: Path
    ):
        self.records, self.tok, self.ep, self.gen = records, tokenizer, ep, gen
        self.final = cache_file
        self.partial = cache_file.with_name(cache_file.name.removesuffix(".jsonl") + ".partial.jsonl")

    def where(self, job: _Job) -> str:
        return f"the prompt on data line {job.record.line}"

    def run(self, on_item: Callable[[int, int], None] | None = None) -> list[Example]:
        """Every record regenerated (resuming what is done); the final file written last."""
        if self.final.is_file():
            return read_examples(self.final)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        done = load_partial(self.partial)
        todo = [i for i in range(len(self.records)) if i not in done]
        if done:
            log.info(
                "regeneration resumes: %d of %d prompts already done (%s)",
                len(done),
                len(self.records),
                self.partial,
            )
        if todo:
            self._send(todo, done, on_item)
        return self._finish(done)

    def _send(self, todo: list[int], done: dict[int, Example], on_item) -> None:
        model = self.ep.model or served_model(self.ep)
        with (
            open(self.partial, "a", encoding="utf-8") as out,
            ThreadPoolExecutor(self.ep.concurrency) as pool,
        ):
            pending: set[Future] = set()
            queue = iter(todo)
            try:
                while True:
                    for i in _take(queue, 2 * self.ep.concurrency - len(pending)):
                        pending.add(pool.submit(self._one, i, model))
                    if not pending:
                        break
                    finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                    if (error := self._record(finished, done, out)) is not None:
                        pool.shutdown(wait=True, cancel_futures=True)  # started requests finish ...
                        self._record({f for f in pending if not f.cancelled()}, done, out)  # ... and are kept
                        raise error
                    if on_item is not None:
                        on_item(len(done), len(self.records))
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise

    def _record(self, finished: set[Future], done: dict[int, Example], out) -> BaseException | None:
        """Append the successful results (one fsync for the batch); returns the first failure, if any."""
        error = None
        for fut in finished:
            if fut.exception() is not None:
                error = error or fut.exception()
                continue
            i, ex = fut.result()
            done[i] = ex
            out.write(json.dumps({"index": i, "ids": list(ex.ids), "start": ex.start}) + "\n")
        out.flush()
        os.fsync(out.fileno())
        return error

    def _one(self, i: int, model: str) -> tuple[int, Example]:
        rec = self.records[i]
        g = self.gen
        job = _Job(i, rec, prompt_ids(rec, self.tok, g.raw, g.chat_kwargs, g.prompt_tokens))
        chat = self.ep.api == "chat" and rec.text is None and not g.raw
        url = f"{self.ep.root()}/v1/{'chat/completions' if chat else 'completions'}"
        body = _body(job, self.ep, model, g, chat)
        try:
            text, ids, stop = _answer(self._with_retries(job, url, body), chat)
        except (_Malformed, _Rejected) as exc:
            what = "malformed answer from" if isinstance(exc, _Malformed) else "rejected by"
            raise RegenerationError(
                f"{self.where(job)}: {what} {url}: {exc}",
                hint=f"check the server; finished prompts are kept in {self.partial} and a rerun resumes",
            ) from exc
        return i, Example(tuple(job.ids + self._response_ids(text, ids, stop)), len(job.ids))

    def _response_ids(self, text: str, ids: list[int] | None, stop: int | str | None) -> list[int]:
        """The response's token ids, ending with the token the server stopped on (as the built-in path's)."""
        resp = list(ids) if ids is not None else self.tok.encode(text, add_special_tokens=False)
        end = stop if isinstance(stop, int) else self.tok.eos_token_id if stop == "eos" else None
        return resp + [end] if end is not None and (not resp or resp[-1] != end) else resp

    def _with_retries(self, job: _Job, url: str, body: dict) -> Any:
        for attempt in range(self.ep.retries + 1):
            try:
                return _post(url, body, self.ep.timeout)
            except _Retryable as exc:
                last = exc
                if attempt == self.ep.retries:
                    break
                delay = exc.wait if exc.wait is not None else self.ep.backoff * 2**attempt
                time.sleep(min(MAX_BACKOFF, delay) * (1 + 0.1 * random.random()))
        raise RegenerationError(
            f"{self.where(job)}: {url} failed {self.ep.retries + 1} times (last: {last})",
            hint=f"check the server (or raise --retries); finished prompts are kept in {self.partial} and a rerun resumes",
        )

    def _finish(self, done: dict[int, Example]) -> list[Example]:
        out = [done[i] for i in range(len(self.records)) if len(done[i].ids) - done[i].start >= 2]
        write_examples(self.final, out)
        self.partial.unlink(missing_ok=True)
        return out


def _take(it: Iterator[int], n: int) -> list[int]:
    out = []
    for _ in range(max(0, n)):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


def served_model(ep: Endpoint) -> str:
    """The single model `/v1/models` lists; an error asking for `--regenerate-model` otherwise."""
    url = f"{ep.root()}/v1/models"
    try:
        with urllib.request.urlopen(url, timeout=min(ep.timeout, 60)) as resp:
            models = [m["id"] for m in json.loads(resp.read())["data"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RegenerationError(
            f"cannot list the models of {url}: {exc}", hint="is the server up? pass --regenerate-model NAME"
        ) from exc
    if len(models) != 1:
        raise RegenerationError(
            f"{url} serves {len(models)} models ({', '.join(models[:5])})",
            hint="pass --regenerate-model NAME",
        )
    return models[0]
