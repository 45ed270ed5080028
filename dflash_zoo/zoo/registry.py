"""The pair registry (`registry.yaml`) and the zoo's lock file; torch-free.

Contract:
- `load_registry()` reads the built-in `registry.yaml` (shipped as `dflash_zoo/registry.yaml`, a symlink to
  the top-level file) plus `$DFLASH_ZOO_REGISTRY` when set. Every entry is validated by `registry_schema`;
  a malformed one raises `ConfigError` naming the entry and the field. A slug or alias used twice is an
  error naming both entries.
- Status downgrade: the YAML states the author's intended status. An entry whose adapter is not registered
  in this install (`dflash_zoo.adapters.find_adapter(entry.adapter)` is None) is loaded as
  "unsupported-here" with reason "no adapter for model_type X in this install", so the status stays true
  as adapters land or fail to import.
- Entries the author marked "unsupported-here" (`declared_status`) are published drafters dflash-zoo lists but
  cannot run; their target shape may be unknown (`TargetFingerprint.known`). `refuse_unrunnable` is the one
  refusal every command that would fetch, serve or run one raises (`UnsupportedModelError`, with the reason).
- `Registry.resolve(name)` tries slug, alias, target repo, draft repo, then variant repo, each an exact
  case-insensitive match; never a substring or prefix. `by_fingerprint` matches target config shapes.
- `read_lock` / `write_lock` keep `$DFLASH_ZOO_HOME/lock.json`: {slug: {draft_repo, draft_revision,
  draft_commit, target_repo, target_revision, target_commit, pulled_at}} (target keys only once the target was
  pulled; `commit` / `requested_revision` repeat the draft's for older readers); `read_pins` reads both pins,
  `drop_pins` forgets those of removed repos; writes are atomic.

Longer than the ~300 lines we aim for: the entry dataclasses, resolution by name and fingerprint, and the lock file share one schema.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from importlib.resources import files
from pathlib import Path
from typing import Any

from dflash_zoo.drafters import arch_names
from dflash_zoo.errors import ConfigError, NotFoundError, UnsupportedModelError
from dflash_zoo.paths import zoo_home
from dflash_zoo.zoo.revisions import Revision, parse_revisions
from dflash_zoo.zoo.schema import STATUSES, parse_document  # noqa: F401  (STATUSES re-exported)

log = logging.getLogger("dflash_zoo")


@dataclass(frozen=True)
class TargetFingerprint:
    """Shape of the target's text model: what a drafter must match. None: not public (an unsupported-here
    entry only, `zoo/schema.py`)."""

    model_type: str
    hidden_size: int | None
    num_hidden_layers: int | None
    vocab_size: int | None

    @property
    def known(self) -> bool:
        """Whether every shape fact is known (a config can be built and compared from it)."""
        return None not in (self.hidden_size, self.num_hidden_layers, self.vocab_size)


@dataclass(frozen=True)
class DraftFingerprint:
    """Drafter facts from its pinned config; None (or None taps) where the registry records them unknown."""

    block_size: int | None
    target_layer_ids: tuple[int, ...] | None
    mask_token_id: int | None
    num_layers: int | None
    architecture: str | None = "dflash"  # dflash_zoo.drafters name; None: an architecture not run here


@dataclass(frozen=True)
class Entry:
    """One published drafter and the target it was trained for."""

    slug: str
    aliases: tuple[str, ...]
    target_repo: str
    draft_repo: str
    draft_revision: str
    adapter: str
    target: TargetFingerprint
    draft: DraftFingerprint
    variants: tuple[str, ...]
    chat_template_kwargs: dict
    thinking: str
    gated: bool
    license: str
    status: str
    reason: str | None
    draft_size_bytes: int | None
    notes: str
    target_revision: str = "main"  # "main" where no commit is known
    draft_license: str | None = (
        None  # the drafter repo's own licence (`license` is the target's); None: unknown
    )
    draft_gated: bool | None = None  # the drafter repo alone; None: not recorded
    gated_seen: str | None = None  # when the gated flags were last observed (YYYY-MM-DD); None: not recorded
    target_params_b: float | None = None  # total parameters, billions (bf16 weights = 2 bytes each)
    tp_hint: int = 1  # tensor-parallel size on 80 GB GPUs when no GPU is visible to measure
    shape_from: str | None = None  # the repo the target fingerprint was copied from, when not its own
    mask_token_ids_seen: dict = field(default_factory=dict)  # revision label -> mask id seen there
    revisions: tuple[Revision, ...] = ()  # known uploads of the drafter repo, newest first
    declared_status: str = "supported"  # the YAML's status, before the missing-adapter downgrade

    @property
    def draft_architecture(self) -> str | None:
        return self.draft.architecture

    @property
    def listed_only(self) -> bool:
        """Marked unsupported-here by its author: listed, but refused by registry id (`refuse_unrunnable`).
        An entry only downgraded for a missing adapter in this install is not (the engines bring their own
        model code)."""
        return self.declared_status == "unsupported-here"

    @property
    def target_bf16_bytes(self) -> int | None:
        return None if self.target_params_b is None else int(self.target_params_b * 2e9)

    def names(self) -> tuple[str, ...]:
        """Every name `resolve` and `list PATTERN` know this entry by."""
        return (self.slug, *self.aliases, self.target_repo, self.draft_repo, *self.variants)


_RESOLVE_ORDER = ("slug", "alias", "target", "draft", "variant")


class Registry:
    """An ordered, validated set of entries (built-in first, then the extra file)."""

    def __init__(self, entries: tuple[Entry, ...]):
        self.entries = tuple(entries)

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def resolve(self, name: str) -> Entry:
        """The entry called `name` (see `lookup`); raises NotFoundError with the nearest names as a hint."""
        found = self.lookup(name)
        if found is None:
            near = self.suggest(name)
            hint = (
                f"did you mean: {', '.join(near)}?" if near else "run `dflash-zoo list` to see the registry"
            )
            raise NotFoundError(f"no registry entry named {name!r}", hint=hint)
        return found[0]

    def lookup(self, name: str, kinds: tuple[str, ...] = _RESOLVE_ORDER) -> tuple[Entry, str] | None:
        """(entry, how) or None; `how` is one of `kinds`: slug, alias, target, draft, variant (tried in that
        order)."""
        key = name.strip().lower()
        for how in kinds:
            for entry in self.entries:
                if key in (n.lower() for n in _names_of(entry, how)):
                    return entry, how
        return None

    def suggest(self, name: str, n: int = 3) -> list[str]:
        """Slugs of the entries whose names are closest to `name` (difflib)."""
        by_name = {nm.lower(): e.slug for e in self.entries for nm in e.names()}
        close = difflib.get_close_matches(name.strip().lower(), list(by_name), n=n * 3, cutoff=0.5)
        return list(dict.fromkeys(by_name[c] for c in close))[:n]

    def by_fingerprint(
        self, model_type: str, hidden_size: int, num_hidden_layers: int, vocab_size: int
    ) -> list[Entry]:
        """Entries whose target has this shape; model types are compared through adapter aliases. An entry
        whose target shape is not public matches nothing."""
        from dflash_zoo.adapters import canonical_model_type

        want = (canonical_model_type(model_type), hidden_size, num_hidden_layers, vocab_size)
        return [e for e in self.entries if e.target.known and _fingerprint_key(e.target) == want]

    def match(self, pattern: str | None) -> list[Entry]:
        """Entries with any name matching the glob `pattern` (case-insensitive); all when None."""
        if not pattern:
            return list(self.entries)
        pat = pattern.lower()
        return [e for e in self.entries if any(fnmatch.fnmatchcase(n.lower(), pat) for n in e.names())]


def _names_of(entry: Entry, how: str) -> tuple[str, ...]:
    return {
        "slug": (entry.slug,),
        "alias": entry.aliases,
        "target": (entry.target_repo,),
        "draft": (entry.draft_repo,),
        "variant": entry.variants,
    }[how]


def _fingerprint_key(fp: TargetFingerprint) -> tuple:
    from dflash_zoo.adapters import canonical_model_type

    return canonical_model_type(fp.model_type), fp.hidden_size, fp.num_hidden_layers, fp.vocab_size


# ---- loading ---------------------------------------------------------------------------------------


def load_registry(extra: str | Path | None = None) -> Registry:
    """Built-in entries plus those of `extra` (default: `$DFLASH_ZOO_REGISTRY`), validated.

    Raises:
        ConfigError: a malformed file or entry (message names the entry and field), a duplicate slug or
            alias (names both entries), or an extra file that does not exist.
    """
    builtin = files("dflash_zoo") / "registry.yaml"
    entries = _load_file(builtin.read_text(encoding="utf-8"), "built-in registry.yaml")
    extra = extra if extra is not None else (os.environ.get("DFLASH_ZOO_REGISTRY") or None)
    if extra is not None:
        entries += _load_extra(Path(extra).expanduser())
    _check_unique(entries)
    return Registry(tuple(_apply_adapter_rule(e) for e, _ in entries))


def _load_extra(path: Path) -> list[tuple[Entry, str]]:
    """The entries of the extra registry file `DFLASH_ZOO_REGISTRY` names; every failure is a ConfigError
    naming the file and saying how to do without it."""
    unset = "fix it, or unset DFLASH_ZOO_REGISTRY"
    if not path.is_file():
        what = "is a directory, not a YAML file" if path.is_dir() else "does not exist"
        raise ConfigError(f"extra registry {path} {what}", hint=unset)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"extra registry {path} is not valid UTF-8 (byte {exc.start}: {exc.object[exc.start]:#04x})",
            hint="re-save it as UTF-8, or unset DFLASH_ZOO_REGISTRY",
        ) from exc
    except OSError as exc:
        raise ConfigError(f"cannot read extra registry {path}: {exc.strerror or exc}", hint=unset) from exc
    try:
        return _load_file(text, f"extra registry {path}")
    except ConfigError as exc:  # the file DFLASH_ZOO_REGISTRY names: say how to do without it
        raise ConfigError(str(exc), hint=exc.hint or unset) from exc


def _load_file(text: str, source: str) -> list[tuple[Entry, str]]:
    """Parse and validate one YAML document into (entry, source) pairs."""
    return [(_to_entry(raw), source) for raw in parse_document(text, source)]


def _to_entry(raw: dict[str, Any]) -> Entry:
    t, d = raw["target"], raw["draft"]
    taps = d.get("target_layer_ids")
    return Entry(
        slug=raw["slug"],
        aliases=tuple(raw.get("aliases") or ()),
        target_repo=t["repo"],
        draft_repo=d["repo"],
        draft_revision=d["revision"],
        adapter=raw["adapter"],
        target=TargetFingerprint(t["model_type"], t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]),
        draft=DraftFingerprint(
            d["block_size"],
            None if taps is None else tuple(taps),
            d["mask_token_id"],
            d["num_layers"],
            d["architecture"],
        ),
        variants=tuple(raw.get("variants") or ()),
        chat_template_kwargs=dict(raw.get("chat_template_kwargs") or {}),
        thinking=raw.get("thinking", ""),
        gated=raw.get("gated", False),
        license=raw["license"],
        status=raw["status"],
        reason=raw.get("reason"),
        draft_size_bytes=d.get("size_bytes"),
        notes=raw.get("notes", ""),
        target_revision=t.get("revision", "main"),
        draft_license=d.get("license"),
        draft_gated=d.get("gated"),
        gated_seen=raw.get("gated_seen"),
        target_params_b=t.get("params_b"),
        tp_hint=t.get("tp_hint", 1),
        shape_from=t.get("shape_from"),
        mask_token_ids_seen=dict(d.get("mask_token_ids_seen") or {}),
        revisions=parse_revisions(d["revisions"], raw["slug"], tuple(arch_names()))
        if "revisions" in d
        else (),
        declared_status=raw["status"],
    )


def _check_unique(entries: list[tuple[Entry, str]]) -> None:
    """No two entries may share a slug or alias (case-insensitive)."""
    seen: dict[str, tuple[str, str]] = {}
    for entry, source in entries:
        for name in dict.fromkeys(n.lower() for n in (entry.slug, *entry.aliases)):
            if name in seen:
                other, other_src = seen[name]
                raise ConfigError(
                    f"registry name {name!r} is used by entry {other!r} ({other_src}) "
                    f"and by entry {entry.slug!r} ({source})",
                    hint="rename the slug or alias in the extra registry (DFLASH_ZOO_REGISTRY)",
                )
            seen[name] = (entry.slug, source)


def _apply_adapter_rule(entry: Entry) -> Entry:
    """Downgrade an entry whose adapter is not installed to "unsupported-here"."""
    from dflash_zoo.adapters import find_adapter

    if find_adapter(entry.adapter) is not None or entry.status == "unsupported-here":
        return entry
    reason = f"no adapter for model_type {entry.adapter} in this install"
    log.debug("registry entry %s: %s", entry.slug, reason)
    return replace(entry, status="unsupported-here", reason=reason)


def refuse_unrunnable(entry: Entry, hint: str | None = None) -> None:
    """Raise `UnsupportedModelError` with the reason for an entry its author marked unsupported-here:
    dflash-zoo lists it, but fetching, serving or running it by its registry id is refused (`listed_only`)."""
    if not entry.listed_only:
        return
    raise UnsupportedModelError(
        f"{entry.slug} is marked unsupported here: {entry.reason}",
        hint=hint or f"`dflash-zoo info {entry.slug}` shows what is known and what is missing",
    )


# ---- zoo state -------------------------------------------------------------------------------------


def lock_path() -> Path:
    return zoo_home() / "lock.json"


def read_lock() -> dict:
    """The lock file as {slug: {...}}; {} when it does not exist. Raises ConfigError when unreadable."""
    path = lock_path()
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"lock file {path} is unreadable: {exc}", hint=f"delete {path} and pull again"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"lock file {path} is not a JSON object", hint=f"delete {path} and pull again")
    for slug, rec in data.items():  # each record: an object of strings (repos, commits, revisions, times)
        if not isinstance(rec, dict) or not all(isinstance(v, (str, type(None))) for v in rec.values()):
            raise ConfigError(
                f"lock file {path}: the record of {slug!r} is not an object of strings: {rec!r}",
                hint=f"delete {path} and pull again",
            )
    return data


@dataclass(frozen=True)
class Pins:
    """The commits `pull` recorded for an entry: the drafter's (and the target's, once pulled), else None."""

    draft: str | None = None
    target: str | None = None


def read_pins(entry: Entry) -> Pins:
    """Pins of `entry` from the lock file; a pin recorded for another repo (the entry changed) is ignored."""
    return pins_of(entry, read_lock())


def pins_of(entry: Entry, lock: dict) -> Pins:
    """`read_pins` on an already-read lock file (one read for many entries)."""
    rec = lock.get(entry.slug) or {}
    draft = rec.get("draft_commit") or rec.get("commit")  # "commit": lock files written before target pins
    return Pins(
        draft=draft if rec.get("draft_repo") == entry.draft_repo else None,
        target=rec.get("target_commit") if rec.get("target_repo") == entry.target_repo else None,
    )


def write_lock(
    slug: str,
    draft_repo: str,
    requested_revision: str,
    commit: str,
    *,
    target_repo: str | None = None,
    target_revision: str | None = None,
    target_commit: str | None = None,
) -> None:
    """Record the pinned draft commit of `slug` (and the target's, when given); atomic (temp file + replace).

    A target pin recorded earlier for the same target repo is kept when this pull did not fetch the target.
    """
    data = read_lock()
    old = data.get(slug) or {}
    rec = {
        "draft_repo": draft_repo,
        "draft_revision": requested_revision,
        "draft_commit": commit,
        "requested_revision": requested_revision,  # the pre-target-pin keys, still read by older code
        "commit": commit,
        "pulled_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if target_commit is not None:
        rec |= {"target_repo": target_repo, "target_revision": target_revision or "main",
                "target_commit": target_commit}  # fmt: skip
    elif old.get("target_commit") and old.get("target_repo") == target_repo:
        rec |= {k: old[k] for k in ("target_repo", "target_revision", "target_commit") if k in old}
    data[slug] = rec
    _write_lock_data(data)


_DRAFT_KEYS = ("draft_repo", "draft_revision", "draft_commit", "requested_revision", "commit")
_TARGET_KEYS = ("target_repo", "target_revision", "target_commit")


def drop_pins(repo_ids: list[str] | tuple[str, ...]) -> list[str]:
    """Forget the pins of `repo_ids` (removed from the cache) in every entry; returns "slug (side)" labels.

    An entry left with no pin at all is removed from the lock file. Nothing is written when nothing changes.
    """
    gone = {r.lower() for r in repo_ids}
    data = read_lock()
    dropped = []
    for slug, rec in list(data.items()):
        for side, keys in (("draft", _DRAFT_KEYS), ("target", _TARGET_KEYS)):
            if str(rec.get(f"{side}_repo", "")).lower() in gone:
                dropped.append(f"{slug} ({side})")
                for key in keys:
                    rec.pop(key, None)
        if not (rec.get("commit") or rec.get("draft_commit") or rec.get("target_commit")):
            data.pop(slug)
    if dropped:
        _write_lock_data(data)
    return dropped


def _write_lock_data(data: dict) -> None:
    from dflash_zoo.engine.outdir import umask

    path = lock_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".lock.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=True)
            fh.write("\n")
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp's files are private; the lock file is an ordinary one
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
