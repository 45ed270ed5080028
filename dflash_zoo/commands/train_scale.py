"""`train`'s options for real scale: drafter attention kernel, the on-disk feature cache, regeneration through
a serving engine and a target sharded over the ranks (FSDP). `commands/train.py` applies `scale_options`
and calls the helpers below at its preflight, loading and data steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from dflash_zoo.commands.run import Finite

MEMORY = "memory"  # `--cache-features` without a directory: the in-memory cache


def scale_options(fn):
    """The options of this module, added to `train`."""
    options = [
        click.option("--attention", type=click.Choice(["auto", "dense", "flex"]), default="auto", show_default=True,
                     help="Drafter attention in training: flex (block-sparse, CUDA) or dense (the reference); "
                     "auto: flex on CUDA."),
        click.option("--compile", "compile_step", type=click.Choice(["auto", "on", "off"]), default="auto",
                     show_default=True, help="torch.compile the target's and drafter's layers region by region "
                     "(fused norms and activations; docs/training.md, 'Speed'). auto: on for an unsharded target on CUDA."),
        click.option("--cache-features", "cache_features", is_flag=False, flag_value=MEMORY, default=None,
                     metavar="[DIR]", help="Compute the target's features once: into DIR (kept across epochs and "
                     "runs, crash-safe), or without DIR in device memory."),
        click.option("--cache-dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16",
                     show_default=True, help="Storage dtype of --cache-features DIR."),
        click.option("--cache-shard-mb", type=Finite(min=0, min_open=True), default=1000.0,
                     show_default=True, help="Features per file of --cache-features DIR (MB)."),
        click.option("--regenerate-endpoint", default=None, metavar="URL",
                     help="Regenerate through an OpenAI-compatible server (vLLM, SGLang) at URL instead of the "
                     "built-in generate; implies --regenerate."),
        click.option("--regenerate-model", default=None, help="The served model name (default: the only one "
                     "the server lists)."),
        click.option("--regenerate-api", type=click.Choice(["completions", "chat"]), default="completions",
                     show_default=True, help="completions: our chat template, token-id prompts; chat: the "
                     "server's template."),
        click.option("--concurrency", type=click.IntRange(min=1), default=16, show_default=True,
                     help="Requests in flight to the regeneration server."),
        click.option("--retries", type=click.IntRange(min=0), default=6, show_default=True,
                     help="Retries per request on 429 / 5xx / timeouts (exponential backoff)."),
        click.option("--request-timeout", type=Finite(min=0, min_open=True), default=600.0,
                     show_default=True, help="Seconds per regeneration request."),
        click.option("--regenerate-only", is_flag=True, help="Regenerate (cached), then stop before training."),
        click.option("--fsdp-target", is_flag=True, help="Under torchrun: shard the frozen target over the GPUs "
                     "(FSDP), for targets that do not fit one."),
    ]  # fmt: skip
    for option in reversed(options):
        fn = option(fn)
    return fn


def regenerating(p: dict) -> bool:
    return bool(p["regenerate"] or p["regenerate_endpoint"])


def preflight(p: dict, rank: int) -> None:
    """Checks of these options before any model loads."""
    from dflash_zoo.training import feature_cache
    from dflash_zoo.training.distributed import dist_info

    world = dist_info()[1]
    if p["fsdp_target"] and world < 2:
        raise click.UsageError("--fsdp-target shards the target over torchrun's ranks: launch with torchrun")
    if p["fsdp_target"] and p["cache_features"] == MEMORY:
        raise click.UsageError("--fsdp-target needs --cache-features DIR (or none), not the in-memory cache")
    if p["regenerate_only"] and not regenerating(p):
        raise click.UsageError("--regenerate-only needs --regenerate or --regenerate-endpoint")
    if p["attention"] == "flex":  # no backward off CUDA: refused before anything loads
        from dflash_zoo.api import default_device
        from dflash_zoo.training.attention import resolve_kind

        resolve_kind("flex", p["device"] or default_device())
    url = p["regenerate_endpoint"]
    if url is not None and not url.startswith(("http://", "https://")):
        raise click.UsageError(f"--regenerate-endpoint {url!r} is not an http(s) URL")
    if cache_dir(p) is not None and rank == 0:
        feature_cache.check_root(Path(cache_dir(p)))  # foreign files or an unwritable place: refused now


def cache_dir(p: dict) -> str | None:
    value = p["cache_features"]
    return None if value in (None, MEMORY) else value


def config_values(p: dict) -> dict[str, Any]:
    """`TrainConfig` fields these options set."""
    return {"cache_features": p["cache_features"] == MEMORY, "cache_dir": cache_dir(p), "compile": p["compile_step"],
            "cache_shard_bytes": max(1, int(p["cache_shard_mb"] * 1e6))}  # fmt: skip


def load_sharded(p: dict, device: str | None, rank: int) -> tuple[Any, Any, str]:
    """(target sharded over the ranks, tokenizer, device) for --fsdp-target."""
    from dflash_zoo.api import default_device, parse_dtype
    from dflash_zoo.output import quiet_loading, status
    from dflash_zoo.training.distributed import load_sharded_target

    device = device or default_device()
    quiet_loading()
    with status("loading and sharding the target..."):
        model, tok = load_sharded_target(p["target"], device, parse_dtype(p["dtype"], device), rank)
    return model, tok, device


def endpoint_examples(p: dict, records: list, tok: Any, chat: dict, rank: int, world: int) -> list:
    """Examples regenerated by the server at --regenerate-endpoint (rank 0 asks; the others read the file)."""
    from dflash_zoo.output import status
    from dflash_zoo.paths import zoo_home
    from dflash_zoo.training import data, distributed
    from dflash_zoo.training import regenerate as R

    keys = ("raw", "prompt_tokens", "max_new_tokens", "temperature", "seed")
    settings = {k: p[k] for k in keys} | {"server_model": p["regenerate_model"], "api": p["regenerate_api"]}
    settings |= data.template_settings(tok, p["raw"], chat)
    cache = zoo_home() / "regen" / f"{data.regen_key(p['target'], p['data'], settings)}.jsonl"
    ep = R.Endpoint(p["regenerate_endpoint"], p["regenerate_model"], p["regenerate_api"], p["concurrency"],
                    p["retries"], p["request_timeout"])  # fmt: skip
    gen = R.Generation(p["raw"], chat, p["max_new_tokens"], p["temperature"], p["prompt_tokens"], p["seed"])
    exs = None
    if rank == 0:
        with status("server regenerating responses...", lines=True) as st:
            run = R.Regenerator(records, tok, ep, gen, cache)
            exs = run.run(on_item=lambda d, t: st.update(f"regenerated {d}/{t} prompts"))
    if world > 1:
        distributed.barrier()
        exs = R.read_examples(cache)
    return exs
