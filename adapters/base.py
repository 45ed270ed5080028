"""The adapter contract between the generic engine and one target family.

An adapter owns everything family-specific about a loaded Hugging Face target:

- where the decoder layers live (`layers_path`) and where the text config is (`text_config`);
- `embed(ids)`: exactly what decoder layer 0 receives (scaled embeddings included);
- `logits(h)`: the target's LM head on post-norm states, soft-capping included;
- `tap(layer_ids)`: removable forward hooks on only the tapped decoder layers (never
  `output_hidden_states=True`, which materialises every layer at prefill);
- the cache: `new_cache`, `start_decoding` (after prefill), `snapshot` (before verify) and `rollback`
  (after a partial accept), with `cache_strategy` naming the approach for `check`;
- `validate(target_config, draft_config)`: problems found from configs alone, for `check`;
- `static_layout`: the module names the static fast path runs the decoder from (`StaticLayout`), or None.

This module must not import torch at import time (`check` and `list` run without it).

Longer than the ~300 lines we aim for: the contract's defaults and the `StaticLayout` declaration dataclasses
live together, so a family module reads one file to see what it may override.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from dflash_zoo.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from dflash_zoo.engine.config import DraftConfig


# An unknown mask id: what each serving engine then does, and the fix (docs/serving.md).
MASK_UNKNOWN = (
    "mask id unknown: vLLM needs dflash_config.mask_token_id in the draft config; SGLang falls back to the "
    "tokenizer's <|MASK|> token; fix: add dflash_config.mask_token_id (an id below the target's embedding "
    "rows) to the drafter's config.json, or pass --draft-config FILE"
)
LAST_LAYER_TAP = (
    "tap {last} is the target's last layer: dflash-zoo feeds its raw output, z-lab's reference and transformers' "
    "DFlash its output after the final norm, so proposals differ from theirs (the output is the target's)"
)


@dataclass(frozen=True)
class Problem:
    """One finding of `validate`: severity is "FAIL" (incompatible) or "WARN" (works, but worse)."""

    severity: str
    code: str
    message: str


# ---- the static fast path's view of a decoder (cuda/static/) ---------------------------------------------
# Module names are attribute paths: per-layer names from a decoder layer (or from its attention / MLP module),
# model-wide ones from the loaded model, like `layers_path`. Config keys are read from the text config.
# New families extend these by adding fields whose defaults keep the families declared so far unchanged.
@dataclass(frozen=True)
class StaticAttention:
    """Self-attention: q/k/v/o projections (nn.Linear), optional per-head RMSNorms on q and k before rotary."""

    path: str = "self_attn"  # from the decoder layer
    q_proj: str = "q_proj"  # the rest from the attention module
    k_proj: str = "k_proj"
    v_proj: str = "v_proj"
    o_proj: str = "o_proj"
    q_norm: str | None = None  # Qwen3 names "q_norm" / "k_norm"; None: no q/k norm (Llama)
    k_norm: str | None = None
    qk_norm_per_head: bool = (
        True  # False: one norm over all heads at once, before the head split (MiniMax-M2)
    )
    head_dim: str = "head_dim"  # attributes of the attention module (ints / floats, read once)
    scaling: str = "scaling"  # the softmax scale
    sinks: str | None = None  # gpt-oss "sinks": a learned per-head logit joined to every softmax; None: none
    v_norm: str | None = None  # Gemma 4: an RMSNorm (without weight) on the values; None: none
    # Gemma 4 global layers: no v_proj (the module's is None), the values are the key projection before its norm
    k_eq_v: bool = False
    # Gemma 4 E2B/E4B: layers that reuse the K/V of the last earlier layer of their type storing them; module
    # attributes (bools) naming which layers reuse and which store; None: every layer has its own K/V
    kv_shared: str | None = None
    kv_store: str | None = None
    # Qwen3.5 / Qwen3-Next: q_proj emits [query | gate] per head and the output is attn * sigmoid(gate)
    output_gate: bool = False

    def __post_init__(self) -> None:
        if (self.q_norm is None) != (self.k_norm is None):  # the fused kernel normalises both or neither
            raise ValueError("StaticAttention: declare q_norm and k_norm together, or neither")


@dataclass(frozen=True)
class GatedMLP:
    """A dense gated MLP, `down(act(gate(x)) * up(x))`, its three projections nn.Linear."""

    gate_proj: str = "gate_proj"  # from the layer's MLP module
    up_proj: str = "up_proj"
    down_proj: str = "down_proj"
    act_fn: str = "act_fn"  # the module's activation, called as is off the fused kernels
    activation: str = "hidden_act"  # config key naming it: "silu" / "swish" allow the fused SiLU kernels


# the experts' gated activations the down kernel computes (`SparseMoE.expert_gate`), and the config activations
# each stands for (None: any)
EXPERT_GATES = {
    None: None,
    "silu": ("silu", "swish"),
    "clamped_swiglu": None,
    "gelu_tanh": ("gelu_pytorch_tanh",),
}


@dataclass(frozen=True)
class SparseMoE:
    """A sparse MoE block, run by the static engine as its parts: `router(x [N, H], *router_args)` -> (logits,
    top-k weights, top-k indices) or the declared routing rule's kernel, the routed experts through the expert
    kernels of cuda/ops/moe.py for steps of a few rows (the experts module for longer ones), plus
    `sigmoid(shared_expert_gate(x)) * shared_expert(x)`."""

    experts: str = "experts"  # the child that marks a layer's MLP module as this block
    router: str = "gate"
    router_args: tuple[str, ...] = ()  # block attributes passed to the router after x (MiniMax: a score bias)
    shared_expert: str | None = None  # an always-on expert beside the routed ones (Qwen3.5-MoE, Qwen3-Next)
    shared_expert_gate: str | None = None  # its sigmoid gate
    # the router's rule, for one kernel over its logits (`router.weight`, `router.bias` if any) instead of the
    # module: "softmax_topk" (softmax over every expert in fp32, the top k, renormalised where `renormalize`
    # says), "topk_softmax" (the top k logits, softmaxed in their dtype); None: the router module runs
    routing: str | None = None
    renormalize: str | bool = (
        True  # softmax_topk: renormalise the top-k weights; a str names the router's flag
    )
    # the experts' gated activation, for the down projection's kernel to compute from the gate/up output: "silu"
    # (silu(gate) * up over [gate | up] halves, where the config's activation is SiLU), "clamped_swiglu"
    # (interleaved gate/up, both clamped at the module's `limit`, (up + 1) * gate * sigmoid(alpha * gate)),
    # "gelu_tanh" (GELU's tanh form of gate times up over [gate | up] halves, where the config's activation is
    # `gelu_pytorch_tanh`); None: the module's own `_apply_gate`
    expert_gate: str | None = None
    # config attribute naming transformers' experts implementation (`integrations/moe.py`): the static engine
    # reads it to tell whether a step would sync with the host, so whether it can be a CUDA graph
    implementation: str = "_experts_implementation"

    def __post_init__(self):
        if self.routing not in (None, "softmax_topk", "topk_softmax"):
            raise ValueError(f"SparseMoE: unknown routing {self.routing!r}")
        if self.expert_gate not in EXPERT_GATES:
            raise ValueError(f"SparseMoE: unknown expert_gate {self.expert_gate!r}")


@dataclass(frozen=True)
class SandwichNorms:
    """Gemma: each sublayer's output is normed too, before its residual add (`post_attention_norm` of the
    layout then names the MLP's input norm)."""

    attention_out: str = "post_attention_layernorm"
    mlp_out: str = "post_feedforward_layernorm"


