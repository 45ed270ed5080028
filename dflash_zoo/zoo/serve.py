"""Launch commands for serving a DFlash pair with vLLM or SGLang; pure, no I/O (docs/serving.md).

Per-family recipes are data (`RECIPES`), never code branches: for each (family or entry slug, engine) the
target attention backend, the draft attention backend, trust-remote-code, the minimum engine version, a
tensor-parallel hint and a refusal where the engine cannot run the pair at all.

- vLLM: `vllm serve <target> --speculative-config '{"method": "dflash", "model": <draft>,
  "num_speculative_tokens": B-1, "attention_backend": <draft backend>}'`. The drafter needs non-causal
  attention, so its backend travels *inside* the speculative config (vLLM >= 0.21.0); a top-level
  `--attention-backend` would force it onto the target too (MLA on Kimi, 512-wide heads on Gemma 4, sinks on
  gpt-oss), so it is only emitted where the recipe names a target backend.
- SGLang: `python -m sglang.launch_server --model-path <target> --speculative-algorithm DFLASH
  --speculative-draft-model-path <draft> --speculative-num-draft-tokens B` (DFLASH from 0.5.11).

B is the drafter's block size: vLLM counts the proposed tokens (B-1, the bonus token is not drafted), SGLang
the whole block. DFlash 2 drafters use the same flags: both engines pick DFlash 2 from the drafter's
`architectures` (vLLM under `"method": "dflash"`), from vLLM 0.28.0 and SGLang 0.5.19 (`ARCH_MIN_VERSIONS`).
A quantized target (FP8, MXFP4, NVFP4) needs no flag: both engines read its `quantization_config`. Pinned revisions travel as `"revision"` in vLLM's speculative config and `--revision` for the
target; SGLang uses `--speculative-draft-model-revision` and `--revision`. Extra arguments are appended
verbatim, last, so they can override anything before them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
from dataclasses import dataclass, field, replace
from importlib import metadata

from dflash_zoo.errors import IncompatiblePairError, InvalidArgumentError, ZooError

ENGINES = ("vllm", "sglang")
SGLANG_MODULE = "sglang.launch_server"
# SGLang forces the drafter's context length to the target's and refuses unless this is set
SGLANG_ENV = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
# Fraction of a GPU's memory the weights may take; the rest is KV cache, activations and CUDA graphs.
WEIGHT_FRACTION = 0.8


@dataclass(frozen=True)
class Recipe:
    """How one engine serves one family. None fields mean "let the engine choose"."""

    min_version: str
    target_backend: str | None = None  # vLLM --attention-backend / SGLang --attention-backend
    draft_backend: str | None = None  # vLLM speculative_config.attention_backend / SGLang draft backend flag
    trust_remote_code: bool = False
    extra: tuple[str, ...] = ()  # flags the engine needs for this family
    refusal: str | None = None  # why the engine cannot run the pair (exit 3)
    works_with: str | None = None  # what would work instead, named in the refusal


# Minimum versions: vLLM added DFlash in 0.20.0 and the draft-only `attention_backend` key of
# --speculative-config in 0.21.0 (checked in the release wheels); SGLang accepts DFLASH from 0.5.11.
_VLLM = Recipe(min_version="0.21.0", draft_backend="flash_attn")
_SGLANG = Recipe(min_version="0.5.11")
# The first release of each engine that runs a drafter architecture (dflash_zoo/drafters), where later than the
# recipe's, read from the release wheels' model registries: DFlash 2 (vLLM PR #52816, SGLang PR #35371); Laguna
# DFlash (vLLM PR #46853, SGLang PR #29446: `DFlashLagunaForCausalLM` and the Laguna target's hidden-state
# capture first ship in vLLM 0.25.0 and SGLang 0.5.15; 0.24.0 and 0.5.14 lack the drafter class).
ARCH_MIN_VERSIONS: dict[str, dict[str, str]] = {
    "dflash2": {"vllm": "0.28.0", "sglang": "0.5.19"},
    "laguna_dflash": {"vllm": "0.25.0", "sglang": "0.5.15"},
}
# 512-wide global heads: FlashAttention rejects them outside FA4, the published recipe uses Triton
_GEMMA4_VLLM = Recipe(min_version="0.21.0", target_backend="triton_attn", draft_backend="flash_attn")
_HYBRID_NOTE = "hybrid GDN: vLLM derives mamba_cache_mode, SGLang its mamba radix strategy (no flag needed)"

# (family = registry `adapter`, or an entry slug) -> engine -> recipe. A slug key wins over its family.
RECIPES: dict[str, dict[str, Recipe]] = {
    "qwen3": {"vllm": _VLLM, "sglang": _SGLANG},
    "qwen3_moe": {"vllm": _VLLM, "sglang": _SGLANG},
    "llama": {"vllm": _VLLM, "sglang": _SGLANG},
    # hybrid Gated-DeltaNet targets: both engines derive their state-cache mode themselves (_HYBRID_NOTE);
    # `--mamba-scheduler-strategy` from older recipes is rejected by SGLang 0.5.23
    "qwen3_next": {"vllm": _VLLM, "sglang": _SGLANG},
    "qwen3_5": {"vllm": _VLLM, "sglang": _SGLANG},
    "qwen3_5_moe": {"vllm": _VLLM, "sglang": _SGLANG},
    # attention sinks: FlashAttention-2 lacks them, so the target keeps vLLM's own choice
    "gpt_oss": {"vllm": _VLLM, "sglang": _SGLANG},
    # Gemma 4, the 12B's own model type included: 512-wide heads on the full-attention layers (_GEMMA4_VLLM)
    "gemma4": {"vllm": _GEMMA4_VLLM, "sglang": _SGLANG},
    "gemma4_unified": {"vllm": _GEMMA4_VLLM, "sglang": _SGLANG},
    # MLA target: never force a backend on it; remote-code tokenizer (tiktoken)
    "kimi_k25": {"vllm": Recipe(min_version="0.21.0", draft_backend="flash_attn", trust_remote_code=True),
                 "sglang": Recipe(min_version="0.5.11", trust_remote_code=True)},
    "minimax_m2": {
        "vllm": _VLLM,
        "sglang": Recipe(
            min_version="0.5.11",
            refusal="SGLang (up to 0.5.23, the newest checked) has no DFlash hidden-state capture for minimax_m2",
            works_with="vllm >= 0.21.0 (dflash-zoo serve ID --engine vllm)",
        ),
    },
    # dense VLM wrapper (sliding and NoPE global layers, soft-capped logits): the engines' own backend choice
    "muse_glimmer": {"vllm": _VLLM, "sglang": _SGLANG},
    # MLA + DSA sparse attention (GLM-5.x): never force a target backend; FP8 checkpoints carry their quantization
    "glm_moe_dsa": {"vllm": _VLLM, "sglang": _SGLANG},
}  # fmt: skip


def recipe_for(
    family: str, engine: str, slug: str | None = None, architecture: str | None = "dflash"
) -> Recipe:
    """The recipe of an entry (slug first, then family; the engine default for unknown families), its minimum
    version raised to what the drafter's architecture needs (`ARCH_MIN_VERSIONS`)."""
    if engine not in ENGINES:
        raise InvalidArgumentError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    recipe = _VLLM if engine == "vllm" else _SGLANG
    for key in (slug, family):
        if key and engine in RECIPES.get(key, {}):
            recipe = RECIPES[key][engine]
            break
    need = ARCH_MIN_VERSIONS.get(architecture or "", {}).get(engine)
    if need and version_tuple(need) > version_tuple(recipe.min_version):
        recipe = replace(recipe, min_version=need)
    return recipe


