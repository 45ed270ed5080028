"""The verifier tensors a speculators drafter carries: recorded at load, checked against the pair's target.

A speculators checkpoint copies the verifier's input embedding, LM head (all rows, or the rows of a reduced
draft vocabulary) and final norm. Our drafter uses the target's own modules instead, which is the same
computation exactly when the copies equal them. So every copy is consumed by a check, never ignored: its
shape, dtype and SHA-256 are recorded when the drafter loads (`record`), and `check` compares them with the
target's tensors cast to the copy's dtype (a bf16 copy of a target loaded in fp32 compares bit for bit), refusing
the pair over the first one that differs. `target_tensors` reads the same parts from a target's safetensors
files for `convert --target`.
"""

from __future__ import annotations

import hashlib
import json
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_zoo.errors import DrafterFormatError, IncompatiblePairError
from dflash_zoo.formats.weights import VERIFIER_PARTS, draft_ids


@dataclass(frozen=True)
class Copy:
    """One verifier tensor a drafter checkpoint carried: which part of the target, and its fingerprint."""

    name: str
    part: str  # "embedding", "head" or "final norm"
    shape: tuple[int, ...]
    dtype: torch.dtype
    sha256: str
    rows: torch.Tensor | None = None  # [Vd] the target rows a reduced head copies (None: all)


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (contiguous, on the CPU)."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


def record(copies: dict[str, torch.Tensor], d2t: torch.Tensor | None) -> tuple[Copy, ...]:
    """Fingerprints of the copies; a head copy of a reduced vocabulary covers the target rows `d2t` maps to."""
    rows = None if d2t is None else draft_ids(d2t.cpu())
    return tuple(
        Copy(
            name,
            VERIFIER_PARTS[name],
            tuple(t.shape),
            t.dtype,
            digest(t),
            rows if VERIFIER_PARTS[name] == "head" else None,
        )
        for name, t in copies.items()
    )


def model_parts(model: Any, final_norm_path: str) -> dict[str, torch.Tensor]:
    """The target modules' tensors the copies stand for."""
    return {
        "embedding": model.get_input_embeddings().weight,
        "head": model.get_output_embeddings().weight,
        "final norm": operator.attrgetter(final_norm_path)(model).weight,
    }


def check(copies: tuple[Copy, ...], parts: dict[str, torch.Tensor], target: str = "the target") -> None:
    """Refuse the pair unless every copy equals the target's tensor (`IncompatiblePairError`, exit 3)."""
    for c in copies:
        t = parts[c.part]
        if c.rows is not None:
            t = t[c.rows.to(t.device)]
        same = tuple(t.shape) == c.shape and t.is_floating_point() and digest(t.to(c.dtype)) == c.sha256
        if not same:
            raise IncompatiblePairError(
                f"the drafter's copy of the verifier {c.part} ({c.name}, {list(c.shape)}) differs from {target}'s "
                f"({list(t.shape)}, {str(t.dtype).removeprefix('torch.')}): it was made for another target",
                hint="pair it with the target it was converted from (its config names it under "
                "speculators_config.verifier)",
            )


def target_tensors(directory: Path, adapter: Any) -> dict[str, torch.Tensor]:
    """The embedding, head and final norm tensors of a target checkpoint (safetensors), by the adapter's paths."""
    from safetensors import safe_open

    where = _tensor_files(directory)
    parent = adapter.layers_path.rpartition(".")[0]
    wanted = {
        "embedding": [f"{parent}.embed_tokens.weight", "model.embed_tokens.weight"],
        "head": ["lm_head.weight"],
        "final norm": [f"{adapter.final_norm_path()}.weight", "model.norm.weight"],
    }
    out = {}
    for part, names in wanted.items():
        name = next((n for n in names if n in where), None)
        if name is None and part == "head":  # a tied head is the embedding
            out[part] = out["embedding"]
            continue
        if name is None:
            raise DrafterFormatError(
                f"target {directory} has no {part} tensor (looked for {', '.join(names)})"
            )
        with safe_open(str(where[name]), framework="pt") as f:
            out[part] = f.get_tensor(name)
    return out


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or a sharded index)."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return {k: directory / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise DrafterFormatError(f"target {directory} has no safetensors weights")
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            out.update({k: file for k in f.keys()})  # noqa: SIM118 (safe_open has no __iter__)
    return out
