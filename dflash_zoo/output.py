"""The one output sink: data on stdout, progress / logs / hints on stderr (rich), modes human|json|quiet.

`NO_COLOR` and non-TTY streams turn colour and bars off (rich detects both). The library never installs
logging handlers; `setup_logging` is called by the CLI only.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.logging import RichHandler
from rich.measure import Measurement
from rich.table import Table, box

LOGGER_NAME = "dflash_zoo"
_stdout: Console | None = None
_stderr: Console | None = None


def stdout() -> Console:
    global _stdout
    if _stdout is None or _stdout.file is not sys.stdout:
        _stdout = Console(file=sys.stdout, soft_wrap=True, no_color="NO_COLOR" in os.environ)
    return _stdout


def stderr() -> Console:
    global _stderr
    if _stderr is None or _stderr.file is not sys.stderr:
        _stderr = Console(file=sys.stderr, soft_wrap=True, no_color="NO_COLOR" in os.environ)
    return _stderr


def setup_logging(verbosity: int = 0) -> None:
    """Install one rich handler on stderr for the `dflash_zoo` logger (CLI only)."""
    env = os.environ.get("DFLASH_ZOO_VERBOSITY", "").upper()
    level = (
        env
        if env in ("DEBUG", "INFO", "WARNING", "ERROR")
        else ("DEBUG" if verbosity > 1 else "INFO" if verbosity else "WARNING")
    )
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers[:] = [RichHandler(console=stderr(), show_time=False, show_path=False, markup=False)]
    logger.setLevel(level)
    logger.propagate = False


def emit_json(obj: Any) -> None:
    """One JSON document on stdout (keys stable, snake_case)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def table(
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    title: str | None = None,
    ids: Sequence[str] = (),
) -> Table:
    """A borderless table with uppercase headers (ollama / hf style).

    ids: columns of identifiers (repo ids, paths): never wrapped; the others wrap first when space is short.
    """
    t = Table(box=box.SIMPLE_HEAD if title else None, show_edge=False, title=title, pad_edge=False)
    for col in columns:
        whole = col in ids
        t.add_column(col.upper(), overflow="ignore" if whole else "fold", no_wrap=whole)
    for row in rows:
        t.add_row(*("" if v is None else str(v) for v in row))
    return t


def print_table(t: Table, cut: Sequence[str] = ()) -> None:
    """A table on stdout. Into a pipe or a file: at its natural width, wider than the console if need be, no
    cell (repo id, path) ever folded, one line per row for grep / awk. On a terminal narrower than that: the
    `cut` columns (by header, case-insensitive) are shortened with an ellipsis first, so rows fit the screen
    (`--json` and pipes keep every id whole)."""
    con = stdout()
    natural = Measurement.get(con, con.options.update_width(100_000), t).maximum
    width = con.width
    if con.is_terminal and natural > width and cut:
        _shorten(t, {c.upper() for c in cut}, width)
        con.print(t)
        return
    con.width = max(width, natural)  # print(width=) can only narrow
    try:
        con.print(t)
    finally:
        con.width = width


def _shorten(t: Table, cut: set[str], width: int, least: int = 8) -> None:
    """Fit `t` into `width` on one line per row: the `cut` columns are narrowed (an ellipsis ends what is
    cut), the widest first; when they alone cannot make room, every column but the first is narrowed too."""
    from rich.cells import cell_len

    natural = [max([cell_len(str(c.header))] + [cell_len(str(x)) for x in c._cells]) for c in t.columns]
    names = [str(c.header).upper() for c in t.columns]
    shrink = [i for i, n in enumerate(names) if n in cut]
    room = width - 2 * (len(natural) - 1) - sum(w for i, w in enumerate(natural) if i not in shrink)
    if room < least * len(shrink):  # the cut columns would be left too narrow
        shrink = list(range(1, len(natural)))
        room = width - 2 * (len(natural) - 1) - natural[0]
    cap = _water_level([natural[i] for i in shrink], max(room, len(shrink)))
    for i, column in enumerate(t.columns):
        column.no_wrap, column.overflow = True, "ellipsis"
        if i in shrink:
            column.max_width = max(1, min(natural[i], cap))


def _water_level(widths: list[int], room: int) -> int:
    """The largest cap c with sum(min(w, c)) <= room (the widest columns give way first)."""
    cap = max(widths, default=0)
    while cap > 1 and sum(min(w, cap) for w in widths) > room:
        cap -= 1
    return cap


class _Lines:
    """Progress as plain stderr lines where no spinner can show (a pipe, a log file): the first message at
    once, then an update at most every `every` seconds."""

    def __init__(self, message: str, every: float = 5.0):
        self.every, self.last = every, time.monotonic()
        info(message)

    def update(self, message: str) -> None:
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            info(message)


class _Silent:
    def update(self, message: str) -> None:
        pass


@contextmanager
def status(message: str, lines: bool = False) -> Iterator[Any]:
    """A spinner on a terminal's stderr; elsewhere, with `lines` (long work: evaluation, regeneration), plain
    progress lines, else nothing (so that a failure there is the only output). `update(text)` changes it."""
    con = stderr()
    if con.is_terminal:
        with con.status(message, spinner="dots") as spinner:
            yield spinner
    else:
        yield _Lines(message) if lines else _Silent()


def quiet_loading() -> None:
    """Turn transformers' own loading bars off (our status line says what is loading); called by the
    commands that load models, never at import."""
    from transformers.utils import logging as tf_logging

    tf_logging.disable_progress_bar()


def hint(message: str) -> None:
    stderr().print(f"[dim]hint:[/dim] {message}", highlight=False)


def info(message: str) -> None:
    stderr().print(message, highlight=False)


def human_size(n: int | None) -> str:
    """The one size format (files, caches, memory): decimal units, as the Hub shows them: 999 B, 16.4 kB,
    1.2 GB, 5.0 TB ("?" when unknown)."""
    if n is None:
        return "?"
    if n < 1000:
        return f"{n} B"
    size = n / 1000
    for unit in ("kB", "MB", "GB"):
        if size < 1000:
            return f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"
