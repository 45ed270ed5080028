"""Gemma 4 text decoders (`gemma4_text`: Gemma4ForCausalLM; mirrors transformers `models/gemma4/modeling_gemma4.py`).

Quirks:
- scaled embeddings: `Gemma4TextScaledWordEmbedding` multiplies by sqrt(H) inside its `forward`, so `embed`
  goes through `get_input_embeddings()` (indexing `.weight` would drop the scale; vllm#41703);
- final-logit soft-capping: logits become `cap * tanh(logits / cap)` (cap 30). `logits(h)` applies it with
  the same operations as the target, and the engine uses `logits` for draft logits too, as the drafter
  config (`final_logit_softcapping: 30.0`) expects. Greedy argmax is unaffected; sampling is not;
- sliding(1024) : full layers 5:1, full layers with their own head dim / KV heads (K = V on 31B/26B). The
  cache mixes sliding and full layers: past recording after prefill, then negative crop (base class);
- KV-shared tail layers (E2B/E4B, `num_kv_shared_layers > 0`) reuse earlier layers' K/V and write nothing
  to the cache (`DummyLayer` entries in 5.24). transformers also feeds those layers only the last
  `logits_to_keep` positions when `logits_to_keep` is an int > 0, which would cut the prefill taps there;
  a tensor of positions disables that shortcut, so `forward` passes one;
- tied LM head (`lm_head.weight` is the embedding); `get_output_embeddings()` covers tied and untied;
- fast path: sandwich norms (attention and MLP outputs normed before their residual adds), Gemma's RMSNorm
  (weight multiplied in fp32: the modules run), q/k norms and a weightless v norm, softmax scale 1, global
  layers with their own head size and KV heads whose values are the key projection (K = V), rotary tables per
  layer type, KV-shared tail layers reading the K/V buffers of the last layer of their type that stores them,
  per-layer inputs (`per_layer_inputs`), the 26B-A4B experts beside the dense MLP (their router run as its
  declared parts: a weightless norm times scales, softmax, top k, per-expert scales), and the layer scalar.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dflash_zoo.adapters import register
from dflash_zoo.adapters.base import (
    GatedMLP,
    ParallelMoE,
    PerLayerInput,
    Problem,
    SandwichNorms,
    ScaledRouter,
    StaticAttention,
    StaticLayout,
    TargetAdapter,
)

if TYPE_CHECKING:
    import torch

    from dflash_zoo.engine.config import DraftConfig


@register("gemma4_text")
class Gemma4TextAdapter(TargetAdapter):
    cache_strategy = "crop-with-recording"
    static_layout = StaticLayout(
        attention=StaticAttention(
            q_norm="q_norm",
            k_norm="k_norm",
            v_norm="v_norm",
            k_eq_v=True,
            kv_shared="is_kv_shared_layer",
            kv_store="store_full_length_kv",
        ),
        mlp=GatedMLP(activation="hidden_activation"),
        post_attention_norm="pre_feedforward_layernorm",  # the MLP's input norm
        sandwich=SandwichNorms(),
        parallel_moe=ParallelMoE(routing=ScaledRouter(), expert_gate="gelu_tanh"),
        per_layer_input=PerLayerInput(),
        layer_scalar="layer_scalar",
        norms="fp32_weight",
        rotary_by_layer_type=True,
        cuda_verified=True,
        layer_types=("sliding_attention", "full_attention"),
    )

    @classmethod
    def validate(cls, target_config: dict[str, Any], draft: DraftConfig) -> list[Problem]:
        problems = super().validate(target_config, draft)
        cap = cls.text_config_dict(target_config).get("final_logit_softcapping")
        if draft.final_logit_softcapping is not None and draft.final_logit_softcapping != cap:
            problems.append(
                Problem(
                    "WARN", "softcap", f"drafter soft-cap {draft.final_logit_softcapping} != target {cap}"
                )
            )
        return problems

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[B, T, H] -> [B, T, V], soft-capped exactly as the target's forward does."""
        import torch

        logits = self.model.get_output_embeddings()(h)
        cap = self.text_config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def per_layer_inputs(self, ids: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """ids [1, T], their embeddings [1, T, H] -> [1, T, layers, width]: what each layer's per-layer input
        branch receives (E2B/E4B), computed by the text model's own two steps."""
        import operator

        text_model = operator.attrgetter(self.layers_path.rpartition(".")[0])(self.model)
        return text_model.project_per_layer_inputs(emb, text_model.get_per_layer_inputs(ids, emb))

    def forward(self, ids: torch.Tensor, cache: Any, logits_to_keep: int = 0, **extra: Any) -> torch.Tensor:
        if not (logits_to_keep and ids.shape[1] > 1 and getattr(self.text_config, "num_kv_shared_layers", 0)):
            return super().forward(ids, cache, logits_to_keep, **extra)
        import torch

        from dflash_zoo import compat

        seq = ids.shape[1]
        # [k] positions: a tensor (not an int) turns off the KV-shared slicing
        keep = torch.arange(seq - logits_to_keep, seq, device=ids.device)
        kwargs = {compat.cache_kwarg(self.model): cache, "use_cache": True, "logits_to_keep": keep, **extra}
        return self.model(input_ids=ids, **kwargs).logits  # [1, k, V]
