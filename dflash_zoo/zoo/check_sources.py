"""Where `check` gets its configs from: local files, the HF cache, the registry, then the Hub (torch-free).

Target, first found: `config=` file; `target` is a local dir (or a .json file); the repo's `config.json` in
the HF cache (a registry id means its target repo; the commit `pull --with-target` pinned first, then main);
the registry's target fingerprint (target resolved by slug, alias, repo id or variant; no download); the Hub
(`config.json` only, never when offline). A registered target whose text shape the registry does not know (an
unsupported-here entry: not public) and whose config is not at hand, or lacks the shape, raises
`UnknownTargetShape`: `check` reports the pair as unverified, with the entry's reason.
Draft, first found: `draft_config=` file; `draft` is a local dir; the draft repo's `config.json` in the HF
cache (locked commit from lock.json, else the entry's revision); the Hub at that revision (unless offline);
the registry's draft fingerprint, with a note saying the config itself was not seen. A registered drafter whose
config cannot be seen and whose fingerprint the registry does not know (a gated preview, a drafter of an
architecture dflash-zoo does not run) raises `UnknownDraftConfig`: `check` reports the pair as unverified.
Without `draft`, the drafter is the target's registry entry (by name, else by config fingerprint).
Failures raise `ZooError` subclasses with a next step.

A little over the ~300 lines we aim for: both sides' source orders, and the configs built from registry facts.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dflash_zoo.adapters import find_adapter
from dflash_zoo.adapters.base import TargetAdapter
from dflash_zoo.engine.config import FULL, DraftConfig, RopeSpec, normalize_config_file
from dflash_zoo.errors import ConfigError, InvalidArgumentError, NotFoundError, OfflineError, ZooError
from dflash_zoo.zoo.registry import Entry, Registry, TargetFingerprint, read_pins

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class UnknownDraftConfig(OfflineError):
    """A registered drafter's config is out of reach and the registry lacks its fingerprint."""

    def __init__(self, message: str, hint: str, entry: Entry):
        super().__init__(message, hint=hint)
        self.entry = entry


class UnknownTargetShape(OfflineError):
    """A registered target's text shape is not public and no config at hand gives it."""

    def __init__(self, message: str, hint: str, entry: Entry):
        super().__init__(message, hint=hint)
        self.entry = entry


@dataclass(frozen=True)
class Side:
    """One side of the pair: the name given, where its config came from, its registry entry and how found."""

    name: str
    source: str
    entry: Entry | None
    how: str | None  # slug | alias | target | draft | variant | fingerprint | None
    folder: Path | None = None  # the local or cached folder its config.json came from (its other files)


def resolve_target(
    reg: Registry, name: str, config: str | Path | None, offline: bool
) -> tuple[dict, Side, TargetFingerprint, type[TargetAdapter] | None]:
    """The target's config dict, side, fingerprint and adapter class (None when no adapter exists).

    Raises:
        InvalidArgumentError: `name` is a registered drafter.
    """
    named = _lookup(reg, name, config)
    if named and named[1] == "draft":
        raise InvalidArgumentError(
            f"{name} is a drafter; pass it as --draft and its target as --target",
            hint=f"`dflash-zoo info {name}` names its target",
        )
    entry = named[0] if named else None
    cfg, source, folder = _target_config(name, config, entry, offline, reg)
    cls = find_adapter(str(cfg.get("model_type", "")))
    try:
        fp = fingerprint(cfg, cls or TargetAdapter)
    except ConfigError as exc:
        if entry is not None and not entry.target.known:  # its own config lacks the shape too
            raise _unknown_shape(entry, f"{source} lacks it ({exc})") from exc
        raise ConfigError(f"{source}: {exc}", hint=exc.hint) from exc  # name the file it came from
    return cfg, Side(name, source, *(named or _by_fingerprint(reg, fp)), folder), fp, cls


