"""Known uploads of a drafter repo and which one a config is (torch-free).

z-lab re-trains drafters and re-uploads them under the same repo id with new shapes (more layers, more taps, a
wider sliding window). A registry entry lists the uploads it knows under `draft.revisions`, newest first, each
with a label, the commit when one is public (a full 40-hex id, or the short prefix a public source quotes) and
the shape facts of that upload; `null` facts are unknown and never compared.

`parse_revisions(raw, where)` validates the list into `Revision`s; `identify(revisions, config)` compares a
normalised draft config with each one and returns a `RevisionMatch`: the uploads it equals on every known
fact, or, when none fits, what differs from each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from dflash_zoo.errors import ConfigError

_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
# fact -> (the DraftConfig attribute it is compared with, its kind)
FACTS: dict[str, tuple[str, str]] = {
    "architecture": ("arch", "str"),
    "num_layers": ("num_hidden_layers", "int"),
    "target_layer_ids": ("target_layer_ids", "[int]"),
    "mask_token_id": ("mask_token_id", "int"),
    "block_size": ("block_size", "int"),
    "sliding_window": ("sliding_window", "int"),
}
_KEYS = ("label", "commit", "date", *FACTS)


@dataclass(frozen=True)
class Revision:
    """One upload of a drafter repo: a label, its commit (None: not public) and its shape facts (None: unknown)."""

    label: str
    commit: str | None = None
    date: str | None = None
    architecture: str | None = None
    num_layers: int | None = None
    target_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    block_size: int | None = None
    sliding_window: int | None = None

    def name(self) -> str:
        """`the <label> upload (commit <c>)`, as `check` says it."""
        commit = f" (commit {self.commit})" if self.commit else " (commit not public)"
        return f"the {self.label} upload{commit}"

    def known(self) -> dict[str, Any]:
        """The facts this upload is known by (non-null)."""
        return {k: getattr(self, k) for k in FACTS if getattr(self, k) is not None}


@dataclass(frozen=True)
class RevisionMatch:
    """`matches`: the uploads equal to the config on every known fact; `differences`: label -> what differs."""

    matches: tuple[Revision, ...]
    differences: dict[str, list[str]]

    def message(self) -> str:
        if self.matches:
            return "your cached copy is " + " or ".join(r.name() for r in self.matches)
        parts = [f"{label}: {'; '.join(diff)}" for label, diff in self.differences.items()]
        return "matches none of the known uploads: " + " | ".join(parts)


def parse_revisions(raw: Any, where: str, archs: tuple[str, ...]) -> tuple[Revision, ...]:
    """Validate `draft.revisions` (a list of mappings) into Revisions; ConfigError names the item and field."""
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where}: field 'draft.revisions' must be a non-empty list of uploads")
    out, labels = [], set()
    for i, item in enumerate(raw):
        field = f"draft.revisions[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: field {field!r} must be a mapping, got {item!r}")
        unknown = sorted(set(item) - set(_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {unknown} in {field!r}; known: {', '.join(_KEYS)}")
        rev = _revision(item, f"{where}: field {field!r}", archs)
        if rev.label in labels:
            raise ConfigError(f"{where}: field {field!r} repeats the label {rev.label!r}")
        labels.add(rev.label)
        out.append(rev)
    return tuple(out)


def _revision(item: dict, where: str, archs: tuple[str, ...]) -> Revision:
    label, commit, date = item.get("label"), item.get("commit"), item.get("date")
    if not isinstance(label, str) or not label.strip():
        raise ConfigError(f"{where} needs a 'label' (a date or a name of the upload)")
    if commit is not None and not (isinstance(commit, str) and _COMMIT.match(commit)):
        raise ConfigError(f"{where}: 'commit' must be 7 to 40 lowercase hex digits, got {commit!r}")
    if date is not None and not isinstance(date, str):
        raise ConfigError(f"{where}: 'date' must be a string (YYYY-MM-DD), got {date!r}")
    facts = {k: item.get(k) for k in FACTS}
    for key, (_, kind) in FACTS.items():
        _check_fact(facts[key], kind, f"{where}.{key}")
    if facts["architecture"] is not None and facts["architecture"] not in archs:
        raise ConfigError(
            f"{where}.architecture must be one of {', '.join(archs)}, got {facts['architecture']!r}"
        )
    if all(v is None for v in facts.values()):
        raise ConfigError(f"{where} gives no shape fact: an upload is told apart by at least one")
    taps = facts["target_layer_ids"]
    facts["target_layer_ids"] = None if taps is None else tuple(taps)
    return Revision(label=label, commit=commit, date=date, **facts)


def _check_fact(value: Any, kind: str, where: str) -> None:
    ok = {
        "str": lambda v: isinstance(v, str) and v != "",
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "[int]": lambda v: (
            isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        ),
    }[kind]
    if value is not None and not ok(value):
        raise ConfigError(f"{where} must be of type {kind} or null, got {value!r}")


def identify(revisions: tuple[Revision, ...], config: Any) -> RevisionMatch:
    """Which known uploads a normalised draft config (`DraftConfig`) is, compared on each upload's known facts."""
    matches, differences = [], {}
    for rev in revisions:
        diff = [
            f"{key} {_plain(getattr(config, FACTS[key][0]))} vs {_plain(want)}"
            for key, want in rev.known().items()
            if _plain(getattr(config, FACTS[key][0])) != _plain(want)
        ]
        if diff:
            differences[rev.label] = diff
        else:
            matches.append(rev)
    return RevisionMatch(tuple(matches), {} if matches else differences)


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, (list, tuple)) else v
