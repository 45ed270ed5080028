"""Shared machinery for hybrid Gated-DeltaNet targets (Qwen3.5/3.6, Qwen3-Coder-Next); see docs/hybrid-rollback.md.

`Cache.crop` trims a linear layer's recorded conv window but cannot rewind its recurrent (delta-rule) state
(docs/compat.md §3). Two exact rollbacks, chosen per adapter instance:
- "replay": restore the pre-verify linear states, crop the whole block, run the committed inputs again;
- "recompute" (default): forward hooks on each GDN module's input projections keep the verify's conv input and
  decay/beta logits; `crop` fixes attention KV and conv windows, and the recurrent state is recomputed from the
  snapshot for the accepted prefix only (`gated_delta_final_state`, all GDN layers stacked in one solve). No second target forward.
Mirrors `Qwen3_5GatedDeltaNet` / `torch_chunk_gated_delta_rule` in transformers `models/qwen3_5/modeling_qwen3_5.py`.
Torch is imported inside functions only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from dflash_zoo.adapters.base import Problem, TargetAdapter

if TYPE_CHECKING:
    import torch

LINEAR, FULL = "linear_attention", "full_attention"
ROLLBACK_MODES = ("recompute", "replay")


def gated_delta_final_state(state, k, v, g, beta) -> torch.Tensor:
    """State after n gated delta-rule steps from `state`, in closed (WY / UT-transform) form.

    Per step t: S = exp(g_t) S; S += k_t (beta_t (v_t - S^T k_t))^T. Shapes: state [B, H, Dk, Dv]; k [B, H, n, Dk]
    (l2-normed); v [B, H, n, Dv]; g, beta [B, H, n]. All fp32. One triangular solve instead of n sequential steps.
    """
    import torch

    n = k.shape[-2]
    c = g.cumsum(-1)  # [B, H, n] log of the decay accumulated from the block start to step t
    strictly_lower = torch.ones(n, n, dtype=torch.bool, device=k.device).tril(-1)
    pair = (
        (c[..., :, None] - c[..., None, :]).masked_fill(~strictly_lower, float("-inf")).exp()
    )  # [B, H, n, n]
    system = beta[..., None] * (k @ k.transpose(-1, -2)) * pair  # [B, H, n, n], strictly lower
    system = system + torch.eye(n, dtype=k.dtype, device=k.device)
    rhs = beta[..., None] * (v - c.exp()[..., None] * (k @ state))  # [B, H, n, Dv]
    delta = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [B, H, n, Dv]
    tail = (c[..., -1:] - c).exp()[..., None]  # [B, H, n, 1] decay from step t to the block end
    return c[..., -1:].exp()[..., None] * state + (k * tail).transpose(-1, -2) @ delta  # [B, H, Dk, Dv]


@dataclass
class GDNSnapshot:
    """Linear-layer states before a verify, plus what the capture hooks saw during it."""

    conv: dict[int, Any]  # layer -> conv window [B, C, K]
    recurrent: dict[int, Any]  # layer -> state [B, Hv, Dk, Dv]
    seen: dict[tuple[int, str], Any] = field(default_factory=dict)  # (layer, projection) -> output [B, T, *]
    handles: list[Any] = field(default_factory=list)

    def release(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class HybridGDNAdapter(TargetAdapter):
    """A decoder whose `layer_types` mix `linear_attention` (Gated-DeltaNet) and `full_attention` layers."""

    cache_strategy = "gdn-recompute"
    gdn_attr: ClassVar[str] = "linear_attn"  # the GDN module inside a decoder layer
    gdn_capture: ClassVar[tuple[str, ...]] = ()  # GDN submodules whose outputs the recompute rollback needs

    def __init__(self, model: Any, rollback: str = "recompute", layers_path: str | None = None):
        super().__init__(model)
        if rollback not in ROLLBACK_MODES:
            raise ValueError(f"rollback must be one of {ROLLBACK_MODES}, not {rollback!r}")
        self.mode = rollback
        self.cache_strategy = f"gdn-{rollback}"
        if layers_path is not None:
            self.layers_path = layers_path
        self.linear_ids = self._check_layers()

    @classmethod
    def validate(cls, target_config: dict[str, Any], draft: Any) -> list[Problem]:
        problems = super().validate(target_config, draft)
        text = cls.text_config_dict(target_config)
        unknown = sorted(set(text.get("layer_types") or []) - {LINEAR, FULL})
        hk, hv = text.get("linear_num_key_heads") or 1, text.get("linear_num_value_heads") or 1
        if "layer_types" not in text and "full_attention_interval" not in text:
            problems.append(Problem("WARN", "layer_types", "no layer_types: 3 GDN : 1 full is assumed"))
        if unknown:
            problems.append(Problem("FAIL", "layer_types", f"layer types {unknown} have no exact rollback"))
        if hv % hk:
            problems.append(Problem("FAIL", "linear_heads", f"{hv} GDN value heads, {hk} key heads"))
        return problems

    def gdn_inputs(self, gdn: Any, seen: dict[str, Any]) -> tuple[Any, Any, Any]:
        """Family hook: captured outputs -> (conv input [B, T, C], a [B, T, Hv], b [B, T, Hv])."""
        raise NotImplementedError

    def _check_layers(self) -> list[int]:
        from dflash_zoo.errors import UnsupportedModelError

        types = list(self.text_config.layer_types)
        unknown = sorted(set(types) - {LINEAR, FULL})
        layers = self.layers()
        missing = [
            i
            for i, t in enumerate(types)
            if t == LINEAR
            and not all(hasattr(getattr(layers[i], self.gdn_attr, None), m) for m in self.gdn_capture)
        ]
        if unknown or missing:
            raise UnsupportedModelError(
                f"{type(self).__name__} cannot roll back layer types {unknown} / GDN layers {missing} of this target",
                hint="no exact rollback for this stateful model; use a transformers version this adapter supports",
            )
        return [i for i, t in enumerate(types) if t == LINEAR]

    # ---- cache protocol --------------------------------------------------------------------------
    def snapshot(self, cache: Any) -> GDNSnapshot:
        snap = GDNSnapshot(
            conv={i: cache.layers[i].conv_states[0].clone() for i in self.linear_ids},
            recurrent={i: cache.layers[i].recurrent_states[0].clone() for i in self.linear_ids},
        )
        if self.mode == "recompute":
            layers = self.layers()
            for i in self.linear_ids:
                gdn = getattr(layers[i], self.gdn_attr)
                for name in self.gdn_capture:
                    snap.handles.append(getattr(gdn, name).register_forward_hook(self._keep(snap, i, name)))
        return snap

    @staticmethod
    def _keep(snap: GDNSnapshot, layer: int, name: str):
        def hook(_module, _args, output):
            snap.seen[(layer, name)] = output

        return hook

    def rollback(self, cache: Any, num_rejected: int, snapshot: Any, committed_ids: Any) -> None:
        snapshot.release()
        if num_rejected == 0:  # the verify's own states are right; crop(0) trims the recorded conv history
            cache.crop(0)
        elif self.mode == "replay":
            self._replay(cache, snapshot, committed_ids, num_rejected)
        else:
            self._recompute(cache, snapshot, committed_ids.shape[1], num_rejected)
        snapshot.seen.clear()

    def _crop_attention(self, cache: Any, tokens: int) -> None:
        """Drop the last `tokens` rows of the attention layers (the GDN layers are set by the caller)."""
        linear = set(self.linear_ids)
        for i, layer in enumerate(cache.layers):
            if i not in linear:
                layer.crop(-tokens)

    def _replay(self, cache: Any, snap: GDNSnapshot, committed: Any, num_rejected: int) -> None:
        from dflash_zoo import compat

        dropped = committed.shape[1] + num_rejected  # the whole verify block, re-run below
        self._crop_attention(cache, dropped)
        for i in self.linear_ids:
            compat.set_linear_state(cache.layers[i], snap.conv[i].clone(), snap.recurrent[i], dropped)
        self.forward(committed, cache, logits_to_keep=1)  # re-appends attention KV and conv inputs, exact
        cache.crop(0)

    def _recompute(self, cache: Any, snap: GDNSnapshot, n: int, num_rejected: int) -> None:
        import torch

        from dflash_zoo import compat

        self._crop_attention(cache, num_rejected)
        layers = self.layers()
        gdns = [getattr(layers[i], self.gdn_attr) for i in self.linear_ids]
        seen = [
            self.gdn_inputs(gdn, {name: snap.seen[(i, name)] for name in self.gdn_capture})
            for i, gdn in zip(self.linear_ids, gdns, strict=True)
        ]
        mixed, a, b = (torch.stack([x[j][:, :n] for x in seen]) for j in range(3))  # [L, B, n, *] each
        windows = torch.stack([snap.conv[i] for i in self.linear_ids])  # [L, B, C, K]
        states = torch.stack([snap.recurrent[i] for i in self.linear_ids])  # [L, B, Hv, Dk, Dv]
        new = _accepted_states(gdns, windows, states, mixed, a, b)  # all GDN layers at once: one solve
        # the conv window after the accepted rows: the last K columns of the old window and their inputs
        kept = torch.cat([windows, mixed.transpose(-1, -2).to(windows.dtype)], -1)[..., -windows.shape[-1] :]
        for j, i in enumerate(self.linear_ids):
            compat.set_linear_state(cache.layers[i], kept[j], new[j], num_rejected)


def _accepted_states(gdns: list[Any], window, state, mixed, a, b) -> torch.Tensor:
    """Recurrent states of L GDN layers after the n accepted tokens: causal conv, then the delta rule.

    Mirrors `Qwen3_5GatedDeltaNet` per layer; the layers (same shapes) are stacked on a leading dim so the
    rollback costs a fixed number of kernels, not one set per layer. window [L, B, C, K]; state
    [L, B, Hv, Dk, Dv]; mixed [L, B, n, C]; a, b [L, B, n, Hv]. Returns [L, B, Hv, Dk, Dv] (fp32).
    """
    import torch
    import torch.nn.functional as F

    gdn, (layers, batch, n, channels) = gdns[0], mixed.shape
    k_size = gdn.conv_kernel_size
    w = torch.cat([g.conv1d.weight for g in gdns])  # [L*C, 1, K] depthwise, layer-major
    bias = torch.cat([g.conv1d.bias for g in gdns]) if gdn.conv1d.bias is not None else None
    x = torch.cat([window[..., -(k_size - 1) :], mixed.transpose(-1, -2)], dim=-1).to(
        w.dtype
    )  # [L, B, C, K-1+n]
    x = x.transpose(0, 1).reshape(batch, layers * channels, -1)  # [B, L*C, K-1+n]: one grouped conv
    conv = getattr(F, gdn.activation)(F.conv1d(x, w, bias, groups=layers * channels))  # [B, L*C, n]
    conv = conv.view(batch, layers, channels, n).permute(1, 0, 3, 2).float()  # [L, B, n, C]
    _, k, v = conv.split([gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
    k = k.reshape(layers, batch, n, gdn.num_k_heads, gdn.head_k_dim)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)  # l2norm as in the FLA kernel
    k = k.repeat_interleave(gdn.num_v_heads // gdn.num_k_heads, dim=3).transpose(2, 3)  # [L, B, Hv, n, Dk]
    v = v.reshape(layers, batch, n, gdn.num_v_heads, gdn.head_v_dim).transpose(2, 3)  # [L, B, Hv, n, Dv]
    a_log = torch.stack([g.A_log for g in gdns]).float()[:, None, None, :]  # [L, 1, 1, Hv]
    dt_bias = torch.stack([g.dt_bias for g in gdns]).float()[:, None, None, :]
    beta = b.float().sigmoid().transpose(-1, -2)  # [L, B, Hv, n]
    g = (-a_log.exp() * F.softplus(a.float() + dt_bias)).transpose(-1, -2)  # [L, B, Hv, n]
    return gated_delta_final_state(state.float(), k, v, g, beta)
