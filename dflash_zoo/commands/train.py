"""`train` and `eval`: thin click wrappers over `dflash_zoo.training.train` and `dflash_zoo.training.evaluate`.

Longer than the ~300 lines we aim for: two commands (`train`, `eval`) whose options and early input/output checks belong together.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from dflash_zoo.commands import train_arch, train_scale, train_shape
from dflash_zoo.commands.run import (
    SEED,
    Finite,
    Temperature,
    check_device,
    check_model_paths,
    dtype_option,
    load_pipeline,
    model_options,
)
from dflash_zoo.output import emit_json, hint, info, status, table
from dflash_zoo.paths import zoo_home

EXAMPLES_TRAIN = """
\b
Examples:
  dflash-zoo train --target ./my-target --data chat.jsonl --out runs/d1 --regenerate
  dflash-zoo train --target ./t --data code.jsonl --out runs/b8 --block-size 8 --draft-layers 3 --steps 2000
  dflash-zoo train --target ./t --data code.jsonl --out runs/d1 --save-every 200   # then, after a crash:
  dflash-zoo train --target ./t --data code.jsonl --out runs/d1 --save-every 200 --resume
  torchrun --nproc-per-node 4 -m dflash_zoo train --target ./t --data d.jsonl --out runs/d1 --device cuda
