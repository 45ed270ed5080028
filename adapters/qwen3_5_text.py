"""Qwen3.5/3.6 text decoder (`Qwen3_5ForCausalLM`; mirrors transformers `models/qwen3_5/modeling_qwen3_5.py`).

Quirks:
- hybrid layers: `layer_types` repeats `linear_attention` x3 then `full_attention`; the linear layers are
  Gated-DeltaNet (`Qwen3_5GatedDeltaNet` at `layer.linear_attn`), whose recurrent state `Cache.crop` cannot
  rewind: rollback is the GDN recompute (default) or replay of `_hybrid.py`;
- the GDN input projections are separate: `in_proj_qkv` (the conv input, [q | k | v]), `in_proj_a` (decay
  logits) and `in_proj_b` (beta logits); the recompute rollback hooks exactly these three;
- `DynamicCache(config=...)` is required (it builds `LinearAttentionLayer`s), and past recording is turned on
  only after prefill (base `start_decoding`);
- full-attention layers are gated (q_proj doubles as a gate) and use partial rotary: taps are unaffected;
- fast path: RMSNorms are zero-centred (`1 + weight`, in fp32), so the static engine calls the norm modules;
  GDN layers run over static conv / recurrent states (`cuda/static/gdn.py`, `gdn_split` splits the projections' outputs);
- thinking is on by default in the chat template and the z-lab drafters were benchmarked with it, so no
  template switch is passed.
"""

from __future__ import annotations

from typing import Any

from dflash_zoo.adapters import register
from dflash_zoo.adapters._hybrid import HybridGDNAdapter
from dflash_zoo.adapters.base import SparseMoE, StaticAttention, StaticGDN, StaticLayout

# the gated full-attention layers (q/k norms, [query | gate] q_proj) and the GDN layers; MoE variants' sparse
# blocks: routed experts plus a gated shared expert
HYBRID_LAYOUT = StaticLayout(
    attention=StaticAttention(q_norm="q_norm", k_norm="k_norm", output_gate=True),
    # the router always renormalises its top k (it has no norm_topk_prob); experts are [gate | up] with SiLU
    moe=SparseMoE(
        shared_expert="shared_expert",
        shared_expert_gate="shared_expert_gate",
        routing="softmax_topk",
        expert_gate="silu",
    ),
    norms="fp32_one_plus_weight",
    rotary_axes=3,  # mRoPE position ids (time, height, width), as the text model builds them
    linear=StaticGDN(),
    layer_types=("linear_attention", "full_attention"),
    cuda_verified=True,
)


@register("qwen3_5_text")
class Qwen3_5TextAdapter(HybridGDNAdapter):
    gdn_capture = ("in_proj_qkv", "in_proj_a", "in_proj_b")
    static_layout = HYBRID_LAYOUT

    def gdn_split(self, gdn: Any, outs: tuple[Any, ...]) -> tuple[Any, Any, Any, Any]:
        """The `in_proj` outputs (qkv, z, b, a; [1, T, width] each) -> (conv input [1, T, C], z [1, T, Hv, Dv],
        b [1, T, Hv], a [1, T, Hv])."""
        qkv, z, b, a = outs
        return qkv, z.reshape(*z.shape[:2], -1, gdn.head_v_dim), b, a

    def gdn_inputs(self, gdn: Any, seen: dict[str, Any]) -> tuple[Any, Any, Any]:
        return seen["in_proj_qkv"], seen["in_proj_a"], seen["in_proj_b"]  # [B, T, C], [B, T, Hv], [B, T, Hv]
