"""`dflash-zoo` command line: a thin click layer over the Python API.

Subcommands live in `dflash_zoo/commands/*` and are imported only when invoked, so `--help`, `list`, `info`
and `check` never import torch or transformers. Errors map to one line plus a hint (`errors.py`); tracebacks
only with `DFLASH_ZOO_DEBUG=1`. Exit codes: 0 ok, 1 runtime error, 2 usage, 3 incompatible pair, 130 Ctrl-C.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

# name -> "module:function"; aliases share the target (ls = list, show = info)
COMMANDS = {
    "generate": "dflash_zoo.commands.run:generate",
    "chat": "dflash_zoo.commands.run:chat",
    "list": "dflash_zoo.commands.zoo:list_cmd",
    "ls": "dflash_zoo.commands.zoo:list_cmd",
    "info": "dflash_zoo.commands.zoo:info",
    "show": "dflash_zoo.commands.zoo:info",
    "check": "dflash_zoo.commands.zoo:check",
    "convert": "dflash_zoo.commands.convert:convert",
    "pull": "dflash_zoo.commands.hubcmds:pull",
    "rm": "dflash_zoo.commands.hubcmds:rm",
    "env": "dflash_zoo.commands.hubcmds:env",
    "serve": "dflash_zoo.commands.serve:serve",
    "train": "dflash_zoo.commands.train:train",
    "eval": "dflash_zoo.commands.train:eval_cmd",
    "bench": "dflash_zoo.commands.bench:bench",
}
HIDDEN_ALIASES = {"ls", "show"}

ENV_HELP = """
\b
Environment:
  HF_HOME, HF_HUB_CACHE   where models are cached (the standard Hugging Face cache)
  HF_HUB_OFFLINE=1        never touch the network
  HF_TOKEN                token for gated repos
  DFLASH_ZOO_HOME         zoo state (lock file, bench results)
  DFLASH_ZOO_REGISTRY     an extra registry file
  DFLASH_ZOO_DEBUG=1      full tracebacks
  DFLASH_ZOO_VERBOSITY    library log level (DEBUG, INFO, WARNING)
  DFLASH_ZOO_KERNELS=0    CUDA fast path without our Triton kernels (SDPA / cuBLAS)
  NO_COLOR                no colour
"""


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(n for n in COMMANDS if n not in HIDDEN_ALIASES)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise click.ClickException(f"command {name!r} is not available in this build: {exc}") from exc

    def invoke(self, ctx: click.Context) -> object:
        from dflash_zoo.errors import PipeClosedError

        try:
            return super().invoke(ctx)
        except BrokenPipeError as exc:  # click would turn it into exit 1; `main` exits 0 quietly
            raise PipeClosedError(str(exc)) from exc

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # short help without importing the command modules (they may import torch)
        rows = [(n, SHORT_HELP.get(n, "")) for n in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


SHORT_HELP = {
    "bench": "Autoregressive vs DFlash speed on a pair, a demo pair or a random-weight shape.",
    "chat": "Interactive chat with speculative decoding.",
    "check": "Is a target / drafter pair compatible? (configs only, no weights)",
    "convert": "Convert a drafter between the zlab, speculators and hf-native layouts.",
    "env": "Versions, GPUs and cache paths for a bug report.",
    "eval": "Acceptance statistics of a pair over a JSONL prompt file.",
    "generate": "Generate text for one prompt with DFlash speculative decoding.",
    "info": "Details of one registry entry (alias: show).",
    "list": "Registry entries and what is installed (alias: ls).",
    "pull": "Download a drafter (and optionally its target) into the HF cache.",
    "rm": "Remove cached revisions of entries.",
    "serve": "Build (and run) the vLLM / SGLang launch command for a pair.",
    "train": "Train a DFlash drafter for a target.",
}


@click.group(cls=LazyGroup, epilog=ENV_HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dflash-zoo", prog_name="dflash-zoo")
@click.option("-v", "--verbose", count=True, help="More log output on stderr (-vv for debug).")
def cli(verbose: int) -> None:
    """DFlash speculative decoding for Hugging Face targets.

    \b
    Examples:
      dflash-zoo generate "def read_lines(path):"  # embedded demo pair, offline, CPU
      dflash-zoo list
      dflash-zoo check --target Qwen/Qwen3-8B
      dflash-zoo generate "Hi" --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16
    """
    from dflash_zoo.output import setup_logging

    setup_logging(verbose)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: runs the group and maps errors to one-line messages and exit codes."""
    from dflash_zoo.errors import PipeClosedError, ZooError, from_exception, hint_for

    debug = os.environ.get("DFLASH_ZOO_DEBUG", "") not in ("", "0")
    args = sys.argv[1:] if argv is None else list(argv)
    as_json = json_requested(args)  # failures then also print one JSON object on stdout
    try:
        _check_utf8(args)
        code = cli.main(args=args, prog_name="dflash-zoo", standalone_mode=False)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's shutdown
        if isinstance(code, int) and code:
            sys.exit(code)
    except (PipeClosedError, BrokenPipeError):  # `dflash-zoo generate ... | head -1`: the reader is done
        _quiet_stdout()
        sys.exit(0)
    except (click.exceptions.Abort, KeyboardInterrupt):
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except click.exceptions.NoArgsIsHelpError as exc:  # bare `dflash-zoo`: the help, as click shows it
        exc.show()
        sys.exit(exc.exit_code)
    except click.UsageError as exc:
        _fail(exc.format_message(), _usage_hint(exc), exc.exit_code, as_json)
    except click.ClickException as exc:
        _fail(exc.format_message(), None, exc.exit_code, as_json)
    except ZooError as exc:
        if debug:
            raise
        _fail(str(exc), hint_for(exc), exc.exit_code, as_json)
    except Exception as exc:  # unexpected: one line unless debugging
        known = from_exception(exc)
        if debug:
            raise
        if known is not None:
            _fail(str(known), hint_for(known), known.exit_code, as_json)
        report = "rerun with DFLASH_ZOO_DEBUG=1 for the traceback and report it"
        _fail(f"{type(exc).__name__}: {exc}", report, 1, as_json)