def _lookup(reg: Registry, name: str, config: Any) -> tuple[Entry, str] | None:
    if config is None and Path(name).expanduser().exists():
        return None  # a local path is never a registry name
    return reg.lookup(name)


def _target_config(
    name: str, config: Any, entry: Entry | None, offline: bool, reg: Registry
) -> tuple[dict, str, Path | None]:
    """The config, where it came from, and the folder beside it (local or cached; None otherwise)."""
    if config is not None:
        return _read_json(Path(config)), f"config file {config}", None
    local = _local_config(name)
    if local is not None:
        return _read_json(local), f"local {local}", _folder(name)
    repo = name if REPO_ID.match(name) else (entry.target_repo if entry is not None else None)
    if repo is not None:
        own = entry is not None and entry.target_repo.lower() == repo.lower()
        pinned = read_pins(entry).target if own else None
        for rev in dict.fromkeys((pinned, None)):  # the commit `pull --with-target` recorded, then main
            cached = _cached_config(repo, rev)
            if cached is not None:
                return _read_json(cached), f"hf cache {repo}" + (f"@{rev}" if rev else ""), cached.parent
    if entry is not None:
        if not entry.target.known:  # nothing to build a config from; the Hub's would lack it as well
            raise _unknown_shape(entry, "no config.json of it is cached")
        return registry_config(entry), f"registry {entry.slug} (target fingerprint)", None
    if not REPO_ID.match(name):
        reg.resolve(name)  # raises NotFoundError with the nearest registry names
    if offline:
        raise OfflineError(
            f"no config for {name}: not a local dir, not in the HF cache, not in the registry, and offline",
            hint="pass --config FILE, or run without --offline / HF_HUB_OFFLINE",
        )
    fetched = _hub_config(name, None)
    return _read_json(fetched), f"hub {name}", fetched.parent


def _unknown_shape(entry: Entry, why: str) -> UnknownTargetShape:
    return UnknownTargetShape(
        f"the registry does not know the text shape of {entry.target_repo} (not public), and {why}",
        f"pass --config FILE with the target's text shape; `dflash-zoo info {entry.slug}` says what is known",
        entry,
    )


def resolve_draft(
    reg: Registry, draft: str | None, draft_config: str | Path | None, tside: Side, fp, offline: bool
) -> tuple[Side, DraftConfig, list[str]]:
    """The drafter's side, its normalised config and notes on a degraded source (for WARN rows)."""
    local = _local_config(draft) if draft else None
    named = None if draft is None or local is not None else reg.lookup(draft)
    entry = named[0] if named else (tside.entry if draft is None else None)
    if draft is None and entry is None and draft_config is None:
        raise NotFoundError(
            f"no registered drafter fits {tside.name} ({fp.model_type}, hidden {fp.hidden_size}, "
            f"{fp.num_hidden_layers} layers, vocab {fp.vocab_size})",
            hint="pass --draft REPO_OR_DIR; `dflash-zoo list` shows the registered pairs",
        )
    if draft is not None and named is None and local is None and not REPO_ID.match(draft):
        reg.resolve(draft)  # raises NotFoundError with suggestions
    repo = entry.draft_repo if entry and local is None else (draft or "")
    name = draft if local is not None else (repo or str(draft_config))
    side = Side(name, "", entry, named[1] if named else None)
    L = fp.num_hidden_layers
    if draft_config is not None:
        return _with(side, f"config file {draft_config}"), _draft(Path(draft_config), L), []
    if local is not None:
        return _with(side, f"local {local}", _folder(draft)), _draft(local, L), []
    return _remote_draft(side, repo, offline, L)


