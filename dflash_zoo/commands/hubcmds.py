"""`pull`, `rm`, `env`: thin click wrappers over `dflash_zoo.zoo.hub` and `dflash_zoo.zoo.removal`.

`pull` and `rm` take registry ids (slug or alias: the entry's drafter, plus its target with `--with-target`)
or exact Hub repo ids, which always act on that repo, even when it is some entry's target (`jobs_for`); each
says which repos it touches before touching them. `pull` refuses the registry id of an entry its author marked
unsupported-here, with the reason, before any Hub call (as `serve` does); its exact repo ids still fetch.
`resolve` (registry first, for any name) is kept for `serve`. Data goes to stdout (paths, tables, byte counts,
JSON); progress and hints go to stderr. Torch is imported only by `env`, lazily.

Longer than the ~300 lines we aim for: `pull`, `rm` and `env` share name resolution and their human and JSON reports.
"""

from __future__ import annotations

import os
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
  HF_HUB_OFFLINE=1        never touch the network (pull: same as --offline)
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


@dataclass(frozen=True)
class Job:
    """One repo that `pull` / `rm` acts on: `role` says why (shown before acting); `entry` gets the pins."""

    repo_id: str
    revision: str | None
    role: str
    entry: Any = None  # set for registry ids only: their pull records pins in the lock file
    side: str | None = None  # "draft" or "target" of `entry`


def jobs_for(name: str, with_target: bool, revision: str | None = None) -> list[Job]:
    """The repos NAME means: a slug / alias is the entry's drafter (and target with `with_target`); an exact
    repo id is that repo and nothing else, even when the registry knows it as some entry's target."""
    from dflash_zoo.zoo.registry import load_registry

    registry = load_registry()
    found = registry.lookup(name)
    if found is not None and found[1] == "alias" and _looks_like_repo(name):
        found = registry.lookup(name, ("target", "draft", "variant"))  # an alias spelling a repo id: the repo
    if found is not None and found[1] in ("slug", "alias"):
        entry = found[0]
        jobs = [
            Job(
                entry.draft_repo, revision or entry.draft_revision, f"drafter of {entry.slug}", entry, "draft"
            )
        ]
        if with_target:
            target_rev = getattr(entry, "target_revision", None) or "main"  # field added by the registry
            jobs.append(Job(entry.target_repo, target_rev, f"target of {entry.slug}", entry, "target"))
        return jobs
    if found is None and not _looks_like_repo(name):
        registry.resolve(name)  # raises NotFoundError with the nearest names
    repo_id, role = _repo_role(found, name)
    if with_target:
        ctx = click.get_current_context(silent=True)
        verb = ctx.info_name if ctx is not None and ctx.info_name else "pull"
        also = (
            f"; `dflash-zoo {verb} {found[0].slug} --with-target` acts on that entry's pair" if found else ""
        )
        raise click.UsageError(f"--with-target needs a registry id, and {name} is a repo id{also}")
    return [Job(repo_id, revision, role)]


def _repo_role(found: tuple[Any, str] | None, name: str) -> tuple[str, str]:
    """The repo id in the registry's spelling (ids match case-insensitively) and a role naming its entry."""
    if found is None:
        return name, "repo id"
    entry, how = found
    names = {"target": [entry.target_repo], "draft": [entry.draft_repo], "variant": list(entry.variants)}[how]
    repo_id = next((n for n in names if n.lower() == name.strip().lower()), name)
    what = {"target": "the target", "draft": "the drafter", "variant": "a variant"}[how]
    return repo_id, f"repo id, {what} of {entry.slug}"


def _zoo_home_var() -> str:
    return "DFLASH_ZOO_HOME" if os.environ.get("DFLASH_ZOO_HOME") else "DFLASH_ZOO_HOME unset, so the default"


