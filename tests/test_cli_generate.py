"""`dflash-zoo generate` end to end on a tiny local pair: JSON schema, streaming, one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from dflash_zoo.cli import cli, main
from tests.oracles import greedy_reference
from tests.tiny import save_tiny_pair


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


def _run(*args, **env):
    return CliRunner().invoke(cli, ["generate", *args], env={"COLUMNS": "120", **env})


def _main(capsys, *args) -> tuple[int, str, str]:
    """`dflash-zoo generate ARGS` through `cli.main`, which maps errors to one line and an exit code."""
    with pytest.raises(SystemExit) as exc:
        main(["generate", *args])
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


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
    assert "--compile applies to the single-GPU fast engine only" in res.stderr


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
    assert proc.stderr.startswith(f"error: no such directory: {tmp_path / 'nope'}")


@pytest.fixture(scope="module")
def short_target(pair_dirs, tmp_path_factory):
    """The tiny target with 48 positions (its tokenizer is one token per character)."""
    target = tmp_path_factory.mktemp("short") / "target"
    shutil.copytree(pair_dirs[0], target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["max_position_embeddings"] = 48
    (target / "config.json").write_text(json.dumps(cfg))
    return target


def test_prompt_longer_than_the_target_positions_is_refused(capsys, short_target, pair_dirs):
    code, out, err = _main(capsys, "y" * 60, "-t", str(short_target), "-d", str(pair_dirs[1]), "--raw",
                           "--device", "cpu")  # fmt: skip
    assert code == 2 and out == ""
    assert err.startswith("error: the prompt is 60 tokens; the target holds 48 positions\nhint: shorten")


def test_new_tokens_past_the_target_positions_are_capped_with_a_warning(short_target, pair_dirs):
    args = ("y" * 40, "-t", str(short_target), "-d", str(pair_dirs[1]), "--raw", "-n", "30", "--json")
    res = _run(*args, "--device", "cpu", DFLASH_ZOO_VERBOSITY="WARNING")  # the tests' default is ERROR
    assert res.exit_code == 0, res.output
    assert (
        "max_new_tokens 30 capped to 8: the prompt's 40 tokens leave 8 of the target's 48 positions"
        in " ".join(res.stderr.split())
    )
    assert 1 <= len(json.loads(res.stdout)["output_ids"]) <= 8


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


@pytest.mark.parametrize("temperature", [float("nan"), float("inf")])
def test_api_refuses_a_non_finite_temperature(pair_dirs, temperature):
    from dflash_zoo.api import load
    from dflash_zoo.errors import InvalidArgumentError

    pipe = load(str(pair_dirs[0]), str(pair_dirs[1]), device="cpu")
    with pytest.raises(InvalidArgumentError, match="temperature must be a finite number"):
        pipe.generate("x", raw=True, max_new_tokens=2, temperature=temperature)


def test_eval_reports_progress_as_plain_lines_without_a_terminal(pair_dirs, tmp_path):
    """Into a pipe or a log, eval's progress and its summary still reach stderr (as lines, not a spinner)."""
    from tests.cli_runner import run_cli

    target, draft = pair_dirs
    data = tmp_path / "p.jsonl"
    data.write_text('{"text": "hello there, general"}\n{"text": "one two three four"}\n')
    run = run_cli("eval", "-t", str(target), "-d", str(draft), "--data", str(data), "--raw", "-n", "4",
                  "--no-baseline", "--device", "cpu")  # fmt: skip
    assert run.code == 0, run.stderr
    lines = run.stderr.splitlines()
    assert lines[0] == "evaluating 2 prompt(s)..."
    assert lines[-1].startswith("evaluated 2 prompt(s): mean acceptance length ")
    assert "mean acceptance length" in run.stdout  # the table: data stays on stdout


def test_bench_shows_no_transformers_loading_bar(pair_dirs, tmp_path):
    """`bench` says what it builds; transformers' own "Loading weights" bar stays off."""
    from transformers.utils import logging as tf_logging

    from tests.cli_runner import run_cli

    target, draft = pair_dirs
    tf_logging.enable_progress_bar()  # as in a fresh process (another test may have turned it off)
    run = run_cli("bench", "-t", str(target), "-d", str(draft), "--device", "cpu", "--prompt-tokens", "8",
                  "-n", "4", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path / "r.json"))  # fmt: skip
    assert run.code == 0, run.stderr
    assert "building " in run.stderr and "Loading weights" not in run.stderr and "it/s" not in run.stderr