def _remote_draft(side: Side, repo: str, offline: bool, L: int) -> tuple[Side, DraftConfig, list[str]]:
    entry, notes = side.entry, []
    locked = read_pins(entry).draft if entry else None
    revision = entry.draft_revision if entry else "main"
    for rev in dict.fromkeys(r for r in (locked, revision) if r):
        cached = _cached_config(repo, rev)
        if cached is not None:
            return _with(side, f"hf cache {repo}@{rev}", cached.parent), _draft(cached, L), notes
    why = "not cached, offline"
    if not offline:
        try:
            fetched = _hub_config(repo, revision)
            return _with(side, f"hub {repo}@{revision}", fetched.parent), _draft(fetched, L), notes
        except ZooError as exc:
            if entry is None:
                raise
            why = f"hub: {exc}"
    synth = _fingerprint_draft(entry) if entry else None
    if synth is None:
        gated = " (gated repo: needs a token)" if entry and entry.gated else ""
        # `pull` refuses the slug of an entry marked unsupported here; its drafter repo id still works
        name = entry.slug if entry and not entry.listed_only else repo
        hint = f"`dflash-zoo pull {name}` while online, or pass --draft-config FILE"
        if entry is None:
            raise OfflineError(
                f"no config for drafter {repo}: {why}, and it is not in the registry", hint=hint
            )
        raise UnknownDraftConfig(
            f"no config for drafter {repo}{gated}: {why}, and {_unknown_facts(entry)}", hint, entry
        )
    gated = "; gated, cannot verify offline" if entry.gated else ""
    notes.append(f"{why}; checked against the registry fingerprint{gated}")
    return _with(side, f"registry {entry.slug} (draft fingerprint)"), synth, notes


def _with(side: Side, source: str, folder: Path | None = None) -> Side:
    return Side(side.name, source, side.entry, side.how, folder)


def _local_config(name: str | None) -> Path | None:
    path = Path(name).expanduser() if name else None
    if path is None or not path.exists():
        return None
    if path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(
            f"{path} is a directory without config.json",
            hint="point at the model's own folder (the one holding config.json), or pass --config FILE",
        )
    return path / "config.json" if path.is_dir() else path


def _folder(name: str) -> Path | None:
    """A local model folder given by name (a config.json file alone says nothing of its siblings)."""
    path = Path(name).expanduser()
    return path if path.is_dir() else None


def _cached_config(repo: str, revision: str | None) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    from dflash_zoo.zoo import hub

    try:
        found = try_to_load_from_cache(repo, "config.json", cache_dir=hub.hub_cache_dir(), revision=revision)
    except ValueError:  # HFValidationError: not a valid repo id
        return None
    return Path(found) if isinstance(found, str) else None


def _hub_config(repo: str, revision: str | None) -> Path:
    """Download only `config.json` into the HF cache; hub errors become ZooErrors with a next step.

    Through `hub.snapshot` (one listing call, then a verified fetch), not `hf_hub_download`: that one retries
    an unreachable Hub five times with backoff (~25 s, a log line each), where `pull` fails at once.
    """
    from dflash_zoo.zoo import hub

    return hub.snapshot(repo, revision, allow_patterns=["config.json"], offline=False) / "config.json"


def _read_json(path: Path) -> dict:
    from dflash_zoo.engine.target_files import read_config

    if not path.is_file():
        raise NotFoundError(f"no config file at {path}", hint="check the path, or pass --config FILE")
    return read_config(path)


def _draft(path: Path, num_target_layers: int) -> DraftConfig:
    return normalize_config_file(_read_json(path), path, num_target_layers=num_target_layers)


