"""`serve`: validate a pair, then build (and run) the vLLM or SGLang launch command (docs/serving.md)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click

from dflash_zoo.commands.hubcmds import HUB_ENV, Ref, resolve
from dflash_zoo.commands.serve_checks import check_overrides
from dflash_zoo.errors import IncompatiblePairError, NotFoundError, ZooError
from dflash_zoo.output import emit_json, hint, info
from dflash_zoo.zoo import hub

_SERVE_ENV = """
\b
  CUDA_VISIBLE_DEVICES    the GPUs whose memory sizes --tp when it is not given"""


@click.command(epilog=HUB_ENV + _SERVE_ENV)
@click.argument("model_id")
@click.option("--engine", type=click.Choice(["vllm", "sglang"]), required=True, help="Serving engine.")
@click.option("--target", default=None, help="Target model (required for a plain draft repo id).")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="Port for the engine's server.")
@click.option(
    "--tp", type=click.IntRange(1, 64), default=None, help="Tensor-parallel size (default: computed)."
)
@click.option("--block-size", type=click.IntRange(2, 64), default=None, help="Drafter block size override.")
@click.option("--dry-run", is_flag=True, help="Print the launch command; do not run it.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: print argv and env as JSON.")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def serve(model_id, engine, target, port, tp, block_size, dry_run, as_json, extra):
    """Validate a pair, then build and run the vLLM / SGLang launch command (args after -- are passed on).

    MODEL_ID is a registry id, a drafter's Hub repo id or a local drafter folder (the last two need --target).
    Exits 3 when the engine cannot serve the pair, or the installed engine is too old for it.

    \b
    Examples:
      dflash-zoo serve qwen3-8b --engine vllm --dry-run
      dflash-zoo serve qwen3-8b --engine sglang --port 30000
      dflash-zoo serve kimi-k2.5 --engine vllm --tp 8 -- --max-model-len 8192
      dflash-zoo serve z-lab/Qwen3-8B-DFlash-b16 --engine vllm --target Qwen/Qwen3-8B --dry-run
    """
    from dflash_zoo.zoo import serve as sv

    if as_json and not dry_run:
        raise click.UsageError("--json prints the command instead of running it: add --dry-run")
    ref = _resolve_draft(model_id)
    spec, name, arch = _serve_spec(ref, engine, target, port, tp, block_size, extra)
    installed = sv.installed_version(engine)
    why = (
        f"{arch} drafters need {engine} >= {spec.recipe.min_version}" if arch in sv.ARCH_MIN_VERSIONS else ""
    )
    sv.check_engine_version(spec.recipe, engine, installed, why)
    argv = sv.build_command(engine, spec, python=sys.executable)
    extra_env = sv.engine_env(engine)
    if dry_run:
        if as_json:
            doc = {"engine": engine, "argv": argv, "env": extra_env, "command": shlex.join(argv)}
            doc.update(
                entry=name, tensor_parallel=spec.tensor_parallel, min_engine_version=spec.recipe.min_version
            )
            doc["engine_installed"] = installed
            return emit_json(doc)
        prefix = " ".join(f"{k}={v}" for k, v in extra_env.items())
        return click.echo(f"{prefix} {shlex.join(argv)}".strip())
    sv.require_engine(engine)
    info(f"exec: {shlex.join(argv)}")
    os.environ.update(extra_env)
    os.execvp(argv[0], argv)


def _resolve_draft(model_id: str) -> Ref:
    """A registry entry first; else an existing local folder (as `from_pretrained` prefers it to a repo id of
    the same spelling); else a Hub repo id."""
    from dflash_zoo.commands.run import check_model_paths

    check_model_paths(model_id)  # `./my-drafter` that is not there: a path, not a registry miss
    local = Path(model_id).expanduser()
    try:
        ref = resolve(model_id)
    except NotFoundError:
        if not local.is_dir():
            raise
        ref = None
    if ref is None or (ref.entry is None and local.is_dir()):
        return Ref(model_id, str(local.resolve()), None)
    return ref


def _serve_spec(ref: Ref, engine: str, target, port, tp, block_size, extra: tuple[str, ...]):
    """Check the pair and gather target, draft, block size, pins, recipe and tensor parallelism; also the
    drafter's architecture (None: unknown), which may raise the engine's minimum version.

    A plain repo id or a local folder only warns (no registry check), gets the engine's default recipe and is
    held to what its config.json says the engine needs (the architecture's release, vLLM's mask id).
    """
    from dflash_zoo.zoo import serve as sv
    from dflash_zoo.zoo.registry import read_pins, refuse_unrunnable

    entry = ref.entry
    if entry is None:
        if target is None:
            raise click.UsageError(f"{ref.name} is not a registry entry: pass --target with the target model")
        hint(f"{ref.name} is not in the registry: the pair is not validated; run `dflash-zoo check` first")
        config = _plain_draft_config(ref, block_size)
        check_overrides(tp, block_size, target, None, ref.name, lambda: config and config.block_size)
        if engine == "vllm" and config is not None and config.mask_token_id is None:
            raise _no_mask_id(ref.name)
        arch = config.arch if config is not None else None
        recipe = sv.recipe_for("", engine, architecture=arch)
        block = block_size or config.block_size
        spec = sv.ServeSpec(target, ref.repo_id, block, None, port, extra, None, recipe, tp or 1)
        return spec, ref.name, arch
    refuse_unrunnable(entry, hint="`dflash-zoo list` shows the entries that can be served")  # author-marked
    if entry.status == "unsupported-here":  # dflash-zoo's own adapter is missing: the engine needs none
        hint(
            f"dflash-zoo itself cannot run {entry.slug} here ({entry.reason}); {engine} serves it on its own"
        )
    recipe = sv.recipe_for(entry.adapter, engine, entry.slug, entry.draft.architecture)
    sv.refuse_if_unsupported(recipe, engine, entry.slug)
    pins = read_pins(entry)
    draft_rev = pins.draft or entry.draft_revision
    # the pinned target commit only applies to the registered target, not a --target override
    target_rev = None if target not in (None, entry.target_repo) else (pins.target or entry.target_revision)
    trained = lambda: entry.draft.block_size or _entry_block_size(entry, draft_rev)  # noqa: E731
    check_overrides(tp, block_size, target or entry.target_repo, target_rev, entry.slug, trained)
    block = block_size or trained()
    if engine == "vllm" and entry.draft.mask_token_id is None:
        _vllm_mask_id(entry, draft_rev)
    size = tp or sv.tensor_parallel_size(entry.target_bf16_bytes, visible_gpu_bytes(), entry.tp_hint)
    spec = sv.ServeSpec(
        target or entry.target_repo, entry.draft_repo, block, draft_rev, port, extra, target_rev, recipe, size
    )
    return spec, entry.slug, entry.draft.architecture


def _plain_draft_config(ref: Ref, block_size: int | None):
    """The config.json of a drafter that is not a registry entry (a local folder's; a repo's from the cache,
    else the Hub), or None when --block-size is given and it cannot be read (then unchecked, with a hint).

    Raises:
        ZooError: the config cannot be read and no --block-size was given.
    """
    from dflash_zoo.engine.config import load_draft_config

    try:
        if Path(ref.repo_id).is_dir():
            return load_draft_config(ref.repo_id)
        return load_draft_config(hub.snapshot(ref.repo_id, None, allow_patterns=["config.json"]))
    except ZooError as exc:
        if not block_size:
            raise
        hint(
            f"{ref.name}'s config.json could not be read ({exc}): its architecture and mask id are unchecked"
        )
        return None


def _vllm_mask_id(entry, revision: str) -> None:
    """vLLM reads the mask id from the drafter's config.json and stops without one; SGLang falls back to the
    tokenizer's <|MASK|> token. The registry does not know this drafter's: read the cached config (no
    network).

    Raises:
        IncompatiblePairError: the cached config.json has no mask id (exit 3).
    """
    from dflash_zoo.engine.config import load_draft_config

    try:
        mask = load_draft_config(
            hub.snapshot(entry.draft_repo, revision, ["config.json"], offline=True)
        ).mask_token_id
    except ZooError:
        return hint(
            f"the registry does not know {entry.slug}'s mask id and its config.json is not cached: vLLM "
            f"stops if the drafter's config.json has none (`dflash-zoo pull {entry.slug}`, then serve again "
            "to know)"
        )
    if mask is None:
        raise _no_mask_id(entry.slug)


def _no_mask_id(name: str) -> IncompatiblePairError:
    return IncompatiblePairError(
        f"vllm cannot serve {name}: its drafter's config.json has no mask_token_id, which vLLM requires",
        hint="use --engine sglang (it falls back to the tokenizer's <|MASK|> token); vLLM needs a "
        "drafter whose config.json has dflash_config.mask_token_id",
    )


def _entry_block_size(entry, revision: str) -> int:
    """The drafter's block size from its config.json when the registry does not know it."""
    try:
        return _config_block_size(entry.draft_repo, revision)
    except ZooError as exc:
        gated = " (gated: set HF_TOKEN)" if entry.gated else ""
        raise ZooError(
            f"the registry does not know the block size of {entry.slug}'s drafter and its config.json is not "
            f"available{gated}: {exc}",
            hint=f"`dflash-zoo pull {entry.slug}` first, or pass --block-size N",
        ) from exc


def _config_block_size(repo_id: str, revision: str | None) -> int:
    """Block size from the drafter's config.json (fetched alone, or read from the cache when offline)."""
    from dflash_zoo.engine.config import load_draft_config

    return load_draft_config(hub.snapshot(repo_id, revision, allow_patterns=["config.json"])).block_size


def visible_gpu_bytes() -> list[int]:
    """Memory of each visible NVIDIA GPU in bytes, from `nvidia-smi` (no torch); [] when none is visible."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1") or shutil.which("nvidia-smi") is None:
        return []
    query = ["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    sizes = {}
    for line in out.strip().splitlines():
        index, _, mib = line.partition(",")
        if index.strip().isdigit() and mib.strip().isdigit():
            sizes[index.strip()] = int(mib.strip()) * 2**20
    if visible is None:
        return list(sizes.values())
    return [sizes[i.strip()] for i in visible.split(",") if i.strip() in sizes]  # UUIDs: not resolved
