"""Launch commands for serving a DFlash pair with vLLM or SGLang (docs/method.md §7); pure, no I/O.

- vLLM: `vllm serve <target> --speculative-config '{"method": "dflash", "model": <draft>,
  "num_speculative_tokens": B-1}' --attention-backend flash_attn` (the drafter needs non-causal attention).
- SGLang: `python -m sglang.launch_server --model-path <target> --speculative-algorithm DFLASH
  --speculative-draft-model-path <draft> --speculative-num-draft-tokens B`.

B is the drafter's block size: vLLM counts the proposed tokens (B-1, the bonus token is not drafted), SGLang the
whole block. A pinned draft revision travels as `"revision"` in vLLM's speculative config and as
`--speculative-draft-model-revision` for SGLang. Extra arguments are appended verbatim, last, so they can
override anything before them.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from dataclasses import dataclass, field

from dflash_zoo.errors import InvalidArgumentError, ZooError

ENGINES = ("vllm", "sglang")
SGLANG_MODULE = "sglang.launch_server"
# SGLang forces the drafter's context length to the target's and refuses unless this is set (docs/method.md §7)
SGLANG_ENV = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}


@dataclass(frozen=True)
class ServeSpec:
    """What to serve: target and draft (Hub ids or local folders), the draft block size and engine options."""

    target: str
    draft: str
    block_size: int
    draft_revision: str | None = None
    port: int | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise InvalidArgumentError(f"block size must be >= 2 to draft anything, got {self.block_size}")


def vllm_command(spec: ServeSpec) -> list[str]:
    """`vllm serve` argv for `spec` (num_speculative_tokens = block_size - 1)."""
    config: dict[str, object] = {
        "method": "dflash",
        "model": spec.draft,
        "num_speculative_tokens": spec.block_size - 1,
    }
    if _pinned(spec.draft_revision):
        config["revision"] = spec.draft_revision
    argv = ["vllm", "serve", spec.target, "--speculative-config", json.dumps(config)]
    argv += ["--attention-backend", "flash_attn"]
    if spec.port is not None:
        argv += ["--port", str(spec.port)]
    return argv + list(spec.extra_args)


def sglang_command(spec: ServeSpec, python: str = "python") -> list[str]:
    """`python -m sglang.launch_server` argv for `spec` (num_draft_tokens = block_size)."""
    argv = [python, "-m", SGLANG_MODULE, "--model-path", spec.target]
    argv += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", spec.draft]
    if _pinned(spec.draft_revision):
        argv += ["--speculative-draft-model-revision", str(spec.draft_revision)]
    argv += ["--speculative-num-draft-tokens", str(spec.block_size)]
    if spec.port is not None:
        argv += ["--port", str(spec.port)]
    return argv + list(spec.extra_args)


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
