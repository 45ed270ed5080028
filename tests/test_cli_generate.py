"""`dflash-zoo generate` end to end on a tiny local pair: JSON schema, streaming, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from dflash_zoo.cli import cli
from tests.oracles import greedy_reference
from tests.tiny import save_tiny_pair


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


def _run(*args):
    return CliRunner().invoke(cli, ["generate", *args], env={"COLUMNS": "120"})


def test_json_schema_and_lossless_output(pair_dirs):
    target, draft = pair_dirs
    res = _run("hello", "-t", str(target), "-d", str(draft), "-n", "16", "--raw", "--device", "cpu", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    for key in (
        "output_ids",
        "text",
        "acceptance_lengths",
        "steps",
        "mean_acceptance_length",
        "tokens_per_second",
    ):
        assert key in out
    assert len(out["output_ids"]) == 16
    assert len(out["acceptance_lengths"]) == len(out["steps"])
    assert all(set(s) >= {"proposed", "acceptance_length"} for s in out["steps"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target).eval()
    ids = AutoTokenizer.from_pretrained(target).encode("hello")
    assert out["output_ids"] == greedy_reference(model, ids, 16)


def test_compile_off_the_gpu_fast_path_is_a_hint_not_an_error(pair_dirs):
    target, draft = pair_dirs
    res = _run("hi", "-t", str(target), "-d", str(draft), "-n", "4", "--device", "cpu", "--compile")
    assert res.exit_code == 0, res.output
    assert "--compile applies to the single-GPU fast path only" in res.stderr


def test_streams_text_to_stdout_and_stats_to_stderr(pair_dirs):
    target, draft = pair_dirs
    res = _run("hi", "-t", str(target), "-d", str(draft), "-n", "8", "--device", "cpu")
    assert res.exit_code == 0
    assert "tok/s" in res.stderr and "tok/s" not in res.stdout


@pytest.mark.parametrize(
    "args,code,message",
    [
        (["-n", "0"], 2, "Invalid value for '--max-new-tokens'"),
        (["--block-size", "1"], 2, "Invalid value for '--block-size'"),
        (["--block-size", "99"], 2, "exceeds the drafter's trained block size"),
    ],
)
def test_bad_arguments(pair_dirs, args, code, message):
    target, draft = pair_dirs
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_zoo",
            "generate",
            "x",
            "-t",
            str(target),
            "-d",
            str(draft),
            "--device",
            "cpu",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == code and message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_path_is_one_line(tmp_path, pair_dirs):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_zoo",
            "generate",
            "x",
            "-t",
            str(tmp_path / "nope"),
            "-d",
            str(pair_dirs[1]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and "nope" in proc.stderr


def test_chat_session_commands_and_turns(pair_dirs):
    target, draft = pair_dirs
    script = "hello\n/stats\n/set max_new_tokens 4\n/set think on\n/set bogus 1\nagain\n/clear\n/help\n/bye\n"
    res = CliRunner().invoke(
        cli, ["chat", "-t", str(target), "-d", str(draft), "-n", "6", "--device", "cpu"], input=script
    )
    assert res.exit_code == 0, res.output
    assert res.stderr.count("tok/s") >= 3  # two answers + /stats
    assert "max_new_tokens = 4" in res.stderr and "unknown setting 'bogus'" in res.stderr
    assert "conversation cleared" in res.stderr and "/bye" in res.stderr


def test_chat_keeps_the_conversation(pair_dirs):
    from dflash_zoo.api import load
    from dflash_zoo.commands.run import ChatSession

    pipe = load(str(pair_dirs[0]), str(pair_dirs[1]), device="cpu")
    session = ChatSession(pipe, {"max_new_tokens": 3}, raw=False)
    session.answer("hi")
    session.answer("more")
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]
    session.command("/clear")
    assert session.messages == []
