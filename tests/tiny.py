"""Tiny random models for tests: targets from transformers config classes, drafters from DraftConfig.

Greedy paths of tiny random targets hit many near-ties; the LM head is scaled (x8, docs/compat.md §4)
so argmax decisions are stable and exact-equality tests test the loop, not rounding.
"""

from __future__ import annotations

import torch

from dflash_zoo.engine.config import default_target_layer_ids, normalize_draft_config
from dflash_zoo.engine.drafter import DFlashDrafter

VOCAB, HIDDEN = 256, 64
LM_SCALE = 8.0  # tiny LM heads are scaled up so greedy argmax has no near-ties
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def target_config(model_type: str, **overrides):
    """The tiny config of a family: `tests/tiny_families/<model_type>.py` defines `config(common) -> config`."""
    import importlib

    try:
        mod = importlib.import_module(f"tests.tiny_families.{model_type}")
    except ModuleNotFoundError as exc:
        raise AssertionError(
            f"no tiny config for adapter {model_type!r}: add tests/tiny_families/{model_type}.py"
        ) from exc
    return mod.config({**COMMON, **overrides})


def tiny_target(model_type: str = "qwen3", seed: int = 0, lm_scale: float = LM_SCALE, **overrides):
    """A tiny random fp32 causal LM of `model_type` in eval mode."""
    import transformers

    torch.manual_seed(seed)
    config = target_config(model_type, **overrides)
    model = getattr(transformers, tiny_auto_class(model_type)).from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(lm_scale)  # untied in every tiny config
    return model.eval()


def tiny_auto_class(model_type: str) -> str:
    from dflash_zoo.adapters import get_adapter

    return get_adapter(model_type).auto_class


def draft_config_dict(target=None, layers: int = 2, block_size: int = 8, taps=None, **extra) -> dict:
    """A z-lab-style draft config.json dict for a tiny target."""
    n_target = target.config.get_text_config().num_hidden_layers if target is not None else 4
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 2048,
        "num_target_layers": n_target,
        "dflash_config": {
            "block_size": block_size,
            "target_layer_ids": list(taps)
            if taps is not None
            else default_target_layer_ids(n_target, layers),
            "mask_token_id": VOCAB - 1,
        },
        **extra,
    }


def tiny_drafter(target=None, seed: int = 1, **kw) -> DFlashDrafter:
    """A random drafter for a tiny target (weights scaled up so drafts are not all the same token)."""
    torch.manual_seed(seed)
    model = DFlashDrafter(normalize_draft_config(draft_config_dict(target, **kw)))
    return model.float().eval()


CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def tiny_tokenizer():
    """A character-level fast tokenizer (ids < 100) with a chat template, built offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "\n": 4}
    vocab.update({chr(c): 5 + i for i, c in enumerate(range(32, 127))})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_pair(root, model_type: str = "qwen3", block_size: int = 8):
    """Write a tiny target (with tokenizer) and a random drafter as local directories; returns both paths."""
    from dflash_zoo.engine.checkpoint import save_drafter

    target = tiny_target(model_type)
    target_dir, draft_dir = root / "target", root / "draft"
    target.save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    save_drafter(tiny_drafter(target, block_size=block_size), draft_dir)
    return target_dir, draft_dir


DFLASH2_PARAMS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}


def dflash2_config(target, block_size=8, layers=2, params=None, **extra) -> dict:
    """A z-lab DFlash 2 config.json dict for a tiny target."""
    raw = draft_config_dict(target, layers=layers, block_size=block_size, **extra)
    raw["architectures"] = ["DFlash2DraftModel"]
    raw["dflash_config"].update(params or DFLASH2_PARAMS)
    return raw


def randomize(model, seed: int, scale: float = 0.3):
    """Random DFlash 2 parts (a fresh model starts them neutral): the convolutions and selector do work."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_conv." in name or name.startswith("candidate_selector."):
                p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def tiny_dflash2(target, seed=1, params=None, **kw):
    """A random DFlash 2 drafter (`DFLASH2_PARAMS` unless `params`) with its own parts randomised too."""
    from dflash_zoo.drafters.dflash2 import DFlash2Drafter

    torch.manual_seed(seed)
    return randomize(
        DFlash2Drafter(normalize_draft_config(dflash2_config(target, params=params, **kw))).float(), seed
    )
