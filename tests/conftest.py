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

from tests.tiny import tiny_drafter, tiny_target  # noqa: E402


@pytest.fixture(params=["qwen3", "qwen3_moe", "llama"])
def core_model_type(request):
    return request.param


@pytest.fixture
def qwen3_target():
    return tiny_target("qwen3", seed=0)


@pytest.fixture
def qwen3_drafter(qwen3_target):
    return tiny_drafter(qwen3_target, seed=1)