@dataclass(frozen=True)
class ScaledRouter:
    """Gemma 4's router as its parts, for the norm and routing kernels instead of the module: logits =
    proj(norm(x) * scale * scale_root) with a weightless RMSNorm (each product rounded to the dtype); a softmax
    over every expert in fp32, the top k renormalised, times the chosen experts' `expert_scale`, kept in fp32."""

    norm: str = "norm"  # router attributes
    proj: str = "proj"
    scale: str = "scale"
    scale_root: str = "scalar_root_size"
    expert_scale: str = "per_expert_scale"
    top_k: str = "top_k_experts"  # text-config attribute


@dataclass(frozen=True)
class ParallelMoE:
    """Gemma 4 26B-A4B: routed experts beside the dense MLP, children of the decoder layer, on the MLP's input
    residual: mlp_out = norm1(mlp(x)) + norm2(experts(norm_in(x), router(x)))."""

    enabled: str = "enable_moe_block"  # decoder-layer attribute (bool)
    router: str = "router"  # called (x [N, H]) -> (logits, top-k weights, top-k indices)
    experts: str = "experts"  # called (x [N, H], indices, weights) -> [N, H]
    dense_out_norm: str = "post_feedforward_layernorm_1"
    experts_in_norm: str = "pre_feedforward_layernorm_2"
    experts_out_norm: str = "post_feedforward_layernorm_2"
    routing: ScaledRouter | None = None  # the router's parts for the kernels; None: the router module runs
    expert_gate: str | None = None  # the experts' gated activation, as `SparseMoE.expert_gate`
    activation: str = "hidden_activation"  # text-config attribute naming the experts' activation

    def __post_init__(self):
        if self.expert_gate not in EXPERT_GATES:
            raise ValueError(f"ParallelMoE: unknown expert_gate {self.expert_gate!r}")


