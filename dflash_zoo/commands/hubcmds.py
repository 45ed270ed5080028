"""`pull`, `rm`, `env`, `serve`: thin click wrappers over `dflash_zoo.zoo.hub` and `dflash_zoo.zoo.serve`.

IDs are registry entries (slug, alias or repo id) or plain Hub repo ids. Data goes to stdout (paths, tables,
JSON); progress, sizes and hints go to stderr. Torch is imported only by `env`, lazily.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass
from typing import Any

import click

from dflash_zoo.errors import NotFoundError
from dflash_zoo.output import emit_json, hint, human_size, info, stdout, table
from dflash_zoo.zoo import hub

HUB_ENV = """
\b
Environment:
  HF_HOME, HF_HUB_CACHE   the Hugging Face cache (models are stored there)
  HF_ENDPOINT             Hub URL (default https://huggingface.co)
  HF_HUB_OFFLINE=1        never touch the network (same as --offline)
  HF_TOKEN                token for gated repos
  DFLASH_ZOO_HOME         zoo state (the lock file of pulled revisions)
  DFLASH_ZOO_REGISTRY     an extra registry file
"""


@dataclass(frozen=True)
class Ref:
    """What an ID names: a repo at a revision, plus its registry entry (None for a plain repo id)."""

    name: str
    repo_id: str
    revision: str | None
    entry: Any = None


def resolve(name: str) -> Ref:
    """Registry entry first (slug, alias, repo id); else an `org/name` Hub id; else the registry's NotFoundError."""
    try:
        from dflash_zoo.zoo.registry import load_registry
    except ImportError:  # registry module absent in this build: plain repo ids only
        load_registry = None
    if load_registry is not None:
        try:
            entry = load_registry().resolve(name)
            return Ref(name, entry.draft_repo, entry.draft_revision, entry)
        except NotFoundError:
            if not _looks_like_repo(name):
                raise
    elif not _looks_like_repo(name):
        raise NotFoundError(f"{name!r} is neither a registry entry nor a Hub repo id (org/name)")
    return Ref(name, name, None)


def _looks_like_repo(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/"))


# pull ------------------------------------------------------------------------------------------------------
@click.command(epilog=HUB_ENV)
@click.argument("model_id")
@click.option("--with-target", is_flag=True, help="Also pull the target model of a registry entry (large).")
@click.option(
    "--revision", default=None, help="Draft revision (branch, tag or sha); default: the registry pin."
)
@click.option("--dry-run", is_flag=True, help="List files and total size; download nothing.")
@click.option("--offline", is_flag=True, help="Use the cache only (like HF_HUB_OFFLINE=1).")
@click.option("-q", "--quiet", is_flag=True, help="Print only the snapshot path(s); no progress.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def pull(model_id, with_target, revision, dry_run, offline, quiet, as_json):
    """Download a drafter (and optionally its target) into the Hugging Face cache.

    Prints the local snapshot path. A second pull downloads nothing.

    \b
    Examples:
      dflash-zoo pull qwen3-8b                    # the drafter at its pinned revision
      dflash-zoo pull qwen3-8b --with-target      # drafter + target
      dflash-zoo pull z-lab/Qwen3-8B-DFlash-b16 --revision main
      dflash-zoo pull qwen3-8b --dry-run --json   # files and sizes only
      HF_HUB_OFFLINE=1 dflash-zoo pull qwen3-8b -q   # path of the cached copy, or what is missing
    """
    ref = resolve(model_id)
    jobs = [(ref.repo_id, revision or ref.revision)]
    if with_target:
        if ref.entry is None:
            raise click.UsageError(
                "--with-target needs a registry entry (a plain repo id has no known target)"
            )
        jobs.append((ref.entry.target_repo, None))
    offline = offline or hub.is_offline()
    plans = [hub.plan_pull(repo, rev, offline=offline, name=model_id) for repo, rev in jobs]
    for plan in plans:
        if not quiet and not as_json:
            _describe(plan)
    if dry_run:
        return _show_plans(plans, as_json, quiet)
    progress = not (quiet or as_json) and sys.stderr.isatty()
    results = [hub.download(plan, progress=progress) for plan in plans]
    if ref.entry is not None:
        from dflash_zoo.zoo.registry import write_lock

        write_lock(ref.entry.slug, ref.repo_id, jobs[0][1] or "main", results[0].commit)
    _show_results(plans, results, as_json, quiet)


def _describe(plan: hub.PullPlan) -> None:
    head = f"{plan.repo_id} @ {plan.revision} ({plan.commit[:12]}): {len(plan.files)} files, "
    if plan.up_to_date:
        info(head + f"{human_size(plan.total_bytes)}, already up to date")
    else:
        info(head + f"{human_size(plan.total_bytes)} total, {human_size(plan.missing_bytes)} to download")


def _plan_dict(plan: hub.PullPlan) -> dict[str, Any]:
    files = [{"path": f.path, "size": f.size, "cached": f.cached} for f in plan.files]
    return {"repo_id": plan.repo_id, "revision": plan.revision, "commit": plan.commit, "path": str(plan.path),
            "total_bytes": plan.total_bytes, "missing_bytes": plan.missing_bytes, "files": files}  # fmt: skip


def _show_plans(plans: list[hub.PullPlan], as_json: bool, quiet: bool) -> None:
    if as_json:
        return emit_json({"dry_run": True, "repos": [_plan_dict(p) for p in plans]})
    for plan in plans:
        if quiet:
            click.echo(str(plan.path))
            continue
        rows = [(f.path, human_size(f.size), "yes" if f.cached else "no") for f in plan.files]
        stdout().print(table(["file", "size", "cached"], rows, title=plan.repo_id))
    if not quiet:
        hint("dry run: nothing downloaded")


def _show_results(plans, results: list[hub.PullResult], as_json: bool, quiet: bool) -> None:
    if as_json:
        repos = [{**_plan_dict(p), "downloaded_bytes": r.downloaded_bytes, "up_to_date": r.up_to_date}
                 for p, r in zip(plans, results, strict=True)]  # fmt: skip
        return emit_json({"dry_run": False, "repos": repos})
    for result in results:
        if not quiet and not result.up_to_date:
            info(f"downloaded {human_size(result.downloaded_bytes)} of {result.repo_id}")
        click.echo(str(result.path))


# rm --------------------------------------------------------------------------------------------------------
@click.command(epilog=HUB_ENV)
@click.argument("model_ids", nargs=-1, required=True)
@click.option(
    "--dry-run", is_flag=True, help="Show what would be deleted and the space freed; delete nothing."
)
@click.option(
    "-y", "--yes", is_flag=True, help="Do not ask for confirmation (required when not interactive)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def rm(model_ids, dry_run, yes, as_json):
    """Remove every cached revision of one or more drafters from the Hugging Face cache.

    \b
    Examples:
      dflash-zoo rm qwen3-8b                      # asks before deleting
      dflash-zoo rm qwen3-8b llama3.1-8b --yes
      dflash-zoo rm z-lab/Qwen3-8B-DFlash-b16 --dry-run
      dflash-zoo rm qwen3-8b --yes --json
    """
    plan = hub.plan_removal([resolve(name).repo_id for name in model_ids])
    for repo_id in plan.not_cached:
        info(f"{repo_id}: not cached")
    if not plan.revisions:
        return emit_json(_rm_dict(plan, 0, dry_run)) if as_json else info("nothing to delete")
    if not as_json:
        rows = [
            (r.repo_id, r.commit[:12], ",".join(r.refs), human_size(r.size_bytes)) for r in plan.revisions
        ]
        stdout().print(table(["repo", "revision", "refs", "size"], rows))
    if dry_run:
        if as_json:
            return emit_json(_rm_dict(plan, 0, True))
        return info(f"dry run: would free {human_size(plan.expected_freed_bytes)}")
    _confirm(plan, yes, as_json)
    freed = hub.execute_removal(plan)
    if as_json:
        return emit_json(_rm_dict(plan, freed, False))
    click.echo(f"freed {human_size(freed)} ({freed} bytes)")


def _confirm(plan: hub.RemovalPlan, yes: bool, as_json: bool) -> None:
    """Ask on a TTY; without one (or with --json) refuse unless --yes was given."""
    if yes:
        return
    if as_json or not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise click.UsageError("refusing to delete without confirmation in non-interactive mode: pass --yes")
    size = human_size(plan.expected_freed_bytes)
    click.confirm(f"delete {len(plan.revisions)} revision(s), freeing {size}?", abort=True, err=True)


def _rm_dict(plan: hub.RemovalPlan, freed: int, dry_run: bool) -> dict[str, Any]:
    revs = [{"repo_id": r.repo_id, "commit": r.commit, "refs": list(r.refs), "size_bytes": r.size_bytes,
             "path": str(r.path)} for r in plan.revisions]  # fmt: skip
    return {"dry_run": dry_run, "revisions": revs, "not_cached": list(plan.not_cached),
            "expected_freed_bytes": plan.expected_freed_bytes, "bytes_freed": freed}  # fmt: skip


# env -------------------------------------------------------------------------------------------------------
@click.command(epilog=HUB_ENV)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def env(as_json):
    """Versions, GPUs, cache folders and the offline flag, ready to paste into an issue.

    \b
    Examples:
      dflash-zoo env
      dflash-zoo env --json
      HF_HUB_OFFLINE=1 dflash-zoo env
    """
    report = env_report()
    if as_json:
        return emit_json(report)
    for key, value in report.items():
        shown = (", ".join(map(str, value)) or "none") if isinstance(value, list) else value
        click.echo(f"- {key}: {shown}")


def env_report() -> dict[str, Any]:
    """A flat dict of versions and paths (keys stable, snake_case); torch fields are None without torch."""
    from importlib.metadata import PackageNotFoundError, version

    def ver(pkg: str) -> str | None:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return None

    report: dict[str, Any] = {"dflash_zoo": ver("dflash-zoo"), "python": platform.python_version(),
                              "platform": platform.platform()}  # fmt: skip
    report.update(_torch_report())
    report |= {"transformers": ver("transformers"), "huggingface_hub": ver("huggingface_hub")}
    report["triton"] = ver("triton")  # the CUDA fast path's kernels (dflash_zoo/kernels.py)
    report |= {"hf_home": str(hub.hf_home()), "hf_hub_cache": str(hub.hub_cache_dir()),
               "hf_endpoint": hub.hub_endpoint(), "dflash_zoo_home": _zoo_home(), "offline": hub.is_offline()}  # fmt: skip
    return report


def _torch_report() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"torch": None, "cuda": None, "gpus": []}
    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    return {"torch": torch.__version__, "cuda": torch.version.cuda if cuda else None, "gpus": gpus}


def _zoo_home() -> str:
    from dflash_zoo.paths import zoo_home

    return str(zoo_home())
