"""The Python API: `load(target, draft)` returns a `Pipeline` whose `generate` the CLI only wraps.

    pipe = dflash_zoo.load("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", device="cuda")
    res = pipe.generate("Explain KV caches", max_new_tokens=128)
    print(res.text, res.mean_acceptance_length, res.tokens_per_second)

`target` / `draft` are local directories, Hub ids, registry slugs, or already-built objects
(a transformers model and a `DFlashDrafter`). With neither, the embedded demo pair is used.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_zoo import demo
from dflash_zoo.adapters import get_adapter
from dflash_zoo.engine.checkpoint import load_drafter, resolve_dir
from dflash_zoo.engine.decode import EagerEngine
from dflash_zoo.engine.drafter import DFlashDrafter
from dflash_zoo.engine.results import GenerationConfig, GenerationResult, fit_to_positions, target_positions
from dflash_zoo.engine.run import AcceptOverride, Engine, Generation
from dflash_zoo.engine.select import EngineChoice, EngineOptions, choose_engine
from dflash_zoo.errors import (
    ConfigError,
    IncompatiblePairError,
    NotFoundError,
    looks_like_path,
    missing_directory,
)

log = logging.getLogger("dflash_zoo")

TARGET_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
MASK_TOKEN_STRING = "<|MASK|>"  # what the first z-lab README added to tokenizers


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_dtype(name: str | torch.dtype | None, device: str) -> torch.dtype:
    """'bf16' / 'bfloat16' / 'fp16' / 'fp32' / 'auto' -> torch dtype (auto: bf16 on GPU, fp32 on CPU)."""
    if isinstance(name, torch.dtype):
        return name
    table = {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
        "fp32": torch.float32,
        "float32": torch.float32,
    }
    if name in (None, "auto"):
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if name not in table:
        raise ConfigError(f"unknown dtype {name!r}; use one of auto, {', '.join(table)}")
    return table[name]


class TextStream:
    """Incremental detokenisation: feed committed ids, get the new text (held back mid-character)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def push(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next tokens
            return ""
        new, self.sent = text[self.sent :], len(text)
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

    def __post_init__(self) -> None:
        if self.adapter is None:
            self.adapter = get_adapter(self.model.config.model_type)(self.model)

    @property
    def device(self) -> torch.device:
        return next(self.drafter.parameters()).device

    def encode(self, prompt: str | list[int] | list[dict], raw: bool = False) -> list[int]:
        """Token ids for a prompt: ids as given; text raw or through the chat template; or a message list."""
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            return list(prompt)
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

    def config(self, **kw: Any) -> GenerationConfig:
        """A validated `GenerationConfig`; `stop_token_ids=None` means the pair's defaults, `[]` none at all."""
        stops = kw.pop("stop_token_ids", None)
        stops = self.stop_token_ids if stops is None else tuple(stops)
        return GenerationConfig(stop_token_ids=stops, **kw).validated(self.drafter.cfg.block_size)

    def engine(self, cfg: GenerationConfig, prompt_tokens: int, images: bool = False) -> Engine:
        """The engine for one generation (`engine/select.py` decides; `last_choice` says which and why)."""
        choice = choose_engine(
            self.adapter, self.device, self.options, split=self.placement is not None, prefill_inputs=images
        )
        if not choice.fast and self.options.fast:
            log.warning("%s; using the eager engine", choice.reason)
        if choice != self.last_choice:
            log.info("engine: %s (%s)", choice.name, choice.reason)
        self.last_choice = choice
        if not choice.fast:
            if "eager" not in self._engines:
                self._engines["eager"] = EagerEngine(self.adapter, self.drafter, self.mask_token_id)
            return self._engines["eager"]
        return self._fast_engine(cfg, prompt_tokens + cfg.max_new_tokens)

    def _fast_engine(self, cfg: GenerationConfig, need: int) -> Engine:
        """The static engine for this block size, rebuilt when a longer generation or other options need it."""
        key = f"fast-b{cfg.block_size}"
        eng = self._engines.get(key)
        if eng is None or eng.max_len < need or eng.compile != self.options.compile:
            for stale in [k for k in self._engines if k.startswith("fast")]:
                del self._engines[stale]  # an engine is a reference cycle (its step table): free buffers now
            gc.collect()
            from dflash_zoo.cuda.fast import FastEngine

            eng = FastEngine(
                self.adapter,
                self.drafter,
                self.mask_token_id,
                max(need, 2048),
                block_size=cfg.block_size,
                compile=self.options.compile,
            )
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
        ids, prefill = (self.encode(prompt, raw), None) if not images else self._image_inputs(prompt, images)
        cfg = fit_to_positions(cfg, len(ids), target_positions(self.model.config))  # refuse / cap, one line
        engine = self.engine(cfg, len(ids), images=bool(images))
        return engine.start(
            ids, cfg, speculative=speculative, accept_override=accept_override, prefill_inputs=prefill
        )

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
        gen.result.text = self._decode(gen.result.output_ids)
        return gen.result

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""


def _stop_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


def _mask_id(drafter: DFlashDrafter, tokenizer: Any, rows: int | None = None) -> int:
    """The drafter's mask id (its config, else the tokenizer's <|MASK|>), checked against the target's `rows`
    embedding rows: an id outside them would fail only at the first draft, after output has started."""
    mask = drafter.cfg.mask_token_id
    if mask is None and tokenizer is not None:
        tid = tokenizer.convert_tokens_to_ids(MASK_TOKEN_STRING)
        mask = tid if tid is not None and tid != tokenizer.unk_token_id else None
    if mask is None:
        raise ConfigError("the draft config has no mask_token_id and the tokenizer has no <|MASK|> token")
    if rows is not None and not 0 <= mask < rows:
        raise IncompatiblePairError(
            f"the drafter's mask_token_id {mask} is outside the target's embedding table ({rows} rows)",
            hint="fix dflash_config.mask_token_id in the drafter's config.json; `dflash-zoo check` reports the pair",
        )
    return mask


def _embedding_rows(model: Any) -> int | None:
    return getattr(model.get_input_embeddings(), "num_embeddings", None)


def load_target(source: Any, device: str, dtype: torch.dtype, revision: str | None) -> tuple[Any, Any]:
    """(model, tokenizer or None) for a local dir / Hub id; an already-built model passes through.

    For a target split across GPUs, `load` passes device="cpu" and places it afterwards: transformers 5.x
    needs accelerate for any `from_pretrained(device_map=...)`, so the checkpoint is read into host RAM
    (about its size on disk in the chosen dtype) and moved one module at a time (placement.py).
    """
    if not isinstance(source, str | Path):
        return source, None
    directory = resolve_dir(source, revision, TARGET_FILES)
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(directory)
    model = get_adapter(config.model_type).load_model(str(directory), dtype, device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer in %s (%s); text prompts are unavailable", directory, exc)
        tokenizer = None
    return model, tokenizer


def check_pair(model: Any, drafter: DFlashDrafter) -> None:
    """Refuse a pair whose configs do not fit (one line naming the problem)."""
    adapter = get_adapter(model.config.model_type)
    problems = adapter.validate(model.config.to_dict(), drafter.cfg)
    fails = [p for p in problems if p.severity == "FAIL"]
    if fails:
        raise IncompatiblePairError(
            "; ".join(p.message for p in fails), hint="run `dflash-zoo check` for the full report"
        )
    for p in problems:
        log.warning("%s", p.message)


def _warn_ignored_revision(source: Any, revision: str | None, what: str) -> None:
    """A local directory has no revisions: say that one given for it is not used (instead of ignoring it)."""
    if revision and isinstance(source, str | Path) and Path(source).expanduser().is_dir():
        log.warning("%s revision %r ignored: %s is a local directory", what, revision, source)


def load(
    target: Any = None,
    draft: Any = None,
    *,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    tokenizer: Any = None,
    revision: str | None = None,
    draft_revision: str | None = None,
    device_map: str | list[str] | None = None,
    fast: bool | None = None,
    compile: bool = False,
) -> Pipeline:
    """Load a target + drafter pair and check that they fit.

    Args:
        target: local dir, Hub id, registry slug, or a loaded transformers model. None: the embedded demo
            target (and, without `draft`, its drafter).
        draft: local dir, Hub id or `DFlashDrafter`; None: the registry's drafter for `target`.
        device / dtype: default cuda + bf16 when available, else cpu + fp32.
        device_map: split the target over devices: "auto" (all visible GPUs), "cuda:0,cuda:1" or a list.
            Layers are balanced by bytes; the drafter joins the LM head on the last device; eager engine only.
        fast: the static fast engine: None (auto: on CUDA for families that declare a static layout), True
            (wherever it can run, CPU included), False (always the eager engine). See `engine/select.py`.
        compile: `torch.compile` the fast engine's steps (a one-time cost, reported apart from throughput).
    Returns:
        A `Pipeline` with `generate`, `stream` and `generate_autoregressive`.
    """
    device, devices = resolve_devices(device_map, device)
    torch_dtype = parse_dtype(dtype, devices[0] if devices else device)
    device = "cpu" if devices else device  # a split target is loaded on the CPU first, then placed
    chat_kwargs: dict[str, Any] = {}
    if target is None:  # the embedded demo target, with its own drafter unless one is given
        target, draft = demo.target_dir(), demo.draft_dir() if draft is None else draft
    elif isinstance(target, str) and draft is None:
        entry = _registry_entry(target)
        target, draft = entry.target_repo, entry.draft_repo
        draft_revision = draft_revision or locked_revision(entry)
        chat_kwargs = dict(entry.chat_template_kwargs)
    if draft is None:
        raise NotFoundError(
            "no drafter given", hint="pass --draft DIR_OR_REPO, or a registry id (`dflash-zoo list`)"
        )
    _warn_ignored_revision(target, revision, "target")
    _warn_ignored_revision(draft, draft_revision, "drafter")
    model, tok = load_target(target, device, torch_dtype, revision)
    tokenizer = tokenizer if tokenizer is not None else tok
    drafter = (
        draft
        if isinstance(draft, DFlashDrafter)
        else load_drafter(draft, device, torch_dtype, draft_revision)
    )
    check_pair(model, drafter)
    adapter = get_adapter(model.config.model_type)(model)
    placement = _place(adapter, drafter, devices) if devices else None
    return Pipeline(
        model=model,
        drafter=drafter,
        tokenizer=tokenizer,
        stop_token_ids=tuple(dict.fromkeys(_stop_ids(model, tokenizer) + adapter.extra_stop_token_ids)),
        processor_source=str(target) if isinstance(target, str | Path) else None,
        chat_template_kwargs={**adapter.chat_template_kwargs, **chat_kwargs},
        mask_token_id=_mask_id(drafter, tokenizer, _embedding_rows(model)),
        adapter=adapter,
        placement=placement,
        options=EngineOptions(fast=fast, compile=compile),
    )


def resolve_devices(device_map: str | list[str] | None, device: str | None) -> tuple[str, list[str] | None]:
    """(device, device slots of a split target or None); a map naming one device is a plain one-device run."""
    if device_map is None:
        return device or default_device(), None
    if device is not None:
        raise ConfigError("pass either a device or a device map, not both", hint="drop --device")
    from dflash_zoo.cuda.placement import parse_devices

    devices = parse_devices(device_map)
    if len(devices) == 1:
        log.info("device map names one device (%s): no placement", devices[0])
        return devices[0], None
    return devices[0], devices


def _place(adapter: Any, drafter: DFlashDrafter, devices: list[str]) -> Any:
    """Split the target over `devices` (the drafter's bytes planned on the head's device), then move the drafter."""
    from dflash_zoo.cuda.placement import apply_placement, module_bytes, plan_placement

    plan = plan_placement(adapter, devices, reserve_bytes=module_bytes(drafter))
    placement = apply_placement(adapter.model, adapter, plan)
    placement.attach_drafter(drafter)
    log.info("the target spans %d devices: the eager engine runs it (CUDA graphs need one)", len(devices))
    return placement


def locked_revision(entry: Any) -> str:
    """The commit `pull` recorded for this entry (reproducible runs), else the registry's pin."""
    from dflash_zoo.zoo.registry import read_lock

    lock = read_lock().get(entry.slug) or {}
    return lock.get("commit") if lock.get("draft_repo") == entry.draft_repo else entry.draft_revision


def _registry_entry(name: str) -> Any:
    """Registry entry for a slug / alias / repo id; a local directory is never a registry name."""
    if Path(name).expanduser().is_dir():
        raise NotFoundError(
            f"{name} is a directory but no --draft was given", hint="pass --draft DIR_OR_REPO"
        )
    if looks_like_path(name):  # a path that does not exist is no registry miss
        raise missing_directory(name)
    from dflash_zoo.zoo.registry import load_registry

    return load_registry().resolve(name)