@dataclass(frozen=True)
class PerLayerInput:
    """Gemma 4 E2B/E4B: each layer adds norm(projection(act(gate(x)) * e_i)), e_i its slice of per-layer token
    embeddings, which the adapter computes (`per_layer_inputs(ids, emb)` -> [1, T, layers, width])."""

    width: str = "hidden_size_per_layer_input"  # config key; 0 / None: the target has none
    gate: str = "per_layer_input_gate"  # decoder-layer modules
    projection: str = "per_layer_projection"
    norm: str = "post_per_layer_input_norm"
    act: str = "act_fn"


@dataclass(frozen=True)
class StaticGDN:
    """A Gated-DeltaNet (linear attention) layer: causal depthwise conv, the gated delta rule over a recurrent
    state, a gated RMSNorm and an output projection. The input projections differ by family: the layout names
    them (`in_proj`, run as one GEMM by the static engine) and the adapter splits their outputs (`gdn_split`);
    the sizes are the module's own attributes (`num_k_heads`, `head_k_dim`, ...)."""

    path: str = "linear_attn"  # from the decoder layer; the rest from the GDN module
    # the input projections (nn.Linear), in the order `gdn_split` takes their outputs
    in_proj: tuple[str, ...] = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    conv1d: str = "conv1d"  # nn.Conv1d, depthwise, kernel K, over [q | k | v] channels
    norm: str = "norm"  # gated RMSNorm, called (core [N, Dv], z [N, Dv])
    out_proj: str = "out_proj"
    a_log: str = "A_log"  # per value head: decay g = -exp(A_log) * softplus(a + dt_bias)
    dt_bias: str = "dt_bias"


