"""`serve`'s checks of the user's overrides, before any command is built (torch-free).

- `--block-size` may not exceed the block the drafter was trained with (as `generate` refuses): a drafter
  runs smaller blocks, never larger ones.
- `--tp` must split the target's attention heads, and its KV heads (or be a multiple of them: the engines
  then replicate each KV head), as vLLM and SGLang both require; the heads come from the target's
  `config.json` (a local directory, the HF cache, else the Hub). When no config can be read the check is
  skipped with a hint, never guessed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_zoo.errors import InvalidArgumentError, ZooError
from dflash_zoo.output import hint


def check_overrides(
    tp: int | None, block_size: int | None, target: str, revision: str | None, name: str,
    trained: Callable[[], int | None],
) -> None:  # fmt: skip
    """Check what the user gave: `--block-size` against `trained()` (the drafter's block, looked up only then;
    a lookup that fails leaves it unchecked) and `--tp` above 1 against `target`'s heads."""
    if block_size:
        try:
            known = trained()
        except ZooError:
            known = None
        check_block_size(block_size, known, name)
    if tp and tp > 1:
        check_tensor_parallel(tp, target, revision)


def check_block_size(block_size: int, trained: int | None, name: str) -> None:
    """Refuse a `--block-size` above the drafter's trained one (`trained` None: unknown, not checked)."""
    if trained is None:
        hint(
            f"the trained block size of {name}'s drafter is unknown here: --block-size {block_size} is unchecked"
        )
        return
    if block_size > trained:
        raise InvalidArgumentError(
            f"--block-size {block_size} exceeds the block size {trained} that {name}'s drafter was trained with",
            hint=f"pass --block-size {trained} or less, or leave it out (a drafter runs smaller blocks, "
            "never larger)",
        )


def check_tensor_parallel(tp: int, target: str, revision: str | None) -> None:
    """Refuse a `--tp` that does not split the target's attention heads (of every layer) and KV heads."""
    heads = target_heads(target, revision)
    if heads is None:
        hint(f"could not read {target}'s config.json to check --tp {tp} against its attention heads")
        return
    qs, kv = heads

    def splits(t: int) -> bool:
        return all(q % t == 0 for q in qs) and (kv % t == 0 or t % kv == 0)

    if splits(tp):
        return
    fits = [t for t in range(1, 65) if splits(t)]
    q_text = " and ".join(map(str, qs))
    what = f"{next(q for q in qs if q % tp)} attention heads" if any(q % tp for q in qs) else f"{kv} KV heads"
    raise InvalidArgumentError(
        f"--tp {tp} does not split {target}'s {what} evenly ({q_text} query heads, {kv} KV heads)",
        hint=f"use --tp {', '.join(map(str, fits[:-1]))} or {fits[-1]}, or leave --tp out"
        if len(fits) > 1
        else "use --tp 1, or leave --tp out",
    )


def target_heads(target: str, revision: str | None) -> tuple[tuple[int, ...], int] | None:
    """(the query-head counts of its layers, KV heads) of the target's text model, or None when its config
    cannot be read. Most targets have one count; Laguna lists one a layer
    (`num_attention_heads_per_layer`)."""
    try:
        raw = _target_config(target, revision)
    except ZooError:
        return None
    text = _text_config(raw)
    q, kv = text.get("num_attention_heads"), text.get("num_key_value_heads")
    if not _count(q):
        return None
    per_layer = text.get("num_attention_heads_per_layer")
    qs = {q} | ({n for n in per_layer if _count(n)} if isinstance(per_layer, list) else set())
    return tuple(sorted(qs)), kv if _count(kv) else q


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _target_config(target: str, revision: str | None) -> dict[str, Any]:
    """A local directory's config.json; else the repo's, from the HF cache, else the Hub (config only)."""
    from dflash_zoo.engine.target_files import read_config
    from dflash_zoo.zoo import hub

    local = Path(target).expanduser()
    if local.is_dir():
        return read_config(local / "config.json", "target config")
    try:
        folder = hub.snapshot(target, revision, ["config.json"], offline=True)
    except ZooError:
        if hub.is_offline():
            raise
        folder = hub.snapshot(target, revision, ["config.json"])
    return read_config(folder / "config.json", "target config")


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: the family adapter's reading, else a `text_config` block, else the top level."""
    from dflash_zoo.adapters import find_adapter

    cls = find_adapter(str(raw.get("model_type", "")))
    if cls is not None:
        return cls.text_config_dict(raw)
    nested = raw.get("text_config")
    return nested if isinstance(nested, dict) else raw
