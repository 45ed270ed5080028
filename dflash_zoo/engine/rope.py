"""Rotary position embeddings for the drafter: default, linear, llama3 and yarn scaling.

Own copies of the standard formulas (as speculators keeps `rotate_half`) so the drafter does not depend on
transformers internals that move between releases. Tests compare them with transformers' own init functions.
"""

from __future__ import annotations

import math

import torch

from dflash_zoo.engine.config import RopeSpec


def inverse_frequencies(
    rope: RopeSpec, head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [dim/2], attention_scaling) for the rotary part of a head (dim = head_dim * partial)."""
    dim = int(head_dim * rope.partial_rotary_factor)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.type == "llama3":
        return _llama3(inv_freq, rope, max_position_embeddings), 1.0
    if rope.type == "yarn":
        return _yarn(rope, dim, max_position_embeddings)
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, rope: RopeSpec, max_pos: int) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings or max_pos
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are interpolated by `factor`, short ones kept, the band between blended smoothly
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeSpec, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    orig = rope.original_max_position_embeddings or max_pos
    factor = rope.factor
    attn = rope.attention_factor
    if attn is None:
        if rope.mscale and rope.mscale_all_dim:  # DeepSeek/Kimi spelling of the attention factor
            attn = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attn = _yarn_mscale(factor)

    def corr_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp  # 1 where the original frequency is kept
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attn)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for integer positions; a buffer, not a parameter (never saved)."""

    def __init__(self, rope: RopeSpec, head_dim: int, max_position_embeddings: int):
        super().__init__()
        inv_freq, self.scaling = inverse_frequencies(rope, head_dim, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..., T] (int) -> cos, sin [..., T, rot_dim] in `dtype`."""
        freqs = positions.float()[..., None] * self.inv_freq  # [..., T, rot_dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; cos/sin [T, rot] or [B, 1, T, rot]. Only the first `rot` dims rotate (partial rotary)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    out = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat([out, x_pass], dim=-1) if x_pass.numel() else out
