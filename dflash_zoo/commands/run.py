"""`generate` and `chat`: thin click wrappers over `dflash_zoo.api`.

Longer than the ~300 lines we aim for: `generate` and `chat` share their options, loading and stats; chat's command loop is most of it.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from dflash_zoo.output import emit_json, hint, stderr

ENV = """
\b
Environment: HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE=1, HF_TOKEN, DFLASH_ZOO_DEBUG=1, NO_COLOR.
"""


DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32")


def dtype_option(help_text: str = "auto, bf16, fp16 or fp32."):
    """`--dtype`, one of `DTYPES` (a typo is a usage error at once, not after torch loads)."""
    kind = click.Choice(DTYPES, case_sensitive=False)
    return click.option("--dtype", type=kind, default="auto", show_default=True, help=help_text)


devices_option = click.option(
    "--devices",
    "--device-map",
    "devices",
    default=None,
    metavar="LIST|auto",
    help="Split the target across GPUs: cuda:0,cuda:1 or auto (all visible). The drafter joins the LM head's "
    "GPU; eager loop only. See docs/multi-gpu.md.",
)


def _remember_flag(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Keep a flag in the context's meta (shared by the command's whole context chain)."""
    ctx.meta[param.name] = value
    return value


def model_options(f):
    """Options shared by generate, chat (and reused by eval/bench)."""
    opts = [
        click.option(
            "--target", "-t", help="Target: local dir, Hub id or registry id (default: embedded demo)."
        ),
        click.option("--draft", "-d", help="Drafter: local dir or Hub id (default: the registry's drafter)."),
        click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)."),
        devices_option,
        dtype_option(),
        click.option("--revision", default=None, help="Target revision."),
        click.option(
            "--draft-revision", default=None, help="Drafter revision (default: the registry's pin)."
        ),
        click.option(
            "--compile/--no-compile",
            "compile_steps",
            default=False,
            show_default=True,
            help="torch.compile the CUDA fast engine's steps: a one-time compile (~3 min for an 8B target); "
            "with the default Triton kernels it measured no faster on an 8B shape (docs/performance.md).",
        ),
        click.option(  # read by load_pipeline from the context: no parameter on every command
            "--allow-quantized-drafter",
            is_flag=True,
            expose_value=False,
            callback=_remember_flag,
            help="Try a quantized drafter (refused by default: docs/quantization.md has the evidence).",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


# what torch.Generator.manual_seed takes
SEED = click.IntRange(-(2**63), 2**64 - 1)


class Finite(click.FloatRange):
    """A finite float in a range (click's FloatRange lets `nan` through every bound, and `inf` through
    open-ended ones)."""

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        import math

        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


class Temperature(Finite):
    """A temperature: a finite float >= 0."""

    def __init__(self) -> None:
        super().__init__(min=0)


top_p_option = click.option("--top-p", type=Finite(0, 1, min_open=True), default=1.0, show_default=True)
top_k_option = click.option(
    "--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off."
)


def decoding_options(f):
    opts = [
        click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=256, show_default=True),
        click.option(
            "--temperature",
            type=Temperature(),
            default=0.0,
            show_default=True,
            help="0 = greedy (lossless).",
        ),
        top_p_option,
        top_k_option,
        click.option(
            "--block-size",
            type=click.IntRange(min=2),
            default=None,
            help="Override the drafter's block size (smaller only).",
        ),
        click.option("--seed", type=SEED, default=None, help="Sampling seed."),
        click.option("--raw", is_flag=True, help="No chat template: tokenize the prompt as given."),
        click.option(
            "--image",
            "images",
            multiple=True,
            type=click.Path(exists=True, dir_okay=False),
            help="Image file for a VLM target (repeatable); seen at prefill, drafting stays text-only.",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def load_pipeline(target, draft, device, dtype, revision, draft_revision, devices=None, compile_steps=False):
    from dflash_zoo.output import quiet_loading, status

    check_device(device)  # imports torch only for a --device given
    check_devices(device, devices)
    precheck_models(target, draft)  # torch-free: a typo or a broken local target fails before torch loads
    from dflash_zoo.api import load

    quiet_loading()  # our own status line says what is happening

    with status("loading models..."):
        pipe = load(
            target,
            draft,
            device=device,
            dtype=dtype,
            revision=revision,
            draft_revision=draft_revision,
            device_map=devices,
            compile=compile_steps,
            allow_quantized_drafter=click.get_current_context().meta.get("allow_quantized_drafter", False),
        )
    if compile_steps and (pipe.device.type != "cuda" or pipe.placement is not None):
        hint("--compile applies to the single-GPU fast engine only; ignored here")
    return pipe


def check_device(device: str | None) -> None:
    """Refuse a --device torch cannot parse (usage, exit 2) or a GPU this machine lacks (exit 1), before
    anything loads; torch's own errors ("Torch not compiled with CUDA enabled") name no next step."""
    if device is None:
        return
    import torch

    from dflash_zoo.errors import InvalidArgumentError, ZooError, no_gpu_error

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise InvalidArgumentError(
            f"unknown device {device!r}",
            hint="use cpu, cuda or cuda:N (N counts from 0), or leave --device out",
        ) from None
    if dev.type == "cpu":
        return
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise no_gpu_error(device)
    available = getattr(getattr(torch, dev.type, None), "is_available", None)  # torch.mps, torch.xpu, ...
    if available is None or not available():
        raise ZooError(f"device {device!r} is not available here", hint="use --device cpu, or leave it out")
    if dev.type != "cuda":
        return
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ZooError(
            f"device {device!r} does not exist: torch sees {torch.cuda.device_count()} CUDA GPU(s)",
            hint="cuda:0 is the first GPU; `dflash-zoo env` lists them",
        )


def check_devices(device: str | None, devices: str | None) -> None:
    """--devices (a target split across GPUs): alone, and a list torch can parse, before anything loads."""
    from dflash_zoo.errors import InvalidArgumentError, ZooError

    if not devices:
        return
    if device:
        raise click.UsageError(
            "--devices splits the target over several devices; do not combine it with --device"
        )
    from dflash_zoo.cuda.placement.plan import parse_devices

    try:
        parse_devices(devices)
    except ZooError as exc:  # a usage error: the list itself is wrong
        raise InvalidArgumentError(str(exc), hint=exc.hint) from exc


def check_model_paths(*names: str | None) -> None:
    """A model argument written as a path (`./t`, `/x/y`) that is not a directory: one line, before loading."""
    import os

    from dflash_zoo.errors import looks_like_path, missing_directory

    for name in names:
        if name and looks_like_path(name) and not os.path.isdir(os.path.expanduser(name)):
            raise missing_directory(name)


def precheck_models(target: str | None, draft: str | None, registry: bool = True) -> None:
    """What can fail without loading anything, in the order a user reads the arguments: a path that is not a
    directory, a mistyped registry id (with `registry`, a target given without --draft is one), a local target
    whose config or weight headers are broken. Imports no torch."""
    import os
    from pathlib import Path

    check_model_paths(target, draft)
    local = target is not None and os.path.isdir(os.path.expanduser(target))
    if registry and target and draft is None and not local:
        from dflash_zoo.zoo.registry import load_registry, refuse_unrunnable

        refuse_unrunnable(load_registry().resolve(target))  # NotFoundError with the nearest ids; unrunnable
    if local:
        from dflash_zoo.engine.target_files import check_target_dir

        check_target_dir(Path(target).expanduser())
    if draft and os.path.isdir(os.path.expanduser(draft)):
        from dflash_zoo.engine.config import load_draft_config

        load_draft_config(Path(draft).expanduser())  # what the loader reads first: its errors, before torch


def gen_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    keys = ("max_new_tokens", "temperature", "top_p", "top_k", "block_size", "seed")
    return {k: params[k] for k in keys if k in params}


def print_stats(res) -> None:
    hist = " ".join(f"{k}:{v}" for k, v in res.histogram.items())
    stopped = "interrupted: " if res.stop_reason == "interrupted" else ""
    stderr().print(
        f"[dim]{stopped}{len(res.output_ids)} tokens, {res.tokens_per_second:.1f} tok/s, "
        f"mean acceptance {res.mean_acceptance_length:.2f} over {len(res.steps)} steps "
        f"(block {res.block_size}, {res.acceptance_rule}); prefill {res.prefill_seconds * 1000:.0f} ms; "
        f"accepted-length histogram {hist or '-'}[/dim]",
        highlight=False,
    )


@click.command(epilog=ENV)
@click.argument("prompt")
@model_options
@decoding_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (ids, text, steps, stats).")
def generate(
    prompt, target, draft, device, devices, dtype, revision, draft_revision, compile_steps, raw, images,
    as_json, **params,
):  # fmt: skip
    """Generate a continuation of PROMPT with DFlash speculative decoding.

    Text streams to stdout and statistics go to stderr; with --json stdout holds one object with
    output_ids, text, acceptance_lengths, steps, mean_acceptance_length and tokens_per_second.

    \b
    Examples:
      dflash-zoo generate "def quicksort(xs):"              # embedded demo pair, offline
      dflash-zoo generate "Hi" --target qwen3-8b --max-new-tokens 64
      dflash-zoo generate "Hi" -t ./my-target -d ./my-drafter --json
      dflash-zoo generate "2+2=" -t qwen3-8b --temperature 0.7 --top-p 0.9 --seed 0
      dflash-zoo generate "What is in the picture?" -t qwen3.5-9b --image cat.png
      dflash-zoo generate "Hi" -t ./big-target -d ./drafter --devices cuda:0,cuda:1
    """
    if raw and not prompt and not images:  # before loading anything: nothing to continue from
        from dflash_zoo.errors import InvalidArgumentError

        raise InvalidArgumentError(
            "the prompt is empty", hint="give some text to continue; --raw adds nothing"
        )
    pipe = load_pipeline(target, draft, device, dtype, revision, draft_revision, devices, compile_steps)
    kw = {**gen_kwargs(params), "images": list(images) or None}
    if as_json:
        res = pipe.generate(prompt, raw=raw, **kw)
        emit_json(res.to_dict())
        return
    res = pipe.generate(prompt, raw=raw, on_text=_write, **kw)
    sys.stdout.write("\n")
    print_stats(res)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


CHAT_HELP = """commands:
  /help              this help
  /clear             forget the conversation
  /set KEY VALUE     temperature, top_p, top_k, max_new_tokens, block_size, seed, think (on|off)
  /stats             statistics of the last answer
  /bye               quit (also Ctrl-D)
Ctrl-C stops the current answer."""


@click.command(epilog=ENV)
@click.argument("model_id", required=False)
@model_options
@decoding_options
def chat(
    model_id, target, draft, device, devices, dtype, revision, draft_revision, compile_steps, raw, images,
    **params,
):  # fmt: skip
    """Interactive multi-turn chat with speculative decoding (per-turn stats on stderr).

    MODEL_ID is a registry id; --target/--draft pick any pair; with neither, the embedded demo pair. With --raw
    the turns are one running text (each line, its continuation, a newline) that the target continues.

    \b
    Examples:
      dflash-zoo chat                         # embedded demo pair, offline, CPU
      dflash-zoo chat qwen3-8b
      dflash-zoo chat -t ./target -d ./drafter --temperature 0.7
    """
    if model_id and not (target or draft):
        pull_missing(model_id)
    pipe = load_pipeline(
        target or model_id, draft, device, dtype, revision, draft_revision, devices, compile_steps
    )
    ChatSession(pipe, gen_kwargs(params), raw, list(images)).run()


def pull_missing(name: str) -> None:
    """For a registry id: show what is missing (size) and download it, drafter first, before loading."""
    import os

    from dflash_zoo.api import TARGET_FILES, locked_revision
    from dflash_zoo.errors import looks_like_path, missing_directory
    from dflash_zoo.output import human_size
    from dflash_zoo.sources import DRAFT_FILES
    from dflash_zoo.zoo import hub
    from dflash_zoo.zoo.registry import load_registry, refuse_unrunnable

    if os.path.isdir(name):
        return
    if looks_like_path(name):  # as for --target: a path that does not exist is no registry miss
        raise missing_directory(name)
    entry = load_registry().resolve(name)
    refuse_unrunnable(entry)  # before anything is downloaded
    jobs = [(entry.draft_repo, locked_revision(entry), DRAFT_FILES), (entry.target_repo, None, TARGET_FILES)]
    for repo, rev, patterns in jobs:
        plan = hub.plan_pull(repo, rev, allow_patterns=patterns, name=name)
        if not plan.up_to_date:
            stderr().print(f"pulling {repo}: {human_size(plan.missing_bytes)} to download", highlight=False)
            hub.download(plan, progress=sys.stderr.isatty())


def _opt_int(value: str) -> int | None:
    """An int, or `none` / `default` for "the drafter's own" (block_size) or "unseeded" (seed)."""
    return None if value.lower() in ("none", "default", "off") else int(value)


# /set KEY VALUE: how each value is read; `think` is handled apart (a chat-template switch)
SETTING_TYPES = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "max_new_tokens": int,
    "block_size": _opt_int,
    "seed": _opt_int,
}


class ChatSession:
    """The REPL state: messages, decoding settings, last result."""

    def __init__(self, pipe, settings: dict[str, Any], raw: bool, images: list[str] | None = None):
        self.pipe, self.settings, self.raw, self.images = pipe, settings, raw, images or []
        self.messages: list[dict[str, str]] = []
        self.last = None

    def run(self) -> None:
        if hasattr(sys.stdin, "reconfigure"):  # a line that is not UTF-8 must not end the session
            sys.stdin.reconfigure(errors="replace")
        stderr().print("[dim]chat ready: /help for commands, /bye to quit[/dim]")
        prompt = ">>> " if sys.stdin.isatty() else ""  # piped: stdout holds the answers alone
        while True:
            try:
                line = input(prompt)
            except EOFError:
                break
            except KeyboardInterrupt:
                sys.stderr.write("\n")
                continue
            if line.startswith("/"):
                if not self.command(line):
                    break
            elif line.strip():
                self.answer(line)

    def command(self, line: str) -> bool:
        """Handle a slash command; False means quit."""
        parts = line.split()
        cmd = parts[0]
        if cmd in ("/bye", "/exit", "/quit"):
            return False
        if cmd == "/help":
            stderr().print(CHAT_HELP, highlight=False)
        elif cmd == "/clear":
            self.messages.clear()
            stderr().print("[dim]conversation cleared[/dim]")
        elif cmd == "/stats":
            print_stats(self.last) if self.last else stderr().print("no answer yet")
        elif cmd == "/set" and len(parts) == 1:
            self.show_settings()
        elif cmd == "/set" and len(parts) == 3:
            self.set(parts[1], parts[2])
        elif cmd == "/set":
            stderr().print("usage: /set KEY VALUE (/set alone shows the settings)", highlight=False)
        else:
            stderr().print(f"unknown command {line!r}; /help lists commands")
        return True

    def show_settings(self) -> None:
        shown = {k: self.shown(k) for k in SETTING_TYPES}
        think = self.pipe.chat_template_kwargs.get("enable_thinking")
        shown["think"] = "default" if think is None else "on" if think else "off"
        stderr().print("  ".join(f"{k} {v}" for k, v in shown.items()), highlight=False)

    def shown(self, key: str) -> str:
        """A setting as /set prints it (an unset block size is the drafter's own)."""
        value = self.settings.get(key)
        if key == "block_size" and value is None:
            return f"{self.pipe.drafter.cfg.block_size} (the drafter's)"
        return "none" if value is None else str(value)

    def set(self, key: str, value: str) -> None:
        """Change one setting, checked as the next answer would check it; a bad value keeps the old one."""
        from dflash_zoo.errors import InvalidArgumentError

        if key == "think":
            on, off = ("on", "1", "true", "yes"), ("off", "0", "false", "no")
            if value.lower() not in on + off:
                stderr().print(f"think needs on or off, got {value!r}", highlight=False)
                return
            self.pipe.chat_template_kwargs["enable_thinking"] = value.lower() in on
        elif key in SETTING_TYPES:
            try:
                new = SETTING_TYPES[key](value)
            except ValueError:
                kind = "a number" if SETTING_TYPES[key] is float else "an integer"
                stderr().print(f"{key} needs {kind}, got {value!r}", highlight=False)
                return
            try:
                settings_config({**self.settings, key: new}).validated(self.pipe.drafter.cfg.block_size)
            except InvalidArgumentError as exc:
                stderr().print(f"error: {exc}; {key} stays {self.shown(key)}", highlight=False)
                if exc.hint:
                    stderr().print(f"hint: {exc.hint}", highlight=False)
                return
            self.settings[key] = new
        else:
            stderr().print(f"unknown setting {key!r}; settings: {', '.join([*SETTING_TYPES, 'think'])}")
            return
        stderr().print(f"[dim]{key} = {value}[/dim]")

    def answer(self, text: str) -> None:
        """One turn: stream the reply; Ctrl-C keeps what was said so far, a `ZooError` drops the turn."""
        from dflash_zoo.api import TextStream
        from dflash_zoo.errors import ZooError

        self.messages.append({"role": "user", "content": text})
        prompt = self._raw_transcript() if self.raw else self.messages
        if self.images:  # image prompts go through the processor: earlier turns are flattened into the text
            prompt = "".join(f"{m['role']}: {m['content']}\n" for m in self.messages[:-1]) + text
        stream, reply, gen, steps = TextStream(self.pipe.tokenizer), [], None, None
        t0 = time.perf_counter()
        try:
            gen = self.pipe.generation(prompt, self.raw, images=self.images or None, **self.settings)
            steps = iter(gen)
            for ids in steps:
                piece = stream.push(ids)
                reply.append(piece)
                _write(piece)
        except KeyboardInterrupt:
            if gen is None:
                self.messages.pop()
                sys.stderr.write("\ninterrupted\n")
                return
            if hasattr(steps, "close"):
                steps.close()  # the generation's own bookkeeping ends its timings at this point
            _partial_timings(gen.result, time.perf_counter() - t0)
        except ZooError as exc:
            sys.stdout.write("\n" if reply else "")
            stderr().print(f"error: {exc}", highlight=False)
            if exc.hint:
                stderr().print(f"hint: {exc.hint}", highlight=False)
            self.messages.pop()
            return
        reply.append(stream.flush())  # a reply that ended inside a character: its held-back bytes
        _write(reply[-1])
        sys.stdout.write("\n")
        self.last = gen.result
        self.messages.append({"role": "assistant", "content": "".join(reply)})
        print_stats(gen.result)

    def _raw_transcript(self) -> str:
        """Without a chat template the turns are one running text: each line, its continuation, a newline."""
        turns = self.messages[:-1]
        done = "".join(
            u["content"] + a["content"] + "\n" for u, a in zip(turns[::2], turns[1::2], strict=True)
        )
        return done + self.messages[-1]["content"]


def _partial_timings(res: Any, elapsed: float) -> None:
    """An answer stopped by Ctrl-C: its real partial numbers (tok/s over the time it ran), not 0.0 tok/s."""
    res.stop_reason = "interrupted"
    if res.decode_seconds <= 0 and len(res.output_ids) > 1:
        res.decode_seconds = max(elapsed - res.prefill_seconds, 1e-9)


def settings_config(settings: dict[str, Any]) -> Any:
    """The `GenerationConfig` of chat settings (the keys it knows; `think` lives in the chat template)."""
    from dflash_zoo.engine.results import GenerationConfig

    fields = GenerationConfig.__dataclass_fields__
    return GenerationConfig(**{k: v for k, v in settings.items() if k in fields})
