"""CI: every `dflash-zoo serve ID --engine E --dry-run --json` command through the engine's own parser.

Run by `.ci/engine_parsers.sh` inside a venv holding the pinned vLLM and SGLang wheels (`--no-deps`) and the
few packages their parsers import. No GPU: vLLM runs with VLLM_TARGET_DEVICE=cpu, so the deepest parts that
run are its `vllm serve` argument parser, `validate_parsed_serve_args`, `EngineArgs.from_cli_args`, the
speculative-config keys against `SpeculativeConfig`'s fields, and each named attention backend's own
`validate_configuration` for an H100/H200 (compute capability 9.0) with the shapes of the golden configs in
tests/fixtures/configs. SGLang runs `prepare_server_args` (argparse plus `ServerArgs.from_cli_args`).
Both engines' model classes for each target architecture are parsed (not imported) for the hook that feeds a
DFlash drafter the target's hidden states (`CAPTURE`), and their model registries for the drafter's own
architecture (`DFlash2DraftModel` for a DFlash 2 drafter). Supported pairs must be accepted and have both;
`EXPECTED_REFUSALS` must exit 3 and lack the hook (a refusal the engine has outgrown fails too). An entry its
author marked unsupported-here (`declared_status`) is listed as refused with its reason: `serve` must exit 1
naming that reason, and no command exists for the engines to parse. Controls prove the checks can fail.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "configs"
# SGLang has no DFlash capture for minimax_m2
EXPECTED_REFUSALS = {("minimax-m2.5", "sglang"), ("minimax-m2.7", "sglang")}
CAPABILITY = (9, 0)
# What an engine needs from the target's model class to feed a DFlash drafter the target's hidden states:
# (package, models folder, base class or method that provides the capture)
CAPTURE = {
    "vllm": ("vllm", "model_executor/models", "SupportsEagle3"),  # aux hidden states (EAGLE-3 and DFlash)
    "sglang": ("sglang", "srt/models", "set_dflash_layers_to_capture"),
}


@cache
def registry() -> dict[str, dict]:
    """slug -> the entry as `dflash-zoo list --json` gives it."""
    out = subprocess.run(["dflash-zoo", "list", "--json"], capture_output=True, text=True, check=True).stdout
    return {e["slug"]: e for e in json.loads(out)}


def serve_json(slug: str, engine: str) -> tuple[int, dict | None, str]:
    cmd = ["dflash-zoo", "serve", slug, "--engine", engine, "--dry-run", "--json"]
    cmd += (
        ["--block-size", "16"] if registry()[slug]["draft"]["block_size"] is None else []
    )  # unknown: give one
    env = os.environ | {"HF_HUB_OFFLINE": "1"}  # serve needs no Hub: the registry has every fact
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    return run.returncode, json.loads(run.stdout) if run.returncode == 0 else None, run.stderr.strip()


def fixture(slug: str, side: str) -> dict:
    path = FIXTURES / slug / f"{side}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def target_attention(slug: str) -> list[dict]:
    """The target's attention shapes that a forced backend must handle (every head size, MLA, sinks)."""
    cfg = fixture(slug, "target")
    text = cfg.get("text_config") or cfg
    mla = "kv_lora_rank" in text
    sizes = {text["kv_lora_rank"] + text["qk_rope_head_dim"]} if mla else {text.get("head_dim", 128)}
    sizes |= {text["global_head_dim"]} if "global_head_dim" in text else set()
    # Gemma 4 (and the 12B's gemma4_unified) full-attention layers: head dim 512, the config classes' default
    sizes |= {512} if cfg.get("model_type") in ("gemma4", "gemma4_unified") else set()
    sink = cfg.get("model_type") == "gpt_oss"
    swa = "sliding_attention" in (text.get("layer_types") or [])
    return [dict(head_size=s, use_mla=mla, has_sink=sink, has_sliding_window=swa) for s in sorted(sizes)]


def draft_attention(slug: str) -> list[dict]:
    cfg = fixture(slug, "draft")
    swa = "sliding_attention" in (cfg.get("layer_types") or [])
    shape = dict(head_size=cfg.get("head_dim", 128), use_mla=False, has_sink=False, has_sliding_window=swa)
    return [shape | {"use_non_causal": True}]


