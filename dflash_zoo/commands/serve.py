"""`serve`: validate a pair, then build (and run) the vLLM or SGLang launch command."""

from __future__ import annotations

import os
import shlex
import sys

import click

from dflash_zoo.commands.hubcmds import HUB_ENV, Ref, resolve
from dflash_zoo.errors import UnsupportedModelError
from dflash_zoo.output import emit_json, hint, info
from dflash_zoo.zoo import hub


@click.command(epilog=HUB_ENV, context_settings={"ignore_unknown_options": True})
@click.argument("model_id")
@click.option("--engine", type=click.Choice(["vllm", "sglang"]), required=True, help="Serving engine.")
@click.option("--target", default=None, help="Target model (required for a plain draft repo id).")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="Port for the engine's server.")
@click.option("--dry-run", is_flag=True, help="Print the launch command; do not run it.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: print argv and env as JSON.")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def serve(model_id, engine, target, port, dry_run, as_json, extra):
    """Validate a pair, then build and run the vLLM / SGLang launch command (args after -- are passed on).

    \b
    Examples:
      dflash-zoo serve qwen3-8b --engine vllm --dry-run
      dflash-zoo serve qwen3-8b --engine sglang --port 30000
      dflash-zoo serve qwen3-8b --engine vllm -- --max-model-len 8192
      dflash-zoo serve z-lab/Qwen3-8B-DFlash-b16 --engine vllm --target Qwen/Qwen3-8B --dry-run
    """
    from dflash_zoo.zoo import serve as sv

    spec = _serve_spec(resolve(model_id), target, port, extra)
    argv = sv.build_command(engine, spec, python=sys.executable)
    extra_env = sv.engine_env(engine)
    if dry_run:
        if as_json:
            return emit_json({"engine": engine, "argv": argv, "env": extra_env, "command": shlex.join(argv)})
        prefix = " ".join(f"{k}={v}" for k, v in extra_env.items())
        return click.echo(f"{prefix} {shlex.join(argv)}".strip())
    sv.require_engine(engine)
    info(f"exec: {shlex.join(argv)}")
    os.environ.update(extra_env)
    os.execvp(argv[0], argv)


def _serve_spec(ref: Ref, target: str | None, port: int | None, extra: tuple[str, ...]):
    """Check the pair and gather target, draft, block size; a plain repo id only warns (no registry check)."""
    from dflash_zoo.zoo.serve import ServeSpec

    entry = ref.entry
    if entry is not None:
        if entry.status == "unsupported-here":
            raise UnsupportedModelError(f"{entry.slug} is marked unsupported here: {entry.reason}")
        block = entry.draft.block_size
        return ServeSpec(
            target or entry.target_repo, entry.draft_repo, block, entry.draft_revision, port, extra
        )
    if target is None:
        raise click.UsageError(f"{ref.name} is not a registry entry: pass --target with the target model")
    hint(f"{ref.name} is not in the registry: the pair is not validated; run `dflash-zoo check` first")
    return ServeSpec(target, ref.repo_id, _config_block_size(ref.repo_id, None), None, port, extra)


def _config_block_size(repo_id: str, revision: str | None) -> int:
    """Block size from the drafter's config.json (fetched alone, or read from the cache when offline)."""
    from dflash_zoo.engine.config import load_draft_config

    return load_draft_config(hub.snapshot(repo_id, revision, allow_patterns=["config.json"])).block_size
