"""`list` / `ls`, `info` / `show` and `check`: registry and compatibility commands (torch-free).

Thin click layer over `dflash_zoo.zoo.registry` and `dflash_zoo.zoo.check`. Data goes to stdout (rich tables, or one
JSON document with `--json`); hints go to stderr. Errors are `ZooError`s mapped by `cli.main`; bad flags are
`click.UsageError` (exit 2). `check` exits 3 through `sys.exit` when the pair is incompatible, so the code
survives `cli.main`'s non-standalone click call.

A little over the ~300 lines we aim for: three commands, each with its human and JSON renderings.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from importlib import metadata
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from dflash_zoo import output
from dflash_zoo.zoo.registry import Entry, load_registry, lock_path, read_lock

_ENV_COMMON = """
\b
Environment:
  HF_HOME, HF_HUB_CACHE   the Hugging Face cache searched for installed drafters
  DFLASH_ZOO_REGISTRY     an extra registry file merged into the built-in one
  DFLASH_ZOO_HOME         zoo state (lock.json with pinned commits)
  NO_COLOR                no colour"""
_STATUS_STYLE = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red"}


# ---- helpers ---------------------------------------------------------------------------------------


def is_installed(repo_id: str) -> bool:
    """True when `repo_id` has at least one snapshot in the HF cache; False when the cache is absent."""
    from dflash_zoo.zoo.hub import repo_cache_dir

    snapshots = repo_cache_dir(repo_id) / "snapshots"
    try:
        return snapshots.is_dir() and any(p.is_dir() for p in snapshots.iterdir())
    except OSError:
        return False


def _unknown(v: Any) -> str:
    return "unknown" if v is None else str(v)


def _not_public(v: Any) -> str:
    """A target shape fact: null only on an unsupported-here entry, where no public source gives it."""
    return "not public" if v is None else str(v)


def _entry_json(entry: Entry, lock: dict) -> dict[str, Any]:
    """The entry's fields, whether its drafter is cached, its lock record and both pinned commits.

    `pins` follows `read_pins`: a pin recorded for another repo than the entry names now is None.
    """
    from dflash_zoo.zoo.registry import pins_of

    return {**asdict(entry), "installed": is_installed(entry.draft_repo), "locked": lock.get(entry.slug),
            "pins": asdict(pins_of(entry, lock))}  # fmt: skip


def _transformers_version() -> str | None:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


# ---- list ------------------------------------------------------------------------------------------


@click.command(
    "list",
    epilog="""\b
Examples:
  dflash-zoo list
  dflash-zoo list qwen                 # every id, alias or repo id containing "qwen"
  dflash-zoo ls 'qwen3.5*'
  dflash-zoo list 'z-lab/*' --json
  dflash-zoo list -q
"""
    + _ENV_COMMON,
)
@click.argument("pattern", required=False)
@click.option("--json", "as_json", is_flag=True, help="One JSON array on stdout.")
@click.option("-q", "--quiet", is_flag=True, help="Only the entry ids, one per line.")
def list_cmd(pattern: str | None, as_json: bool, quiet: bool) -> None:
    """Registry entries and whether their drafter is in the HF cache (alias: ls).

    PATTERN matches ids, aliases and repo ids (case-insensitive): a plain word matches as a substring
    ('qwen', 'coder'), a glob as a whole name ('qwen3*', 'google/*').
    """
    if as_json and quiet:
        raise click.UsageError("--json and -q cannot be combined")
    entries = load_registry().match(_as_glob(pattern))
    if pattern and not entries:
        output.hint(f"no entry matches {pattern!r}; run `dflash-zoo list` for all entries")
    if as_json:
        lock = read_lock()
        output.emit_json([_entry_json(e, lock) for e in entries])
    elif quiet:
        for e in entries:
            click.echo(e.slug)
    elif entries:
        lock = read_lock()
        rows = [_list_row(e, lock) for e in entries]
        cols = ("ID", "TARGET", "DRAFT", "ARCH", "BLOCK", "STATUS", "SIZE", "INSTALLED")
        output.print_table(output.table(cols, rows, ids=("ID", "TARGET", "DRAFT")), cut=("TARGET", "DRAFT"))


def _as_glob(pattern: str | None) -> str | None:
    """A pattern without glob characters matches as a substring (`list qwen`), a glob as given."""
    if not pattern or any(c in pattern for c in "*?["):
        return pattern
    return f"*{pattern}*"


def _list_row(e: Entry, lock: dict) -> tuple[str, ...]:
    from dflash_zoo.zoo.check_sources import entry_architecture

    block = _unknown(e.draft.block_size).replace("unknown", "?")
    installed = "yes" if is_installed(e.draft_repo) else "-"
    return (
        e.slug,
        e.target_repo,
        e.draft_repo,
        entry_architecture(e, lock),
        block,
        e.status,
        output.human_size(e.draft_size_bytes),
        installed,
    )


# ---- info ------------------------------------------------------------------------------------------


@click.command(
    epilog="""\b
