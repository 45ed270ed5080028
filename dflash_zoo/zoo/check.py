"""`check`: is a target / drafter pair compatible? Configs only: never imports torch or transformers.

`check_pair` finds both configs (`check_sources.py` documents the order: local files, HF cache, registry
fingerprint, Hub) and returns a `CheckReport` of PASS / WARN / FAIL rows: adapter and cache strategy,
transformers version (against the package's own floor), the field checks of `adapter.validate` (base
`TargetAdapter` when no adapter exists: hidden size, taps, mask id, vocab), block size, the registry's
expectations (status, pinned fingerprint and revision, thinking / chat template) and how the pair relates to
the registry (a variant or fingerprint match is compatible, with a WARN that acceptance may be lower).

Rows also name the drafter's architecture ("dflash", "dflash (in-block causal)", "dflash2") and, for an entry
that lists its known uploads, which upload the config is (`zoo/revisions.py`).

The verdict is "incompatible" when any row is FAIL; WARN rows keep it "compatible". A registered drafter whose
config is out of reach and whose fingerprint the registry does not know gives the verdict "unverified" with the
reason in a FAIL row; so does a registered target whose text shape is not public (an unsupported-here entry)
when no config at hand gives it. Failing to obtain a config otherwise raises a `ZooError` (exit 1); the CLI
maps "incompatible" and "unverified" to exit 3. An unsupported-here entry's reason is a FAIL "status" row.

A little over the ~300 lines we aim for: the report, its three verdicts and every row kind read together.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from dflash_zoo import drafters
from dflash_zoo.adapters import canonical_model_type, find_adapter, supported_model_types
from dflash_zoo.adapters.base import MASK_UNKNOWN, Problem, TargetAdapter
from dflash_zoo.engine.config import DraftConfig
from dflash_zoo.errors import looks_like_path, missing_directory
from dflash_zoo.zoo.check_sources import (
    Side,
    UnknownDraftConfig,
    UnknownTargetShape,
    resolve_draft,
    resolve_target,
)
from dflash_zoo.zoo.registry import (
    DraftFingerprint,
    Entry,
    Registry,
    TargetFingerprint,
    load_registry,
    read_pins,
)
from dflash_zoo.zoo.revisions import identify
from dflash_zoo.zoo.serve import version_tuple

_FIELD_ROWS = {"hidden_size": "hidden size", "taps": "taps", "num_target_layers": "taps"}
_FIELD_ROWS.update({"mask_token_id": "mask id", "vocab_size": "vocab"})


@dataclass(frozen=True)
class CheckRow:
    check: str
    status: str  # PASS | WARN | FAIL
    detail: str


@dataclass(frozen=True)
class CheckReport:
    """The outcome of `check_pair`; `verdict` is "compatible", "incompatible" or "unverified"."""

    rows: tuple[CheckRow, ...]
    verdict: str
    target: str
    draft: str
    entry: str | None
    target_source: str
    draft_source: str
    target_fingerprint: TargetFingerprint
    draft_fingerprint: DraftFingerprint

    @property
    def compatible(self) -> bool:
        return self.verdict == "compatible"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: {verdict, compatible, rows: [{check, status, detail}], target, draft, ...}."""
        return {**asdict(self), "compatible": self.compatible}


