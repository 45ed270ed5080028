"""Image prompts: a prefill with pixel values, then text-only drafting and verification on the same cache,
must equal the target's own greedy `generate` with the same inputs (tiny Qwen3-VL: mRoPE deltas)."""

from __future__ import annotations

import pytest
import torch
from dflash_zoo.adapters import get_adapter

from dflash_zoo.engine.decode import SpeculativeDecoder
from dflash_zoo.engine.results import GenerationConfig
from dflash_zoo.engine.vision import image_prompt_inputs, require_image_support
from dflash_zoo.errors import ConfigError, NotFoundError, UnsupportedModelError
from tests.oracles import OracleDecoder, greedy_reference
from tests.tiny import tiny_drafter, tiny_target

IMAGE_TOKEN = 250
GRID = (1, 4, 4)  # t, h, w in patches; a 2x2 merge gives 4 image tokens


@pytest.fixture(scope="module")
def vlm():
    model = tiny_target("qwen3_vl", seed=0, image_token_id=IMAGE_TOKEN)
    return model, get_adapter("qwen3_vl")(model)


def _image_inputs(text_before: list[int], text_after: list[int], seed: int = 0):
    """Ids with the expanded image placeholder, and the tensors a Qwen3-VL processor would return."""
    gen = torch.Generator().manual_seed(seed)
    n_patches, n_tokens = GRID[0] * GRID[1] * GRID[2], GRID[0] * GRID[1] * GRID[2] // 4
    ids = text_before + [IMAGE_TOKEN] * n_tokens + text_after
    types = torch.tensor([[int(t == IMAGE_TOKEN) for t in ids]])  # [1, T]: 1 marks image tokens
    prefill = {
        "pixel_values": torch.randn(n_patches, 3 * 2 * 4 * 4, generator=gen),  # [patches, C * T * P * P]
        "image_grid_thw": torch.tensor([GRID]),
        "mm_token_type_ids": types,
    }
    return ids, prefill


def _run(adapter, drafter, ids, prefill, n, reference=None):
    cfg = GenerationConfig(max_new_tokens=n, block_size=6)
    if reference is None:
        dec = SpeculativeDecoder(adapter, drafter, ids, cfg, 255, prefill_inputs=prefill)
    else:
        dec = OracleDecoder(adapter, drafter, ids, cfg, 255, prefill_inputs=prefill, reference=reference)
    list(dec)
    return dec.result.output_ids


def test_image_prompt_is_lossless(vlm):
    model, adapter = vlm
    drafter = tiny_drafter(model, seed=4, block_size=6)
    ids, prefill = _image_inputs([5, 17, 33], [40, 41, 42, 43])
    n = 24
    out = model.generate(
        torch.tensor([ids]),
        **prefill,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    ref = out[0, len(ids) :].tolist()
    assert model.model.rope_deltas.abs().sum() > 0  # the image really shifted the text positions
    assert _run(adapter, drafter, ids, prefill, n) == ref
    assert _run(adapter, drafter, ids, prefill, n, reference=ref) == ref
    # a text-only prompt right after an image prompt must not inherit its rope deltas
    text = [9, 8, 7, 6, 5]
    assert _run(adapter, drafter, text, {}, n) == greedy_reference(model, text, n)


class FakeProcessor:
    """Stands in for an HF processor: a chat template, and an image token expanded into 3 slots."""

    chat_template = "{{ messages }}"
    image_token = "<img>"

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
        self.calls.append(("template", kwargs))
        n = sum(c["type"] == "image" for c in messages[0]["content"])
        return "<bos>" + self.image_token * n + messages[0]["content"][-1]["text"]

    def __call__(self, text, images, return_tensors, add_special_tokens):
        self.calls.append(("call", add_special_tokens))
        ids = [2] + [IMAGE_TOKEN] * 3 * len(images) + [ord(c) % 200 for c in text[0].split(">")[-1]]
        return {
            "input_ids": torch.tensor([ids]),
            "attention_mask": torch.ones(1, len(ids)),
            "pixel_values": torch.stack(images),
        }


def test_image_prompt_inputs_splits_prefill_tensors(tmp_path):
    proc, paths = FakeProcessor(), [tmp_path / "a.png", tmp_path / "b.png"]
    ids, prefill = image_prompt_inputs(
        proc, "hi", paths, {"enable_thinking": False}, loader=lambda p: torch.ones(3)
    )
    assert ids[:7] == [2] + [IMAGE_TOKEN] * 6 and len(ids) == 9
    assert set(prefill) == {"pixel_values"} and prefill["pixel_values"].shape == (2, 3)
    assert proc.calls == [("template", {"enable_thinking": False}), ("call", False)]


def test_image_prompt_errors(tmp_path, vlm):
    with pytest.raises(NotFoundError):
        image_prompt_inputs(FakeProcessor(), "hi", [tmp_path / "missing.png"])
    with pytest.raises(ConfigError):
        image_prompt_inputs(FakeProcessor(), "hi", [])
    require_image_support(vlm[1])
    with pytest.raises(UnsupportedModelError):
        require_image_support(get_adapter("qwen3")(tiny_target("qwen3")))
