"""`bench`: a thin click wrapper over `dflash_zoo.bench.runner` (data on stdout, progress on stderr).

The record's location is checked before anything is measured, and the results are printed before the record
is written, so a bad `DFLASH_ZOO_HOME` or `--out` costs no measurement. The embedded demo pair is measured on
its held-out standard-library files (`bench/prompts.py`); `--prompts FILE.jsonl` gives any pair a prompt set.

A little over the ~300 lines we aim for: the command's many options, its early checks and its table.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import click

from dflash_zoo.commands import bench_train
from dflash_zoo.commands.run import (
    SEED,
    Finite,
    Temperature,
    devices_option,
    dtype_option,
    top_k_option,
    top_p_option,
)
from dflash_zoo.errors import ZooError
from dflash_zoo.output import emit_json, human_size, info, print_table, table

EXAMPLES = """
\b
Examples:
  dflash-zoo bench                                        # demo pair, its held-out stdlib files
  dflash-zoo bench --shape qwen3-8b --what-if-acceptance 6.5
  dflash-zoo bench --shape qwen3-8b --what-if-acceptance 6.5 --compile
  dflash-zoo bench --shape qwen3-8b --what-if-acceptance 6.5 --fp8   # block-FP8 vs its bf16 self
  dflash-zoo bench --shape qwen3.5-9b --what-if-acceptance 6.5 --profile   # time and kernels per step
  dflash-zoo bench qwen3-8b --prompt-tokens 512 --max-new-tokens 512
  dflash-zoo bench qwen3-8b --prompts prompts.jsonl --limit 20
  dflash-zoo bench --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --path eager --path fast
  dflash-zoo bench --shape qwen3-32b --devices cuda:0,cuda:1 --what-if-acceptance 6.5   # split, eager
  dflash-zoo bench --train --shape qwen3-8b --attention flex --warmup 3 --repeats 10   # one training step
