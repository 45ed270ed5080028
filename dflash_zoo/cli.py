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

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # short help without importing the command modules (they may import torch)
        rows = [(n, SHORT_HELP.get(n, "")) for n in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


SHORT_HELP = {
    "bench": "Autoregressive vs DFlash speed on a pair, a demo pair or a random-weight shape.",
    "chat": "Interactive chat with speculative decoding.",
    "check": "Is a target / drafter pair compatible? (configs only, no weights)",
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
    from dflash_zoo.errors import ZooError

    debug = os.environ.get("DFLASH_ZOO_DEBUG", "") not in ("", "0")
    try:
        code = cli.main(args=argv, prog_name="dflash-zoo", standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except click.exceptions.Abort:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except ZooError as exc:
        if debug:
            raise
        sys.stderr.write(f"error: {exc}\n")
        if exc.hint:
            sys.stderr.write(f"hint: {exc.hint}\n")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except Exception as exc:  # unexpected: one line unless debugging
        if debug:
            raise
        sys.stderr.write(f"error: {type(exc).__name__}: {exc}\n")
        sys.stderr.write("hint: rerun with DFLASH_ZOO_DEBUG=1 for the traceback and report it\n")
        sys.exit(1)
