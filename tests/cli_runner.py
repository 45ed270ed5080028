"""`dflash-zoo ARGS` in-process through `cli.main`, so exit codes and the error table apply as in a shell."""

from __future__ import annotations

import sys
from typing import NamedTuple

from click.testing import CliRunner

from dflash_zoo.cli import main


class Run(NamedTuple):
    code: int
    stdout: str
    stderr: str


def run_cli(*args: str, stdin: str | None = None) -> Run:
    """Run the CLI with `args` (and `stdin`); returns its exit code, stdout and stderr."""
    runner = CliRunner()
    with runner.isolation(input=stdin) as (out, err, _):
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        sys.stdout.flush()
        sys.stderr.flush()
        return Run(code, out.getvalue().decode(), err.getvalue().decode())


def run_captured(capsys, *args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `dflash-zoo ARGS` through `cli.main`, read from pytest's `capsys`."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err
