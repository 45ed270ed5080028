"""`dflash-zoo chat` as a user meets it: a bad /set is refused and the session goes on, /set alone shows the
settings, a prompt the target cannot hold drops only that turn, Ctrl-C reports the answer's real numbers."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import time

import pytest
from click.testing import CliRunner

from dflash_zoo.cli import cli
from tests.readonly import cli as cli_argv
from tests.tiny import save_tiny_pair

POSITIONS = 48  # the short target's max_position_embeddings


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def short_pair(pair, tmp_path_factory):
    """The tiny pair with a target of only POSITIONS positions (the tokenizer is one token per character)."""
    target = tmp_path_factory.mktemp("short") / "target"
    shutil.copytree(pair[0], target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["max_position_embeddings"] = POSITIONS
    (target / "config.json").write_text(json.dumps(cfg))
    return target, pair[1]


def chat(pair, script: str, *args: str):
    argv = ["chat", "-t", str(pair[0]), "-d", str(pair[1]), "-n", "6", "--device", "cpu", *args]
    return CliRunner().invoke(cli, argv, input=script)


def test_bad_set_is_refused_and_the_session_goes_on(pair):
    script = (
        "/set temperature -1\n/set top_p 5\n/set max_new_tokens 0\n/set block_size 64\n/set top_k x\n"
        "hello\n/set\n/bye\n"
    )
    res = chat(pair, script)
    assert res.exit_code == 0, res.output
    err = res.stderr
    assert "temperature must be >= 0, got -1.0; temperature stays 0.0" in err
    assert "top_p must be in [1e-06, 1], got 5.0; top_p stays 1.0" in err
    assert "max_new_tokens must be >= 1, got 0; max_new_tokens stays 6" in err
    assert (
        "block_size 64 exceeds the drafter's trained block size 8; block_size stays 8 (the drafter's)" in err
    )
    assert "top_k needs an integer, got 'x'" in err
    assert err.count("tok/s") == 1  # the message after the bad /set values was answered
    assert "temperature 0.0  top_p 1.0  top_k 0  max_new_tokens 6  block_size 8 (the drafter's)" in err


def test_piped_stdout_holds_the_answers_alone(pair):
    """No `>>> ` prompt when stdin is not a terminal: a script reading stdout gets only the answers."""
    from dflash_zoo.api import load

    pipe = load(str(pair[0]), str(pair[1]), device="cpu")
    want = pipe.generate([{"role": "user", "content": "hello"}], max_new_tokens=6).text
    res = chat(pair, "hello\n/stats\n/bye\n")
    assert res.exit_code == 0, res.output
    assert res.stdout == want + "\n"


def test_raw_chat_continues_one_running_text(pair):
    """--raw: no template, and turn 2 continues turn 1's line and answer (the history is not dropped)."""
    from dflash_zoo.api import load

    pipe = load(str(pair[0]), str(pair[1]), device="cpu")
    first = pipe.generate("ab", raw=True, max_new_tokens=6).text
    second = pipe.generate("ab" + first + "\n" + "cd", raw=True, max_new_tokens=6).text
    res = chat(pair, "ab\ncd\n/bye\n", "--raw")
    assert res.exit_code == 0, res.output
    assert res.stdout == first + "\n" + second + "\n"
    assert second != pipe.generate("cd", raw=True, max_new_tokens=6).text  # else this tests nothing


def test_non_finite_temperature_and_unknown_think_values_are_refused(pair):
    res = chat(
        pair, "/set temperature nan\n/set temperature inf\n/set think maybe\n/set think on\n/set\n/bye\n"
    )
    assert res.exit_code == 0, res.output
    err = res.stderr
    assert "temperature must be a finite number >= 0, got nan; temperature stays 0.0" in err
    assert "temperature must be a finite number >= 0, got inf; temperature stays 0.0" in err
    assert "think needs on or off, got 'maybe'" in err and "think = on" in err
    assert "temperature 0.0  top_p 1.0" in err and err.rstrip().endswith("think on")


def test_set_alone_shows_the_settings_and_good_values_apply(pair):
    res = chat(pair, "/set\n/set block_size 4\n/set max_new_tokens 3\n/set temperature 0.5\n/set\nhi\n/bye\n")
    assert res.exit_code == 0, res.output
    err = res.stderr
    assert "unknown command" not in err
    assert (
        "temperature 0.0  top_p 1.0  top_k 0  max_new_tokens 6  block_size 8 (the drafter's)  seed none"
        in err
    )
    assert "temperature 0.5  top_p 1.0  top_k 0  max_new_tokens 3  block_size 4  seed none" in err
    stats = next(line for line in err.splitlines() if "tok/s" in line)
    assert int(stats.split()[0]) <= 3 and "(block 4," in stats


def test_a_prompt_the_target_cannot_hold_drops_only_that_turn(short_pair):
    res = chat(short_pair, f"{'x' * (POSITIONS + 10)}\nhi\n/bye\n", "--raw")
    assert res.exit_code == 0, res.output
    assert f"tokens; the target holds {POSITIONS} positions" in res.stderr
    assert "/clear forgets the conversation" in res.stderr
    assert res.stderr.count("tok/s") == 1  # the next, short message was answered


def _read_until(stream, pattern: re.Pattern, deadline: float) -> str:
    """Read a pipe until `pattern` matches what was read, or the deadline passes (bounded)."""
    seen = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], 1.0)
        if ready:
            chunk = os.read(stream.fileno(), 4096)
            if not chunk:
                break
            seen += chunk
            if pattern.search(seen.decode(errors="replace")):
                break
    return seen.decode(errors="replace")


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow  # a subprocess that loads torch and a pair: 15-25 s on a busy 2-core machine
def test_ctrl_c_reports_the_partial_answer(pair):
    """SIGINT while an answer streams: the answer stops, its stats are the real partial numbers, chat goes on."""
    argv = cli_argv("chat", "-t", str(pair[0]), "-d", str(pair[1]), "--raw", "-n", "2000", "--device", "cpu")
    # one torch thread: on a 2-core machine the chat must not starve this process of the CPU it needs to
    # read the stream and send the signal before the whole answer is written
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    # SIGINT at its default in the child, so that its Python raises KeyboardInterrupt even where this suite
    # runs in the background of a non-interactive shell (which starts it, and so the child, ignoring SIGINT)
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        preexec_fn=_default_sigint,
    )  # fmt: skip
    try:
        proc.stdin.write(b"x\n")
        proc.stdin.flush()
        seen = _read_until(proc.stdout, re.compile(r".{20}", re.S), time.monotonic() + 300)
        assert len(seen) >= 20, seen  # the answer is streaming
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(b"/stats\n/bye\n", timeout=300)
    finally:
        proc.kill() if proc.poll() is None else None
    err = err.decode()
    assert proc.returncode == 0, err
    stats = [line for line in err.splitlines() if "tok/s" in line]
    assert len(stats) == 2 and stats[0] == stats[1], err  # the answer's line, and /stats repeats it
    m = re.match(r"interrupted: (\d+) tokens, ([\d.]+) tok/s", stats[0])
    assert m, stats[0]
    assert 1 < int(m.group(1)) < 2000 and float(m.group(2)) > 0