\b
Environment: DFLASH_ZOO_HOME (results go to $DFLASH_ZOO_HOME/bench/), HF_HOME, HF_HUB_OFFLINE=1.
"""
FIXED_PROMPT_TOKENS, FIXED_NEW_TOKENS = 512, 512  # one fixed prompt (or a random one for --shape)


@click.command(epilog=EXAMPLES)
@click.argument("entry", required=False)
@click.option("--target", "-t", help="Target: local dir, Hub id or registry id.")
@click.option("--draft", "-d", help="Drafter: local dir or Hub id.")
@click.option(
    "--shape", help="Random-weight target of a named shape (qwen3-8b, qwen3.5-9b, ...; no download)."
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="JSONL prompts, the line formats of `eval --data` (default: one fixed prompt; the demo pair: "
    "its held-out stdlib files).",
)
@click.option("--raw", is_flag=True, help="No chat template for prompt / messages lines of --prompts.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N prompts of a set.")
@click.option(
    "--prompt-tokens",
    type=click.IntRange(min=1),
    default=None,
    help=f"Prompt length (default {FIXED_PROMPT_TOKENS}); with a prompt set, the prefix length of text lines "
    "(default 32, as in eval).",
)
@click.option(
    "--max-new-tokens",
    "-n",
    "new_tokens",
    type=click.IntRange(min=2),
    default=None,
    help=f"Tokens to generate (default {FIXED_NEW_TOKENS}; 256 with a prompt set, as in eval).",
)
@click.option("--new-tokens", "new_tokens_alias", type=click.IntRange(min=2), default=None, hidden=True)
@click.option("--block-size", type=click.IntRange(min=2), default=None, help="Default: the drafter's.")
@dtype_option()
@click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available).")
@devices_option
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Unmeasured runs first (of the longest prompt, for a prompt set).",
)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option(
    "--graphs/--no-graphs",
    default=None,
    help="CUDA graphs on the fast path (default: on for CUDA).",
)
@click.option(
    "--compile/--no-compile",
    "compile_steps",
    default=None,
    help="torch.compile the fast path's steps; compile time is reported apart from tok/s (default: off). "
    "With --train: the layers region by region (default: `train --compile auto`).",
)
@click.option(
    "--path",
    "paths",
    multiple=True,
    type=click.Choice(["eager", "fast"]),
    help="Engine(s) to measure (default: the one `generate` would pick here).",
)
@click.option(
    "--temperature",
    type=Temperature(),
    default=0.0,
    show_default=True,
    help="0 = greedy; > 0 measures speculative sampling (seeded by --seed).",
)
@top_p_option
@top_k_option
@click.option("--seed", type=SEED, default=0, show_default=True, help="Random prompt and sampling seed.")
@click.option(
    "--what-if-acceptance",
    type=Finite(min=1),
    default=None,
    help="Force this mean acceptance length (a projection: drafts are not checked).",
)
@click.option(
    "--profile",
    is_flag=True,
    help="Also time each fast-path step on the device (and on CUDA list its kernels): the drafter's share.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="JSON record path (default: $DFLASH_ZOO_HOME/bench/<time>-<name>.json).",
)
@click.option(
    "--draft-arch",
    type=click.Choice(["dflash", "dflash2"]),
    default=None,
    help="With --shape: build its drafter as this architecture (DFlash 2 vs DFlash at one target and block).",
)
@click.option(
    "--fp8",
    is_flag=True,
    help="With --shape: quantize the target's decoder projections to block-wise FP8 (128x128, transformers' "
    "layout) and measure it on the fast engine against its bf16 self: tok/s ratios and greedy divergence.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the JSON record on stdout.")
@bench_train.train_options
def bench(
    entry, target, draft, shape, dtype, device, devices, paths, out, as_json, compile_steps,
    prompts_file, raw, limit, prompt_tokens, new_tokens, new_tokens_alias, fp8, **kw,
) -> None:  # fmt: skip
    """Autoregressive vs DFlash speed on one target and a prompt (or a prompt set), with a provenance record.

    Each of --repeats runs decodes the prompt (or every prompt of the set) once; the table gives the median
    tok/s and the range over the repeats, and a warning when they spread widely.
    """

    train = bench_train.pop(kw, compile_steps)  # --train: one training step instead (commands/bench_train.py)
    if train.train:
        extra = {"--prompts": prompts_file, "--raw": raw, "--limit": limit, "--devices": devices, "--path": paths,
                 "--prompt-tokens": prompt_tokens, "--max-new-tokens": new_tokens or new_tokens_alias,
                 "--fp8": fp8}  # fmt: skip
        return bench_train.run(train, shape, entry or target or draft, device, dtype, kw, extra, out, as_json)

    from dflash_zoo.api import parse_dtype, resolve_devices
    from dflash_zoo.bench import meta as benchmeta
    from dflash_zoo.bench import runner as B
    from dflash_zoo.commands.run import check_device, check_devices, check_model_paths, precheck_models
    from dflash_zoo.output import quiet_loading

    if shape and (entry or target or draft):
        raise click.UsageError("--shape builds a random target; do not combine it with a model")
    tau, block = kw.get("what_if_acceptance"), kw.get("block_size")
    if tau and block and tau > block:  # else checked once the drafter's block is known
        raise click.BadParameter(f"{tau} exceeds --block-size {block}", param_hint="--what-if-acceptance")
    if devices and device:
        raise click.UsageError(
            "--devices splits the target over several devices; do not combine it with --device"
        )
    if devices and "fast" in paths:
        raise click.UsageError("a target split across devices runs the eager path only (--path eager)")
    fast_only = _fast_only_options(kw, compile_steps)
    if fast_only and paths and "fast" not in paths:
        raise click.UsageError(f"{fast_only} only the fast engine: add --path fast")
    if shape and shape not in B.SHAPES:
        raise click.UsageError(f"unknown shape {shape!r}; known: {', '.join(B.SHAPES)}")
    if kw.get("draft_arch") and not shape:
        raise click.UsageError("--draft-arch rebuilds a --shape's drafter; it needs --shape")
    if shape and (prompts_file or raw or limit):
        raise click.UsageError("--shape has no tokenizer: drop --prompts, --raw and --limit")
    if fp8 and not shape:
        raise click.UsageError("--fp8 quantizes a --shape's random weights; an FP8 checkpoint runs as it is")
    if fp8 and (devices or "eager" in paths):
        raise click.UsageError(
            "--fp8 measures the fast engine (transformers' own FP8 forward fetches a kernel from the Hub): "
            "drop --path eager and --devices"
        )
    check_device(device)  # `--device nonsense` / a GPU this machine lacks: before anything is built
    check_devices(device, devices)
    check_model_paths(entry, target, draft)
    if not shape:  # a mistyped registry id or a broken local target: before anything loads
        precheck_models(entry or target, draft)
        _check_prompt_tokens(prompt_tokens, _local_positions(entry or target))
    record_path = out or benchmeta.default_out(shape or entry or target or "demo")
    _check_record_location(record_path, explicit=out is not None)
    # inputs before any model: a missing or malformed prompt file fails here
    prompt_set = _prompt_set(prompts_file, limit, demo=not (shape or entry or target))
    if prompt_set is not None:
        info(f"prompts: {prompt_set.name}")
    kw |= _lengths(prompt_set is not None, prompt_tokens, new_tokens or new_tokens_alias)
    # a split target: its first device sets the dtype default
    device, split = resolve_devices(devices, device)
    torch_dtype = parse_dtype(dtype, device)
    if kw.get("graphs") and not str(device).startswith("cuda"):
        raise click.UsageError(f"--graphs captures CUDA graphs; this bench runs on {device}")
    where = devices or device
    quiet_loading()  # transformers' own loading bar: the line below says what is built
    info(f"building {'shape ' + shape if shape else entry or target or 'the demo pair'} on {where} ...")
    opts = B.BenchOptions(paths=tuple(paths) or ("fast",), compile=bool(compile_steps), **kw)
    if shape:
        sub = B.random_subject(shape, device, torch_dtype, opts, split)
    else:
        sub = B.pair_subject(entry or target, draft, device, torch_dtype, opts, devices, prompt_set, raw)
    if not shape:  # a too-long prompt is refused; running past the positions is a warning
        _check_positions(sub, prompt_set, opts.new_tokens, prompt_tokens)
    if not paths and not fp8:  # the engine `generate` would pick, as `engine/select.py` decides
        from dflash_zoo.engine.select import EngineOptions, choose_engine

        choice = choose_engine(
            sub.adapter, device, EngineOptions(), drafter=sub.drafter, split=sub.placement is not None
        )
        info(f"engine: {choice.name} ({choice.reason})")
        if fast_only and choice.name != "fast":
            info(f"{fast_only} only the fast engine, not measured here: --path fast runs it")
        opts = B.BenchOptions(**{**vars(opts), "paths": (choice.name,)})
    argv = ["dflash-zoo", *sys.argv[1:]]
    if fp8:  # the bf16 target, then the same weights in FP8 (bench/fp8.py)
        from dflash_zoo.bench.fp8 import run_fp8_bench, summary

        record = run_fp8_bench(sub, opts, argv)
    else:
        record = B.run_bench(sub, opts, argv)
    if not as_json:
        _print_table(record)
    for line in summary(record) if fp8 else ():
        info(line)
    _warn_spread(record)
    report(record, record_path, explicit=out is not None, as_json=as_json)


def _fast_only_options(kw: dict, compile_steps: bool | None) -> str | None:
    """The options given that only the fast engine reads, as a sentence's subject and verb."""
    given = {"--profile": kw.get("profile"), "--graphs": kw.get("graphs"), "--compile": compile_steps}
    names = [name for name, value in given.items() if value]
    return f"{' and '.join(names)} {'concern' if len(names) > 1 else 'concerns'}" if names else None


