"""Gated-DeltaNet (linear-attention) layers over static state buffers, for the static engine.

A GDN layer carries two states instead of K/V rows: the last K-1 inputs of its causal depthwise conv
([1, C, K-1]) and the delta rule's recurrent state ([1, Hv, Dk, Dv], fp32). Neither can be rewound by a
position counter, so a verify step leaves them untouched and `commit(n)` moves them past the first n verified
rows once the acceptance is known, on device, at fixed shapes:
- conv window: the K-1 inputs ending at row n, gathered from the verify's conv input at tensor positions;
- recurrent state: the delta rule over the n accepted rows from the pre-verify state: `delta_rule` with the
  count read on device, or without the kernels flash-linear-attention's fused recurrent kernel (one launch),
  else in closed form (`gated_delta_final_state`, the same solve as the eager engine's recompute rollback, ~25
  kernels); for those two the rows past n get beta 0 and decay 1, which makes them identity steps, so the
  shape never depends on n.
No replay forward, no host sync: the whole step can be a CUDA graph.

The delta rule itself runs through flash-linear-attention's Triton kernels when that package is installed
and the layer is on CUDA (the chunked kernel for prefill and verify, the fused recurrent kernel for one-row
steps), else through the torch reference functions of the family's own transformers module.

With `kernel` (the engine's `fused_ops`) the work around the projections runs as three Triton kernels
(cuda/ops/gdn.py), where torch took ~20 a layer in a one-row step, each ~2 us in a graphed step for ~2 us of real
work (docs/performance.md): `conv_gates` (conv, SiLU, q | k | v, decay and gate; the window moves on in it),
`delta_rule` (one-row steps, verifies and commits: the rule row by row over a few rows, the state updated in
place or kept, value heads reading their key heads, so no repeated heads and no state copy) and
`window_commit`. Prefills keep the chunked rule.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dflash_zoo.adapters._hybrid import gated_delta_final_state
from dflash_zoo.cuda.ops import fused as fused_ops
from dflash_zoo.cuda.ops.gdn import delta_rule, gdn_conv_gates, window_commit
from dflash_zoo.cuda.static.linear import FusedLinear, Gemv, project
from dflash_zoo.cuda.static.lookup import norm_eps

# (query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel) -> (out, state)
DeltaRule = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def fla_kernels() -> tuple[DeltaRule, DeltaRule] | None:
    """flash-linear-attention's (chunked, fused recurrent) gated delta rule, or None when not installed."""
    try:
        ops = importlib.import_module("fla.ops.gated_delta_rule")
    except Exception:  # not installed, or installed without a working triton
        return None
    return ops.chunk_gated_delta_rule, ops.fused_recurrent_gated_delta_rule


def delta_rule_kernels(
    gdn: nn.Module, device: torch.device, fla: bool = True
) -> tuple[DeltaRule, DeltaRule, str]:
    """(chunked rule, recurrent rule, name): flash-linear-attention on CUDA where installed and `fla`
    (`FastOptions.fla`, `DFLASH_ZOO_FLA`), else the torch reference functions of the module's own transformers
    file."""
    fla = fla_kernels() if fla and device.type == "cuda" else None
    if fla is not None:
        return (*fla, "flash-linear-attention")
    home = sys.modules[type(gdn).__module__]
    return home.torch_chunk_gated_delta_rule, home.torch_recurrent_gated_delta_rule, "torch"


