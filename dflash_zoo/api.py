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
from dflash_zoo.engine.decode import SpeculativeDecoder, autoregressive_generate
from dflash_zoo.engine.drafter import DFlashDrafter
from dflash_zoo.engine.results import GenerationConfig, GenerationResult
from dflash_zoo.errors import ConfigError, IncompatiblePairError, NotFoundError

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
    fast: bool | None = None  # static-cache CUDA-graph path: None = auto (CUDA, greedy, supported family)
    compile: bool = False  # torch.compile the fast path's steps (compiled on first use, then reused)
    placement: Any = None  # a `placement.Placement` when the target is split across devices (eager loop only)
    processor_source: str | None = None  # where AutoProcessor loads from, for image prompts
    _engine: Any = field(default=None, repr=False)

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
        stops = tuple(kw.pop("stop_token_ids", None) or self.stop_token_ids)
        return GenerationConfig(stop_token_ids=stops, **kw)

    def decoder(
        self, prompt: Any, raw: bool = False, images: list[str] | None = None, **kw: Any
    ) -> SpeculativeDecoder:
        """The decode loop for one prompt; `images` (file paths) go to a VLM target's prefill only."""
        accept_override = kw.pop("accept_override", None)
        ids, prefill = (self.encode(prompt, raw), None) if not images else self._image_inputs(prompt, images)
        return SpeculativeDecoder(
            self.adapter, self.drafter, ids, self.config(**kw), self.mask_token_id, accept_override, prefill
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
        """Speculative generation. `kw` are `GenerationConfig` fields (max_new_tokens, temperature, ...)."""
        images = kw.pop("images", None)
        if not images:
            prompt = self.encode(prompt, raw)  # token ids: encoded once, for either path
            engine = self._fast_engine(len(prompt), kw)
            if engine is not None:
                res = engine.speculative(prompt, self.config(**kw))
                res.text = self._decode(res.output_ids)
                if on_text is not None and res.text:
                    on_text(res.text)
                return res
        dec = self.decoder(prompt, raw, images=images, **kw)
        stream = TextStream(self.tokenizer)
        for ids in dec:
            text = stream.push(ids)
            if on_text is not None and text:
                on_text(text)
        dec.result.text = self._decode(dec.result.output_ids)
        return dec.result

    def _fast_engine(self, prompt_tokens: int, kw: dict[str, Any]) -> Any:
        """The static fast path when it applies (same tokens as the eager loop), else None."""
        if self.fast is False or (self.fast is None and self.device.type != "cuda"):
            return None
        from dflash_zoo.cuda.fast import FastEngine
        from dflash_zoo.cuda.static import unsupported_reason

        cfg = self.config(**kw).validated(self.drafter.cfg.block_size)
        reason = (
            # CUDA graphs and static caches need the whole target on one device
            ("target split across devices" if self.placement is not None else None)
            or unsupported_reason(self.adapter, cfg, graphs=self.device.type == "cuda")
            or ("block size override" if cfg.block_size != self.drafter.cfg.block_size else None)
        )
        if reason or kw.get("accept_override"):
            if self.fast:
                log.warning("fast path unavailable (%s); using the eager loop", reason)
            return None
        need = prompt_tokens + cfg.max_new_tokens
        stale = self._engine is not None and self._engine.compile != self.compile
        if self._engine is None or self._engine.max_len < need or stale:
            if self._engine is not None:
                self._engine = None  # an engine is a reference cycle (its step table): free its buffers now
                gc.collect()
            self._engine = FastEngine(
                self.adapter, self.drafter, self.mask_token_id, max(need, 2048), compile=self.compile
            )
        return self._engine

    def stream(self, prompt: Any, raw: bool = False, **kw: Any) -> Iterator[str]:
        """Yield text as tokens are committed."""
        dec = self.decoder(prompt, raw, **kw)
        stream = TextStream(self.tokenizer)
        for ids in dec:
            text = stream.push(ids)
            if text:
                yield text

    def generate_autoregressive(self, prompt: Any, raw: bool = False, **kw: Any) -> GenerationResult:
        """The target alone, one token per forward (the baseline for speedups).

        Runs on the same path `generate` would take (the fast engine's static target when it applies), so a
        speedup compares DFlash with autoregressive decoding on equal footing.
        """
        ids, cfg = self.encode(prompt, raw), self.config(**kw)
        engine = self._fast_engine(len(ids), kw)
        if engine is not None:
            res = engine.autoregressive(ids, cfg)
        else:
            res = autoregressive_generate(self.adapter, ids, cfg, self.device)
        res.text = self._decode(res.output_ids)
        return res

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""


def _stop_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


def _mask_id(drafter: DFlashDrafter, tokenizer: Any) -> int:
    if drafter.cfg.mask_token_id is not None:
        return drafter.cfg.mask_token_id
    if tokenizer is not None:
        tid = tokenizer.convert_tokens_to_ids(MASK_TOKEN_STRING)
        if tid is not None and tid != tokenizer.unk_token_id:
            return tid
    raise ConfigError("the draft config has no mask_token_id and the tokenizer has no <|MASK|> token")


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
) -> Pipeline:
    """Load a target + drafter pair and check that they fit.

    Args:
        target: local dir, Hub id, registry slug, or a loaded transformers model. None: the embedded demo
            target (and, without `draft`, its drafter).
        draft: local dir, Hub id or `DFlashDrafter`; None: the registry's drafter for `target`.
        device / dtype: default cuda + bf16 when available, else cpu + fp32.
        device_map: split the target over devices: "auto" (all visible GPUs), "cuda:0,cuda:1" or a list.
            Layers are balanced by bytes; the drafter joins the LM head on the last device; eager loop only.
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
        mask_token_id=_mask_id(drafter, tokenizer),
        adapter=adapter,
        placement=placement,
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
    log.info("fast path off: the target spans %d devices (CUDA graphs need one); eager loop", len(devices))
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
    from dflash_zoo.zoo.registry import load_registry

    return load_registry().resolve(name)