def check_pair(
    target: str,
    draft: str | None = None,
    config: str | Path | None = None,
    draft_config: str | Path | None = None,
    offline: bool | None = None,
    registry: Registry | None = None,
) -> CheckReport:
    """Check `target` against `draft` (or the target's registered drafter) from configs alone.

    Raises:
        NotFoundError / OfflineError / ConfigError: a config cannot be found or read (exit 1).
        InvalidArgumentError: `target` names a drafter (exit 2).
    """
    from dflash_zoo.quantization import check_rows as quantization_rows
    from dflash_zoo.zoo import hub

    for name in (target, draft):  # `./my-finetune` that is not there: a path, not a registry miss
        if name and looks_like_path(name) and not Path(name).expanduser().exists():
            raise missing_directory(name)
    reg = registry or load_registry()
    offline = hub.is_offline() if offline is None else offline
    try:
        tcfg, tside, fp, cls = resolve_target(reg, target, config, offline)
    except UnknownTargetShape as exc:
        return _unknown_target(exc, target)
    try:
        dside, dcfg, notes = resolve_draft(reg, draft, draft_config, tside, fp, offline)
    except UnknownDraftConfig as exc:
        return _unverified(exc, target, tside, fp, cls)
    extra = [CheckRow("draft config", "WARN", n) for n in notes]
    rows = _adapter_rows(fp.model_type, cls) + _field_rows(cls or TargetAdapter, tcfg, dcfg)
    rows += extra + _entry_rows(dside, dcfg, cls) + _pair_rows(tside, dside, fp)
    quant = [CheckRow(*row) for row in quantization_rows(tcfg, dcfg.raw, dside.folder)]
    if tside.source.startswith("registry"):  # a shape from the registry says nothing of the quantization
        unknown = "unknown: the target's config.json is not cached (`dflash-zoo pull ID --with-target`)"
        quant = [CheckRow("quantization", "WARN", unknown) if r.check == "quantization" else r for r in quant]
    rows += quant + _verifier_rows(dcfg.verifier, tside)
    if dcfg.mask_token_id is None and _tokenizer_lacks_mask(tside.folder):  # then `generate` has no mask id
        why = f"no mask id in the draft config, and {target}'s tokenizer has no {MASK_TOKEN} token either"
        rows = [CheckRow("mask id", "FAIL", why) if r.check == "mask id" else r for r in rows]
    verdict = "incompatible" if any(r.status == "FAIL" for r in rows) else "compatible"
    dfp = DraftFingerprint(
        dcfg.block_size, dcfg.target_layer_ids, dcfg.mask_token_id, dcfg.num_hidden_layers, dcfg.arch
    )
    slug = dside.entry.slug if dside.entry else None
    return CheckReport(tuple(rows), verdict, target, dside.name, slug, tside.source, dside.source, fp, dfp)


def _unverified(
    exc: UnknownDraftConfig, target: str, tside: Side, fp: TargetFingerprint, cls: type[TargetAdapter] | None
) -> CheckReport:
    """The report for a registered drafter that cannot be checked: target rows, the reason, and the next step."""
    e = exc.entry
    rows = _adapter_rows(fp.model_type, cls) + [CheckRow("draft config", "FAIL", f"{exc} ({exc.hint})")]
    rows += _status_rows(e)
    side = Side(e.draft_repo, f"registry {e.slug} (draft fingerprint unknown)", e, None)
    return CheckReport(
        tuple(rows), "unverified", target, e.draft_repo, e.slug, tside.source, side.source, fp, e.draft
    )


def _unknown_target(exc: UnknownTargetShape, target: str) -> CheckReport:
    """The report for a registered target whose text shape is not public: the adapter, why, and the reason."""
    e = exc.entry
    rows = _adapter_rows(e.target.model_type, find_adapter(e.target.model_type))
    rows += [CheckRow("target config", "FAIL", f"{exc} ({exc.hint})"), *_status_rows(e)]
    sources = (f"registry {e.slug} (target shape not public)", f"registry {e.slug}")
    return CheckReport(tuple(rows), "unverified", target, e.draft_repo, e.slug, *sources, e.target, e.draft)


def _status_rows(e: Entry) -> list[CheckRow]:
    """A preview's reason warns; an unsupported-here entry's reason fails (dflash-zoo cannot run it)."""
    if e.status == "supported":
        return []
    severity = "FAIL" if e.status == "unsupported-here" else "WARN"
    return [CheckRow("status", severity, f"{e.status}: {e.reason}")]


# ---- rows ------------------------------------------------------------------------------------------


