"""CI: every `dflash-zoo serve ID --engine E --dry-run --json` command through the engine's own parser.

Run by `.ci/engine_parsers.sh` inside a venv holding the pinned vLLM and SGLang wheels (`--no-deps`) and the
few packages their parsers import. No GPU: vLLM runs with VLLM_TARGET_DEVICE=cpu, so the deepest parts that
run are its `vllm serve` argument parser, `validate_parsed_serve_args`, `EngineArgs.from_cli_args`, the
speculative-config keys against `SpeculativeConfig`'s fields, and each named attention backend's own
`validate_configuration` for an H100/H200 (compute capability 9.0) with the shapes of the golden configs in
tests/fixtures/configs. SGLang runs `prepare_server_args` (argparse plus `ServerArgs.from_cli_args`).
Supported pairs must be accepted; `EXPECTED_REFUSALS` must exit 3. Controls prove the checks can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "configs"
EXPECTED_REFUSALS = {("minimax-m2.5", "sglang")}  # SGLang has no DFlash capture for minimax_m2
UNKNOWN_BLOCK = {"minimax-m2.5"}  # the registry lacks the drafter's block size: give one
CAPABILITY = (9, 0)


def serve_json(slug: str, engine: str) -> tuple[int, dict | None, str]:
    cmd = ["dflash-zoo", "serve", slug, "--engine", engine, "--dry-run", "--json"]
    cmd += ["--block-size", "16"] if slug in UNKNOWN_BLOCK else []
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
    sizes |= {512} if cfg.get("model_type") == "gemma4" else set()  # Gemma 4 global layers: head dim 512
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
    try:
        args = prepare_server_args(argv[3:])
    except SystemExit as exc:  # argparse rejected a flag
        return [f"argparse exit {exc.code}"]
    return [] if args.speculative_algorithm == "DFLASH" else [f"algorithm {args.speculative_algorithm}"]


def controls() -> list[str]:
    """Commands the engines must reject, so a silently permissive checker fails CI."""
    bad = []
    if not backend_problems("flash_attn", target_attention("kimi-k2.5")):
        bad.append("control: flash_attn on Kimi's MLA target was accepted")
    if not backend_problems("flash_attn", target_attention("gemma4-31b-it")):
        bad.append("control: flash_attn on Gemma 4's 512-wide heads was accepted")
    base = ["python", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3.5-9B"]
    for flag in (["--mamba-scheduler-strategy", "extra_buffer"], ["--speculative-dflash-draft-window-size", "8"]):
        if not check_sglang(base + flag):
            bad.append(f"control: SGLang accepted {flag[0]}")
    return bad


def main() -> int:
    slugs = subprocess.run(["dflash-zoo", "list", "-q"], capture_output=True, text=True, check=True).stdout.split()
    failures = controls()
    for slug in slugs:
        for engine in ("vllm", "sglang"):
            code, doc, err = serve_json(slug, engine)
            expect_refusal = (slug, engine) in EXPECTED_REFUSALS
            if expect_refusal or code != 0:
                ok = expect_refusal and code == 3
                print(f"{'ok  ' if ok else 'FAIL'} {slug:22} {engine:7} refused (exit {code}): {err[:120]}")
                failures += [] if ok else [f"{slug} {engine}: exit {code}: {err}"]
                continue
            problems = check_vllm(slug, doc["argv"]) if engine == "vllm" else check_sglang(doc["argv"])
            print(f"{'FAIL' if problems else 'ok  '} {slug:22} {engine:7} {doc['command'][:150]}")
            failures += [f"{slug} {engine}: {p}" for p in problems]
    for line in failures:
        print("FAILED:", line, file=sys.stderr)
    print(f"{len(slugs) * 2} commands checked, {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # vLLM's EngineArgs resolves model ids to local snapshots when offline; online it only parses (the
    # parsers download nothing), so the engines' own imports run with offline mode off
    os.environ["HF_HUB_OFFLINE"] = "0"
    sys.exit(main())
