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
(gdn_kernels.py), where torch took ~20 a layer in a one-row step, each ~2 us in a graphed step for ~2 us of real
work (docs/performance.md): `conv_gates` (conv, SiLU, q | k | v, decay and gate; the window moves on in it),
`delta_rule` (one-row steps, verifies and commits: the rule row by row over a few rows, the state updated in
place or kept, value heads reading their key heads, so no repeated heads and no state copy) and
`window_commit`. Prefills keep the chunked rule.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dflash_zoo.adapters._hybrid import gated_delta_final_state
from dflash_zoo.cuda.ops import fused as fused_ops
from dflash_zoo.cuda.ops.attention_kernels import _pow2
from dflash_zoo.cuda.static.layout import norm_eps

# (query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel) -> (out, state)
DeltaRule = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def fla_kernels() -> tuple[DeltaRule, DeltaRule] | None:
    """flash-linear-attention's (chunked, fused recurrent) gated delta rule, or None when not installed
    (or turned off with `DFLASH_ZOO_FLA=0`)."""
    if os.environ.get("DFLASH_ZOO_FLA", "1") == "0":
        return None
    try:
        ops = importlib.import_module("fla.ops.gated_delta_rule")
    except Exception:  # not installed, or installed without a working triton
        return None
    return ops.chunk_gated_delta_rule, ops.fused_recurrent_gated_delta_rule


def delta_rule_kernels(gdn: nn.Module, device: torch.device) -> tuple[DeltaRule, DeltaRule, str]:
    """(chunked rule, recurrent rule, name): flash-linear-attention on CUDA where installed, else the torch
    reference functions of the module's own transformers file."""
    fla = fla_kernels() if device.type == "cuda" else None
    if fla is not None:
        return (*fla, "flash-linear-attention")
    home = sys.modules[type(gdn).__module__]
    return home.torch_chunk_gated_delta_rule, home.torch_recurrent_gated_delta_rule, "torch"


class StaticGDN:
    """One GDN layer: prefill (from a zero state), one-row steps (state moves on), verify + `commit`."""

    def __init__(
        self,
        gdn: nn.Module,
        parts: tuple[nn.Module, nn.Module, nn.Module, tuple[nn.Linear, ...]],
        split: Callable,
        kernel: bool = False,
        fuse: bool = True,
        gemv: bool = False,
    ):
        from dflash_zoo.cuda.static.target import FusedLinear, _project  # static.py imports this module

        self.gdn, (self.conv1d, self.gated_norm, self.out_proj, projections) = gdn, parts
        # few-row output projections through the GEMV kernels, as attention's (`static._project`)
        self.project_out = functools.partial(_project, self.out_proj, gate=None, gemv=gemv)
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
        self.chunk_rule, self.recurrent_rule, self.kernels = delta_rule_kernels(gdn, w.device)
        # transformers' reference rules want a query/key head per value head; the Triton ones group them
        self.repeat = self.kernels == "torch"
        # verify rows through `delta_rule` too (the state kept), or with `DFLASH_ZOO_GDN_VERIFY=chunk` the chunked
        # rule: on Qwen3.5-4B (16-row verify, one H200) 5.43 against 5.58 ms a DFlash step (docs/performance.md)
        self.recurrent_verify = (
            self.kernel and os.environ.get("DFLASH_ZOO_GDN_VERIFY", "recurrent") != "chunk"
        )
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


def _kernels():
    from dflash_zoo.cuda.ops import gdn_kernels  # needs triton: imported on first use

    return gdn_kernels


ROW_BLOCK, CHANNEL_BLOCK = 16, 128  # conv rows and channels per program
VALUE_BLOCK = 8  # value columns per delta-rule program (one warp each): Hv x Dv / 8 programs, ~4 per SM at 9B


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


def _rows(y: torch.Tensor) -> torch.Tensor:
    """[1, T, W] with unit column stride (rows may be strided: column slices of one projection's output)."""
    return y if y.stride(-1) == 1 else y.contiguous()