class StaticGDN:
    """One GDN layer: prefill (from a zero state), one-row steps (state moves on), verify + `commit`.

    Args: the layer's GDN module and its resolved parts (conv1d, gated norm, out_proj, input projections), the
    adapter's `gdn_split`; `kernel` (the kernels of cuda/ops/gdn.py and the gated-norm kernel), `fuse` and
    `gemv` as the target's projections; `verify` ("recurrent" or "chunk", `FastOptions.gdn_verify`) and `fla`
    (`FastOptions.fla`).
    """

    def __init__(
        self,
        gdn: nn.Module,
        parts: tuple[nn.Module, nn.Module, nn.Module, tuple[nn.Linear, ...]],
        split: Callable,
        kernel: bool = False,
        fuse: bool = True,
        gemv: Gemv = Gemv(),
        verify: str = "recurrent",
        fla: bool = True,
    ):
        self.gdn, (self.conv1d, self.gated_norm, self.out_proj, projections) = gdn, parts
        # few-row output projections through the GEMV kernels, as attention's (`linear.project`)
        self.project_out = functools.partial(project, self.out_proj, gate=None, gemv=gemv)
        # the input projections as one GEMM (views of its output); the adapter splits them (`gdn_split`)
        self.in_proj, self.split = FusedLinear(list(projections), fuse, gemv), split
        # the gated norm (Llama-formula norm times silu(z)) in one kernel (`fused_ops.rms_norm` with a gate)
        self.norm_kernel = kernel and getattr(self.gated_norm, "activation", None) == "silu"
        # conv, gates, one-row steps and commits through gdn_kernels.py (their conv activation is SiLU)
        self.kernel = kernel and gdn.activation == "silu"
        self.k_size = self.conv1d.kernel_size[0]
        channels = self.conv1d.in_channels
        w = self.conv1d.weight  # [C, 1, K]
        self.window = torch.zeros(1, channels, self.k_size - 1, device=w.device, dtype=w.dtype)
        hv, dk, dv = gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim
        self.state = torch.zeros(1, hv, dk, dv, device=w.device, dtype=torch.float32)
        self.chunk_rule, self.recurrent_rule, self.kernels = delta_rule_kernels(gdn, w.device, fla)
        # transformers' reference rules want a query/key head per value head; the Triton ones group them
        self.repeat = self.kernels == "torch"
        # verify rows through `delta_rule` too (the state kept), or with verify "chunk" the chunked rule: on
        # Qwen3.5-4B (16-row verify, one H200) 5.43 against 5.58 ms a DFlash step (docs/performance.md)
        self.recurrent_verify = self.kernel and verify != "chunk"
        # commit through the recurrent rule where it is one kernel (flash-linear-attention), else the closed form
        self.recurrent_commit = self.kernels == "flash-linear-attention"
        self._pending: tuple[torch.Tensor, ...] | None = None  # the last verify's (conv input, k, v, g, beta)

    def states(self) -> list[torch.Tensor]:
        """The tensors a step mutates in place (put back after a warm-up or capture run)."""
        return [self.window, self.state]

    def __call__(self, x: torch.Tensor, mode: str, fold: bool = False):
        """x [1, T, H] -> [1, T, H]. mode: "prefill" (T prompt rows from position 0), "step" (one committed
        row: the states move on) or "verify" (states kept; `commit` moves them). `fold`: a one-row step's
        output projection as the GEMV's `Parts` (the next residual add sums them)."""
        g_mod, t = self.gdn, x.shape[1]
        # conv input [1, T, C], z [1, T, Hv, Dv], b and a [1, T, Hv]
        mixed, z, b, a = self.split(g_mod, self.in_proj(x))
        if self.kernel:  # the window moves on inside the kernel, except in a verify
            conv_in = mixed
            q, k, v, g, beta = conv_gates(mixed, self.window, self.conv1d, g_mod, b, a, mode)
        else:
            conv_in, (q, k, v, g, beta) = self._conv_gates(mixed, b, a, mode)
        if self.kernel and (mode == "step" or mode == "verify" and self.recurrent_verify):
            # core [1, T, Hv, Dv]; a step's state moves on in place, a verify's waits for `commit`
            core = delta_rule(q, k, v, g, beta, self.state, None, store=mode == "step")
        else:
            core = self._rule(q, k, v, g, beta, mode)
        if mode == "verify":
            self._pending = (conv_in, k, v, g, beta)
        out = self._gated_norm(core.reshape(-1, g_mod.head_v_dim), z.reshape(-1, g_mod.head_v_dim))
        out = out.reshape(1, t, -1)
        projected = self.project_out(out, fold=fold)
        return self.out_proj(out) if projected is None else projected

    def _conv_gates(self, mixed, b, a, mode):
        """The torch ops of `conv_gates`: (conv input [1, C, K-1+T], (q, k [1, T, Hk, Dk], v [1, T, Hv, Dv],
        g, beta [1, T, Hv])); the window moves on unless verifying."""
        g_mod, t = self.gdn, mixed.shape[1]
        window = torch.zeros_like(self.window) if mode == "prefill" else self.window
        conv_in = torch.cat([window, mixed.transpose(1, 2).to(window.dtype)], dim=-1)  # [1, C, K-1+T]
        if mode != "verify":
            self.window.copy_(conv_in[..., -(self.k_size - 1) :])
        w = self.conv1d.weight
        conv = F.conv1d(conv_in, w, self.conv1d.bias, groups=w.shape[0])  # [1, C, T]
        conv = getattr(F, g_mod.activation)(conv).to(mixed.dtype).transpose(1, 2)  # [1, T, C]
        q, k, v = conv.split([g_mod.key_dim, g_mod.key_dim, g_mod.value_dim], dim=-1)
        q, k = (y.reshape(1, t, g_mod.num_k_heads, g_mod.head_k_dim) for y in (q, k))
        v = v.reshape(1, t, g_mod.num_v_heads, g_mod.head_v_dim)
        beta = b.sigmoid()  # [1, T, Hv]
        g = -g_mod.A_log.float().exp() * F.softplus(a.float() + g_mod.dt_bias)  # [1, T, Hv], log decay <= 0
        return conv_in, (q, k, v, g, beta)

    def _heads(self, y: torch.Tensor) -> torch.Tensor:
        """Key heads [1, T, Hk, Dk] as the rule takes them: repeated to one per value head for the reference."""
        return y.repeat_interleave(self.gdn.num_v_heads // self.gdn.num_k_heads, 2) if self.repeat else y

    def _rule(self, q, k, v, g, beta, mode) -> torch.Tensor:
        """The chunked rule (prefill, verify) or the recurrent one (one-row steps): core [1, T, Hv, Dv]; the
        state moves on unless verifying."""
        initial = None if mode == "prefill" else self.state
        rule = self.recurrent_rule if q.shape[1] == 1 and mode != "prefill" else self.chunk_rule
        # a verify's final state is not used: `commit` computes the one after the accepted rows
        core, final = rule(
            self._heads(q), self._heads(k), v, g=g, beta=beta, initial_state=initial,
            output_final_state=mode != "verify", use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        if mode != "verify":
            self.state.copy_(final)
        return core

    def _gated_norm(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """norm(x) * silu(z), rows [N, Dv]: the module, or one kernel of the same rounding."""
        m = self.gated_norm
        if self.norm_kernel and m.weight.dtype == x.dtype == z.dtype:
            return fused_ops.rms_norm(x, m.weight, norm_eps(m), gate=z)
        return m(x, z)

    def commit(self, n: torch.Tensor) -> None:
        """Move both states past the first `n` rows of the last verify (0-d long tensor, 1 <= n <= T)."""
        conv_in, k, v, g, beta = self._pending
        self._pending = None
        if self.kernel:  # two kernels: the window, then the rule over the first n rows (the state in place)
            window_commit(conv_in, self.window, n)
            delta_rule(None, k, v, g, beta, self.state, n)
            return
        t = k.shape[1]
        self.window.copy_(conv_in.index_select(-1, n + torch.arange(self.k_size - 1, device=n.device)))
        # rows past n: beta 0 and log decay 0 leave the state as it is (identity steps), at a fixed shape
        keep = (torch.arange(t, device=n.device) < n).float()[None, :, None]  # [1, T, 1]
        k = self._heads(k)
        if self.recurrent_commit:
            _, final = self.recurrent_rule(
                k,
                k,
                v,
                g=g * keep,
                beta=beta * keep.to(beta.dtype),
                initial_state=self.state,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )  # the output (k stands in for q) is not used
            self.state.copy_(final)
            return
        k = k.float()
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)  # the kernels' l2 norm of the keys
        k = k.transpose(1, 2)  # [1, Hv, T, Dk]
        v = v.float().transpose(1, 2)  # [1, Hv, T, Dv]
        g, beta = ((y.float() * keep).transpose(1, 2) for y in (g, beta))  # [1, Hv, T]
        self.state.copy_(gated_delta_final_state(self.state, k, v, g, beta))


def conv_gates(mixed, window, conv1d: nn.Module, gdn: nn.Module, b, a, mode: str) -> tuple[torch.Tensor, ...]:
    """The conv input [1, T, C] -> q, k [1, T, Hk, Dk], v [1, T, Hv, Dv] (contiguous views of one output), the
    log decay g (fp32) and gate beta [1, T, Hv], through `gdn_conv_gates`; the window moves on unless
    verifying (a prefill starts from an empty window)."""
    t = mixed.shape[1]
    out, g, beta = gdn_conv_gates(
        mixed, window, conv1d.weight, conv1d.bias, b, a, gdn.A_log, gdn.dt_bias, gdn.key_dim,
        mode == "prefill", mode != "verify",
    )  # fmt: skip
    kd = t * gdn.key_dim
    q, k = (out[i * kd : (i + 1) * kd].view(1, t, gdn.num_k_heads, gdn.head_k_dim) for i in (0, 1))
    return q, k, out[2 * kd :].view(1, t, gdn.num_v_heads, gdn.head_v_dim), g[None], beta[None]
