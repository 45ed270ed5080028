"""Loading a pair: `load(target, draft)` resolves both (local directory, Hub id, registry id or a built
object), checks that they fit, places a target split across GPUs, and returns a `Pipeline`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from dflash_zoo import demo
from dflash_zoo.adapters import get_adapter
from dflash_zoo.engine import checkpoint
from dflash_zoo.engine.drafter import DFlashDrafter
from dflash_zoo.engine.options import EngineOptions, FastOptions
from dflash_zoo.engine.target_files import check_target_dir
from dflash_zoo.errors import (
    ConfigError,
    IncompatiblePairError,
    NotFoundError,
    looks_like_path,
    missing_directory,
)
from dflash_zoo.formats import verifier
from dflash_zoo.pipeline import Pipeline
from dflash_zoo.sources import DRAFT_FILES, TARGET_FILES, resolve_dir

log = logging.getLogger("dflash_zoo")
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
        raise ConfigError(
            "the draft config has no mask_token_id and the tokenizer has no <|MASK|> token",
            hint="add dflash_config.mask_token_id (the id the drafter was trained with) to the drafter's "
            "config.json, or pass --draft-config FILE",
        )
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
    check_target_dir(Path(directory))  # config and weight headers: one line naming the file, not a traceback
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(directory)
    model = get_adapter(config.model_type).load_model(str(directory), dtype, device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer in %s (%s); text prompts are unavailable", directory, exc)
        tokenizer = None
    return model, tokenizer


def load_drafter(
    source: Any,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    revision: str | None = None,
    allow_quantized: bool = False,
) -> DFlashDrafter:
    """A drafter from a local directory or a Hub id (fetched into the HF cache first, at `revision`), every
    weight loaded strictly (`engine/checkpoint.py`); a quantized one only with `allow_quantized`."""
    return checkpoint.load_drafter(resolve_dir(source, revision, DRAFT_FILES), device, dtype, allow_quantized)


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
    copies = getattr(drafter, "verifier_copies", ())  # what a speculators drafter copied from its verifier
    if copies:
        verifier.check(copies, verifier.model_parts(model, adapter.final_norm_path()))


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
    fast_options: FastOptions | None = None,
    allow_quantized_drafter: bool = False,
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
        fast_options: how the fast engine runs (`FastOptions`); None: `FastOptions.from_env()` (the
            `DFLASH_ZOO_*` switches of docs/performance.md). `compile=True` turns its `compile` on.
        allow_quantized_drafter: try a quantized drafter (refused by default: docs/quantization.md).
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
        else load_drafter(draft, device, torch_dtype, draft_revision, allow_quantized_drafter)
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
        options=EngineOptions(fast, _fast_options(fast_options, compile)),
    )


def _fast_options(given: FastOptions | None, compile: bool) -> FastOptions:
    """The fast engine's options: those given, else the environment's (`FastOptions.from_env`); `compile` on top."""
    options = given if given is not None else FastOptions.from_env()
    return options.with_choices(compile=True) if compile else options


def resolve_devices(device_map: str | list[str] | None, device: str | None) -> tuple[str, list[str] | None]:
    """(device, device slots of a split target or None); a map naming one device is a plain one-device run."""
    if device_map is None:
        return device or default_device(), None
    if device is not None:
        raise ConfigError("pass either a device or a device map, not both", hint="drop --device")
    from dflash_zoo.cuda.placement.plan import parse_devices

    devices = parse_devices(device_map)
    if len(devices) == 1:
        log.info("device map names one device (%s): no placement", devices[0])
        return devices[0], None
    return devices[0], devices


def _place(adapter: Any, drafter: DFlashDrafter, devices: list[str]) -> Any:
    """Split the target over `devices` (the drafter's bytes planned on the head's device), then move the drafter."""
    from dflash_zoo.cuda.placement.hooks import apply_placement
    from dflash_zoo.cuda.placement.plan import module_bytes, plan_placement

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
    from dflash_zoo.zoo.registry import load_registry, refuse_unrunnable

    entry = load_registry().resolve(name)
    refuse_unrunnable(entry)  # listed, but not a pair dflash-zoo can run
    return entry
