"""Inputs that used to reach the generic "error: <ExceptionType>: ... / report it" path: each is one line with
the next step and a proper exit code, as a user meets it (the CLI entry point in-process, or a subprocess)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_runner import run_cli as invoke
from tests.readonly import cli as cli_argv
from tests.readonly import run_readonly
from tests.tiny import save_tiny_pair

pytest_plugins = ["tests.hub_fixtures"]  # hub_env: a loopback Hub server (never the network)
REPORT_IT = "report it"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


def assert_one_line(err: str, *needles: str) -> None:
    """stderr is `error: <one line>` plus `hint: <next step>`, naming each needle, and not the generic path."""
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), err
    assert REPORT_IT not in err and "Traceback" not in err
    for needle in needles:
        assert needle in err, err


def drafter_copy(pair, tmp_path: Path, edit=None, raw: bytes | None = None) -> Path:
    """A copy of the tiny drafter with its config.json edited (a dict function) or replaced by bytes."""
    draft = tmp_path / "draft"
    shutil.copytree(pair[1], draft)
    cfg_path = draft / "config.json"
    if edit is not None:
        cfg = json.loads(cfg_path.read_text())
        edit(cfg)
        cfg_path.write_text(json.dumps(cfg))
    if raw is not None:
        cfg_path.write_bytes(raw)
    return draft


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="this machine has a GPU: --device cuda is valid"
)
def test_device_cuda_without_a_gpu(pair):
    code, out, err = invoke("generate", "x", "-t", str(pair[0]), "-d", str(pair[1]), "--device", "cuda")
    assert code == 1 and out == ""
    assert_one_line(err, "'cuda'", "--device cpu")


def test_unknown_device_is_a_usage_error(pair):
    code, _, err = invoke("generate", "x", "-t", str(pair[0]), "-d", str(pair[1]), "--device", "nonsense")
    assert code == 2
    assert_one_line(err, "unknown device 'nonsense'", "cuda:N")


@pytest.mark.parametrize("command", ["train", "eval", "bench"])
@pytest.mark.parametrize("device", ["nonsense", "cuda"])
def test_every_model_command_checks_the_device_before_loading(tmp_path, command, device):
    """The target does not exist: the device error must come first (before any model or data work)."""
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is valid")
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    ghost = str(tmp_path / "no-model")
    args = {"train": ["--target", ghost, "--data", str(data), "--out", str(tmp_path / "out")],
            "eval": ["-t", ghost, "-d", ghost, "--data", str(data)],
            "bench": ["-t", ghost, "-d", ghost]}[command]  # fmt: skip
    code, out, err = invoke(command, *args, "--device", device)
    assert code == (2 if device == "nonsense" else 1) and out == ""
    assert_one_line(err, f"'{device}'", "--device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


def test_empty_raw_prompt():
    code, _, err = invoke("generate", "", "--raw", "--device", "cpu")
    assert code == 2
    assert_one_line(err, "the prompt is empty")


def test_invalid_utf8_in_argv():
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_zoo", "generate", b"ab\xffcd", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert_one_line(proc.stderr, r"'ab\xffcd' is not valid UTF-8", "UTF-8")


def test_invalid_utf8_in_a_jsonl_file_names_file_and_line(pair, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    code, _, err = invoke(
        "eval", "-t", str(pair[0]), "-d", str(pair[1]), "--data", str(data), "--device", "cpu"
    )
    assert code == 2
    assert_one_line(err, f"{data}:2", "UTF-8")


def test_mask_id_outside_the_embedding_table_is_refused_at_load(pair, tmp_path):
    draft = drafter_copy(pair, tmp_path, edit=lambda c: c["dflash_config"].update(mask_token_id=-1))
    code, out, err = invoke("generate", "hello", "-t", str(pair[0]), "-d", str(draft), "--device", "cpu")
    assert code == 3 and out == ""  # nothing printed before the refusal
    assert_one_line(err, "mask", "-1", "256")


def test_check_fails_a_negative_mask_id(pair, tmp_path):
    draft = drafter_copy(pair, tmp_path, edit=lambda c: c["dflash_config"].update(mask_token_id=-1))
    code, out, _ = invoke("check", "-t", str(pair[0]), "-d", str(draft))
    assert code == 3
    row = next(line for line in out.splitlines() if line.startswith("mask id"))
    assert row.split()[2] == "FAIL"


@pytest.mark.parametrize(
    "raw,what",
    [(b'{"hidden_size": 64, "name": "caf\xe9"}', "not valid UTF-8"), (b"{not json", "not valid JSON"),
     (b"[1, 2]", "not a JSON object")],
)  # fmt: skip
def test_bad_drafter_config_names_the_file(pair, tmp_path, raw, what):
    draft = drafter_copy(pair, tmp_path, raw=raw)
    code, _, err = invoke("generate", "x", "-t", str(pair[0]), "-d", str(draft), "--device", "cpu")
    assert code == 1
    assert_one_line(err, str(draft / "config.json"), what)


@pytest.mark.parametrize("flag", ["--target", "--draft"])
def test_missing_paths_read_the_same_for_target_and_drafter(pair, flag):
    other = ["-d", str(pair[1])] if flag == "--target" else ["-t", str(pair[0])]
    for args in ([flag, "/nonexistent/path"], [flag, "/nonexistent/path", *other]):
        code, _, err = invoke("generate", "x", *args, "--device", "cpu")
        assert code == 1
        assert_one_line(err, "no such directory: /nonexistent/path")


@pytest.mark.parametrize("flag", ["-t", "-d"])
def test_bench_reports_a_missing_path_before_building(pair, flag):
    other = ["-d", str(pair[1])] if flag == "-t" else ["-t", str(pair[0])]
    code, _, err = invoke("bench", flag, "/nonexistent/path", *other, "--device", "cpu")
    assert code == 1
    assert_one_line(err, "no such directory: /nonexistent/path")  # and no "building ..." line first


def test_chat_with_a_missing_path():
    code, _, err = invoke("chat", "./no-such-model")
    assert code == 1
    assert_one_line(err, "no such directory: ./no-such-model")


@pytest.mark.parametrize(
    "args,needle,help_of",
    [
        (["generate"], "Missing argument 'PROMPT'", "dflash-zoo generate --help"),
        (["generate", "x", "-n", "0"], "Invalid value for '--max-new-tokens'", "dflash-zoo generate --help"),
        (
            ["generate", "x", "--temperature", "nan"],
            "'nan' is not a finite number",
            "dflash-zoo generate --help",
        ),
        (
            ["eval", "--data", "x", "--temperature", "inf"],
            "'inf' is not a finite number",
            "dflash-zoo eval --help",
        ),
        (["generate", "x", "--bogus"], "No such option '--bogus'", "dflash-zoo generate --help"),
        (["generat", "x"], "No such command 'generat'", "dflash-zoo --help"),
    ],
)
def test_usage_errors_are_one_line_plus_a_hint(args, needle, help_of):
    code, out, err = invoke(*args)
    assert code == 2 and out == ""
    assert_one_line(err, needle, help_of)
    assert "Usage:" not in err


@pytest.mark.slow  # a subprocess that loads torch and a pair: 15-25 s on a busy 2-core machine
def test_generate_into_a_closed_pipe_exits_quietly(pair):
    """`dflash-zoo generate ... | head -c 1`: the reader leaves mid-generation; exit 0, nothing on stderr."""
    argv = cli_argv("generate", "x", "-t", str(pair[0]), "-d", str(pair[1]), "--raw", "-n", "1500")
    proc = subprocess.Popen([*argv, "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.read(1)
    proc.stdout.close()
    _, err = proc.communicate(timeout=600)
    assert first and proc.returncode == 0, err
    assert err.decode().strip() == ""  # no traceback, no error line, and no stats: it stopped at the pipe


def test_read_only_hf_cache_is_one_line_naming_it(hub_env, tmp_path):
    """`generate` of Hub repos into a read-only HF cache: one line naming the folder, before any transfer."""
    from tests.hubserver import DRAFT_REPO, TARGET_REPO

    cache = Path(os.environ["HF_HUB_CACHE"])
    cache.mkdir(parents=True)
    argv = cli_argv("generate", "x", "-t", TARGET_REPO, "-d", DRAFT_REPO, "--device", "cpu")
    proc = run_readonly(argv, [cache], env=dict(os.environ), timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert_one_line(proc.stderr, str(cache), "HF_HUB_CACHE")
    assert hub_env.file_gets() == []  # refused before downloading anything


@pytest.mark.slow  # a subprocess that loads torch and a pair: 15-25 s on a busy 2-core machine
def test_read_only_zoo_home_does_not_stop_generate(pair, tmp_path):
    """generate writes nothing under DFLASH_ZOO_HOME, so a read-only one must not matter."""
    home = tmp_path / "zoo-home"
    home.mkdir()
    env = {**os.environ, "DFLASH_ZOO_HOME": str(home)}
    argv = cli_argv("generate", "x", "-t", str(pair[0]), "-d", str(pair[1]), "-n", "4", "--device", "cpu")
    proc = run_readonly(argv, [home], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "tok/s" in proc.stderr


def test_unhandled_read_only_errors_name_the_path_and_the_variable(tmp_path, monkeypatch):
    import errno

    from dflash_zoo.errors import from_exception

    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path / "zoo"))
    target = tmp_path / "zoo" / "bench" / "r.json"
    exc = from_exception(OSError(errno.EROFS, "Read-only file system", str(target)))
    assert exc is not None and str(exc) == f"cannot write to {target}: read-only file system"
    assert "DFLASH_ZOO_HOME" in exc.hint and exc.exit_code == 1
    cuda = from_exception(AssertionError("Torch not compiled with CUDA enabled"))
    assert cuda is not None and "--device cpu" in cuda.hint
    assert from_exception(ValueError("something else")) is None


def _closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "target,code", [("Qwen/Qwen3-8B", 0), ("some-org/unknown-model", 1)], ids=["registered", "unknown"]
)
def test_check_without_a_reachable_hub_fails_fast(tmp_path, target, code):
    """No retries, no retry log: a registered pair falls back to its fingerprint (WARN), others fail in one line."""
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}", "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"), "DFLASH_ZOO_HOME": str(tmp_path / "zoo")}  # fmt: skip
    env.pop("HF_HUB_OFFLINE", None)
    proc = subprocess.run(cli_argv("check", "--target", target), env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == code, proc.stderr
    assert "Retrying" not in proc.stderr and "thrown while requesting" not in proc.stderr
    if code == 0:
        warn = next(line for line in proc.stdout.splitlines() if line.startswith("draft config"))
        assert "WARN" in warn and "could not reach" in warn
        assert proc.stderr.strip() == ""
    else:
        assert_one_line(proc.stderr, "could not reach", "HF_HUB_OFFLINE")


@pytest.mark.skipif(
    shutil.which("setpriv") is None, reason="setpriv drops root's capability to read any file"
)
def test_permission_denied_on_a_read_says_cannot_read_not_choose_a_writable_location(tmp_path):
    """An EACCES that reaches the error table: on a read it names the file and how to make it readable, on a
    write the location to change (run without root's capabilities, as a normal user meets it)."""
    unreadable = tmp_path / "config.json"
    unreadable.write_text("{}")
    unreadable.chmod(0)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    code = (
        "import sys\nfrom dflash_zoo.errors import from_exception\n"
        "for act in (lambda: open(sys.argv[1]).read(), lambda: open(sys.argv[2] + '/new', 'w')):\n"
        "    try:\n        act()\n    except OSError as exc:\n"
        "        known = from_exception(exc)\n        print(known, '|', known.hint)\n"
    )
    prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    done = subprocess.run([*prefix, sys.executable, "-c", code, str(unreadable), str(locked)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    read, write = done.stdout.splitlines()
    assert read == f"cannot read {unreadable}: permission denied | make it readable (chmod a+r {unreadable}), " \
        "or run as a user who can read it"  # fmt: skip
    assert write.startswith(f"permission denied: {locked}/new | ") and "writable" in write
