"""Multi-process training with CPU ranks (gloo, two processes launched by `torch.distributed.run`): a target
sharded with FSDP, rank-sharded feature caches, and resume, through the real CLI."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_zoo.engine.checkpoint import load_drafter
from tests.tiny import save_tiny_pair

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DFLASH_ZOO_VERBOSITY": "WARNING"}


def _torchrun(*args: str, state: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Two ranks of `args`. A rank that dies with SIGABRT ("terminate called without an active exception", gloo
    on a loaded 2-core host, rare; see tests/test_ddp.py) gets one relaunch from the state the directory
    `state` had before the first launch."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    saved = None
    if state is not None:
        saved = state.with_name(state.name + ".before")
        shutil.copytree(state, saved, symlinks=True)
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 and "Signal 6 (SIGABRT)" in done.stderr:
        if saved is not None:
            shutil.rmtree(state)
            shutil.copytree(saved, state, symlinks=True)
        done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    if saved is not None:
        shutil.rmtree(saved)
    return done


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))[0]


def test_sharded_target_gives_the_same_features_and_trains(target, tmp_path):
    done = _torchrun(str(ROOT / "tests" / "fsdp_worker.py"), str(target), str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["world"] == 2 and report["sharded_layers"].startswith("FSDP")
        assert report["features_equal"] and report["features_equal_without_stop"]
        assert report["drafters_identical"]


@pytest.mark.slow
def test_fsdp_target_with_rank_sharded_cache_trains_and_resumes(target, tmp_path):
    rng = random.Random(0)
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": "".join(rng.choice("abcdefgh ") for _ in range(10)),
             "response": "".join(rng.choice("abcdefgh ") for _ in range(24))} for _ in range(8)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    work = tmp_path / "work"  # everything the runs write
    work.mkdir()
    out, cache = work / "d", work / "features"
    base = ["-m", "dflash_zoo", "train", "--target", str(target), "--data", str(data), "--out", str(out),
            "--draft-layers", "1", "--block-size", "4", "--batch-size", "2", "--anchors-per-seq", "8",
            "--device", "cpu", "--fsdp-target", "--cache-features", str(cache), "--save-every", "1",
            "--keep-checkpoints", "--json"]  # fmt: skip
    first = _torchrun(*base, "--steps", "2", state=work)
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(first.stdout)["steps"] == 2  # rank 0 prints the result, rank 1 nothing
    ranks = sorted(p.name for p in cache.iterdir())
    assert ranks == ["rank-00000-of-00002", "rank-00001-of-00002"]
    manifests = {r: (cache / r / "manifest.json").read_bytes() for r in ranks}
    assert all(json.loads(m)["shards"] for m in manifests.values())  # each rank cached its own examples
    second = _torchrun(*base, "--steps", "4", "--resume", state=work)
    assert second.returncode == 0, second.stderr[-3000:]
    assert json.loads(second.stdout)["steps"] == 4
    assert "complete, reused" in second.stderr
    assert {r: (cache / r / "manifest.json").read_bytes() for r in ranks} == manifests  # nothing recomputed
    load_drafter(out)