def _adapter_rows(model_type: str, cls: type[TargetAdapter] | None) -> list[CheckRow]:
    installed = _installed("transformers")
    if cls is None:
        known = ", ".join(supported_model_types())
        return [CheckRow("adapter", "FAIL", f"no adapter for model_type {model_type!r} (supported: {known})")]
    canon = canonical_model_type(model_type)
    alias = f" (alias of {canon})" if canon != model_type else ""
    rows = [
        CheckRow("adapter", "PASS", f"{model_type}{alias} -> {cls.__name__}, cache: {cls.cache_strategy}")
    ]
    floor = transformers_floor()
    needs = f"needs >= {floor}" if floor else "the package's requirement is unknown"
    if installed is None:
        rows.append(CheckRow("transformers", "FAIL", f"not installed; {needs}"))
    else:
        ok = floor is None or version_tuple(installed) >= version_tuple(floor)
        rows.append(CheckRow("transformers", "PASS" if ok else "FAIL", f"{installed} ({needs})"))
    return rows


def transformers_floor() -> str | None:
    """The oldest transformers this installation of dflash-zoo supports: its own requirement (pyproject's
    `transformers>=...`), or None where the package metadata is not installed."""
    try:
        requires = metadata.requires("dflash-zoo") or []
    except metadata.PackageNotFoundError:
        return None
    found = (re.match(r"transformers\s*>=\s*([0-9][0-9.]*)", r) for r in requires)
    return next((m.group(1) for m in found if m), None)


MASK_TOKEN = "<|MASK|>"  # the token `generate` falls back on (loading.MASK_TOKEN_STRING, torch-free here)


def _tokenizer_lacks_mask(folder: Path | None) -> bool:
    """True when the target folder's (local or cached) tokenizer files are there and none names the mask token."""
    files = [folder / n for n in ("tokenizer.json", "tokenizer_config.json")] if folder else []
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files if f.is_file()]
    return bool(texts) and not any(MASK_TOKEN in t for t in texts)


def _field_rows(cls: type[TargetAdapter], tcfg: dict, d: DraftConfig) -> list[CheckRow]:
    """adapter.validate problems as rows, plus PASS rows for the standard checks it did not flag."""
    problems: list[Problem] = cls.validate(tcfg, d)
    rows = [CheckRow(_FIELD_ROWS.get(p.code, p.code), p.severity, p.message) for p in problems]
    text = cls.text_config_dict(tcfg)
    vocab = text.get("vocab_size") or tcfg.get("vocab_size")
    rule = " (default rule)" if d.taps_from_default_rule else ""
    passes = {
        "hidden size": f"{d.hidden_size} (target {text.get('hidden_size')})",
        "taps": f"{list(d.target_layer_ids)}{rule} < {text.get('num_hidden_layers')} target layers",
        "mask id": f"{d.mask_token_id} < {vocab} embedding rows",
        "vocab": f"{d.vocab_size} (target {vocab})",
    }
    out = []
    for name, detail in passes.items():  # stable order; a flagged check shows its problems instead
        flagged = [r for r in rows if r.check == name]
        if not flagged and name == "mask id" and d.mask_token_id is None:  # an adapter that skipped it
            flagged = [CheckRow(name, "WARN", MASK_UNKNOWN)]
        out += flagged or [CheckRow(name, "PASS", detail)]
    out += [r for r in rows if r.check not in passes]  # family-specific codes
    spec = drafters.ARCHS[d.arch]
    engine = "fast engine" if spec.static_fast_path else "eager engine only"
    return out + [
        CheckRow("block size", "PASS", f"{d.block_size} ({d.block_size - 1} draft tokens per step)"),
        CheckRow("architecture", "PASS", f"{d.variant}: {spec.summary} ({engine})"),
    ]


def _entry_rows(side: Side, d: DraftConfig, cls: type[TargetAdapter] | None) -> list[CheckRow]:
    """Registry expectations: status, pinned fingerprint and revision, thinking / chat template."""
    e = side.entry
    if e is None:
        return [
            CheckRow("thinking", "WARN", "unregistered drafter: match the chat template it was trained with")
        ]
    rows = []
    if e.status == "preview":
        rows.append(CheckRow("status", "WARN", f"preview: {e.reason}"))
    elif e.status == "unsupported-here" and cls is not None:
        rows.append(CheckRow("status", "FAIL", f"unsupported here: {e.reason}"))
    if not side.source.startswith("registry"):
        rows += _pin_rows(e, d)
    kwargs = ", ".join(f"{k}={v}" for k, v in e.chat_template_kwargs.items()) or "default template"
    clash = {
        k: v
        for k, v in (cls.chat_template_kwargs if cls else {}).items()
        if e.chat_template_kwargs.get(k, v) != v
    }
    if clash:
        rows.append(
            CheckRow("thinking", "WARN", f"adapter default {clash} differs from the drafter's {kwargs}")
        )
    else:
        rows.append(CheckRow("thinking", "PASS", f"{kwargs}: {e.thinking}"))
    return rows


