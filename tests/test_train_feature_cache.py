"""The on-disk feature cache (training/feature_cache.py): round trip, training from it, refusal of another
run's cache or of foreign files, and crash safety (leftovers of a killed write, random kills of a writer)."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash_zoo.training import feature_cache as fc
from dflash_zoo.training.data import Example
from dflash_zoo.training.train import TrainConfig, build_draft_config, new_drafter, train
from dflash_zoo.training.trainer import Trainer
from tests.tiny import VOCAB, tiny_target, tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent
KEY = fc.CacheKey("cfg", "w", "float32", (1, 2), 64, "data", "ex", "fp32", 0, 1)


def _examples(n: int = 10, seed: int = 0) -> list[Example]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Example(tuple(torch.randint(0, VOCAB - 1, (int(L),), generator=gen).tolist()), 3)
        for L in torch.randint(12, 40, (n,), generator=gen)
    ]


def _cfg(tmp_path, **kw) -> TrainConfig:
    base = dict(out=str(tmp_path / "d"), draft_layers=1, block_size=4, steps=3, batch_size=2, anchors_per_seq=6,
                lr=1e-2, mask_token_id=VOCAB - 1, cache_dtype="fp32")  # fmt: skip
    return TrainConfig(**(base | kw))


def _trainer(tmp_path, target, examples, **kw) -> Trainer:
    cfg = _cfg(tmp_path, **kw)
    drafter = new_drafter(build_draft_config(target, tiny_tokenizer(), cfg), cfg, None, "cpu")
    return Trainer(cfg, target, drafter, examples, "cpu")


def test_round_trip_in_several_shards(tmp_path):
    feats = {i: torch.randn(5 + i, 8) for i in range(7)}
    cache = fc.FeatureCache.open(tmp_path / "c", KEY, 8, shard_bytes=300)
    for i, f in feats.items():
        cache.add(i, f)
    cache.flush()
    again = fc.FeatureCache.open(tmp_path / "c", KEY, 8)
    assert again.missing(8) == [7] and len(again.shards) >= 3
    for i, f in feats.items():
        assert torch.equal(again.get(i), f)
    bf16 = fc.FeatureCache.open(tmp_path / "b", dataclasses.replace(KEY, dtype="bf16"), 8)
    bf16.add(0, feats[0])
    bf16.flush()
    assert (
        fc.FeatureCache.open(tmp_path / "b", dataclasses.replace(KEY, dtype="bf16"), 8).get(0).dtype
        == torch.bfloat16
    )


def test_training_from_the_cache_equals_training_without_and_reuses_it(tmp_path):
    target, exs = tiny_target("qwen3"), _examples()
    forwards = []
    handle = target.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        plain = _trainer(tmp_path, target, exs)
        want = [plain.step(s, s / 3) for s in range(3)]
        cached = _trainer(tmp_path, target, exs, cache_dir=str(tmp_path / "c"))
        cached.use_disk_cache(tmp_path / "c", shard_bytes=2000)
        n = len(forwards)
        got = [cached.step(s, s / 3) for s in range(3)]
        assert len(forwards) == n  # the steps read the cache, never the target
        again = _trainer(tmp_path, target, exs, cache_dir=str(tmp_path / "c"))
        again.use_disk_cache(tmp_path / "c")
        assert len(forwards) == n  # a second run finds the cache complete
    finally:
        handle.remove()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    for p, q in zip(cached.raw.parameters(), plain.raw.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_train_writes_the_cache_before_training(tmp_path, capsys):
    target, exs = tiny_target("qwen3"), _examples()
    cfg = _cfg(tmp_path, cache_dir=str(tmp_path / "c"))
    train(cfg, target, tiny_tokenizer(), exs)
    err = capsys.readouterr().err
    assert f"feature cache {tmp_path / 'c'}" in err and "computing 10 of 10 examples" in err
    (rank_dir,) = (tmp_path / "c").iterdir()
    assert rank_dir.name == "rank-00000-of-00001" and (rank_dir / fc.MANIFEST).is_file()
    train(dataclasses.replace(cfg, out=str(tmp_path / "d2")), target, tiny_tokenizer(), exs)
    assert "complete, reused" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"taps": (1, 3)}, "taps"),
        ({"target_weights": "other"}, "target_weights"),
        ({"max_length": 32}, "max_length"),
        ({"data": "other-data"}, "data"),
        ({"dtype": "fp16"}, "dtype"),
    ],
)
def test_another_runs_cache_is_refused_naming_the_difference(tmp_path, change, named):
    cache = fc.FeatureCache.open(tmp_path / "c", KEY, 8)
    cache.add(0, torch.ones(3, 8))
    cache.flush()
    before = sorted(p.name for p in cache.dir.iterdir())
    with pytest.raises(fc.FeatureCacheError, match=f"written for another run: {named}"):
        fc.FeatureCache.open(tmp_path / "c", dataclasses.replace(KEY, **change), 8)
    assert sorted(p.name for p in cache.dir.iterdir()) == before  # nothing touched


def test_another_target_is_refused(tmp_path):
    exs = _examples()
    _trainer(tmp_path, tiny_target("qwen3", seed=0), exs).use_disk_cache(tmp_path / "c")
    other = _trainer(tmp_path, tiny_target("qwen3", seed=1), exs)  # same config, other weights
    with pytest.raises(fc.FeatureCacheError, match="target_weights differ"):
        other.use_disk_cache(tmp_path / "c")
    shifted = _trainer(tmp_path, tiny_target("qwen3", seed=0), _examples(seed=1))  # other examples
    with pytest.raises(fc.FeatureCacheError, match="examples"):
        shifted.use_disk_cache(tmp_path / "c")


def test_foreign_files_are_refused_and_left_alone(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    with pytest.raises(fc.FeatureCacheError, match="did not write"):
        fc.FeatureCache.open(root, KEY, 8)
    assert (root / "notes.txt").read_text() == "mine"
    (root / "notes.txt").unlink()
    fc.FeatureCache.open(root, KEY, 8)
    mine = root / "rank-00000-of-00001" / "shard-000009.safetensors"  # our name, not our file
    mine.write_bytes(b"user data")
    with pytest.raises(
        fc.FeatureCacheError, match="shard-000009.safetensors, which dflash-zoo did not write"
    ):
        fc.FeatureCache.open(root, KEY, 8)
    assert mine.read_bytes() == b"user data"


def test_leftovers_of_a_killed_write_are_cleaned_and_recomputed(tmp_path):
    cache = fc.FeatureCache.open(tmp_path / "c", KEY, 8, shard_bytes=10)
    cache.add(0, torch.ones(2, 8))  # one shard, listed
    manifest = (cache.dir / fc.MANIFEST).read_bytes()
    cache.add(1, torch.full((2, 8), 2.0))  # a second shard, then the manifest ...
    (cache.dir / fc.MANIFEST).write_bytes(manifest)  # ... as if the kill came before the manifest's rename
    (cache.dir / ".shard-000002.safetensors.tmp-0a1b2c3d").write_bytes(b"half")  # a shard being written
    (cache.dir / ".manifest.json.tmp-0a1b2c3d").write_text("{")
    again = fc.FeatureCache.open(tmp_path / "c", KEY, 8)
    assert sorted(p.name for p in again.dir.iterdir()) == [fc.MANIFEST, "shard-000000.safetensors"]
    assert again.missing(2) == [1] and torch.equal(again.get(0), torch.ones(2, 8))


@pytest.mark.parametrize("damage", ["truncated", "missing", "header"])
def test_a_damaged_shard_is_named_not_reused(tmp_path, damage):
    """A listed shard cut short, gone or with a broken header: refused naming it, not announced as cached."""
    cache = fc.FeatureCache.open(tmp_path / "c", KEY, 8, shard_bytes=10)
    cache.add(0, torch.ones(2, 8))
    cache.add(1, torch.ones(3, 8))
    shard = cache.dir / "shard-000001.safetensors"
    raw = shard.read_bytes()
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(raw[:-20] if damage == "truncated" else b"\xff" * len(raw))
    why = {"truncated": f"has {len(raw) - 20} bytes where the manifest records {len(raw)}",
           "missing": "is missing", "header": "has an unreadable header"}[damage]  # fmt: skip
    with pytest.raises(fc.FeatureCacheError, match=f"shard {shard} {why}") as err:
        fc.FeatureCache.open(tmp_path / "c", KEY, 8)
    assert f"delete {cache.dir}" in err.value.hint


def test_shards_have_normal_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        cache = fc.FeatureCache.open(tmp_path / "c", KEY, 8)
        cache.add(0, torch.ones(2, 8))
        cache.flush()
    finally:
        os.umask(old)
    for f in cache.dir.iterdir():
        assert f.stat().st_mode & 0o777 == 0o644, f


def writer(root: str) -> Trainer:
    """The trainer whose cache the kill test writes (300 examples; run in a subprocess by `_WORKER`)."""
    gen = torch.Generator().manual_seed(0)
    exs = [Example(tuple(torch.randint(0, VOCAB - 1, (30,), generator=gen).tolist()), 2) for _ in range(300)]
    return _trainer(Path(root), tiny_target("qwen3"), exs, batch_size=1, cache_dir=root)


_WORKER = (  # one example per shard: many writes to kill
    "import sys\nfrom pathlib import Path\nfrom tests.test_train_feature_cache import writer\n"
    "writer(sys.argv[1]).use_disk_cache(Path(sys.argv[1]), shard_bytes=1)\n"
)


@pytest.mark.slow
def test_random_kills_of_a_cache_writer_always_leave_a_resumable_cache(tmp_path):
    root = tmp_path / "c"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DFLASH_ZOO_VERBOSITY": "ERROR"}
    argv = [sys.executable, "-c", _WORKER, str(root)]
    rng, counts, ref = random.Random(7), [], writer(str(root))
    for _ in range(4):
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            for _ in range(6000):  # bounded (~60 s): wait for this run's first new shard
                rank = root / "rank-00000-of-00001"
                shards = len(list(rank.glob("shard-*"))) if rank.is_dir() else 0
                if shards > (counts[-1] if counts else 0) or proc.poll() is not None:
                    break
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))
            assert proc.poll() is None, "the writer finished before the kill: nothing was tested"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        cache = fc.FeatureCache.open(
            root, ref.cache_key(), ref.feature_width
        )  # cleans; the manifest is whole
        counts.append(300 - len(cache.missing(300)))
        assert all(cache.get(i).shape == (30, ref.feature_width) for i in cache.where)
    assert counts == sorted(counts) and counts[-1] > 0
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    cache = fc.FeatureCache.open(root, ref.cache_key(), ref.feature_width)
    assert cache.missing(300) == []
    for i in random.Random(0).sample(range(300), 5):  # spot checks against a fresh forward
        torch.testing.assert_close(cache.get(i), ref._target([ref.shard[i].ids])[0], rtol=1e-5, atol=1e-5)