# pull ------------------------------------------------------------------------------------------------------
@click.command(epilog=HUB_ENV)
@click.argument("model_id")
@click.option("--with-target", is_flag=True, help="Also pull the target model of a registry entry (large).")
@click.option(
    "--revision", default=None, help="Draft revision (branch, tag or sha); default: the registry pin."
)
@click.option("--dry-run", is_flag=True, help="List files and total size; download nothing.")
@click.option("--offline", is_flag=True, help="Use the cache only (like HF_HUB_OFFLINE=1); records no pins.")
@click.option("--verify", is_flag=True, help="Re-hash every cached file (small files are always re-hashed).")
@click.option(
    "--force", is_flag=True, help="Fetch cached files again (with --verify: only those that fail it)."
)
@click.option("-q", "--quiet", is_flag=True, help="Print only the snapshot path(s); no progress.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (also on failure).")
def pull(model_id, with_target, revision, dry_run, offline, verify, force, quiet, as_json):
    """Download a drafter (and optionally its target) into the Hugging Face cache, verified.

    MODEL_ID is a registry id (its drafter; --with-target adds its target) or an exact Hub repo id (that
    repo only). Every file is checked against the Hub's sha256 before it is stored; an interrupted pull
    resumes. Prints the local snapshot path; a registry id's commits are recorded in the lock file.

    \b
    Examples:
      dflash-zoo pull qwen3-8b                    # the drafter at its pinned revision
      dflash-zoo pull qwen3-8b --with-target      # drafter + target
      dflash-zoo pull z-lab/Qwen3-8B-DFlash-b16 --revision main
      dflash-zoo pull qwen3-8b --verify --force   # re-hash the cache, re-fetch what is corrupt
      HF_HUB_OFFLINE=1 dflash-zoo pull qwen3-8b -q   # path of the cached copy, or what is missing
    """
    _pull(model_id, with_target, revision, dry_run, offline, verify, force, quiet, as_json)


def _pull(model_id, with_target, revision, dry_run, offline, verify, force, quiet, as_json) -> None:
    jobs = jobs_for(model_id, with_target, revision)
    _refuse_unrunnable(jobs[0].entry)
    if force and (offline or hub.is_offline()):
        how = "drop --offline" if offline else "unset HF_HUB_OFFLINE (it is set in the environment)"
        raise click.UsageError(f"--force fetches files again and needs the network: {how}")
    offline = offline or hub.is_offline()
    plans = [hub.plan_pull(j.repo_id, j.revision, offline=offline, name=model_id) for j in jobs]
    loud = not (quiet or as_json)
    for job, plan in zip(jobs, plans, strict=True):
        if loud:
            _describe(job, plan)
    if dry_run:
        return _show_plans(plans, as_json, quiet)
    refetch = _check_cached(plans, verify, force, model_id, loud)
    if offline:  # the cache only: nothing to download, and no pins (nothing was resolved on the Hub)
        results = [hub.PullResult(p.repo_id, p.revision, p.commit, p.path, 0, True) for p in plans]
        return _show_results(plans, results, as_json, quiet, None)
    entry = jobs[0].entry
    if entry is not None:
        from dflash_zoo.zoo.registry import lock_path

        hub.ensure_writable(lock_path().parent, "the zoo state folder", _zoo_home_var())
    need = sum(hub.bytes_to_fetch(p, r) for p, r in zip(plans, refetch, strict=True))
    hub.check_space(need, [p.repo_id for p in plans])
    progress = loud and sys.stderr.isatty()
    results: list[hub.PullResult] = []
    try:
        for p, r in zip(plans, refetch, strict=True):
            results.append(hub.download(p, progress=progress, refetch=r))
    except BaseException:
        if entry is not None and results:  # the drafter arrived and verified: its pin stays true
            _record_pins(jobs[: len(results)], results)
        raise
    _show_results(plans, results, as_json, quiet, _record_pins(jobs, results) if entry is not None else None)


def _refuse_unrunnable(entry: Any) -> None:
    """A registry id its author marked unsupported-here is not fetched (as `serve` refuses it); an exact repo
    id still fetches that repo alone."""
    if entry is None:
        return
    from dflash_zoo.zoo.registry import refuse_unrunnable

    hint = f"an exact repo id fetches that repo alone: `dflash-zoo pull {entry.draft_repo}`"
    refuse_unrunnable(entry, hint=hint)


def _check_cached(plans: list[hub.PullPlan], verify: bool, force: bool, name: str, loud: bool) -> list[set]:
    """Re-hash cached files; returns, per plan, paths to fetch again; corrupt ones fail without --force."""
    from dflash_zoo.zoo.fetch import IntegrityError, digest_kind

    refetch, corrupt = [], []
    for plan in plans:
        bad = hub.verify(plan, everything=verify)
        corrupt += bad
        refetch.append({f.path for f in plan.files} if force and not verify else {c.path for c in bad})
    for c in corrupt:
        info(f"corrupt: {c.path} of {c.repo_id} ({digest_kind(c.expected)} {c.actual[:12]}, "
             f"expected {c.expected[:12]})")  # fmt: skip
    if corrupt and not force:
        names = ", ".join(f"{c.path} of {c.repo_id}" for c in corrupt)
        raise IntegrityError(
            f"{len(corrupt)} cached file(s) failed verification: {names}",
            hint=f"run `dflash-zoo pull {name} --verify --force` to fetch them again",
        )
    if verify and loud and not corrupt:
        info(f"verified {sum(f.cached for p in plans for f in p.files)} cached file(s)")
    return refetch