def _pin_rows(e: Entry, d: DraftConfig) -> list[CheckRow]:
    want = asdict(e.draft)
    got = {"block_size": d.block_size, "target_layer_ids": d.target_layer_ids, "architecture": d.arch}
    got.update(mask_token_id=d.mask_token_id, num_layers=d.num_hidden_layers)
    diff = [
        f"{k} {_plain(got[k])} vs {_plain(v)}"
        for k, v in want.items()
        if v is not None and _plain(v) != _plain(got[k])
    ]
    locked = read_pins(e).draft
    rows = []
    if diff:
        detail = (
            f"config differs from registry {e.slug}: {'; '.join(diff)} (repo re-uploaded? pin a revision)"
        )
        rows.append(CheckRow("registry fingerprint", "WARN", detail))
    if e.revisions:
        found = identify(e.revisions, d)
        rows.append(CheckRow("upload", "PASS" if found.matches else "WARN", found.message()))
    if locked or re.fullmatch(r"[0-9a-f]{40}", e.draft_revision):
        rows.append(CheckRow("revision", "PASS", f"pinned {locked or e.draft_revision}"))
    else:
        rows.append(
            CheckRow("revision", "WARN", f"tracks {e.draft_revision}; `dflash-zoo pull {e.slug}` pins it")
        )
    return rows


def _verifier_rows(named: str | None, t: Side) -> list[CheckRow]:
    """A speculators drafter names the verifier whose embedding and LM head it carries copies of; `generate`
    refuses it unless they equal the target's, which configs alone cannot tell."""
    if named is None:
        return []
    copies = f"the drafter carries copies of {named}'s embedding and LM head"
    if _same_model(named, t):
        return [CheckRow("verifier", "PASS", f"{copies}; `generate` compares them with the target's")]
    why = f"{copies}, not of {t.name}'s: `generate` refuses it unless the target's are identical"
    return [CheckRow("verifier", "WARN", why)]


def _same_model(named: str, t: Side) -> bool:
    """Whether a drafter's verifier name means the checked target: its name, registry repo or folder."""
    named_entry = t.entry is not None and t.how in ("slug", "alias", "target")  # not a variant or lookalike
    names = {t.name.lower(), t.entry.target_repo.lower() if named_entry else ""}
    if named.lower() in names:
        return True
    path = Path(named).expanduser()
    return t.folder is not None and path.is_dir() and path.resolve() == t.folder.resolve()


def _plain(v: Any) -> Any:
    """Tuples print as lists, matching the registry file and `info`."""
    return list(v) if isinstance(v, (list, tuple)) else v


def _pair_rows(t: Side, d: Side, fp: TargetFingerprint) -> list[CheckRow]:
    e = d.entry
    if e is None:
        return [
            CheckRow("pair", "WARN", f"drafter {d.name} is not in the registry: only config checks apply")
        ]
    if t.entry == e and t.how in ("slug", "alias", "target"):
        return [CheckRow("pair", "PASS", f"registered pair {e.slug}")]
    same = (canonical_model_type(fp.model_type), fp.hidden_size, fp.num_hidden_layers, fp.vocab_size) == (
        canonical_model_type(e.target.model_type), e.target.hidden_size, e.target.num_hidden_layers,
        e.target.vocab_size,
    )  # fmt: skip
    if not same:
        return [CheckRow("pair", "WARN", f"drafter {e.slug} was trained for {e.target_repo}, not {t.name}")]
    how = "a registered variant" if t.how == "variant" else "the same architecture (fingerprint)"
    return [
        CheckRow("pair", "PASS", f"compatible: {t.name} is {how} of {e.target_repo}"),
        CheckRow(
            "acceptance", "WARN", f"drafter trained on {e.target_repo}; acceptance may be lower on {t.name}"
        ),
    ]


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