Examples:
  dflash-zoo info qwen3-8b
  dflash-zoo show meta-llama/Llama-3.1-8B-Instruct
  dflash-zoo info gpt-oss:20b --json
  dflash-zoo info demo                 # the embedded demo pair's folders (train --target DIR)
"""
    + _ENV_COMMON,
)
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def info(name: str, as_json: bool) -> None:
    """Details of one registry entry: target, draft, compatibility, requirements, cache paths (alias: show).

    NAME is an id, an alias, or an exact target, draft or variant repo id; `demo` is the embedded demo pair.
    """
    from dflash_zoo import quantization
    from dflash_zoo.adapters import find_adapter
    from dflash_zoo.zoo.check import transformers_floor
    from dflash_zoo.zoo.hub import hub_cache_dir, repo_cache_dir

    registry = load_registry()
    if name.strip().lower() == "demo" and registry.lookup(name) is None:
        return _info_demo(as_json)
    entry = registry.resolve(name)
    cls = find_adapter(entry.adapter)
    data = _entry_json(entry, read_lock())
    data["adapter_found"] = cls is not None
    data["architecture"] = _architecture(entry)
    data["cache_strategy"] = cls.cache_strategy if cls else None
    data["requires"] = {
        "transformers": transformers_floor() if cls else None,
        "transformers_installed": _transformers_version(),
        "gated": entry.gated,
        "license": entry.license,
        "draft_license": entry.draft_license,
    }
    quant = quantization.cached_report(entry.target_repo, data["pins"]["target"], hub_cache_dir())
    data["requires"]["quantization"] = quant.to_dict() if quant else None
    data["cache"] = {
        "hub_cache": str(hub_cache_dir()),
        "draft": str(repo_cache_dir(entry.draft_repo)),
        "target": str(repo_cache_dir(entry.target_repo)),
        "lock_file": str(lock_path()),
    }
    if as_json:
        output.emit_json(data)
    else:
        _print_info(entry, data)


def _gated(e: Entry) -> str:
    """Which repo of the pair is gated, and when that was last seen (gates change)."""
    if not e.gated:
        return "no"
    which = (
        "the drafter" if e.draft_gated else "the target" if e.draft_gated is False else "target or drafter"
    )
    seen = f"; seen {e.gated_seen}" if e.gated_seen else "; when last checked is not recorded"
    return f"yes, {which} (needs HF_TOKEN and an accepted license{seen})"


def _architecture(e: Entry) -> str:
    """`info`'s architecture line: the cached config's variant, else the registry's, else why unknown."""
    from dflash_zoo.zoo.check_sources import entry_architecture

    arch = entry_architecture(e)
    return arch if arch != "?" else "not one dflash-zoo runs (see notes)"


def _uploads(e: Entry) -> str:
    """The known uploads of the drafter repo, newest first (`check` says which one a cached copy is)."""
    if not e.revisions:
        return "-"
    return "; ".join(f"{r.label}" + (f" ({r.commit})" if r.commit else "") for r in e.revisions)


def _shape_source(e: Entry) -> str:
    """Where the target's fingerprint came from: its own config, another repo's, or nowhere public."""
    if not e.target.known:
        return "not public (the entry is unsupported here)"
    return e.shape_from or "its own config.json"


def _pull_hint(e: Entry, tail: str) -> str:
    """` (`dflash-zoo pull ID <tail>)`, or nothing for an entry `pull` refuses (marked unsupported here)."""
    return "" if e.listed_only else f" (`dflash-zoo pull {e.slug} {tail})"


def _info_demo(as_json: bool) -> None:
    """The embedded demo pair's folders (`train --target DIR`, `eval --target DIR`); `dflash-zoo env` too."""
    from dflash_zoo import demo

    report = demo.report()
    dirs = {"target": report["demo_target"], "draft": report["demo_draft"]}
    if as_json:
        return output.emit_json({"slug": "demo", **dirs})
    for side, path in dirs.items():
        click.echo(f"{side}  {path or 'not in this install'}")
    output.hint(f"dflash-zoo train --target {dirs['target']} --data FILE.jsonl --out DIR")