@dataclass(frozen=True)
class ServeSpec:
    """What to serve: target and draft (Hub ids or local folders), the draft block size and engine options."""

    target: str
    draft: str
    block_size: int
    draft_revision: str | None = None
    port: int | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    target_revision: str | None = None
    recipe: Recipe | None = None  # None: the engine's default recipe
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise InvalidArgumentError(f"block size must be >= 2 to draft anything, got {self.block_size}")
        if self.tensor_parallel < 1:
            raise InvalidArgumentError(f"tensor parallel size must be >= 1, got {self.tensor_parallel}")


def vllm_command(spec: ServeSpec) -> list[str]:
    """`vllm serve` argv for `spec` (num_speculative_tokens = block_size - 1)."""
    recipe = spec.recipe or _VLLM
    config: dict[str, object] = {
        "method": "dflash",
        "model": spec.draft,
        "num_speculative_tokens": spec.block_size - 1,
    }
    if _pinned(spec.draft_revision):
        config["revision"] = spec.draft_revision
    if recipe.draft_backend:
        config["attention_backend"] = recipe.draft_backend
    argv = ["vllm", "serve", spec.target, "--speculative-config", json.dumps(config)]
    if _pinned(spec.target_revision):
        argv += ["--revision", str(spec.target_revision)]
    if recipe.target_backend:
        argv += ["--attention-backend", recipe.target_backend]
    argv += _common(recipe, spec, tp_flag="--tensor-parallel-size")
    return argv + list(spec.extra_args)


