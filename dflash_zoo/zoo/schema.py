"""Schema of `registry.yaml` entries: field kinds, required/nullable rules and value checks (torch-free).

`parse_document(text, source)` safe-loads one YAML document and returns its raw entry dicts, or raises
`ConfigError` naming the source, the entry (slug, else `#index`) and the field: unknown, missing, wrongly
typed, a bad status, a missing reason, or a fingerprint that contradicts itself (tap >= target layers,
mask id outside the vocabulary, block size < 2). Draft facts are required keys whose value may be null,
which means "unknown" (no public source gives the value); they are never guessed.

The target's shape (`hidden_size`, `num_hidden_layers`, `vocab_size`) is required and may be null only on an
entry whose status is "unsupported-here": one dflash-zoo lists but cannot run, whose target's text shape no
public source gives. Such an entry must say why in `reason` and `notes`; a supported or preview entry with a
null shape fact is a ConfigError naming the entry and the field. Checks against an unknown shape (taps below
the layer count, mask ids inside the vocabulary) are skipped, never guessed.

`draft.architecture` names the drafter architecture (`dflash_zoo.drafters.ARCHS`: "dflash", "dflash2"); null
means the drafter is of an architecture dflash-zoo does not run (the entry's notes name it). An
unsupported-here entry whose drafter network is one of those keeps its name; its `reason` says what else is
missing (a target no class builds, a mask embedding in place of a mask token id). `draft.revisions` lists the
known uploads of the drafter repo, newest first (`zoo/revisions.py`); the newest must agree with the entry's
draft facts.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from dflash_zoo.drafters import arch_names
from dflash_zoo.errors import ConfigError
from dflash_zoo.zoo.revisions import parse_revisions

STATUSES = ("supported", "preview", "unsupported-here")
SHAPE = ("hidden_size", "num_hidden_layers", "vocab_size")  # the target's text shape
_NOT_PUBLIC = "unsupported-here"  # the only status whose target shape may be null (not public)
_SLUG = re.compile(r"^[a-z0-9][a-z0-9._:-]*$")
# field -> (kind, required, nullable). Draft facts are required but nullable: null means "unknown".
_SCHEMA: dict[str, dict[str, tuple[str, bool, bool]]] = {
    "entry": {
        "slug": ("str", True, False),
        "aliases": ("[str]", False, False),
        "adapter": ("str", True, False),
        "target": ("target", True, False),
        "draft": ("draft", True, False),
        "variants": ("[str]", False, False),
        "chat_template_kwargs": ("dict", False, False),
        "thinking": ("str", False, False),
        "gated": ("bool", False, False),
        "gated_seen": ("str", False, True),
        "license": ("str", True, False),
        "status": ("str", True, False),
        "reason": ("str", False, True),
        "notes": ("str", False, False),
    },
    "target": {
        "repo": ("str", True, False),
        "model_type": ("str", True, False),
        # nullable only on an unsupported-here entry (`_check_shape`): null means "not public"
        "hidden_size": ("int", True, True),
        "num_hidden_layers": ("int", True, True),
        "vocab_size": ("int", True, True),
        "revision": ("str", False, False),
        "params_b": ("num", False, True),
        "tp_hint": ("int", False, False),
        "shape_from": ("str", False, False),
    },
    "draft": {
        "repo": ("str", True, False),
        "revision": ("str", True, False),
        "architecture": ("str", True, True),
        "block_size": ("int", True, True),
        "target_layer_ids": ("[int]", True, True),
        "mask_token_id": ("int", True, True),
        "num_layers": ("int", True, True),
        "size_bytes": ("int", False, True),
        "license": ("str", False, True),
        "gated": ("bool", False, True),
        "mask_token_ids_seen": ("{str:int}", False, False),
        "revisions": ("list", False, False),
    },
}
_KIND_OK = {
    "str": lambda v: isinstance(v, str) and v.strip() != "",
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "num": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
    "bool": lambda v: isinstance(v, bool),
    "dict": lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
    "{str:int}": lambda v: (
        isinstance(v, dict) and all(_KIND_OK["str"](k) and _KIND_OK["int"](x) for k, x in v.items())
    ),
    "[str]": lambda v: isinstance(v, list) and all(_KIND_OK["str"](x) for x in v),
    "[int]": lambda v: isinstance(v, list) and all(_KIND_OK["int"](x) for x in v),
    "list": lambda v: isinstance(v, list),
    "target": lambda v: isinstance(v, dict),
    "draft": lambda v: isinstance(v, dict),
}


def parse_document(text: str, source: str) -> list[dict[str, Any]]:
    """`yaml.safe_load` one registry document and validate every entry; returns the raw entry dicts."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        raise ConfigError(f"{source}: expected a mapping with an 'entries' list")
    unknown = sorted(set(doc) - {"version", "entries"})
    if unknown:
        raise ConfigError(f"{source}: unknown top-level field(s) {unknown}")
    for i, raw in enumerate(doc["entries"]):
        name = raw.get("slug") if isinstance(raw, dict) and isinstance(raw.get("slug"), str) else f"#{i}"
        where = f"{source}: entry {name!r}"
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
        _check_fields(raw, "entry", where, "")
        _check_facts(raw, where)
    return doc["entries"]


def _check_fields(obj: dict, kind: str, where: str, prefix: str) -> None:
    """Unknown, missing, wrongly typed or null fields -> ConfigError naming `where` and the field."""
    spec = _SCHEMA[kind]
    for key in obj:
        if key not in spec:
            raise ConfigError(f"{where}: unknown field {prefix + str(key)!r}; known: {', '.join(spec)}")
    for key, (vkind, required, nullable) in spec.items():
        field = prefix + key
        if key not in obj:
            if required:
                raise ConfigError(f"{where}: missing field {field!r}{_null_hint(field, nullable)}")
            continue
        value = obj[key]
        if value is None and nullable:
            continue
        if not _KIND_OK[vkind](value):
            null = " or null" if nullable else ""
            raise ConfigError(f"{where}: field {field!r} must be of type {vkind}{null}, got {value!r}")
        if vkind in _SCHEMA:
            _check_fields(value, vkind, where, field + ".")


