"""A `RopeSpec` written back as transformers' `rope_parameters` (torch-free).

Every field that applies to the type is written, so a reader needs no defaults of its own: `default` and
`linear` (theta, factor), `llama3` (factor, low / high frequency factors, original length), `yarn` (factor,
original length, beta_fast / beta_slow, and mscale, mscale_all_dim, attention_factor, truncate when set).
"""

from __future__ import annotations

from typing import Any


def rope_parameters(cfg: Any) -> dict[str, Any]:
    """transformers' `rope_parameters` for a `DraftConfig`'s rotary embedding."""
    r = cfg.rope
    out: dict[str, Any] = {"rope_type": r.type, "rope_theta": r.theta}
    if r.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = r.partial_rotary_factor
    if r.type == "default":
        return out
    out["factor"] = r.factor
    if r.type == "linear":
        return out
    out["original_max_position_embeddings"] = (
        r.original_max_position_embeddings or cfg.max_position_embeddings
    )
    if r.type == "llama3":
        return {**out, "low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor}
    out.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow)
    optional = {
        "mscale": r.mscale,
        "mscale_all_dim": r.mscale_all_dim,
        "attention_factor": r.attention_factor,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    if not r.truncate:
        out["truncate"] = False
    return out