def sglang_command(spec: ServeSpec, python: str = "python") -> list[str]:
    """`python -m sglang.launch_server` argv for `spec` (num_draft_tokens = block_size)."""
    recipe = spec.recipe or _SGLANG
    argv = [python, "-m", SGLANG_MODULE, "--model-path", spec.target]
    if _pinned(spec.target_revision):
        argv += ["--revision", str(spec.target_revision)]
    argv += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", spec.draft]
    if _pinned(spec.draft_revision):
        argv += ["--speculative-draft-model-revision", str(spec.draft_revision)]
    argv += ["--speculative-num-draft-tokens", str(spec.block_size)]
    if recipe.target_backend:
        argv += ["--attention-backend", recipe.target_backend]
    if recipe.draft_backend:
        argv += ["--speculative-draft-attention-backend", recipe.draft_backend]
    argv += _common(recipe, spec, tp_flag="--tp-size")
    return argv + list(spec.extra_args)


def _common(recipe: Recipe, spec: ServeSpec, tp_flag: str) -> list[str]:
    argv = ["--trust-remote-code"] if recipe.trust_remote_code else []
    if spec.tensor_parallel > 1:
        argv += [tp_flag, str(spec.tensor_parallel)]
    argv += list(recipe.extra)
    if spec.port is not None:
        argv += ["--port", str(spec.port)]
    return argv


def build_command(engine: str, spec: ServeSpec, python: str = "python") -> list[str]:
    """The launch argv for `engine` (one of `ENGINES`)."""
    if engine == "vllm":
        return vllm_command(spec)
    if engine == "sglang":
        return sglang_command(spec, python=python)
    raise InvalidArgumentError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")


def engine_env(engine: str) -> dict[str, str]:
    """Environment variables the engine needs on top of the caller's (empty for vLLM)."""
    return dict(SGLANG_ENV) if engine == "sglang" else {}


def refuse_if_unsupported(recipe: Recipe, engine: str, name: str) -> None:
    """Raise `IncompatiblePairError` (exit 3) when the recipe says the engine cannot run the pair."""
    if recipe.refusal:
        raise IncompatiblePairError(
            f"{engine} cannot serve {name}: {recipe.refusal}",
            hint=f"use {recipe.works_with}" if recipe.works_with else "no engine version is known to work",
        )


def check_engine_version(recipe: Recipe, engine: str, installed: str | None, why: str = "") -> None:
    """Raise `IncompatiblePairError` (exit 3) when the installed engine is older than the recipe needs; `why`
    names what sets the minimum (e.g. the drafter's architecture)."""
    if installed is not None and version_tuple(installed) < version_tuple(recipe.min_version):
        raise IncompatiblePairError(
            f"{engine} {installed} is installed; this pair needs {engine} >= {recipe.min_version}"
            + (f" ({why})" if why else ""),
            hint=f"pip install -U '{engine}>={recipe.min_version}' (or --dry-run to only print the command)",
        )


def tensor_parallel_size(weight_bytes: int | None, gpu_bytes: list[int], hint: int = 1) -> int:
    """GPUs to split the target over: the smallest power of two whose memory holds its weights.

    Without visible GPUs, or without the weights' size, the entry's `hint` is used. The result never exceeds
    the visible GPU count.
    """
    if not gpu_bytes:
        return hint
    if not weight_bytes:  # size unknown: the hint, never a guess of 1
        return min(hint, len(gpu_bytes))
    need = weight_bytes / (min(gpu_bytes) * WEIGHT_FRACTION)
    tp = 1 << max(0, math.ceil(math.log2(max(need, 1.0))))
    return min(tp, len(gpu_bytes))


def version_tuple(text: str) -> tuple[int, ...]:
    """Leading numeric release parts: "0.5.11.post1" -> (0, 5, 11), "0.21.0rc1" -> (0, 21, 0)."""
    parts = []
    for piece in text.split("."):
        digits = re.match(r"\d+", piece)
        if not digits:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def installed_version(engine: str) -> str | None:
    """The engine's installed distribution version (importlib.metadata: the engine is never imported)."""
    try:
        return metadata.version(engine)
    except metadata.PackageNotFoundError:
        return None


def require_engine(engine: str) -> None:
    """Raise `ZooError` with an install hint when the engine's binary / module is not installed here."""
    if engine == "vllm" and shutil.which("vllm") is None:
        raise ZooError("the `vllm` command is not on PATH", hint="pip install vllm (or run with --dry-run)")
    if engine == "sglang" and importlib.util.find_spec("sglang") is None:
        raise ZooError(
            "the `sglang` package is not installed", hint="pip install 'sglang[all]' (or --dry-run)"
        )


def _pinned(revision: str | None) -> bool:
    return bool(revision) and revision != "main"