@dataclass(frozen=True)
class StaticLayout:
    """Everything the static engine takes from a target's modules and config; the defaults are Llama's.

    The final norm is the adapter's (`final_norm_path`, shared with multi-device placement); embeddings and
    the head go through `embed` / `logits`; kv / attention heads and hidden size are the standard config keys.
    """

    attention: StaticAttention = StaticAttention()
    mlp_path: str = "mlp"  # from the decoder layer
    mlp: GatedMLP | None = GatedMLP()  # how dense layers run; None: the family has no dense MLP layers
    moe: SparseMoE | None = None  # how sparse layers run; None: every layer must be a gated dense MLP
    input_norm: str = "input_layernorm"  # RMSNorms of the decoder layer (HF's formula: weight * normed x)
    post_attention_norm: str = "post_attention_layernorm"
    norm_eps: str = "rms_norm_eps"  # config key of every RMSNorm's epsilon
    rotary_emb: str = "model.rotary_emb"  # from the model: called (x, position_ids) -> (cos, sin)
    # gpt-oss: cos / sin span half a head and rotate its two halves (the same as Llama's rotate-half with
    # duplicated tables, which is how the engine applies them)
    rotary_halves: bool = False
    # Qwen3.5's rotary embedding takes multimodal (mRoPE) position ids [axes, 1, T] (a text prompt: the same
    # position on every axis); 0: plain [1, T] position ids
    rotary_axes: int = 0
    # the decoder's RMSNorm formula: "llama", `weight * normed(x).to(dtype)` (`F.rms_norm` and every fused kernel
    # reproduce it); "fp32_weight", `(normed(x) * weight).to(dtype)` in fp32 (gpt-oss, Gemma 4);
    # "fp32_one_plus_weight", `(normed(x) * (1 + weight)).to(dtype)` in fp32 (Qwen3.5, Qwen3-Next). The last two
    # run through the norm kernel only (their modules elsewhere; the fused q/k rotary kernel is Llama's)
    norms: str = "llama"
    sliding_window: str = "sliding_window"  # config key of the window of `sliding_attention` layers
    # Gemma 4: one rotary embedding with tables per layer type, called (x, position_ids, layer_type)
    rotary_by_layer_type: bool = False
    sandwich: SandwichNorms | None = None  # Gemma: norms on the sublayer outputs too
    parallel_moe: ParallelMoE | None = None
    per_layer_input: PerLayerInput | None = None
    layer_scalar: str | None = None  # Gemma 4: a decoder-layer buffer the layer's output is multiplied by
    linear: StaticGDN | None = None  # how `linear_attention` layers run; None: the family has none
    layer_types: tuple[str, ...] = ("full_attention",)  # config `layer_types` values the engine can run
    # the layout has passed the GPU tests (CUDA graphs equal the eager engine, fp32); until then CUDA users
    # get the static engine only by asking for it (`fast=True`), CPU tests cover it either way
    cuda_verified: bool = False

    def __post_init__(self) -> None:
        if self.mlp is None and self.moe is None:
            raise ValueError("StaticLayout: declare mlp, moe or both")
        if ("linear_attention" in self.layer_types) != (self.linear is not None):
            raise ValueError("StaticLayout: `linear_attention` layers and a `linear` declaration go together")


