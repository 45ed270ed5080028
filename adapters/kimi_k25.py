"""Kimi-K2.5 targets (moonshotai/Kimi-K2.5: Kimi_K25ForConditionalGeneration, transformers >= 5.13; mirrors
`models/kimi_k25/modeling_kimi_k25.py`; the text model is `deepseek_v3`, see adapters/deepseek_v3.py).

Quirks:
- VLM wrapper: the decoder lives at `model.language_model`; `AutoModelForCausalLM` has no mapping for
  kimi_k25, so the target loads through `AutoModelForImageTextToText`;
- untied head: `Kimi_K25Config.tie_word_embeddings` defaults to True while the checkpoint ships its own
  `lm_head`. Loading as-is would silently tie the head to the embeddings, so `load_model` forces the value
  from the checkpoint (untied whenever an `lm_head.weight` tensor exists);
- MLA + MoE as DeepSeek-V3: plain `DynamicCache`, negative crop is exact;
- images (`accepts_images`): pixel values and grid sizes go to the prefill forward only; positions are
  plain 1-D, so later text-only verify forwards need no extra state;
- tokenizer: tiktoken-based remote code (not loaded by default); turns end with `<|im_end|>`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_zoo.adapters import register
from dflash_zoo.adapters.deepseek_v3 import DeepseekV3Adapter


def checkpoint_has_lm_head(directory: str) -> bool:
    """Whether the safetensors checkpoint in `directory` holds a separate `*lm_head.weight` tensor."""
    root = Path(directory)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = json.loads(index.read_text())["weight_map"]
    else:
        from safetensors import safe_open

        names = []
        for shard in root.glob("*.safetensors"):
            with safe_open(str(shard), framework="pt") as f:
                names += list(f.keys())
    return any(name.endswith("lm_head.weight") for name in names)


@register("kimi_k25")
class KimiK25Adapter(DeepseekV3Adapter):
    layers_path = "model.language_model.layers"
    auto_class = "AutoModelForImageTextToText"
    accepts_images = True
    registry_shape = {"model_type": "deepseek_v3"}  # the text config's

    @classmethod
    def load_model(cls, directory: str, dtype: Any, device: Any) -> Any:
        import transformers

        config = transformers.AutoConfig.from_pretrained(directory)
        if checkpoint_has_lm_head(directory):
            config.tie_word_embeddings = False
            config.get_text_config().tie_word_embeddings = False
        return cls.from_pretrained(directory, dtype, device, config=config)
