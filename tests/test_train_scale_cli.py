"""`train`'s scale options through the CLI, as a user runs them: regeneration through a server (loopback),
the on-disk feature cache (and a kill while it is written), early usage errors."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dflash_zoo.engine.checkpoint import load_drafter
from tests.cli_runner import run_captured
from tests.openai_server import OpenAIServer
from tests.readonly import cli
from tests.test_train_safety import TINY
from tests.tiny import save_tiny_pair


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "400")
    return tmp_path / "home"


def _data(tmp_path: Path, n: int = 6, responses: bool = True) -> Path:
    rng = random.Random(0)
    f = tmp_path / "data.jsonl"
    rows = []
    for _ in range(n):
        row = {"prompt": "".join(rng.choice("abcdefgh ") for _ in range(10))}
        if responses:
            row["response"] = "".join(rng.choice("abcdefgh ") for _ in range(40))
        rows.append(row)
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


run = run_captured  # (exit code, stdout, stderr) of `dflash-zoo ARGS`


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))[0]


def test_regeneration_through_a_server_then_training(capsys, tmp_path, target, home):
    data = _data(tmp_path, responses=False)  # prompts only: the server writes the responses
    base = ["train", "--target", target, "--data", data, "--out", tmp_path / "d", *TINY]
    with OpenAIServer() as server:
        code, out, err = run(
            capsys, *base, "--regenerate-endpoint", server.url, "--regenerate-only", "--json"
        )
        assert code == 0, err
        assert len(server.log) == 6 and "--regenerate-only: done" in err
        assert json.loads(out)["regenerated"] == 6  # --json: one object on stdout here too
        (cache,) = (home / "regen").iterdir()
        assert len(cache.read_text().splitlines()) == 6
        code, out, err = run(capsys, *base, "--regenerate-endpoint", server.url, "--steps", "2", "--json")
        assert code == 0, err
        assert len(server.log) == 6  # the cached responses were reused: no second request
    res = json.loads(out)
    assert res["steps"] == 2 and res["examples"] == 6
    load_drafter(tmp_path / "d")


def test_in_memory_and_disk_caches_through_the_cli(capsys, tmp_path, target, home):
    data = _data(tmp_path)
    base = ["train", "--target", target, "--data", data, *TINY, "--steps", "2"]
    code, _, err = run(capsys, *base, "--out", tmp_path / "m", "--cache-features")
    assert code == 0, err
    code, _, err = run(capsys, *base, "--out", tmp_path / "d", "--cache-features", tmp_path / "c")
    assert code == 0, err
    assert "computing 6 of 6 examples" in err and (tmp_path / "c" / "rank-00000-of-00001").is_dir()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fsdp-target"], "launch with torchrun"),
        (["--regenerate-endpoint", "localhost:8000"], "is not an http(s) URL"),
        (["--regenerate-only"], "needs --regenerate"),
        (["--attention", "flex"], "flex attention has no backward pass on cpu"),
    ],
)
def test_usage_errors_come_before_anything_loads(capsys, tmp_path, home, extra, message):
    ghost = tmp_path / "no-target"  # never reached
    code, _, err = run(capsys, "train", "--target", ghost, "--data", _data(tmp_path), "--out", tmp_path / "d",
                       "--device", "cpu", *extra)  # fmt: skip
    assert code == 2 and message in " ".join(err.split()), err


def test_a_foreign_cache_directory_is_refused_before_loading(capsys, tmp_path, home):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "mine.txt").write_text("x")
    code, _, err = run(capsys, "train", "--target", tmp_path / "no-target", "--data", _data(tmp_path),
                       "--out", tmp_path / "d", "--cache-features", tmp_path / "c", "--device", "cpu")  # fmt: skip
    assert code == 1 and "holds files dflash-zoo did not write" in err, err
    assert (tmp_path / "c" / "mine.txt").read_text() == "x"


@pytest.mark.slow
def test_killed_while_writing_the_cache_then_resumed(tmp_path, target, home):
    data = _data(tmp_path, n=40)
    cache = tmp_path / "c" / "rank-00000-of-00001"
    argv = cli(
        "train",
        "--target",
        str(target),
        "--data",
        str(data),
        "--out",
        str(tmp_path / "d"),
        *TINY,
        "--steps",
        "2",
        "--cache-features",
        str(tmp_path / "c"),
        "--batch-size",
        "1",
        "--cache-shard-mb",
        "0.000001",
    )  # fmt: skip: one example per file, many writes to kill
    env = {**os.environ, "DFLASH_ZOO_VERBOSITY": "WARNING"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(6000):  # bounded (~60 s): some shards written, the cache not complete
            if (cache / "manifest.json").is_file() or proc.poll() is not None:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "training ended before the kill: nothing was tested"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    listed = json.loads((cache / "manifest.json").read_text())["shards"]
    done = subprocess.run([*argv, "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    kept = json.loads((cache / "manifest.json").read_text())["shards"]
    assert kept[: len(listed)] == listed  # what the killed run finished was kept, not recomputed
    assert f"computing {40 - sum(len(s['examples']) for s in listed)} of 40" in " ".join(done.stderr.split())
    load_drafter(tmp_path / "d")