class TapRecorder:
    """Collects the outputs of tapped decoder layers for each forward while active.

    `take()` returns the features of the last forward as [batch, seq, num_taps * hidden], in tap order.
    """

    def __init__(self, layer_ids: Sequence[int]):
        self.layer_ids = tuple(layer_ids)
        self._buf: dict[int, Any] = {}
        self.paused = False

    def hook_for(self, layer_id: int):
        def hook(_module, _args, output):
            if not self.paused:
                # decoder layers return a tensor in 5.x, a tuple in some families: the state is first
                self._buf[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def take(self) -> torch.Tensor:
        import torch

        missing = [i for i in self.layer_ids if i not in self._buf]
        if missing:
            raise RuntimeError(f"tapped layers {missing} produced no output in the last forward")
        dev = self._buf[self.layer_ids[-1]].device  # target split across devices: gather on one
        feats = torch.cat([self._buf[i].to(dev) for i in self.layer_ids], dim=-1)  # [B, T, K*H]
        self._buf.clear()
        return feats

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Ignore forwards run inside (e.g. a rollback replay whose features are already known)."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


class TargetAdapter:
    """Default behaviour for decoder-only targets with a plain `DynamicCache`; families override."""

    model_types: ClassVar[tuple[str, ...]] = ()
    layers_path: ClassVar[str] = "model.layers"
    cache_strategy: ClassVar[str] = "crop"  # negative crop of a plain KV cache is exact
    chat_template_kwargs: ClassVar[dict[str, Any]] = {}
    auto_class: ClassVar[str] = "AutoModelForCausalLM"  # transformers auto class that loads the target
    norm_path: ClassVar[str | None] = None  # the final norm; None: `norm` next to the layers (`model.norm`)
    # what the static fast path (cuda/static/) runs the decoder from; None: no fast path (the eager loop)
    static_layout: ClassVar[StaticLayout | None] = None
    extra_stop_token_ids: ClassVar[tuple[int, ...]] = ()  # family stop ids beyond the generation config's eos
    accepts_images: ClassVar[bool] = False  # VLM wrappers: `generate --image` feeds pixels at prefill only
    # the attention implementation the target is built with (None: transformers' default)
    attn_implementation: ClassVar[str | None] = None
    # what every published config.json of the family has beyond the registry's target fingerprint, for the
    # config `check` builds from it (zoo/check_sources.py): the decoder's own `model_type` under a VLM wrapper's
    # `text_config`, `gdn_every` (every n-th layer full attention, the others Gated-DeltaNet), a logit soft-cap
    registry_shape: ClassVar[dict[str, Any]] = {}

    def __init__(self, model: Any):
        self.model = model

    # ---- configs (torch-free) -------------------------------------------------------------------
    @classmethod
    def text_config_dict(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The decoder's config inside a (possibly composite VLM) config dict."""
        nested = config.get("text_config")
        if nested is not None and not isinstance(nested, dict):
            raise ConfigError(f"target config: text_config must be a JSON object, got {nested!r}")
        return nested or config

    @classmethod
    def validate(cls, target_config: dict[str, Any], draft: DraftConfig) -> list[Problem]:
        """Config-only compatibility problems between a target config dict and a normalised draft config."""
        text = cls.text_config_dict(target_config)
        problems: list[Problem] = []
        hidden, layers = text.get("hidden_size"), text.get("num_hidden_layers")
        vocab = text.get("vocab_size") or target_config.get("vocab_size")
        if hidden is not None and hidden != draft.hidden_size:
            problems.append(
                Problem("FAIL", "hidden_size", f"drafter hidden size {draft.hidden_size} != target {hidden}")
            )
        if layers is not None and max(draft.target_layer_ids) >= layers:
            problems.append(
                Problem("FAIL", "taps", f"tap id {max(draft.target_layer_ids)} >= target layers ({layers})")
            )
        elif (
            layers is not None
            and layers - 1 in draft.target_layer_ids
            and draft.arch in ("dflash", "dflash2")
        ):
            # z-lab's reference (and transformers' DFlash) read hidden_states[L]: after the final norm
            problems.append(Problem("WARN", "taps", LAST_LAYER_TAP.format(last=layers - 1)))
        if layers is not None and draft.num_target_layers not in (None, layers):
            problems.append(
                Problem(
                    "WARN",
                    "num_target_layers",
                    f"drafter expects {draft.num_target_layers} target layers, target has {layers}",
                )
            )
        if draft.mask_token_id is None:
            problems.append(
                Problem(
                    "WARN",
                    "mask_token_id",
                    MASK_UNKNOWN,
                )
            )
        elif vocab is not None and not 0 <= draft.mask_token_id < vocab:
            problems.append(
                Problem(
                    "FAIL",
                    "mask_token_id",
                    f"mask id {draft.mask_token_id} outside the embedding table ({vocab} rows)",
                )
            )
        if vocab is not None and draft.arch == "dflash2" and draft.vocab_size < vocab:
            # the selector's codebooks have a row per drafter token and are indexed by target token ids
            problems.append(
                Problem("FAIL", "vocab_size", f"DFlash 2 drafter vocab {draft.vocab_size} < target {vocab}: "
                        "its candidate selector has no row for the target's later token ids")
            )  # fmt: skip
        elif vocab is not None and draft.vocab_size != vocab:
            problems.append(
                Problem("WARN", "vocab_size", f"drafter vocab {draft.vocab_size} != target {vocab}")
            )
        return problems

    @classmethod
    def load_model(cls, directory: str, dtype: Any, device: Any) -> Any:
        """Load the target from a local directory with transformers' own classes (never remote code)."""
        return cls.from_pretrained(directory, dtype, device)

    @classmethod
    def from_pretrained(cls, directory: str, dtype: Any, device: Any, **kwargs: Any) -> Any:
        """`auto_class.from_pretrained` on `device`, in eval mode: a pre-quantized checkpoint is placed by its
        quantizer at load, in a dtype its kernels take (dflash_zoo/quantization.py `load_kwargs`), any other is
        loaded, then moved."""
        import transformers

        from dflash_zoo import quantization

        place = quantization.load_kwargs(directory, dtype, device)
        auto = getattr(transformers, cls.auto_class)
        model = auto.from_pretrained(directory, **{"dtype": dtype, **kwargs, **place})
        return (model if place else model.to(device)).eval()

    # ---- structure -------------------------------------------------------------------------------
    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def text_config(self) -> Any:
        return self.model.config.get_text_config()

    @property
    def num_layers(self) -> int:
        return len(self.layers())

    def layers(self) -> Any:
        return operator.attrgetter(self.layers_path)(self.model)

    @classmethod
    def final_norm_path(cls) -> str:
        """Where the final norm lives in the model (`norm_path`, else `norm` next to the layers)."""
        parent = cls.layers_path.rpartition(".")[0]
        return cls.norm_path or (f"{parent}.norm" if parent else "norm")

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, T] -> [B, T, H]: exactly what decoder layer 0 receives."""
        return self.model.get_input_embeddings()(ids)

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, T] -> [B, T, H]: the embedding table's rows alone, without any scale or norm the family applies
        (what a drafter with its own `input_embedding_scale` starts from)."""
        import torch.nn.functional as F

        return F.embedding(ids, self.model.get_input_embeddings().weight)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """[B, T, H] post-norm states -> [B, T, V]: the bare LM head, before any soft-cap (drafter logits)."""
        return self.model.get_output_embeddings()(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[B, T, H] post-norm states -> [B, T, V] logits, as the target computes them."""
        return self.head(h)

    @contextmanager
    def tap(self, layer_ids: Sequence[int]) -> Iterator[TapRecorder]:
        """Forward hooks on just the tapped layers; their output is HF `hidden_states[id + 1]`."""
        layers = self.layers()
        bad = [i for i in layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise IndexError(f"tap ids {bad} outside the target's {len(layers)} decoder layers")
        rec = TapRecorder(layer_ids)
        handles = [layers[i].register_forward_hook(rec.hook_for(i)) for i in sorted(set(layer_ids))]
        try:
            yield rec
        finally:
            for h in handles:
                h.remove()

    # ---- forward and cache -------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, cache: Any, logits_to_keep: int = 0, **extra: Any) -> torch.Tensor:
        """One target forward over `ids` [1, T] appended to `cache`; returns logits [1, T', V].

        `extra` carries prefill-only inputs such as `pixel_values` for VLM targets.
        """
        from dflash_zoo import compat

        return compat.forward(self.model, ids, cache, logits_to_keep=logits_to_keep, **extra)

    def new_cache(self) -> Any:
        from dflash_zoo import compat

        return compat.new_cache(self.model.config)

    def start_decoding(self, cache: Any) -> None:
        """Called once after prefill; turns on past recording so sliding/linear layers can be cropped.

        Refuses a cache that cropping cannot restore (recurrent state) unless the adapter owns rollback.
        """
        from dflash_zoo import compat

        if type(self).rollback is TargetAdapter.rollback:
            require_croppable(cache, type(self).__name__)
        compat.record_past(cache)

    def snapshot(self, cache: Any) -> Any:
        """State to keep before a verify forward, handed back to `rollback` (None for plain caches)."""
        return None

    def rollback(self, cache: Any, num_rejected: int, snapshot: Any, committed_ids: torch.Tensor) -> None:
        """Drop the last `num_rejected` verified positions. `committed_ids` [1, n] are the kept block inputs.

        Negative crop is exact for full-attention and (recording) sliding layers; `crop(0)` also trims
        recorded sliding-window history back to the window, so it runs every step.
        """
        cache.crop(-num_rejected)

    # ---- the static engine's extra hooks ----------------------------------------------------------
    def gdn_split(self, gdn: Any, outs: tuple[Any, ...]) -> tuple[Any, Any, Any, Any]:
        """A Gated-DeltaNet layer's input projection outputs (`StaticGDN.in_proj`) -> (conv input, z, b, a);
        required of an adapter whose `static_layout` declares linear-attention layers."""
        raise NotImplementedError(f"{type(self).__name__} declares no linear-attention layers")


def require_croppable(cache: Any, adapter_name: str) -> None:
    """Refuse a crop-based rollback on a cache holding recurrent state. Crop cannot rewind it: before
    transformers 5.25 it leaves the state after the whole verify, and 5.25 has a state to go back to only if the
    verify ran token by token to keep them (`docs/compat.md` section 3)."""
    stateful = sorted(
        {
            type(layer).__name__
            for layer in getattr(cache, "layers", [])
            if any(s is not None for s in (getattr(layer, "recurrent_states", None) or {}).values())
        }
    )
    if stateful:
        from dflash_zoo.errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"adapter {adapter_name} rolls back by cropping, but this cache ({', '.join(stateful)}) cannot be "
            "cropped exactly (recurrent state); refusing rather than producing silently wrong tokens",
            hint="this target needs an adapter with its own rollback (see docs/hybrid-rollback.md)",
        )