def _null_hint(field: str, nullable: bool) -> str:
    """What a missing required field may be set to when its value is not known."""
    if field in {f"target.{k}" for k in SHAPE}:
        return f" (null if not public: {_NOT_PUBLIC} entries only)"
    return " (null if unknown)" if nullable else ""


def _check_facts(raw: dict, where: str) -> None:
    """Value rules: slug shape, status/reason, and fingerprint self-consistency."""
    if not _SLUG.match(raw["slug"]):
        raise ConfigError(f"{where}: field 'slug' must be lowercase [a-z0-9._:-], got {raw['slug']!r}")
    if raw["status"] not in STATUSES:
        raise ConfigError(
            f"{where}: field 'status' must be one of {', '.join(STATUSES)}, got {raw['status']!r}"
        )
    if raw["status"] != "supported" and not raw.get("reason"):
        raise ConfigError(f"{where}: field 'reason' is required when status is {raw['status']!r}")
    t, d = raw["target"], raw["draft"]
    _check_shape(t, raw["status"], raw.get("notes"), where)
    if d["block_size"] is not None and d["block_size"] < 2:
        raise ConfigError(f"{where}: field 'draft.block_size' must be >= 2, got {d['block_size']}")
    _check_taps(d["target_layer_ids"], t["num_hidden_layers"], where)
    masks = {"draft.mask_token_id": d["mask_token_id"]}
    masks.update(
        {f"draft.mask_token_ids_seen[{k!r}]": v for k, v in (d.get("mask_token_ids_seen") or {}).items()}
    )
    for key, mask in masks.items():
        _check_mask(key, mask, t["vocab_size"], where)
    if t.get("tp_hint") is not None and t["tp_hint"] < 1:
        raise ConfigError(f"{where}: field 'target.tp_hint' must be >= 1, got {t['tp_hint']}")
    _check_draft_revision(d, t, where)


def _check_shape(t: dict, status: str, notes: str | None, where: str) -> None:
    """Shape facts are positive; null (not public) only on an unsupported-here entry, whose notes say why."""
    for key in SHAPE:
        value = t[key]
        if value is None and status != _NOT_PUBLIC:
            raise ConfigError(
                f"{where}: field 'target.{key}' is null (not public), which only an {_NOT_PUBLIC!r} entry "
                f"may be; this entry's status is {status!r}",
                hint=f"give the target's {key} from its config.json, or mark the entry {_NOT_PUBLIC}",
            )
        if value is not None and value <= 0:
            raise ConfigError(f"{where}: field 'target.{key}' must be positive, got {value}")
    if None in (t[k] for k in SHAPE) and not notes:
        raise ConfigError(f"{where}: field 'notes' must say why the target's shape is null (not public)")


def _check_taps(taps: list[int] | None, layers: int | None, where: str) -> None:
    """Taps are non-empty, non-negative and (where the target's depth is known) below its layer count."""
    if taps is None:
        return
    if not taps or min(taps) < 0 or (layers is not None and max(taps) >= layers):
        bound = f"[0, {layers}) (target.num_hidden_layers)" if layers is not None else "[0, ...)"
        raise ConfigError(f"{where}: field 'draft.target_layer_ids' {taps} must be non-empty ids in {bound}")


def _check_mask(key: str, mask: int | None, vocab: int | None, where: str) -> None:
    """A known mask id is non-negative and (where the target's vocabulary is known) inside it."""
    if mask is None:
        return
    if mask < 0 or (vocab is not None and mask >= vocab):
        bound = vocab if vocab is not None else "..."
        raise ConfigError(f"{where}: field {key!r} {mask} outside [0, {bound})")


def _check_draft_revision(d: dict, t: dict, where: str) -> None:
    """The architecture is a known one; every upload's taps and mask id fit the target; the newest known upload
    agrees with the entry's draft facts."""
    archs = tuple(arch_names())
    if d["architecture"] is not None and d["architecture"] not in archs:
        raise ConfigError(
            f"{where}: field 'draft.architecture' must be one of {', '.join(archs)} or null, "
            f"got {d['architecture']!r}"
        )
    if "revisions" not in d:
        return
    revisions = parse_revisions(d["revisions"], where, archs)
    layers, vocab = t["num_hidden_layers"], t["vocab_size"]
    for rev in revisions:  # an unknown (null) target shape bounds nothing
        if rev.target_layer_ids is not None and layers is not None and max(rev.target_layer_ids) >= layers:
            raise ConfigError(f"{where}: upload {rev.label!r} taps layer {max(rev.target_layer_ids)} of a "
                              f"{layers}-layer target")  # fmt: skip
        if rev.mask_token_id is not None and vocab is not None and rev.mask_token_id >= vocab:
            raise ConfigError(f"{where}: upload {rev.label!r} mask id {rev.mask_token_id} >= {vocab}")
    newest = revisions[0]
    own = {k: d[k] for k in ("architecture", "num_layers", "block_size", "mask_token_id", "target_layer_ids")}
    plain = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in newest.known().items()}
    clash = [k for k, v in plain.items() if own.get(k) is not None and own[k] != v]
    if clash:
        raise ConfigError(
            f"{where}: the newest upload in 'draft.revisions' ({newest.label!r}) disagrees with the entry's "
            f"draft facts on {', '.join(clash)}"
        )
