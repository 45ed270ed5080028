"""The embedded demo pair loads offline and greedy speculative output equals the target's greedy output."""

from __future__ import annotations

import os

import pytest

from dflash_zoo import demo

pytestmark = pytest.mark.skipif(
    not demo.available(), reason="demo pair not built (scripts/build_demo_pair.py)"
)


def test_demo_pair_is_lossless_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from dflash_zoo.api import load

    pipe = load(device="cpu", dtype="fp32")
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert pipe.tokenizer is not None and pipe.mask_token_id == pipe.tokenizer.convert_tokens_to_ids(
        "<|MASK|>"
    )
    for prompt in ("import os\n\ndef ", "class Stack:\n    def __init__(self):\n"):
        spec = pipe.generate(prompt, raw=True, max_new_tokens=40)
        base = pipe.generate_autoregressive(prompt, raw=True, max_new_tokens=40)
        assert spec.output_ids == base.output_ids
        assert spec.steps and spec.mean_acceptance_length >= 1.0
