"""`Pipeline`: a loaded target + drafter pair, whose every entry point runs through one engine interface.

`generate`, `stream`, `chat`, `generate_autoregressive` and `generation` encode the prompt, take the engine that
`engine/factory.py` chooses and builds (`last_choice` says which and why; a built engine is reused while it
fits) and run it; the CLI, `eval` and the Python API all go through here. Build one with `dflash_zoo.load(...)`
(`loading.py`). A generation's config is checked once, by the engine that runs it.
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_zoo.adapters import get_adapter
from dflash_zoo.engine.drafter import DFlashDrafter
from dflash_zoo.engine.factory import build_engine
from dflash_zoo.engine.results import GenerationConfig, GenerationResult, fit_to_positions, target_positions
from dflash_zoo.engine.run import AcceptOverride, Engine, Generation
from dflash_zoo.engine.select import EngineChoice, EngineOptions, choose_engine
from dflash_zoo.errors import ConfigError, InvalidArgumentError
from dflash_zoo.sources import TARGET_FILES, resolve_dir

log = logging.getLogger("dflash_zoo")


class TextStream:
    """Incremental detokenisation: feed committed ids, get the new text; a trailing incomplete character is held
    back until its next bytes come, or until `flush` at the end (the pieces then add up to the whole text)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.ids, self.text, self.sent = tokenizer, [], "", 0

    def push(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        self.ids += ids
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self._take(len(self.text.rstrip("\ufffd")))  # U+FFFD at the end: bytes of a character to come

    def flush(self) -> str:
        """What is held back: the generation ended inside a character (decoded as U+FFFD, as `text` has it)."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        new = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return new


@dataclass
class Pipeline:
    """A loaded target + drafter pair. Build with `load(...)`."""

    model: Any
    drafter: DFlashDrafter
    tokenizer: Any = None
    stop_token_ids: tuple[int, ...] = ()
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    mask_token_id: int = 0
    adapter: Any = None
    options: EngineOptions = EngineOptions()  # which engine runs (`engine/select.py`), compiled or not
    placement: Any = None  # a `placement.Placement` when the target is split across devices (eager engine)
    processor_source: str | None = None  # where AutoProcessor loads from, for image prompts
    last_choice: EngineChoice | None = None  # the engine the last generation ran on, and why
    _engines: dict[str, Engine] = field(default_factory=dict, repr=False)
    _current: Any = field(default=None, repr=False)  # a weakref to the latest generation: one runs at a time

    def __post_init__(self) -> None:
        if self.adapter is None:
            self.adapter = get_adapter(self.model.config.model_type)(self.model)

    @property
    def device(self) -> torch.device:
        return next(self.drafter.parameters()).device

    def encode(self, prompt: str | list[int] | list[dict], raw: bool = False) -> list[int]:
        """Token ids for a prompt: ids as given; text raw or through the chat template; or a message list."""
        if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return self._checked_ids(list(prompt))
        if not isinstance(prompt, str) and not (
            isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)
        ):
            raise InvalidArgumentError(
                f"a prompt is text, token ids or a list of chat messages, got {type(prompt).__name__}",
                hint='e.g. "Explain KV caches", [9707, 11], or [{"role": "user", "content": "Hi"}]',
            )
        if self.tokenizer is None:
            raise ConfigError("this target has no tokenizer; pass token ids instead of text")
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(prompt, str) and (raw or not template):
            return self.tokenizer.encode(prompt)
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self.chat_template_kwargs
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _checked_ids(self, ids: list[int]) -> list[int]:
        """Token ids inside the target's embedding table (an id past it would fail deep in the forward)."""
        if not ids:
            raise InvalidArgumentError("the prompt is empty (0 tokens)", hint="give some text or token ids")
        vocab = self.model.get_input_embeddings().weight.shape[0]
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidArgumentError(
                f"token ids {bad[:5]} are outside the target's vocabulary [0, {vocab})"
            )
        return ids

    def config(self, **kw: Any) -> GenerationConfig:
        """A `GenerationConfig` (checked by the engine that runs it); `stop_token_ids=None` means the pair's
        defaults, `[]` none at all."""
        stops = kw.pop("stop_token_ids", None)
        if stops is None:
            stops = self.stop_token_ids
        elif isinstance(stops, int):  # one id
            stops = (stops,)
        elif isinstance(stops, Iterable):  # GenerationConfig names a value of any other type
            stops = tuple(stops)
        return GenerationConfig(stop_token_ids=stops, **kw)

    def engine(self, cfg: GenerationConfig, prompt_tokens: int, images: bool = False) -> Engine:
        """The engine for one generation (`engine/factory.py` chooses and builds it; `last_choice` says which
        and why), reused while it fits the generation and the options."""
        choice = choose_engine(
            self.adapter, self.device, self.options, drafter=self.drafter, split=self.placement is not None,
            prefill_inputs=images,
        )  # fmt: skip
        if not choice.fast and self.options.fast:
            log.warning("%s; using the eager engine", choice.reason)
        if choice != self.last_choice:
            log.info("engine: %s (%s)", choice.name, choice.reason)
        self.last_choice = choice
        block = cfg.block_size or self.drafter.cfg.block_size
        key = f"fast-b{block}" if choice.fast else "eager"
        need = prompt_tokens + cfg.max_new_tokens
        eng = self._engines.get(key)
        stale = (
            choice.fast
            and eng is not None
            and (eng.max_len < need or eng.options != self.options.fast_options)
        )
        if eng is None or stale:
            if choice.fast:  # one static engine at a time: an engine is a reference cycle (its step table)
                for old in [k for k in self._engines if k.startswith("fast")]:
                    del self._engines[old]
                gc.collect()  # free its buffers now
            eng, _ = build_engine(
                self.adapter, self.drafter, self.mask_token_id, self.options, max(need, 2048), block_size=block,
                choice=choice,
            )  # fmt: skip
            self._engines[key] = eng
        return eng

    def generation(
        self,
        prompt: Any,
        raw: bool = False,
        images: list[str] | None = None,
        speculative: bool = True,
        accept_override: AcceptOverride | None = None,
        **kw: Any,
    ) -> Generation:
        """One generation to iterate (each item: the tokens one step committed); `images` (file paths) go to a
        VLM target's prefill only. `kw` are `GenerationConfig` fields (max_new_tokens, temperature, ...)."""
        cfg = self.config(**kw)
        cfg.validated(self.drafter.cfg.block_size)  # every path, the target-alone one too: one line, early
        ids, prefill = (self.encode(prompt, raw), None) if not images else self._image_inputs(prompt, images)
        cfg = fit_to_positions(cfg, len(ids), target_positions(self.model.config))  # refuse / cap, one line
        previous = self._current() if self._current is not None else None
        if previous is not None:  # an unfinished stream: it shares the engine's state, so it ends here
            previous.supersede()
        engine = self.engine(cfg, len(ids), images=bool(images))
        gen = engine.start(
            ids, cfg, speculative=speculative, accept_override=accept_override, prefill_inputs=prefill
        )
        self._current = weakref.ref(gen)
        return gen

    def _image_inputs(self, prompt: Any, images: list[str]) -> tuple[list[int], dict[str, Any]]:
        from dflash_zoo.engine.vision import image_prompt_inputs, require_image_support

        require_image_support(self.adapter)
        if not isinstance(prompt, str) or self.processor_source is None:
            raise ConfigError(
                "image prompts need a text prompt and a target loaded from a directory or Hub id"
            )
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(resolve_dir(self.processor_source, None, TARGET_FILES))
        return image_prompt_inputs(processor, prompt, images, self.chat_template_kwargs)

    def generate(
        self, prompt: Any, raw: bool = False, on_text: Callable[[str], None] | None = None, **kw: Any
    ) -> GenerationResult:
        """Speculative generation; `on_text` receives the text as each step commits it (streaming)."""
        return self._finish(self.generation(prompt, raw, **kw), on_text)

    def chat(
        self, messages: list[dict], on_text: Callable[[str], None] | None = None, **kw: Any
    ) -> GenerationResult:
        """The assistant's next turn for `messages` ([{"role": ..., "content": ...}]), through the chat template."""
        return self.generate(messages, on_text=on_text, **kw)

    def stream(self, prompt: Any, raw: bool = False, **kw: Any) -> Iterator[str]:
        """Yield text as tokens are committed."""
        stream = TextStream(self.tokenizer)
        for ids in self.generation(prompt, raw, **kw):
            text = stream.push(ids)
            if text:
                yield text
        if rest := stream.flush():
            yield rest

    def generate_autoregressive(
        self, prompt: Any, raw: bool = False, on_text: Callable[[str], None] | None = None, **kw: Any
    ) -> GenerationResult:
        """The target alone, one token per forward (the baseline for speedups).

        Runs on the engine `generate` would take, so a speedup compares DFlash with autoregressive decoding on
        equal footing.
        """
        return self._finish(self.generation(prompt, raw, speculative=False, **kw), on_text)

    def _finish(self, gen: Generation, on_text: Callable[[str], None] | None) -> GenerationResult:
        stream = TextStream(self.tokenizer)
        for ids in gen:
            text = stream.push(ids) if on_text is not None else ""
            if text:
                on_text(text)
        if on_text is not None and (rest := stream.flush()):
            on_text(rest)
        gen.result.text = self._decode(gen.result.output_ids)
        return gen.result

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
