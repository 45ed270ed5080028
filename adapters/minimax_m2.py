"""MiniMax-M2 targets (MiniMaxAI/MiniMax-M2.5: MiniMaxM2ForCausalLM; mirrors transformers
`models/minimax_m2/modeling_minimax_m2.py`).

Quirks:
- partial rotary: only half of each head (64 of 128 dims) is rotated. transformers reads it from
  `rope_parameters.partial_rotary_factor`. Released checkpoints state it as a legacy top-level
  `rotary_dim: 64`, which 5.24 converts but 5.17 silently ignores (full rotary: wrong outputs), so
  `load_model` converts it itself;
- q/k RMSNorm runs over all heads concatenated (width heads x head_dim), before the head split;
- MoE (256 experts, top-8) with full attention everywhere: plain `DynamicCache`, negative crop is exact;
- fast path: Qwen3's layout with the q/k norms over all heads at once; partial rotary comes with the rotary
  embedding's tables; the MoE block (sigmoid routing with a score-correction bias) runs as its module;
- the model always emits `<think>...</think>`; there is no template switch. bos 200034, eos 200020.
"""

from __future__ import annotations

from typing import Any

from dflash_zoo.adapters import register
from dflash_zoo.adapters.base import SparseMoE, StaticAttention, StaticLayout, TargetAdapter


def fix_partial_rotary(config: Any) -> Any:
    """Move a legacy `rotary_dim` into `rope_parameters.partial_rotary_factor` when it is missing there."""
    rotary_dim = getattr(config, "rotary_dim", None)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rotary_dim is not None and "partial_rotary_factor" not in rope:
        rope["partial_rotary_factor"] = rotary_dim / config.head_dim
        config.rope_parameters = rope
    return config


@register("minimax_m2")
class MiniMaxM2Adapter(TargetAdapter):
    static_layout = StaticLayout(
        attention=StaticAttention(q_norm="q_norm", k_norm="k_norm", qk_norm_per_head=False),
        mlp=None,
        moe=SparseMoE(router_args=("e_score_correction_bias",)),
        cuda_verified=True,
    )

    @classmethod
    def load_model(cls, directory: str, dtype: Any, device: Any) -> Any:
        import transformers

        config = fix_partial_rotary(transformers.AutoConfig.from_pretrained(directory))
        return cls.from_pretrained(directory, dtype, device, config=config)