def _print_info(e: Entry, data: dict[str, Any]) -> None:
    t, d, req, cache = e.target, e.draft, data["requires"], data["cache"]
    locked, pins = data["locked"] or {}, data["pins"]
    pulled = f" (pulled {locked['pulled_at']})" if locked.get("pulled_at") else ""
    draft_pin = pins["draft"] + pulled if pins["draft"] else "not pulled"
    target_pin = pins["target"] or f"not pulled{_pull_hint(e, '--with-target` records it')}"
    taps = "unknown" if d.target_layer_ids is None else str(list(d.target_layer_ids))
    kwargs = ", ".join(f"{k}={v}" for k, v in e.chat_template_kwargs.items()) or "default template"
    adapter = (
        f"{e.adapter} ({data['cache_strategy']})" if data["adapter_found"] else f"{e.adapter} (not installed)"
    )
    tf = f">= {req['transformers']}" if req["transformers"] else "n/a (no adapter)"
    sections = {
        "Target": [("repo", e.target_repo), ("revision", getattr(e, "target_revision", None) or "main"),
                   ("pinned commit", target_pin), ("model_type", t.model_type),
                   ("hidden size", _not_public(t.hidden_size)), ("layers", _not_public(t.num_hidden_layers)),
                   ("vocab", _not_public(t.vocab_size)),
                   ("shape from", _shape_source(e)),
                   ("variants", ", ".join(e.variants) or "-")],
        "Draft": [("repo", e.draft_repo), ("revision", e.draft_revision),
                  ("pinned commit", draft_pin), ("architecture", data["architecture"]),
                  ("block size", _unknown(d.block_size)),
                  ("layers", _unknown(d.num_layers)), ("taps", taps), ("mask id", _unknown(d.mask_token_id)),
                  ("size", output.human_size(e.draft_size_bytes)), ("uploads", _uploads(e))],
        "Compatibility": [("status", e.status + (f" ({e.reason})" if e.reason else "")), ("adapter", adapter),
                          ("chat template", kwargs), ("thinking", e.thinking), ("notes", e.notes or "-")],
        "Requires": [("transformers", f"{tf}, installed {req['transformers_installed'] or 'none'}"),
                     ("gated", _gated(e)), ("license", f"{e.license} (target)"),
                     ("draft license", e.draft_license or "unknown: see the drafter's model card"),
                     ("quantization", (req["quantization"] or {}).get("detail") or "unknown: target config "
                      f"not cached{_pull_hint(e, '--with-target`')}")],
        "Cache paths": [("hf cache", cache["hub_cache"]), ("draft", cache["draft"]),
                        ("installed", "yes" if data["installed"] else "no"), ("target", cache["target"]),
                        ("lock file", cache["lock_file"])],
    }  # fmt: skip
    console = output.stdout()
    console.print(f"[bold]{escape(e.slug)}[/bold]  {escape(', '.join(e.aliases))}")
    for title, pairs in sections.items():
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim", min_width=14)
        grid.add_column(overflow="fold")
        for key, value in pairs:
            grid.add_row(key, escape(str(value)))
        console.print(f"\n[bold]{title}[/bold]")
        console.print(grid)


# ---- check -----------------------------------------------------------------------------------------


@click.command(
    epilog="""\b
Examples:
  dflash-zoo check --target Qwen/Qwen3-8B
  dflash-zoo check --target meta-llama/Llama-3.1-8B --draft llama3.1-8b-instruct
  dflash-zoo check --target ./my-finetune --draft z-lab/Qwen3-8B-DFlash-b16 --offline
  dflash-zoo check --target Qwen/Qwen3-8B --config target.json --draft-config draft.json --json
\b
Exit codes: 0 compatible (warnings allowed), 3 incompatible, 1 error (e.g. no config), 2 usage.
\b
Environment:
  HF_HOME, HF_HUB_CACHE   where cached config.json files are looked up
  HF_HUB_OFFLINE=1        same as --offline: never touch the network
  HF_TOKEN                token for gated repos (e.g. the MiniMax drafter)
  HF_ENDPOINT             the Hub to download config.json from
  DFLASH_ZOO_REGISTRY     an extra registry file
  DFLASH_ZOO_HOME         zoo state (lock.json: the pinned draft commit is preferred)
  NO_COLOR                no colour""",
)
@click.option("-t", "--target", required=True, help="Target: registry id, repo id, or local dir.")
@click.option(
    "-d", "--draft", help="Drafter: registry id, repo id, or local dir (default: the registered one)."
)
@click.option("--config", type=click.Path(exists=True, dir_okay=False), help="Target config.json to use.")
@click.option(
    "--draft-config", type=click.Path(exists=True, dir_okay=False), help="Drafter config.json to use."
)
@click.option("--offline", is_flag=True, help="Use only local files, the HF cache and the registry.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def check(
    target: str, draft: str | None, config: str | None, draft_config: str | None, offline: bool, as_json: bool
) -> None:
    """Is a target / drafter pair compatible? Reads configs only (no weights, no torch)."""
    from dflash_zoo.zoo.check import check_pair

    report = check_pair(target, draft, config, draft_config, offline=True if offline else None)
    if as_json:
        output.emit_json(report.to_dict())
    else:
        _print_report(report)
    if not report.compatible:
        sys.exit(3)


def _print_report(report: Any) -> None:
    console = output.stdout()
    console.print(f"target: {escape(report.target)}  [dim]({escape(report.target_source)})[/dim]")
    console.print(f"draft:  {escape(report.draft)}  [dim]({escape(report.draft_source)})[/dim]")
    rows = [
        (escape(r.check), f"[{_STATUS_STYLE[r.status]}]{r.status}[/]", escape(r.detail)) for r in report.rows
    ]
    console.print(output.table(("check", "status", "detail"), rows))
    fails = sum(r.status == "FAIL" for r in report.rows)
    warns = sum(r.status == "WARN" for r in report.rows)
    style = "green" if report.compatible else "bold red"
    console.print(f"[{style}]{report.verdict}[/]: {fails} failed, {warns} warning(s)")
    if not report.compatible:
        output.hint("`dflash-zoo list` shows the registered pairs; `dflash-zoo info ID` their fingerprints")