@torch.library.custom_op("dflash_zoo::gdn_conv_gates", mutates_args=("window",))
def gdn_conv_gates(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, b: torch.Tensor,
    a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, key_dim: int, zero: bool, store: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """x [1, T, C] (conv input), window [1, C, K-1], weight [C, 1, K], b and a [1, T, Hv] -> (silu(conv) as
    q | k | v, flat [T C]; g [T, Hv] fp32; beta [T, Hv]). `zero`: the window is taken as empty; `store`: it
    takes the last K-1 conv inputs."""
    x, b, a = _rows(x), _rows(b), _rows(a)
    t, c = x.shape[-2:]
    hv, ks = b.shape[-1], weight.shape[-1]
    out = x.new_empty(t * c)
    g, beta = torch.empty(t, hv, device=x.device, dtype=torch.float32), b.new_empty(t, hv)
    grid = (-(-c // CHANNEL_BLOCK), -(-t // ROW_BLOCK))
    _kernels().conv_gates[grid](
        x, x.stride(-2), window, weight, bias if bias is not None else weight, out, b, b.stride(-2), a, a.stride(-2),
        a_log, dt_bias, g, beta, t, c, key_dim, hv, KS=ks, R=ROW_BLOCK, BC=CHANNEL_BLOCK, WS=_pow2(ks - 1, 2),
        HP=_pow2(hv, 2), BIAS=bias is not None, ZERO=zero, STORE=store,
    )  # fmt: skip
    return out, g, beta


@gdn_conv_gates.register_fake
def _(x, window, weight, bias, b, a, a_log, dt_bias, key_dim, zero, store):
    t, c, hv = x.shape[-2], x.shape[-1], b.shape[-1]
    return x.new_empty(t * c), x.new_empty(t, hv, dtype=torch.float32), b.new_empty(t, hv)


@torch.library.custom_op("dflash_zoo::gdn_window_commit", mutates_args=("window",))
def window_commit(x: torch.Tensor, window: torch.Tensor, n: torch.Tensor) -> None:
    """After a verify of conv input rows x [1, T, C]: the window [1, C, K-1] moves past the first n (0-d
    long tensor on x's device)."""
    x = _rows(x)
    c, ks = x.shape[-1], window.shape[-1] + 1
    grid = (-(-c // CHANNEL_BLOCK),)
    _kernels().window_commit[grid](
        x, x.stride(-2), window, n, c, KS=ks, BC=CHANNEL_BLOCK, WS=_pow2(ks - 1, 2)
    )


@window_commit.register_fake
def _(x, window, n):
    return None


@torch.library.custom_op("dflash_zoo::gdn_delta_rule", mutates_args=("state",))
def delta_rule(
    q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, n: torch.Tensor | None, store: bool = True,
) -> torch.Tensor:  # fmt: skip
    """The gated delta rule over rows [0, n) (all T rows when n is None) of q, k [1, T, Hk, Dk] (contiguous),
    v [1, T, Hv, Dv], g (fp32) and beta [1, T, Hv], from `state` [1, Hv, Dk, Dv] (fp32), and with `store` back
    into it. Returns o [1, T, Hv, Dv], or an empty tensor when q is None (a commit: only the state is wanted)."""
    q = q.contiguous() if q is not None else None
    k, v, g, beta = (y.contiguous() for y in (k, v, g, beta))  # the kernel reads whole rows at row strides
    _, t, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    out = v.new_empty(v.shape) if q is not None else v.new_empty(0)
    grid = (-(-dv // VALUE_BLOCK), hv)
    _kernels().delta_rule[grid](
        q if q is not None else k, k, v, g, beta, state, out, n if n is not None else state, t, hk, hv, dk, dv,
        dk**-0.5, DK=_pow2(dk), BV=VALUE_BLOCK, COUNT=n is not None, OUT=q is not None, STORE=store,
        num_warps=1,
    )  # fmt: skip
    return out


@delta_rule.register_fake
def _(q, k, v, g, beta, state, n, store=True):
    return v.new_empty(v.shape) if q is not None else v.new_empty(0)