def backend_problems(name: str, shapes: list[dict]) -> list[str]:
    import torch
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cls = AttentionBackendEnum[name.upper()].get_class()
    out = []
    for shape in shapes:
        reasons = cls.validate_configuration(
            dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None, use_sparse=False,
            use_mm_prefix=False, use_per_head_quant_scales=False, device_capability=DeviceCapability(*CAPABILITY),
            attn_type="decoder", **shape,
        )  # fmt: skip
        out += [f"{name} {shape}: {r}" for r in reasons]
    return out


@cache
def model_classes(engine: str) -> dict[str, list[tuple[list[str], set[str]]]]:
    """class name -> [(base names, method names)] of every class in the engine's model files, parsed (never
    imported: importing model code needs the engine's CUDA extensions)."""
    package, folder, _ = CAPTURE[engine]
    root = Path(importlib.util.find_spec(package).submodule_search_locations[0]) / folder
    out: dict[str, list[tuple[list[str], set[str]]]] = {}
    for path in sorted(root.glob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rsplit(".", 1)[-1].split("[")[0] for b in node.bases]
                methods = {
                    n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                }
                out.setdefault(node.name, []).append((bases, methods))
    return out


def captures_hidden_states(engine: str, architecture: str) -> bool | None:
    """Whether the engine's class for `architecture` (or a base class) has the DFlash capture; None: no class.

    Names match ignoring case and underscores (transformers' `Kimi_K25...` is the engines' `KimiK25...`).
    """
    classes, want = model_classes(engine), CAPTURE[engine][2]
    architecture = registered_class(engine, architecture)
    key = architecture.replace("_", "").lower()
    names = [n for n in classes if n.replace("_", "").lower() == key]

    def has(name: str, seen: frozenset = frozenset()) -> bool:
        if name == want:
            return True
        if name in seen:
            return False
        defs = classes.get(name, [])
        return any(want in methods or any(has(b, seen | {name}) for b in bases) for bases, methods in defs)

    return any(has(n) for n in names) if names else None


def registered_class(engine: str, architecture: str) -> str:
    """The class an engine's model registry maps `architecture` to (vLLM maps Muse-Glimmer's
    `MuseGlimmerForConditionalGeneration` to `MuseGlimmerForCausalLM`); the name itself where it has none."""
    if engine != "vllm":
        return architecture
    root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    text = (root / "model_executor" / "models" / "registry.py").read_text(encoding="utf-8")
    found = re.search(rf'"{re.escape(architecture)}":\s*\(\s*"[^"]+",\s*"(\w+)"', text)
    return found.group(1) if found else architecture


def capture_problems(slug: str, engine: str, refused: bool) -> list[str]:
    """A supported pair needs the capture in the target's model class; a refused one must lack it (else the
    refusal is stale and should go)."""
    arch = (fixture(slug, "target").get("architectures") or ["?"])[0]
    found = captures_hidden_states(engine, arch)
    if found is None:
        return [f"{engine} has no model class for {arch}"]
    if found == refused:
        why = "has a DFlash capture: lift the refusal" if refused else "has no DFlash hidden-state capture"
        return [f"{engine}'s {arch} {why} ({CAPTURE[engine][2]})"]
    return []


def drafter_problems(slug: str, engine: str) -> list[str]:
    """The engine must know the drafter's architecture by its `architectures` name (vLLM: its model registry;
    SGLang: a model class of that name)."""
    from dflash_zoo.drafters import ARCHS

    arch = registry()[slug]["draft"]["architecture"]
    if arch is None:
        return []
    names = ARCHS[arch].architectures
    if engine == "vllm":
        root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
        text = (root / "model_executor" / "models" / "registry.py").read_text(encoding="utf-8")
        known = any(f'"{n}"' in text for n in names)
    else:
        known = any(n in model_classes("sglang") for n in names)
    return [] if known else [f"{engine} does not register the {arch} drafter ({', '.join(names)})"]


