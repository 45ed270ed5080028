"""`bench --train`: the options and the run of the training-step benchmark (`dflash_zoo.bench.train_step`).

`train_options` adds the training-only options to `bench`; `pop` takes them out of the command's keyword
arguments (the inference bench never sees them); `run` checks the combination, measures, prints and writes
the record with `bench`'s own record helpers.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import click

TRAIN_KEYS = ("train", "attention", "seq_len", "anchors_per_seq", "batch_size", "draft_layers")


def train_options(fn):
    """The training-step options of `bench` (used with `--train` only)."""
    options = [
        click.option("--train", is_flag=True, help="Time one training step of the recipe (needs --shape)."),
        click.option(
            "--attention",
            type=click.Choice(["auto", "dense", "flex"]),
            default="auto",
            show_default=True,
            help="--train: drafter attention (auto: flex on CUDA).",
        ),
        click.option(
            "--seq-len",
            type=click.IntRange(min=8),
            default=3072,
            show_default=True,
            help="--train: tokens per sequence.",
        ),  # fmt: skip
        click.option(
            "--anchors-per-seq",
            type=click.IntRange(min=1),
            default=512,
            show_default=True,
            help="--train: blocks per sequence.",
        ),  # fmt: skip
        click.option(
            "--batch-size",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="--train: sequences per step.",
        ),  # fmt: skip
        click.option(
            "--draft-layers",
            type=click.IntRange(min=1),
            default=None,
            help="--train: drafter layers (default: the shape's drafter).",
        ),  # fmt: skip
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@dataclass(frozen=True)
class TrainArgs:
    train: bool
    attention: str
    seq_len: int
    anchors_per_seq: int
    batch_size: int
    draft_layers: int | None
    compile_step: str  # regional compilation: bench's --compile / --no-compile, else auto


def pop(kw: dict[str, Any], compile_steps: bool | None) -> TrainArgs:
    """The training-step options, removed from `kw`; `compile_steps` is bench's --compile (None: not given)."""
    compiled = {None: "auto", True: "on", False: "off"}[compile_steps]
    return TrainArgs(**{k: kw.pop(k) for k in TRAIN_KEYS}, compile_step=compiled)


def _check(
    args: TrainArgs, shape: str | None, model: str | None, kw: dict[str, Any], extra: dict[str, Any]
) -> None:
    from dflash_zoo.bench.shapes import SHAPES

    if not shape or model:
        raise click.UsageError("--train measures a random-weight target: pass --shape NAME and no model")
    if shape not in SHAPES:
        raise click.UsageError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    given = [flag for flag, value in extra.items() if value]
    if kw.get("what_if_acceptance") is not None or kw.get("profile"):
        given.append("--what-if-acceptance / --profile")
    if given:
        raise click.UsageError(f"--train does not take {', '.join(given)}")
    if args.anchors_per_seq > args.seq_len - 1:
        raise click.UsageError(f"--anchors-per-seq {args.anchors_per_seq} exceeds the {args.seq_len - 1} anchors "
                               f"a {args.seq_len}-token sequence has")  # fmt: skip


def run(
    args: TrainArgs, shape: str | None, model: str | None, device: str | None, dtype: str, kw: dict[str, Any],
    extra: dict[str, Any], out: Any, as_json: bool,
) -> None:  # fmt: skip
    """Measure the training step and report it (table or JSON on stdout; the record written to `out`)."""
    from dflash_zoo.api import default_device, parse_dtype
    from dflash_zoo.bench import meta as benchmeta
    from dflash_zoo.bench.train_step import TrainBenchOptions, run_train_bench
    from dflash_zoo.commands.bench import _check_record_location, report
    from dflash_zoo.commands.run import check_device
    from dflash_zoo.output import info

    _check(args, shape, model, kw, extra)
    check_device(device)
    device = device or default_device()
    record_path = out or benchmeta.default_out(f"train-{shape}")
    _check_record_location(record_path, explicit=out is not None)
    opts = TrainBenchOptions(
        seq_len=args.seq_len, anchors=args.anchors_per_seq, batch_size=args.batch_size,
        draft_layers=args.draft_layers, block_size=kw.get("block_size"), attention=args.attention,
        compile=args.compile_step, warmup=max(1, kw.get("warmup", 1)), steps=kw.get("repeats", 3), seed=kw.get("seed", 0),
    )  # fmt: skip
    info(f"building shape {shape} on {device} for a training step ...")
    record = run_train_bench(shape, device, parse_dtype(dtype, device), opts, ["dflash-zoo", *sys.argv[1:]])
    if not as_json:
        print_record(record)
    report(record, record_path, explicit=out is not None, as_json=as_json)


def print_record(record: dict) -> None:
    from dflash_zoo.output import human_size, info, print_table, table

    st = record["step"]
    parts = st["parts_seconds"]
    rows = [
        [name.replace("_", " "), f"{sec * 1e3:.1f}", f"{sec / st['seconds']:.0%}"]
        for name, sec in parts.items()
    ]
    rows.append(["step", f"{st['seconds'] * 1e3:.1f}", "100%"])
    print_table(table(["part", "ms", "share"], rows, title=f"training step, {record['shape']}"))
    mfu = "-" if st["mfu"] is None else f"{st['mfu']:.1%}"
    info(
        f"{st['tokens_per_second']:,.0f} tokens/s, {st['flops_per_second'] / 1e12:.1f} TFLOP/s model FLOPs, "
        f"MFU {mfu}, peak memory {human_size(st['peak_memory_bytes'])}"
    )
    att = record["attention"]
    info(
        f"drafter attention ({att['mode']}): dense {att['dense_seconds'] * 1e3:.1f} ms, "
        f"flex {att['flex_seconds'] * 1e3:.1f} ms ({att['flex_speedup']:.1f}x)"
    )
