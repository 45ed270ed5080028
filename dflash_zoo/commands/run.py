"""`generate` and `chat`: thin click wrappers over `dflash_zoo.api`."""

from __future__ import annotations

import sys
from typing import Any

import click

from dflash_zoo.output import emit_json, hint, stderr

ENV = """
\b
Environment: HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE=1, HF_TOKEN, DFLASH_ZOO_DEBUG=1, NO_COLOR.
"""


devices_option = click.option(
    "--devices",
    "--device-map",
    "devices",
    default=None,
    metavar="LIST|auto",
    help="Split the target across GPUs: cuda:0,cuda:1 or auto (all visible). The drafter joins the LM head's "
    "GPU; eager loop only. See docs/multi-gpu.md.",
)


def model_options(f):
    """Options shared by generate, chat (and reused by eval/bench)."""
    opts = [
        click.option(
            "--target", "-t", help="Target: local dir, Hub id or registry id (default: embedded demo)."
        ),
        click.option("--draft", "-d", help="Drafter: local dir or Hub id (default: the registry's drafter)."),
        click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)."),
        devices_option,
        click.option("--dtype", default="auto", show_default=True, help="auto, bf16, fp16 or fp32."),
        click.option("--revision", default=None, help="Target revision."),
        click.option(
            "--draft-revision", default=None, help="Drafter revision (default: the registry's pin)."
        ),
        click.option(
            "--compile/--no-compile",
            "compile_steps",
            default=False,
            show_default=True,
            help="torch.compile the CUDA fast path's steps: a one-time compile (~4 min for an 8B target) "
            "for 1.3-1.4x more tok/s (8B); worth it for chat or eval, not for one short prompt.",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def decoding_options(f):
    opts = [
        click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=256, show_default=True),
        click.option(
            "--temperature",
            type=click.FloatRange(min=0),
            default=0.0,
            show_default=True,
            help="0 = greedy (lossless).",
        ),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True),
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off."),
        click.option(
            "--block-size",
            type=click.IntRange(min=2),
            default=None,
            help="Override the drafter's block size (smaller only).",
        ),
        click.option("--seed", type=int, default=None, help="Sampling seed."),
        click.option("--raw", is_flag=True, help="No chat template: tokenize the prompt as given."),
        click.option(
            "--image",
            "images",
            multiple=True,
            type=click.Path(dir_okay=False),
            help="Image file for a VLM target (repeatable); seen at prefill, drafting stays text-only.",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def load_pipeline(target, draft, device, dtype, revision, draft_revision, devices=None, compile_steps=False):
    import transformers

    from dflash_zoo.api import load

    transformers.utils.logging.disable_progress_bar()  # our own spinner says what is happening

    with stderr().status("loading models...", spinner="dots"):
        pipe = load(
            target,
            draft,
            device=device,
            dtype=dtype,
            revision=revision,
            draft_revision=draft_revision,
            device_map=devices,
        )
    if compile_steps and (pipe.device.type != "cuda" or pipe.placement is not None):
        hint("--compile applies to the single-GPU fast path only; ignored here")
    pipe.compile = compile_steps
    return pipe


def gen_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    keys = ("max_new_tokens", "temperature", "top_p", "top_k", "block_size", "seed")
    return {k: params[k] for k in keys if k in params}


def print_stats(res) -> None:
    hist = " ".join(f"{k}:{v}" for k, v in res.histogram.items())
    stderr().print(
        f"[dim]{len(res.output_ids)} tokens, {res.tokens_per_second:.1f} tok/s, "
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

    MODEL_ID is a registry id; --target/--draft pick any pair; with neither, the embedded demo pair.

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
    from dflash_zoo.engine.checkpoint import DRAFT_FILES
    from dflash_zoo.output import human_size
    from dflash_zoo.zoo import hub
    from dflash_zoo.zoo.registry import load_registry

    if os.path.isdir(name):
        return
    entry = load_registry().resolve(name)
    jobs = [(entry.draft_repo, locked_revision(entry), DRAFT_FILES), (entry.target_repo, None, TARGET_FILES)]
    for repo, rev, patterns in jobs:
        plan = hub.plan_pull(repo, rev, allow_patterns=patterns, name=name)
        if not plan.up_to_date:
            stderr().print(f"pulling {repo}: {human_size(plan.missing_bytes)} to download", highlight=False)
            hub.download(plan, progress=sys.stderr.isatty())


class ChatSession:
    """The REPL state: messages, decoding settings, last result."""

    def __init__(self, pipe, settings: dict[str, Any], raw: bool, images: list[str] | None = None):
        self.pipe, self.settings, self.raw, self.images = pipe, settings, raw, images or []
        self.messages: list[dict[str, str]] = []
        self.last = None

    def run(self) -> None:
        stderr().print("[dim]chat ready: /help for commands, /bye to quit[/dim]")
        while True:
            try:
                line = input(">>> ")
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
        elif cmd == "/set" and len(parts) == 3:
            self.set(parts[1], parts[2])
        else:
            stderr().print(f"unknown command {line!r}; /help lists commands")
        return True

    def set(self, key: str, value: str) -> None:
        casts = {
            "temperature": float,
            "top_p": float,
            "top_k": int,
            "max_new_tokens": int,
            "block_size": int,
            "seed": int,
        }
        if key == "think":
            self.pipe.chat_template_kwargs["enable_thinking"] = value.lower() in ("on", "1", "true", "yes")
        elif key in casts:
            try:
                self.settings[key] = casts[key](value)
            except ValueError:
                stderr().print(f"{key} needs a {casts[key].__name__}")
                return
        else:
            stderr().print(f"unknown setting {key!r}; settings: {', '.join([*casts, 'think'])}")
            return
        stderr().print(f"[dim]{key} = {value}[/dim]")

    def answer(self, text: str) -> None:
        from dflash_zoo.errors import ZooError

        self.messages.append({"role": "user", "content": text})
        prompt = text if self.raw else self.messages
        if self.images:  # image prompts go through the processor: earlier turns are flattened into the text
            prompt = "".join(f"{m['role']}: {m['content']}\n" for m in self.messages[:-1]) + text
        dec = self.pipe.decoder(prompt, self.raw, images=self.images or None, **self.settings)
        from dflash_zoo.api import TextStream

        stream, reply = TextStream(self.pipe.tokenizer), []
        try:
            for ids in dec:
                piece = stream.push(ids)
                reply.append(piece)
                _write(piece)
        except KeyboardInterrupt:
            dec.result.stop_reason = "interrupted"
        except ZooError as exc:
            stderr().print(f"error: {exc}")
            self.messages.pop()
            return
        sys.stdout.write("\n")
        self.last = dec.result
        self.messages.append({"role": "assistant", "content": "".join(reply)})
        print_stats(dec.result)