def report(record: dict, path: Path, explicit: bool, as_json: bool) -> None:
    """Write the record, then (--json) print it: stdout holds one JSON document even when the write fails
    (the record, with `record_error` saying why it is not on disk; exit 1)."""
    try:
        where = _write_record(path, record, explicit)
    except ZooError as exc:
        if not as_json:
            raise
        emit_json({**record, "record_error": str(exc)})
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(1) from exc
    if as_json:
        emit_json(record)
    info(f"record written to {where}")


def _check_positions(sub, prompt_set, new_tokens: int, prompt_tokens: int | None = None) -> None:
    from dflash_zoo.bench.prompts import check_positions
    from dflash_zoo.engine.results import target_positions

    positions = target_positions(sub.adapter.config)
    _check_prompt_tokens(prompt_tokens, positions)
    longest = max(map(len, sub.prompts), default=len(sub.prompt))
    if prompt_set is not None and prompt_tokens and longest < prompt_tokens:  # a cap, not a length: say so
        info(
            f"the longest prompt of {prompt_set.name} is {longest:,} tokens (a prompt is at most half its text): "
            f"--prompt-tokens {prompt_tokens:,} caps the prompts, it does not lengthen them"
        )
    if warning := check_positions(sub.prompt, sub.prompts, prompt_set, new_tokens, positions):
        info(warning)