def fingerprint(cfg: dict, cls: type[TargetAdapter]) -> TargetFingerprint:
    """model_type from the top level; shapes from the (text) decoder config."""
    text = cls.text_config_dict(cfg)
    values = {k: text.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    values["vocab_size"] = values["vocab_size"] or cfg.get("vocab_size")
    missing = [k for k, v in values.items() if not isinstance(v, int) or isinstance(v, bool)]
    missing += [] if isinstance(cfg.get("model_type"), str) and cfg["model_type"] else ["model_type"]
    if missing:
        raise ConfigError(
            f"target config lacks {', '.join(missing)}",
            hint="check that --target (or --config) is the target model's config.json; "
            'a target config names its family ("model_type") and its shape',
        )
    return TargetFingerprint(str(cfg["model_type"]), **values)


def registry_config(entry: Entry) -> dict[str, Any]:
    """A config dict of the family's real shape from the registry's target fingerprint.

    VLM wrappers (the adapter's decoder lives under `language_model`) nest the text shapes in `text_config`,
    as their Hub config.json does, so family validators that require a `text_config` accept it; the family's
    other shape facts (its adapter's `registry_shape`) go where the real config has them.
    """
    t = entry.target
    text: dict[str, Any] = {k: v for k, v in asdict(t).items() if k != "model_type"}
    cls = find_adapter(t.model_type)
    family = dict(cls.registry_shape) if cls is not None else {}
    every = family.pop("gdn_every", None)
    if every:
        text["layer_types"] = [
            "full_attention" if i % every == every - 1 else "linear_attention"
            for i in range(t.num_hidden_layers)
        ]
    if cls is not None and "language_model" in cls.layers_path:
        return {"model_type": t.model_type, "text_config": family | text}
    family.pop("model_type", None)
    return {"model_type": t.model_type, **family, **text}


def _by_fingerprint(reg: Registry, fp: TargetFingerprint) -> tuple[Entry | None, str | None]:
    found = reg.by_fingerprint(fp.model_type, fp.hidden_size, fp.num_hidden_layers, fp.vocab_size)
    return (found[0], "fingerprint") if found else (None, None)


def _unknown_facts(entry: Entry) -> str:
    """Why the registry cannot stand in for the drafter's config: what it does not know."""
    d = entry.draft
    if d.architecture is None:
        return "its architecture is not one dflash-zoo runs (see `dflash-zoo info` notes)"
    names = {"block_size": "block size", "target_layer_ids": "taps", "num_layers": "depth"}
    missing = [label for key, label in names.items() if getattr(d, key) is None]
    if not entry.target.known:  # the drafter's width and vocabulary are its target's
        missing.append("width and vocabulary (its target's text shape is not public)")
    return f"the registry does not know its {', '.join(missing)}"


def _fingerprint_draft(entry: Entry) -> DraftConfig | None:
    """A DraftConfig from registry facts; only the fingerprint fields are meaningful. None if incomplete."""
    d, t = entry.draft, entry.target
    if d.block_size is None or d.target_layer_ids is None or d.num_layers is None or d.architecture is None:
        return None
    if not t.known:  # a drafter's width and vocabulary are its target's
        return None
    n = d.num_layers
    return DraftConfig(
        hidden_size=t.hidden_size, num_hidden_layers=n, num_attention_heads=0, num_key_value_heads=0,
        head_dim=0, intermediate_size=0, vocab_size=t.vocab_size, block_size=d.block_size,
        target_layer_ids=d.target_layer_ids, num_target_layers=t.num_hidden_layers,
        mask_token_id=d.mask_token_id, layer_types=(FULL,) * n, sliding_window=None,
        causal=(False,) * n, rope=RopeSpec(), arch=d.architecture,
    )  # fmt: skip


def entry_architecture(entry: Entry, lock: dict | None = None) -> str:
    """The drafter's architecture as `list` and `info` show it: the cached config's variant ("dflash",
    "dflash (in-block causal)", "dflash2") when the pinned or registered revision is in the HF cache, else the
    registry's architecture; "?" for an architecture dflash-zoo does not run. Never touches the network."""
    from dflash_zoo.zoo.registry import pins_of

    pins = pins_of(entry, lock) if lock is not None else read_pins(entry)
    for rev in dict.fromkeys(r for r in (pins.draft, entry.draft_revision) if r):
        cached = _cached_config(entry.draft_repo, rev)
        if cached is None:
            continue
        try:
            return _draft(cached, entry.target.num_hidden_layers).variant
        except ZooError:  # an unreadable or foreign config: fall back to the registry's word
            break
    return entry.draft.architecture or "?"