def check_vllm(slug: str, argv: list[str]) -> list[str]:
    from vllm.config.speculative import SpeculativeConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert argv[:2] == ["vllm", "serve"], argv
    args = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv[2:])
    validate_parsed_serve_args(args)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    spec = dict(engine_args.speculative_config or {})
    unknown = set(spec) - set(SpeculativeConfig.__dataclass_fields__)
    problems = [f"speculative config keys not in SpeculativeConfig: {sorted(unknown)}"] if unknown else []
    if spec.get("attention_backend"):
        problems += backend_problems(spec["attention_backend"], draft_attention(slug))
    backend = engine_args.attention_backend  # a forced target backend: a name or an AttentionBackendEnum
    if backend is not None:
        problems += backend_problems(getattr(backend, "name", str(backend)), target_attention(slug))
    return problems


def check_sglang(argv: list[str]) -> list[str]:
    from sglang.srt.server_args import prepare_server_args

    assert argv[1:3] == ["-m", "sglang.launch_server"], argv
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):  # argparse prints its whole usage on a rejected flag
            args = prepare_server_args(argv[3:])
    except SystemExit as exc:
        return [f"argparse exit {exc.code}: {err.getvalue().strip().splitlines()[-1:]}"]
    return [] if args.speculative_algorithm == "DFLASH" else [f"algorithm {args.speculative_algorithm}"]


def controls() -> list[str]:
    """Commands the engines must reject, so a silently permissive checker fails CI."""
    bad = []
    if not backend_problems("flash_attn", target_attention("kimi-k2.5")):
        bad.append("control: flash_attn on Kimi's MLA target was accepted")
    if not backend_problems("flash_attn", target_attention("gemma4-31b-it")):
        bad.append("control: flash_attn on Gemma 4's 512-wide heads was accepted")
    base = ["python", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3.5-9B"]
    for flag in (
        ["--mamba-scheduler-strategy", "extra_buffer"],
        ["--speculative-dflash-draft-window-size", "8"],
    ):
        if not check_sglang(base + flag):
            bad.append(f"control: SGLang accepted {flag[0]}")
    return bad


def marked_unsupported(slug: str) -> bool:
    """An entry dflash-zoo lists but cannot run (its reason says what is missing): `serve` refuses it."""
    return registry()[slug]["declared_status"] == "unsupported-here"


def check_refusal(slug: str, engine: str) -> list[str]:
    """A marked entry: `serve` exits 1 naming the entry's reason; no command exists for a parser to check."""
    code, _, err = serve_json(slug, engine)
    reason = registry()[slug]["reason"]
    named = code == 1 and reason in " ".join(err.split())  # the one error line may wrap
    problems = [] if named else [f"exit {code}, not 1 with the reason: {err}"]
    print(f"{'FAIL' if problems else 'ok  '} {slug:22} {engine:7} refused (unsupported here): {reason[:100]}")
    return [f"{slug} {engine}: {p}" for p in problems]


def check_pair(slug: str, engine: str) -> list[str]:
    """Problems of one `serve` command: the engine's capture for the target, then its parser or refusal."""
    if marked_unsupported(slug):
        return check_refusal(slug, engine)
    code, doc, err = serve_json(slug, engine)
    refused = (slug, engine) in EXPECTED_REFUSALS
    problems = capture_problems(slug, engine, refused) + ([] if refused else drafter_problems(slug, engine))
    if refused or code != 0:
        problems += [] if refused and code == 3 else [f"exit {code}: {err}"]
        shown = f"refused (exit {code}): {err[:120]}"
    else:
        problems += check_vllm(slug, doc["argv"]) if engine == "vllm" else check_sglang(doc["argv"])
        shown = doc["command"][:150]
    print(f"{'FAIL' if problems else 'ok  '} {slug:22} {engine:7} {shown}")
    return [f"{slug} {engine}: {p}" for p in problems]


def main() -> int:
    slugs = subprocess.run(
        ["dflash-zoo", "list", "-q"], capture_output=True, text=True, check=True
    ).stdout.split()
    failures = controls()
    for slug in slugs:
        for engine in ("vllm", "sglang"):
            failures += check_pair(slug, engine)
    for line in failures:
        print("FAILED:", line, file=sys.stderr)
    marked = sum(marked_unsupported(s) for s in slugs) * 2
    print(
        f"{len(slugs) * 2} commands checked ({marked} refused: unsupported here), {len(failures)} failure(s)"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # vLLM's EngineArgs resolves model ids to local snapshots when offline; online it only parses (the
    # parsers download nothing), so the engines' own imports run with offline mode off
    os.environ["HF_HUB_OFFLINE"] = "0"
    sys.exit(main())