def _check_prompt_tokens(prompt_tokens: int | None, positions: int | None) -> None:
    """Refuse a --prompt-tokens the target cannot hold (positions: its max_position_embeddings, if known)."""
    if prompt_tokens is None or positions is None or prompt_tokens < positions:
        return
    from dflash_zoo.errors import InvalidArgumentError

    raise InvalidArgumentError(
        f"--prompt-tokens {prompt_tokens:,} does not fit the target's {positions:,} positions",
        hint=f"use --prompt-tokens {positions // 2:,} or less (the new tokens need positions too)",
    )


def _local_positions(name: str | None) -> int | None:
    """max_position_embeddings of a local target (the demo pair's without a name), before anything loads."""
    from dflash_zoo import demo
    from dflash_zoo.engine.target_files import read_config

    folder = Path(name).expanduser() if name else demo.target_dir()
    if not (folder / "config.json").is_file():
        return None
    raw = read_config(folder / "config.json", "target config")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    value = text.get("max_position_embeddings", raw.get("max_position_embeddings"))
    return value if isinstance(value, int) and value > 0 else None


def _prompt_set(path: Path | None, limit: int | None, demo: bool):
    """--prompts FILE; else, for the demo pair, its held-out stdlib files; else None (one fixed prompt)."""
    from dflash_zoo.bench import prompts

    if path is not None:
        return prompts.from_jsonl(path, limit)
    return prompts.held_out_stdlib(limit=limit) if demo else None


def _lengths(prompt_set: bool, prompt_tokens: int | None, new_tokens: int | None) -> dict[str, int]:
    """Defaults: eval's (32 / 256) for a prompt set, 512 / 512 for one fixed or random prompt."""
    from dflash_zoo.bench import prompts

    fixed = (FIXED_PROMPT_TOKENS, FIXED_NEW_TOKENS)
    pt, nt = (prompts.PROMPT_TOKENS, prompts.NEW_TOKENS) if prompt_set else fixed
    return {"prompt_tokens": prompt_tokens or pt, "new_tokens": new_tokens or nt}


def _check_record_location(path: Path, explicit: bool) -> None:
    """Before measuring: the record's folder must be writable (a probe file is created and removed)."""
    if explicit and path.exists():
        raise click.UsageError(f"--out {path} exists; bench does not overwrite a file: pass another path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".probe"):
            pass
    except OSError as exc:
        raise ZooError(
            f"cannot write the bench record in {path.parent}: {exc.strerror or exc}",
            hint="set DFLASH_ZOO_HOME to a writable folder, or pass --out FILE",
        ) from exc


def _write_record(path: Path, record: dict, explicit: bool = True) -> Path:
    """Into a temporary sibling, then put in place without replacing anything (a reader never sees half a
    record); a default path another run took meanwhile (a bench started in the same second) gets a `-2`,
    `-3` ... suffix. Returns where the record went."""
    from dflash_zoo.engine.outdir import normal_mode

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record, indent=2, default=str) + "\n")
        normal_mode(Path(tmp))  # mkstemp's file is private (0600); a record is as readable as any other file
        for n in range(1 if explicit else 100):
            final = path if n == 0 else path.with_name(f"{path.stem}-{n + 1}{path.suffix}")
            if _place(Path(tmp), final):
                return final
        raise ZooError(f"{path} appeared while measuring; the record is in {tmp}")  # kept: nothing is lost
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise ZooError(
            f"cannot write the bench record {path}: {exc.strerror or exc}",
            hint="the results above are complete; rerun with --out FILE to keep a record",
        ) from exc


