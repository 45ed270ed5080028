"""The embedded demo pair loads offline, is lossless and trained; its build script runs end to end (tiny)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_zoo import demo

ROOT = Path(__file__).resolve().parents[1]
needs_demo = pytest.mark.skipif(
    not demo.available(), reason="demo pair not built (scripts/build_demo_pair.py)"
)


@needs_demo
def test_demo_pair_is_lossless_offline_and_trained(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from dflash_zoo.api import load

    pipe = load(device="cpu", dtype="fp32")
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert pipe.tokenizer is not None and pipe.mask_token_id == pipe.tokenizer.convert_tokens_to_ids(
        "<|MASK|>"
    )
    steps = accepted = 0
    prompts = ("import os\n\ndef ", "class Stack:\n    def __init__(self):\n", "for i in range(10):\n")
    for prompt in prompts:
        spec = pipe.generate(prompt, raw=True, max_new_tokens=64)
        base = pipe.generate_autoregressive(prompt, raw=True, max_new_tokens=64)
        assert spec.output_ids == base.output_ids
        steps += len(spec.steps)
        accepted += sum(s.acceptance_length for s in spec.steps)
    # an untrained or mismatched drafter sits at ~1.0; the shipped one measures ~3 here (~5 held out)
    assert accepted / steps > 1.5


@pytest.mark.slow
def test_build_script_runs_end_to_end_at_tiny_scale(tmp_path):
    """Every stage of scripts/build_demo_pair.py on CPU (~30 s): the shipped pair's rebuild path stays alive."""
    work, out = tmp_path / "work", tmp_path / "demo"
    sets = ["target_epochs=0.2", "draft_s=3", "eval_n=1", "n_text=8", "n_chat=2"]
    cmd = [sys.executable, "scripts/build_demo_pair.py", "--tiny", "--device", "cpu"]
    cmd += ["--work", str(work), "--out", str(out), *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["target"]["epochs"] == 0.2 and res["target"]["steps"] >= 1
    assert res["target_report"]["held_out_tokens"] > 0
    main = res["eval"]["main"]
    assert main["outputs_match_autoregressive"] == main["prompts"] == 1
    assert (out / "draft" / "model.safetensors").is_file() and (out / "PROVENANCE.md").is_file()


def test_build_script_rejects_unknown_hp_key():
    cmd = [sys.executable, "scripts/build_demo_pair.py", "--tiny", "--set", "nope=1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--set nope=1: unknown key" in proc.stderr


@needs_demo
def test_a_drafter_alone_pairs_with_the_demo_target(tmp_path):
    """`load(draft=D)` without a target: the embedded demo target with D (not the demo drafter)."""
    from dflash_zoo.api import load
    from dflash_zoo.engine.drafter import DFlashDrafter

    shipped = load(device="cpu", dtype="fp32").drafter
    other = DFlashDrafter(shipped.cfg)  # same shape, fresh random weights
    pipe = load(draft=other, device="cpu", dtype="fp32")
    assert pipe.drafter is other
    assert pipe.model.config.model_type == "qwen3" and pipe.tokenizer is not None


def test_env_prints_the_demo_pair_directories():
    """`train --target` needs the demo target's folder: `env` names it (and the drafter's), torch-free."""
    from click.testing import CliRunner

    from dflash_zoo.cli import cli

    result = CliRunner().invoke(cli, ["env", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    if demo.available():
        assert report["demo_target"] == str(demo.target_dir())
        assert report["demo_draft"] == str(demo.draft_dir())
        assert (Path(report["demo_target"]) / "config.json").is_file()
        assert f"- demo_target: {demo.target_dir()}" in CliRunner().invoke(cli, ["env"]).stdout
    else:
        assert report["demo_target"] is None


@needs_demo
def test_revision_for_a_local_pair_is_not_silently_ignored():
    """--revision / --draft-revision name Hub revisions; for local folders the CLI says they are unused."""
    from click.testing import CliRunner

    from dflash_zoo.cli import cli

    args = ["generate", "def f(x):", "--raw", "-n", "2", "--device", "cpu", "--revision", "v1",
            "--draft", str(demo.draft_dir()), "--draft-revision", "abc"]  # fmt: skip
    result = CliRunner().invoke(cli, args, env={"DFLASH_ZOO_VERBOSITY": "WARNING", "COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    err = " ".join(result.stderr.split())
    assert f"target revision 'v1' ignored: {demo.target_dir()} is a local directory" in err
    assert f"drafter revision 'abc' ignored: {demo.draft_dir()} is a local directory" in err
