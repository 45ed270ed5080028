"""`eval` and `bench` against a target of few positions: a prompt it cannot hold is refused before any is run,
naming its line; a bench that would run past the positions says so (generate / chat: test_cli_generate.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.cli_runner import run_cli
from tests.tiny import save_tiny_pair

POSITIONS = 48  # the short target's max_position_embeddings (the tiny tokenizer: one token per character)


@pytest.fixture(scope="module")
def short_pair(tmp_path_factory):
    target, draft = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    short = tmp_path_factory.mktemp("short") / "target"
    shutil.copytree(target, short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = POSITIONS
    (short / "config.json").write_text(json.dumps(cfg))
    return str(short), str(draft)


@pytest.fixture
def prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "y" * 10}) + "\n" + json.dumps({"prompt": "y" * 60}) + "\n")
    return f


def test_eval_refuses_a_prompt_the_target_cannot_hold_naming_its_line(short_pair, prompts):
    t, d = short_pair
    res = run_cli("eval", "-t", t, "-d", d, "--data", str(prompts), "--raw", "-n", "4", "--device", "cpu")
    assert res.code == 2 and res.stdout == "", res.stderr
    assert (
        f"error: {prompts}:2: the prompt is 60 tokens; the target holds {POSITIONS} positions" in res.stderr
    )
    assert "evaluating" not in res.stderr


def test_bench_refuses_a_prompt_the_target_cannot_hold(short_pair, prompts, tmp_path):
    t, d = short_pair
    base = ["bench", "-t", t, "-d", d, "--device", "cpu", "--warmup", "0", "--repeats", "1", "-n", "4",
            "--out", str(tmp_path / "r.json")]  # fmt: skip
    res = run_cli(*base, "--prompts", str(prompts), "--raw")
    assert res.code == 2 and res.stdout == "", res.stderr
    assert f"{prompts}:2: the prompt is 60 tokens; the target holds {POSITIONS} positions" in res.stderr
    res = run_cli(*base)  # the fixed prompt of 512 tokens
    assert res.code == 2 and "the prompt is 512 tokens" in res.stderr and "--prompt-tokens" in res.stderr
    assert not (tmp_path / "r.json").exists()


def test_bench_past_the_positions_is_a_warning(short_pair, tmp_path):
    t, d = short_pair
    res = run_cli("bench", "-t", t, "-d", d, "--device", "cpu", "--warmup", "0", "--repeats", "1",
                  "--prompt-tokens", "20", "-n", "40", "--out", str(tmp_path / "r.json"))  # fmt: skip
    assert res.code == 0, res.stderr
    err = " ".join(res.stderr.split())
    assert f"20 tokens) plus 40 new tokens runs past the target's {POSITIONS} positions" in err
    assert "--max-new-tokens 28 stays inside them" in err