def _place(tmp: Path, final: Path) -> bool:
    """Move `tmp` to `final` unless `final` exists (False then): a hard link never replaces a file; where the
    filesystem has none, a check then a rename."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        return False
    except OSError:  # no hard links here (some network and FAT filesystems)
        if final.exists():
            return False
        os.replace(tmp, final)
        return True
    tmp.unlink()
    return True


def _warn_spread(record: dict) -> None:
    """Repeats far apart (a busy machine, a short warm-up): the median alone would mislead."""
    from dflash_zoo.bench.prompts import WIDE_SPREAD, spread

    for path, r in record["results"].items():
        for mode in ("autoregressive", "dflash"):
            runs = r[mode]["tokens_per_second_runs"]
            s = spread(runs)
            if len(runs) > 1 and s.wide:
                info(
                    f"warning: {path} {mode}: repeats gave {s.low:.1f} / {s.median:.1f} / {s.high:.1f} tok/s "
                    f"(min / median / max, more than {WIDE_SPREAD:.2f}x apart): the machine is busy or the "
                    "warm-up too short; rerun on a quiet machine with more --warmup / --repeats"
                )


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _print_table(record: dict) -> None:
    from dflash_zoo.bench.prompts import spread

    rows = []
    for path, r in record["results"].items():
        for mode in ("autoregressive", "dflash"):
            m = r[mode]
            mem = m["peak_memory_bytes"]
            s = spread(m["tokens_per_second_runs"])
            rows.append(
                [
                    path,
                    mode,
                    _fmt(m["tokens_per_second"], ".1f"),
                    f"{s.low:.1f}-{s.high:.1f}",
                    _fmt(r["speedup"], ".2f") + "x" if mode == "dflash" else "",
                    _fmt(m["mean_acceptance_length"], ".2f"),
                    _fmt(m["ttft_seconds"] * 1e3, ".0f"),
                    "-" if mem is None else human_size(mem),
                    _fmt(m["roofline_fraction"], ".0%"),
                ]
            )
    title = None
    if record["kind"] == "projection":
        title = f"PROJECTION: what-if acceptance {record['projection']['what_if_acceptance']}"
    cols = ["path", "mode", "tok/s", "min-max", "speedup", "tau", "ttft ms", "peak mem", "roofline"]
    print_table(table(cols, rows, title=title))
    for path, r in record["results"].items():
        if p := r.get("profile"):
            steps = ", ".join(f"{k} {p[k]['ms_per_step']:.3f} ms" for k in ("ar", "spec", "draft", "drafter"))
            info(
                f"{path}: device time a step: {steps}; of a DFlash step the drafter takes "
                f"{p['drafter_share']:.1%}, {p['draft_share']:.1%} with its logits"
            )
        if r.get("capture_seconds") is not None:  # one-off costs, outside tok/s
            info(f"{path}: compile {r['compile_seconds']:.1f} s, graph capture {r['capture_seconds']:.1f} s")
        if (eng := r.get("engine")) and eng.get("gemv") is not None:  # which kernels the fast path ran
            info(
                f"{path}: attention {eng['decode_attention']} (one row) / {eng['block_attention']} (blocks), "
                f"split-K GEMV {'on' if eng['gemv'] else 'off'}, "
                f"fused elementwise kernels {'on' if eng.get('fused_ops') else 'off'}"
            )
        if eng and eng.get("fp8"):  # an FP8 target's projections (cuda/static/fp8.py)
            info(f"{path}: FP8 projections {eng['fp8']}")