def _fail(message: str, hint: str | None, code: int, as_json: bool = False) -> None:
    """`error: <one line>` and `hint: <next step>` on stderr (and, under --json, the same as one JSON object
    `{"error", "hint", "exit_code"}` on stdout), then exit."""
    line = " ".join(message.split())
    if as_json:
        from dflash_zoo.output import emit_json

        try:
            emit_json({"error": line, "hint": hint, "exit_code": code})
        except (BrokenPipeError, ValueError):  # the reader is gone (or stdout closed): stderr still says it
            pass
    sys.stderr.write(f"error: {line}\n")
    if hint:
        sys.stderr.write(f"hint: {hint}\n")
    sys.exit(code)


def json_requested(args: list[str]) -> bool:
    """True when `args` run a command that has `--json` with that flag (before any `--`, past which
    arguments belong to another program, as for `serve`)."""
    head = args[: args.index("--")] if "--" in args else args
    if "--json" not in head:
        return False
    name = next((a for a in head if not a.startswith("-")), None)
    target = COMMANDS.get(name or "")
    if target is None:
        return False
    module, attr = target.split(":")
    try:
        command = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return False
    return any("--json" in getattr(p, "opts", ()) for p in command.params)


def _usage_hint(exc: click.UsageError) -> str:
    """The help command of the command that was misused (README: errors are one line plus a hint)."""
    ctx = exc.ctx
    if ctx is None or isinstance(ctx.command, click.Group):
        return "`dflash-zoo --help` lists the commands"
    return f"`{ctx.command_path} --help` lists the arguments and options"


def _check_utf8(args: list[str]) -> None:
    """Refuse an argument that is not valid UTF-8 (Python hands it over with surrogate escapes, which no
    tokenizer can encode); an existing file of that name is a valid path and passes."""
    for arg in args:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as exc:
            if os.path.exists(arg):
                continue
            from dflash_zoo.errors import InvalidArgumentError

            shown = repr(os.fsencode(arg))[2:-1]
            raise InvalidArgumentError(
                f"argument '{shown}' is not valid UTF-8 (byte {exc.start + 1})",
                hint="pass text as UTF-8 (a UTF-8 locale such as LANG=C.UTF-8 does that)",
            ) from None


def _quiet_stdout() -> None:
    """The reader of stdout is gone: point stdout at /dev/null so nothing fails at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (an in-process runner)
        pass
