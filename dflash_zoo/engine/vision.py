"""Image prompts for VLM targets: token ids for the decode loop plus the tensors its prefill needs.

    ids, prefill = image_prompt_inputs(processor, "What is in this picture?", ["cat.png"], {})
    engine.start(ids, cfg, prefill_inputs=prefill)  # the eager engine (engine/factory.py picks it for images)

The HF processor renders the chat template and expands each image placeholder into the number of image
tokens the vision tower produces. Everything it returns besides `input_ids` and `attention_mask`
(`pixel_values`, `image_grid_thw`, `mm_token_type_ids`, `image_position_ids`, ...) goes to the prefill
forward only: the image lands in the target's KV cache there, and drafting and verification stay
text-only (drafters are text-only; docs/families.md). Position state the target derives from the image
(Qwen mRoPE `rope_deltas`) is the adapter's business, not this module's.

Loading image files needs Pillow (and, for the fast image processors, torchvision). Neither is imported
at module import time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_zoo.errors import ConfigError, NotFoundError, UnsupportedModelError

if TYPE_CHECKING:
    import torch

    from dflash_zoo.adapters.base import TargetAdapter

TEXT_ONLY_KEYS = ("input_ids", "attention_mask")


def require_image_support(adapter: TargetAdapter) -> None:
    """Refuse images for a target whose adapter does not declare `accepts_images`."""
    if not adapter.accepts_images:
        types = ", ".join(adapter.model_types) or type(adapter).__name__
        raise UnsupportedModelError(
            f"target family {types} takes no images",
            hint="drop --image, or use a VLM target (qwen3_vl, gemma4, ...)",
        )


def load_image(path: str | Path) -> Any:
    """A file path -> an RGB image through transformers' loader (needs Pillow)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise NotFoundError(f"image file not found: {path}")
    try:
        from transformers.image_utils import load_image as hf_load_image

        return hf_load_image(str(path))
    except ImportError as exc:  # transformers raises ImportError when the vision backend is missing
        raise ConfigError(f"reading images needs Pillow ({exc})", hint="pip install pillow") from exc


def _messages(prompt: str, num_images: int) -> list[dict[str, Any]]:
    content = [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": prompt}]
    return [{"role": "user", "content": content}]


def render_prompt(processor: Any, prompt: str, num_images: int, chat_template_kwargs: dict[str, Any]) -> str:
    """The chat-templated text with one image placeholder per image (before the processor expands them)."""
    if getattr(processor, "chat_template", None):
        return processor.apply_chat_template(
            _messages(prompt, num_images), tokenize=False, add_generation_prompt=True, **chat_template_kwargs
        )
    token = getattr(processor, "image_token", None)
    if token is None:
        raise ConfigError("the processor has neither a chat template nor an image token")
    return token * num_images + prompt


def image_prompt_inputs(
    processor: Any,
    prompt: str,
    image_paths: Sequence[str | Path],
    chat_template_kwargs: dict[str, Any] | None = None,
    *,
    loader: Callable[[str | Path], Any] = load_image,
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Token ids and prefill-only tensors for a text prompt with images.

    Args:
        processor: a loaded HF processor (`AutoProcessor.from_pretrained(target_dir)`).
        prompt: the user's text; rendered through the processor's chat template when it has one.
        image_paths: image files, shown before the text in the order given.
        chat_template_kwargs: template switches (e.g. `enable_thinking`), as for text prompts.
        loader: path -> image object the processor accepts (default: Pillow through transformers).
    Returns:
        `(input_ids, prefill_inputs)`: ids with the image tokens expanded, and a dict such as
        `{"pixel_values": ..., "image_grid_thw": ..., "mm_token_type_ids": ...}` for the prefill forward.
    """
    if not image_paths:
        raise ConfigError("image_prompt_inputs needs at least one image")
    images = [loader(p) for p in image_paths]
    text = render_prompt(processor, prompt, len(images), chat_template_kwargs or {})
    # a rendered template already holds bos: tokenize it without special tokens, as Pipeline.encode does
    templated = bool(getattr(processor, "chat_template", None))
    batch = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=not templated)
    input_ids = batch["input_ids"][0].tolist()  # [1, T] -> T ids; batch size 1 only
    prefill = {k: v for k, v in batch.items() if k not in TEXT_ONLY_KEYS and v is not None}
    return input_ids, prefill
