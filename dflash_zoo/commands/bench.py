"""`bench`: a thin click wrapper over `dflash_zoo.bench.runner` (data on stdout, progress on stderr)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from dflash_zoo.commands.run import devices_option
from dflash_zoo.output import emit_json, info, stdout, table

EXAMPLES = """
\b
Examples:
  dflash-zoo bench                                        # embedded demo pair
  dflash-zoo bench --shape qwen3-8b --what-if-acceptance 6.5
  dflash-zoo bench --shape qwen3-8b --what-if-acceptance 6.5 --compile
  dflash-zoo bench qwen3-8b --prompt-tokens 512 --new-tokens 512
  dflash-zoo bench --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --path eager --path fast
  dflash-zoo bench --shape qwen3-32b --devices cuda:0,cuda:1 --what-if-acceptance 6.5   # split, eager
\b
Environment: DFLASH_ZOO_HOME (results go to $DFLASH_ZOO_HOME/bench/), HF_HOME, HF_HUB_OFFLINE=1.
"""


@click.command(epilog=EXAMPLES)
@click.argument("entry", required=False)
@click.option("--target", "-t", help="Target: local dir, Hub id or registry id.")
@click.option("--draft", "-d", help="Drafter: local dir or Hub id.")
@click.option(
    "--shape", help="Random-weight target of a named shape (qwen3-8b, qwen3.5-9b, ...; no download)."
)
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=2), default=512, show_default=True)
@click.option("--block-size", type=click.IntRange(min=2), default=None, help="Default: the drafter's.")
@click.option("--dtype", default="auto", show_default=True, help="auto, bf16, fp16 or fp32.")
@click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available).")
@devices_option
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option(
    "--graphs/--no-graphs",
    default=None,
    help="CUDA graphs on the fast path (default: on for CUDA).",
)
@click.option(
    "--compile/--no-compile",
    "compile_steps",
    default=False,
    show_default=True,
    help="torch.compile the fast path's steps; compile time is reported apart from tok/s.",
)
@click.option(
    "--path",
    "paths",
    multiple=True,
    type=click.Choice(["eager", "fast"]),
    help="Decode path(s) to measure (default: fast where supported, else eager).",
)
@click.option(
    "--what-if-acceptance",
    type=click.FloatRange(min=1),
    default=None,
    help="Force this mean acceptance length (a projection: drafts are not checked).",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="JSON record path (default: $DFLASH_ZOO_HOME/bench/<time>-<name>.json).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the JSON record on stdout.")
def bench(entry, target, draft, shape, dtype, device, devices, paths, out, as_json, compile_steps, **kw):
    """Autoregressive vs DFlash speed on one target and prompt, with a provenance record."""

    from dflash_zoo.api import parse_dtype, resolve_devices
    from dflash_zoo.bench import meta as benchmeta
    from dflash_zoo.bench import runner as B

    if shape and (entry or target or draft):
        raise click.UsageError("--shape builds a random target; do not combine it with a model")
    if devices and device:
        raise click.UsageError(
            "--devices splits the target over several devices; do not combine it with --device"
        )
    if devices and "fast" in paths:
        raise click.UsageError("a target split across devices runs the eager path only (--path eager)")
    if shape and shape not in B.SHAPES:
        raise click.UsageError(f"unknown shape {shape!r}; known: {', '.join(B.SHAPES)}")
    # a split target: its first device sets the dtype default
    device, split = resolve_devices(devices, device)
    torch_dtype = parse_dtype(dtype, device)
    where = devices or device
    info(f"building {'shape ' + shape if shape else entry or target or 'the demo pair'} on {where} ...")
    opts = B.BenchOptions(paths=tuple(paths) or ("fast",), compile=compile_steps, **kw)
    if shape:
        sub = B.random_subject(shape, device, torch_dtype, opts, split)
    else:
        sub = B.pair_subject(entry or target, draft, device, torch_dtype, opts, devices)
    if not paths:
        from dflash_zoo.cuda.fast import unsupported_reason

        graphs = opts.graphs if opts.graphs is not None else str(device).startswith("cuda")
        reason = "split target" if sub.placement else unsupported_reason(sub.adapter, graphs=graphs)
        opts = B.BenchOptions(**{**vars(opts), "paths": ("eager",) if reason else ("fast",)})
    record = B.run_bench(sub, opts, ["dflash-zoo", *sys.argv[1:]])
    path = out or benchmeta.default_out(shape or entry or target or "demo")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    info(f"record written to {path}")
    if as_json:
        emit_json(record)
    else:
        _print_table(record)


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _print_table(record: dict) -> None:
    rows = []
    for path, r in record["results"].items():
        for mode in ("autoregressive", "dflash"):
            m = r[mode]
            mem = m["peak_memory_bytes"]
            rows.append(
                [
                    path,
                    mode,
                    _fmt(m["tokens_per_second"], ".1f"),
                    _fmt(r["speedup"], ".2f") + "x" if mode == "dflash" else "",
                    _fmt(m["mean_acceptance_length"], ".2f"),
                    _fmt(m["ttft_seconds"] * 1e3, ".0f"),
                    _fmt(None if mem is None else mem / 2**30, ".2f"),
                    _fmt(m["roofline_fraction"], ".0%"),
                ]
            )
    title = None
    if record["kind"] == "projection":
        title = f"PROJECTION: what-if acceptance {record['projection']['what_if_acceptance']}"
    cols = ["path", "mode", "tok/s", "speedup", "tau", "ttft ms", "peak GiB", "roofline"]
    stdout().print(table(cols, rows, title=title))
    for path, r in record["results"].items():
        if r.get("capture_seconds") is not None:  # one-off costs, outside tok/s
            info(f"{path}: compile {r['compile_seconds']:.1f} s, graph capture {r['capture_seconds']:.1f} s")
        if (eng := r.get("engine")) and eng.get("gemv") is not None:  # which kernels the fast path ran
            info(
                f"{path}: attention {eng['decode_attention']} (one row) / {eng['block_attention']} (blocks), "
                f"split-K GEMV {'on' if eng['gemv'] else 'off'}, "
                f"fused elementwise kernels {'on' if eng.get('fused_ops') else 'off'}"
            )