def _record_pins(jobs: list[Job], results: list[hub.PullResult]) -> dict[str, Any] | None:
    """Write the resolved draft (and target) commits of the registry entry to the lock file."""
    from dflash_zoo.zoo.registry import read_lock, write_lock

    by_side = {j.side: (j, r) for j, r in zip(jobs, results, strict=True)}
    (draft, draft_res), target = by_side["draft"], by_side.get("target")
    entry = draft.entry
    write_lock(
        entry.slug,
        draft.repo_id,
        draft.revision or "main",
        draft_res.commit,
        target_repo=entry.target_repo,
        target_revision=target[0].revision if target else None,
        target_commit=target[1].commit if target else None,
    )
    return read_lock().get(entry.slug)


def _describe(job: Job, plan: hub.PullPlan) -> None:
    head = f"{plan.repo_id} ({job.role}) @ {plan.revision} ({plan.commit[:12]}): {len(plan.files)} files, "
    if plan.up_to_date:
        info(head + f"{human_size(plan.total_bytes)}, already up to date")
        return
    unknown = plan.unknown_sizes  # a mirror's listing without sizes: the download tells them
    more = f" and {unknown} files of unknown size" if unknown else ""
    info(head + f"{human_size(plan.total_bytes)} total, {human_size(plan.missing_bytes)}{more} to download")


def _plan_dict(plan: hub.PullPlan) -> dict[str, Any]:
    files = [{"path": f.path, "size": f.size, "cached": f.cached, "digest": f.digest} for f in plan.files]
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


def _show_results(plans, results: list[hub.PullResult], as_json: bool, quiet: bool, lock: Any) -> None:
    if as_json:
        repos = [{**_plan_dict(p), "downloaded_bytes": r.downloaded_bytes, "up_to_date": r.up_to_date,
                  "fetched": list(r.fetched)} for p, r in zip(plans, results, strict=True)]  # fmt: skip
        return emit_json({"dry_run": False, "repos": repos, "lock": lock})
    for result in results:
        if not quiet and result.fetched:
            n = result.downloaded_bytes
            note = "" if n else " (another process had fetched the files)"
            info(f"downloaded {human_size(n)} ({n} bytes) of {result.repo_id}{note}")
        click.echo(str(result.path))


# rm --------------------------------------------------------------------------------------------------------
@click.command(epilog=HUB_ENV)
@click.argument("model_ids", nargs=-1, required=True)
@click.option("--with-target", is_flag=True, help="For registry ids: also remove the entry's target model.")
@click.option(
    "--dry-run", is_flag=True, help="Show what would be deleted and the space freed; delete nothing."
)
@click.option(
    "-y", "--yes", is_flag=True, help="Do not ask for confirmation (required when not interactive)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (also on failure).")
def rm(model_ids, with_target, dry_run, yes, as_json):
    """Remove repos from the Hugging Face cache: every revision, and partial downloads left behind.

    A registry id removes the entry's drafter (and its target with --with-target); an exact repo id removes
    that repo only. The lock-file pins of what is removed are forgotten. Prints the bytes freed.

    \b
    Examples:
      dflash-zoo rm qwen3-8b                      # the drafter; asks before deleting
      dflash-zoo rm qwen3-8b --with-target --yes  # drafter and target
      dflash-zoo rm Qwen/Qwen3-8B --dry-run       # that repo only
      dflash-zoo rm qwen3-8b --yes --json
    """
    _rm(model_ids, with_target, dry_run, yes, as_json)


def _rm(model_ids, with_target, dry_run, yes, as_json) -> None:
    from dflash_zoo.zoo import removal
    from dflash_zoo.zoo.registry import drop_pins

    roles: dict[str, str] = {}
    for name in model_ids:
        for job in jobs_for(name, with_target):
            roles.setdefault(job.repo_id, job.role)
    plan = removal.plan_removal(list(roles))
    for repo_id in plan.not_cached:
        info(f"{repo_id} ({roles[repo_id]}): not cached")
    if not plan.repos:
        return emit_json(_rm_dict(plan, roles, 0, dry_run, [])) if as_json else info("nothing to delete")
    if not dry_run:  # every refusal comes before the listing says "removing"
        _refuse_unconfirmed(yes, as_json)
        removal.check_removable(plan)
        _check_pins_writable([r.repo_id for r in plan.repos])
    if not as_json:
        verb = "would remove" if dry_run else "removing" if yes else "to remove"
        for repo in plan.repos:
            info(f"{verb} {repo.repo_id} ({roles[repo.repo_id]}) from {repo.folder.parent}")
        stdout().print(table(["repo", "revision", "refs", "size"], _rm_rows(plan)))
        _say_what_stays(plan)
    if dry_run:
        if as_json:
            return emit_json(_rm_dict(plan, roles, 0, True, []))
        click.echo(f"would free {human_size(plan.expected_freed_bytes)} ({plan.expected_freed_bytes} bytes)")
        return hint("dry run: nothing deleted")
    if not yes:
        _confirm(plan)
    freed = removal.execute_removal(plan)
    dropped = drop_pins([r.repo_id for r in plan.repos])
    if as_json:
        return emit_json(_rm_dict(plan, roles, freed, False, dropped))
    click.echo(f"freed {human_size(freed)} ({freed} bytes)")
    if dropped:
        info(f"lock pins removed: {', '.join(dropped)}")