"""


def _ids(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from exc


def _load_target(target: str, device: str | None, dtype: str) -> tuple[Any, Any, str]:
    from dflash_zoo.api import default_device, load_target, parse_dtype
    from dflash_zoo.output import quiet_loading

    device = device or default_device()
    quiet_loading()  # the status line says what is happening (as for generate)
    with status("loading target..."):
        model, tok = load_target(target, device, parse_dtype(dtype, device), None)
    if tok is None:
        raise click.UsageError(f"{target} has no tokenizer; training and eval need one")
    return model, tok, device


def _preflight(p: dict, rank: int) -> list:
    """Everything that can be checked without a model: the data file, every output location, --init,
    --resume, the block size and --target-layer-ids (against a local target's config). Returns the data
    records."""
    from dflash_zoo.commands.run import precheck_models
    from dflash_zoo.engine.outdir import check_holds_no_input, check_writable
    from dflash_zoo.training import checkpoints, data
    from dflash_zoo.training.train import TrainConfig, check_locations

    check_device(p["device"])  # `--device nonsense` / a GPU this machine lacks: before anything loads
    records = data.read_jsonl(p["data"])
    found = None
    if rank == 0:
        cfg = TrainConfig(out=p["out"], overwrite=p["overwrite"], save_every=p["save_every"],
                          keep_checkpoints=p["keep_checkpoints"])  # fmt: skip
        found = check_locations(cfg, resume=p["resume"])  # "nothing to resume" names what it skipped
        inputs = {"--data": p["data"], "--target": p["target"], "--init": p["init"]}
        check_holds_no_input(Path(p["out"]), inputs)  # --overwrite must not delete what the run reads
        _check_cache_outside(p)
        if found is not None:
            checkpoints.check_state(found)
        _announce_replacement(Path(p["out"]), p["overwrite"])
    if train_scale.regenerating(p):
        check_writable(zoo_home() / "regen", "regeneration cache (DFLASH_ZOO_HOME)")
    train_scale.preflight(p, rank)
    train_arch.preflight(p)
    check_model_paths(p["target"], p["init"])
    precheck_models(p["target"], None, registry=False)  # a local target's config and weight headers
    ids = _ids(p["target_layer_ids"])
    _check_block(p, train_shape.check(p, found))  # the shape of the drafter a run continues wins
    layers = _local_layers(p["target"])
    if ids and layers is not None and not (p["init"] or p["resume"]):
        from dflash_zoo.training.train import check_layer_ids

        check_layer_ids(ids, layers)
    return records


def _check_cache_outside(p: dict) -> None:
    """A feature cache at or under OUT (or OUT-checkpoint) would make OUT hold files that are not ours when
    the run ends, or be deleted by its replacement: refused before anything loads, existing or not."""
    from dflash_zoo.engine.outdir import norm
    from dflash_zoo.training import checkpoints

    cache = train_scale.cache_dir(p)
    if cache is None:
        return
    where = norm(cache)
    for flag, out in (
        ("--out", norm(p["out"])),
        ("--out's checkpoint folder", checkpoints.root_for(p["out"])),
    ):
        if where == out or out in where.parents:
            beside = out.parent / "features"
            raise click.BadParameter(
                f"{cache} is inside {flag} {out}, which is replaced when the run ends: the cache kept across "
                f"runs would be lost (and the output refused). Put it beside the output, e.g. {beside}",
                param_hint="--cache-features",
            )


def _announce_replacement(out: Path, overwrite: bool) -> None:
    """Say, before the run, that OUT will be replaced when it finishes (it was checked replaceable)."""
    from dflash_zoo.engine.outdir import checkpoint_files, is_ours, norm

    out = norm(out)
    if not out.is_dir() or not any(out.iterdir()):
        return
    if checkpoint_files(out):
        whose = "a training checkpoint (--overwrite)"
    elif is_ours(out):
        whose = "an earlier dflash-zoo output"
    else:
        whose = "files dflash-zoo did not write (--overwrite)"
    info(f"{out} holds {whose}: it is replaced when this run finishes")


def _check_block(p: dict, continued: Any) -> None:
    """The block must fit a training sequence; `continued`: the config of the drafter the run continues."""
    from dflash_zoo.errors import InvalidArgumentError

    block = continued.block_size if continued is not None else p["block_size"]
    if block >= p["max_length"]:
        raise InvalidArgumentError(
            f"block size {block} does not fit --max-length {p['max_length']}: a training block (its anchor "
            f"and {block - 1} drafted tokens) must lie inside one sequence",
            hint=f"use a block size below {p['max_length']} (the paper trains 16 at --max-length 3072), "
            "or raise --max-length",
        )


def _local_layers(target: str) -> int | None:
    """num_hidden_layers of a local target directory's config.json (None when unknown)."""
    import json

    try:
        raw = json.loads((Path(target).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for cfg in (raw, raw.get("text_config") or {}):
        if isinstance(cfg.get("num_hidden_layers"), int):
            return cfg["num_hidden_layers"]
    return None


def _examples(p: dict, records: list, model: Any, tok: Any, rank: int, world: int) -> list:
    """Tokenised training examples, regenerated by the target (rank 0 writes the cache) with --regenerate."""
    from dflash_zoo.adapters import get_adapter
    from dflash_zoo.training import data

    chat = dict(get_adapter(model.config.model_type).chat_template_kwargs)
    if not train_scale.regenerating(p):
        return data.tokenize_records(records, tok, p["raw"], p["max_length"], chat)
    if p["regenerate_endpoint"]:
        exs = train_scale.endpoint_examples(p, records, tok, chat, rank, world)
        return data.cut_regenerated(exs, len(records), p["max_length"])
    keys = ("raw", "prompt_tokens", "max_new_tokens", "temperature", "seed")
    settings = (
        {k: p[k] for k in keys} | {"dtype": str(model.dtype)} | data.template_settings(tok, p["raw"], chat)
    )
    cache = zoo_home() / "regen" / f"{data.regen_key(p['target'], p['data'], settings)}.jsonl"
    if rank == 0 or cache.is_file():
        with status("target regenerating responses...", lines=True) as st:
            exs = data.regenerate(
                records, model, tok, raw=p["raw"], chat_kwargs=chat, max_new_tokens=p["max_new_tokens"],
                temperature=p["temperature"], batch_size=p["regen_batch_size"], prompt_tokens=p["prompt_tokens"],
                seed=p["seed"], cache_file=cache, on_batch=lambda d, t: st.update(f"regenerated {d}/{t} prompts"),
            )  # fmt: skip
    if world > 1:
        import torch

        torch.distributed.barrier()
        exs = data.regenerate(records, model, tok, cache_file=cache)  # every rank reads the cache
    return data.cut_regenerated(exs, len(records), p["max_length"])


@click.command(epilog=EXAMPLES_TRAIN)
@click.option("--target", "-t", required=True, help="Target: local dir or Hub id.")
@click.option(
    "--data", required=True, type=click.Path(dir_okay=False), help="JSONL: text / prompt / messages lines."
)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output drafter directory.")
@click.option("--regenerate", is_flag=True, help="Let the target write the responses first (cached on disk).")
@click.option(
    "--temperature",
    type=Temperature(),
    default=0.0,
    show_default=True,
    help="Regeneration temperature.",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Regeneration length.",
)
@click.option("--regen-batch-size", type=click.IntRange(min=1), default=32, show_default=True)
@click.option(
    "--prompt-tokens",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Prefix length of text lines used as prompts.",
)
@click.option("--raw", is_flag=True, help="No chat template for prompts.")
@click.option("--draft-layers", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--block-size", type=click.IntRange(min=2), default=16, show_default=True)
@click.option(
    "--target-layer-ids", default=None, help="Comma-separated tap ids (default: the upstream rule)."
)
@click.option(
    "--mask-token-id",
    type=click.IntRange(min=0),
    default=None,
    help="Default: the tokenizer's mask token, else <|MASK|>, else the last embedding row.",
)
@click.option(
    "--steps", type=click.IntRange(min=1), default=None, help="Optimizer steps (overrides --epochs)."
)
@click.option("--epochs", type=Finite(min=0, min_open=True), default=6.0, show_default=True)
@click.option(
    "--time-budget",
    type=Finite(min=0, min_open=True),
    default=None,
    help="Stop after this many seconds (the schedule follows).",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Sequences per step (per rank).",
)
@click.option("--max-length", type=click.IntRange(min=4), default=3072, show_default=True)
@click.option("--anchors-per-seq", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--lr", type=Finite(min=0, min_open=True), default=6e-4, show_default=True)
@click.option("--warmup-ratio", type=Finite(0, 1), default=0.04, show_default=True)
@click.option("--weight-decay", type=Finite(min=0), default=0.0, show_default=True)
@click.option(
    "--loss-decay-gamma",
    type=Finite(min=0, min_open=True),
    default=None,
    help="Default 7/5/4 for B=16/10/8 (see docs/training.md).",
)
@click.option("--uniform-loss-weights", is_flag=True, help="Ablation: w_k = 1.")
@click.option(
    "--uniform-blocks", is_flag=True, help="Ablation: consecutive blocks instead of random anchors."
)
@click.option("--no-target-features", is_flag=True, help="Ablation: fc frozen at zero (no target context).")
@click.option("--device", default=None, help="cpu, cuda ... (default: cuda if available).")
@dtype_option("Target dtype (and the saved drafter's).")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option(
    "--resume", is_flag=True, help="Continue from the newest complete checkpoint in OUT-checkpoint/."
)
@click.option(
    "--overwrite", is_flag=True, help="Replace OUT even if it holds files dflash-zoo did not write (deleted)."
)
@click.option(
    "--keep-checkpoints",
    is_flag=True,
    help="Keep OUT-checkpoint/ after success (default: removed; keep it to --resume for more steps).",
)
@click.option("--init", default=None, help="Start from an existing drafter directory.")
@click.option(
    "--save-every",
    type=click.IntRange(min=0),
    default=0,
    help="Checkpoint to OUT-checkpoint/ every N steps (0: none; with --keep-checkpoints, one at the end).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@train_scale.scale_options
@train_arch.arch_options
def train(**p: Any) -> None:
    """Train a DFlash drafter for TARGET on a JSONL file (paper recipe; see docs/training.md)."""
    import dataclasses

    from dflash_zoo.training.train import TrainConfig, dist_info
    from dflash_zoo.training.train import train as run_train

    rank, world, local = dist_info()
    records = _preflight(p, rank)  # before the target loads: no late failure throws work away
    device = f"cuda:{local}" if world > 1 and (p["device"] or "cuda").startswith("cuda") else p["device"]
    if p["fsdp_target"]:
        model, tok, device = train_scale.load_sharded(p, device, rank)
    else:
        model, tok, device = _load_target(p["target"], device, p["dtype"])
    t0 = time.perf_counter()
    exs = _examples(p, records, model, tok, rank, world)
    prep = time.perf_counter() - t0
    if p["regenerate_only"]:
        if p["as_json"] and rank == 0:
            emit_json({"regenerated": len(exs), "cache": str(zoo_home() / "regen"), "data_seconds": prep})
        info(f"regenerated {len(exs)} examples (cached in {zoo_home() / 'regen'}); --regenerate-only: done")
        return
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in p.items() if k in fields and k != "target_layer_ids"}
    values = given | train_scale.config_values(p) | train_arch.config_values(p)
    cfg = TrainConfig(**values, target_layer_ids=_ids(p["target_layer_ids"]))
    meta = {"target": p["target"], "data": p["data"], "regenerate": p["regenerate"], "examples": len(exs)}
    res = run_train(cfg, model, tok, exs, device, init=p["init"], resume=p["resume"], meta=meta)
    if rank != 0:
        return
    if p["as_json"]:
        emit_json({**dataclasses.asdict(res), "examples": len(exs), "data_seconds": prep})
    else:
        last = "no step run" if res.loss is None else f"loss {res.loss:.3f}, tau~{res.tau:.2f}"
        info(f"saved {res.out_dir}: {res.steps} steps in {res.seconds:.0f}s, {last}")


@click.command("eval")
@model_options
@click.option(
    "--data", required=True, type=click.Path(dir_okay=False), help="JSONL prompts (text / prompt / messages)."
)
@click.option("--raw", is_flag=True, help="No chat template for prompts.")
@click.option(
    "--prompt-tokens",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Prefix length of text lines.",
)
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--temperature", type=Temperature(), default=0.0, show_default=True)
@click.option("--top-p", type=Finite(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off.")
@click.option(
    "--block-size", type=click.IntRange(min=2), default=None, help="Run smaller blocks than trained."
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N prompts.")
@click.option("--no-baseline", is_flag=True, help="Skip the autoregressive run (no speedup).")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def eval_cmd(
    target, draft, device, devices, dtype, revision, draft_revision, compile_steps, data, raw, prompt_tokens,
    limit, no_baseline, as_json, **kw,
) -> None:  # fmt: skip
    """Acceptance statistics and speedup of a target + drafter over a JSONL prompt file.

    Model options are those of `generate` (no --target/--draft: the embedded demo pair).

    \b
    Examples:
      dflash-zoo eval -t ./target -d ./draft --data held_out.jsonl --raw --limit 20
      dflash-zoo eval -t ./target -d runs/d1 --data prompts.jsonl --json --no-baseline
    """
    from dflash_zoo.engine.results import target_positions
    from dflash_zoo.training.data import read_jsonl
    from dflash_zoo.training.evaluate import evaluate, load_prompts

    read_jsonl(data, limit)  # a missing or malformed file fails before any model loads
    pipe = load_pipeline(target, draft, device, dtype, revision, draft_revision, devices, compile_steps)
    positions = target_positions(pipe.model.config)
    chat = pipe.chat_template_kwargs
    prompts = load_prompts(data, pipe.tokenizer, raw, chat, prompt_tokens, limit, positions)
    with status(f"evaluating {len(prompts)} prompt(s)...", lines=True) as st:
        res = evaluate(
            pipe, prompts, baseline=not no_baseline, on_prompt=lambda n, t: st.update(f"prompt {n}/{t}"), **kw
        )
    info(f"evaluated {res.prompts} prompt(s): mean acceptance length {res.mean_acceptance_length:.2f}")
    if as_json:
        emit_json(res.to_dict())
    else:
        _print_eval(res)
    _mismatch_hint(res, str(pipe.model.dtype).removeprefix("torch."))


def _mismatch_hint(res, dtype: str) -> None:
    """Greedy DFlash output must equal greedy autoregressive output; say what a shortfall means."""
    n = res.outputs_match_autoregressive
    if n is None or n == res.prompts:
        return
    differ = f"{res.prompts - n} of {res.prompts} outputs differ from autoregressive decoding"
    where = sorted(i for i in res.first_divergence or () if i is not None)
    if where:
        differ += (
            f" (first differing token: {', '.join(map(str, where[:8]))}{', ...' if len(where) > 8 else ''})"
        )
    if dtype == "float32":
        hint(
            f"{differ} in float32, where they must not: please report it with the output of `dflash-zoo env`"
        )
    else:
        hint(
            f"{differ}: expected in {dtype}, where a many-token verify and a one-token step round differently "
            "and near-ties flip; rerun with --dtype fp32 to check token identity"
        )


def _print_eval(res) -> None:
    from dflash_zoo.output import stdout

    rows = [("prompts", res.prompts), ("block size", res.block_size), ("generated tokens", res.generated_tokens),
            ("mean acceptance length", f"{res.mean_acceptance_length:.2f}"),
            ("histogram", " ".join(f"{k}:{v}" for k, v in res.histogram.items())),
            ("per-position acceptance", " ".join(f"{a:.2f}" for a in res.per_position_acceptance)),
            ("dflash tok/s", f"{res.spec_tokens_per_second:.1f}")]  # fmt: skip
    if res.mean_acceptance_length_without_selector is not None:  # DFlash 2: what its selector adds
        rows.insert(4, ("without the selector", f"{res.mean_acceptance_length_without_selector:.2f}"))
    if res.ar_tokens_per_second is not None:
        rows += [
            ("autoregressive tok/s", f"{res.ar_tokens_per_second:.1f}"),
            ("speedup", f"{res.speedup:.2f}x"),
        ]
    if res.outputs_match_autoregressive is not None:
        rows.append(("outputs equal to autoregressive", f"{res.outputs_match_autoregressive}/{res.prompts}"))
    stdout().print(table(["metric", "value"], rows))
