"""Shared fixtures: tiny random targets and drafters built from config classes (no downloads)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DFLASH_ZOO_VERBOSITY", "ERROR")
import torch  # noqa: E402

# without CUDA, the Triton kernels (kernels.py) run in triton's numpy interpreter: read when triton is imported
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:  # each kernel's first config untimed (`gemv.tunes`): every config has tests of its own, and timing them
    os.environ.setdefault(
        "DFLASH_ZOO_TUNE", "0"
    )  # all costs minutes per engine; the tuner's tests set it back

from tests.tiny import tiny_drafter, tiny_target  # noqa: E402

# Long cases of parametrized tests (and whole tests) in files that carry no marker of their own, marked `slow`
# here: the default run skips them (pyproject's addopts), CI's slow leg runs them (`-m slow`). Measured with
# `pytest --durations` on a shared 2-core CPU: each took 8-60 s (the heavy families' tiny models take the
# longest to build and run). Keys are node ids under tests/; a value lists the case ids to mark (None: all).
SLOW_CASES: dict[str, tuple[str, ...] | None] = {
    "test_adapter_matrix.py::test_speculative_greedy_equals_plain_greedy": tuple(
        f"{family}-{seed}"
        for family in ("gemma4_text", "gemma4", "gpt_oss", "deepseek_v3", "kimi_k25")
        for seed in range(4)
    ),
    "test_kernels.py::test_fast_path_with_split_kernels_equals_eager": None,
    "test_sampling.py::test_a_certain_drafter_is_corrected_by_the_rule": None,
    "test_sampling.py::test_speculative_sampling_matches_target_distribution": None,
    "test_placement.py::test_placed_speculative_greedy_equals_unplaced_autoregressive": (
        "qwen3_5_text", "gemma4_text", "qwen3",
    ),
    "test_train.py::test_loss_falls_and_acceptance_beats_untrained": None,  # with its module's training run
    "test_train.py::test_saved_drafter_round_trips": None,
}  # fmt: skip


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        base, _, case = item.nodeid.partition("[")
        cases = SLOW_CASES.get(base.removeprefix("tests/"), ())
        if cases is None or case.rstrip("]") in cases:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(params=["qwen3", "qwen3_moe", "llama"])
def core_model_type(request):
    return request.param


@pytest.fixture
def qwen3_target():
    return tiny_target("qwen3", seed=0)


@pytest.fixture
def qwen3_drafter(qwen3_target):
    return tiny_drafter(qwen3_target, seed=1)


@pytest.fixture
def offline_zoo_home(tmp_path, monkeypatch):
    """Offline, with the HF cache and the zoo's home under `tmp_path` and no extra registry file."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path / "zoo"))
    monkeypatch.delenv("DFLASH_ZOO_REGISTRY", raising=False)
    return tmp_path