def _check_pins_writable(repo_ids: list[str]) -> None:
    """When the lock file pins one of `repo_ids`, its folder must be writable (checked before deleting)."""
    from dflash_zoo.zoo.registry import lock_path, read_lock

    keys = ("draft_repo", "target_repo")
    pinned = {str(rec.get(k, "")).lower() for rec in read_lock().values() for k in keys}
    if any(r.lower() in pinned for r in repo_ids):
        hub.ensure_writable(lock_path().parent, "the zoo state folder", _zoo_home_var())


def _rm_rows(plan: Any) -> list[tuple[str, ...]]:
    rows = []
    for repo in plan.repos:
        rows += [
            (repo.repo_id, r.commit[:12], ",".join(r.refs), human_size(r.size_bytes)) for r in repo.revisions
        ]
        rows += [(repo.repo_id, "partial download", "", human_size(p.size)) for p in repo.partials]
        kept = "kept: not from the Hub"
        rows += [(repo.repo_id, str(p.relative_to(repo.folder)), kept, human_size(p.stat().st_size))
                 for p in repo.kept]  # fmt: skip
    return rows


def _say_what_stays(plan: Any) -> None:
    """Name what `rm` leaves in place: a user's own files, and the folder a linked repo folder points at."""
    for repo in plan.repos:
        if repo.linked_to:
            info(f"{repo.folder} is a link to {repo.linked_to}: only the link goes, that folder is kept")
        if repo.kept:
            info(f"{len(repo.kept)} file(s) in {repo.folder} are not from the Hub (your own?): kept in place")


def _refuse_unconfirmed(yes: bool, as_json: bool) -> None:
    """Without --yes, deleting needs a TTY to ask on (and --json never asks)."""
    if not yes and (as_json or not (sys.stdin.isatty() and sys.stdout.isatty())):
        raise click.UsageError("refusing to delete without confirmation in non-interactive mode: pass --yes")


def _confirm(plan: Any) -> None:
    size = human_size(plan.expected_freed_bytes)
    names = ", ".join(r.repo_id for r in plan.repos)
    if not click.confirm(f"delete {names} from the cache, freeing {size}?", err=True):
        info("nothing removed")  # a "no" is an answer, not an interruption
        raise SystemExit(0)


def _rm_dict(
    plan: Any, roles: dict[str, str], freed: int, dry_run: bool, dropped: list[str]
) -> dict[str, Any]:
    repos = [
        {"repo_id": r.repo_id, "role": roles[r.repo_id], "folder": str(r.folder), "size_bytes": r.size_bytes,
         "partial_files": [{"path": str(p.path), "size": p.size, "in_use": p.in_use} for p in r.partials],
         "kept_files": [str(p) for p in r.kept], "linked_to": str(r.linked_to) if r.linked_to else None}
        for r in plan.repos
    ]  # fmt: skip
    revs = [{"repo_id": r.repo_id, "commit": r.commit, "refs": list(r.refs), "size_bytes": r.size_bytes,
             "path": str(r.path)} for r in plan.revisions]  # fmt: skip
    return {"dry_run": dry_run, "repos": repos, "revisions": revs, "not_cached": list(plan.not_cached),
            "expected_freed_bytes": plan.expected_freed_bytes, "bytes_freed": freed,
            "pins_removed": dropped}  # fmt: skip


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
    report["triton"] = ver("triton")  # the CUDA fast path's kernels (dflash_zoo/cuda/ops/)
    # the gated delta rule's kernels on CUDA (cuda/static/gdn.py; the `cuda` extra)
    report["flash_linear_attention"] = ver("flash-linear-attention")
    report |= {"hf_home": str(hub.hf_home()), "hf_hub_cache": str(hub.hub_cache_dir()),
               "hf_endpoint": hub.hub_endpoint(), "dflash_zoo_home": _zoo_home(), "offline": hub.is_offline()}  # fmt: skip
    from dflash_zoo import demo

    report |= demo.report()  # the embedded pair's folders: `train --target <demo_target>`
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
