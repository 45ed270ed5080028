"""Rollback cost of a hybrid Gated-DeltaNet target as a fraction of one verify step (docs/hybrid-rollback.md).

Builds a random Qwen3.5-9B-shaped target in bf16 on one GPU (`dflash_zoo.bench.runner.SHAPES["qwen3.5-9b"]`:
H 4096, 32 layers = 24 Gated-DeltaNet + 8 full attention, V 248320, 16/4/256 heads, FFN 12288). For each
rollback mode (recompute, replay): prefill 512 tokens, then steps of snapshot, 16-token verify and rollback
of a random number of rejected tokens (1..15), each timed (CUDA events). Prints and writes the median
milliseconds and rollback / verify, and whether the flash-linear-attention / causal-conv1d kernels are
importable (without them transformers runs its torch reference kernels). About 1-2 minutes on an H200;
`--tiny` runs a small fp32 shape on the CPU. Uses the installed package (`pip install -e .`) and the adapter
contract only.

    python scripts/hybrid_rollback_cost.py --modes replay recompute recompute --steps 15 --out hybrid.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from dflash_zoo.bench.runner import (
    SHAPES,
    Shape,
    shape_target,
)

BLOCK = 16
# docs/hybrid-rollback.md's CPU setup (--tiny)
TINY = Shape("qwen3_5_text", hidden=256, layers=8, vocab=1024, heads=8, kv_heads=2, head_dim=32, ffn=512,
             rope_theta=1e7, mask_token_id=1023, extra=dict(linear_num_key_heads=4, linear_num_value_heads=8,
             linear_key_head_dim=32, linear_value_head_dim=32))  # fmt: skip
# config fields written to the record
RECORDED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)


def build(tiny: bool, device: str, dtype: torch.dtype):
    """(model, recorded shape): the tiny CPU shape or bench's "qwen3.5-9b", through bench's builder."""
    s = TINY if tiny else SHAPES["qwen3.5-9b"]
    model = shape_target(s, device, dtype)
    return model, {k: getattr(model.config, k) for k in (*RECORDED, *s.extra)}


def kernels() -> dict:
    from transformers.utils import import_utils as iu

    return {
        "fla_installed": importlib.util.find_spec("fla") is not None,
        "causal_conv1d_installed": importlib.util.find_spec("causal_conv1d") is not None,
        "kernels_hub_installed": importlib.util.find_spec("kernels") is not None,
        "transformers_sees_fla": iu.is_flash_linear_attention_available(),
        "transformers_sees_causal_conv1d": iu.is_causal_conv1d_available(),
    }


class Timer:
    """Milliseconds of `fn()`: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if not self.cuda:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)


def timed_step(adapter, cache, block: torch.Tensor, keep: int, timer: Timer) -> dict:
    """One decode step's cache work, each part timed: snapshot, verify of `block` [1, 16], rollback."""
    snap = None

    def take() -> None:
        nonlocal snap
        snap = adapter.snapshot(cache)

    snapshot_ms = timer(take)
    verify_ms = timer(lambda: adapter.forward(block, cache))
    rollback_ms = timer(lambda: adapter.rollback(cache, BLOCK - keep, snap, block[:, :keep]))
    return {"kept": keep, "snapshot_ms": snapshot_ms, "verify_ms": verify_ms, "rollback_ms": rollback_ms}


def run_mode(model, mode: str, prompt: list[int], steps: int, warmup: int, seed: int) -> dict:
    from dflash_zoo.adapters import get_adapter

    adapter = get_adapter("qwen3_5_text")(model, rollback=mode)
    device = next(model.parameters()).device
    timer, rng = Timer(device), random.Random(seed)
    vocab = model.config.vocab_size
    rows = []
    with torch.inference_mode():
        cache = adapter.new_cache()
        adapter.forward(torch.tensor([prompt], device=device), cache, logits_to_keep=1)
        adapter.start_decoding(cache)
        length = len(prompt)
        for step in range(warmup + steps):
            block = torch.tensor([[rng.randrange(vocab) for _ in range(BLOCK)]], device=device)  # [1, 16]
            keep = rng.randint(1, BLOCK - 1)  # bonus + accepted drafts; the rest (>= 1) is rolled back
            row = timed_step(adapter, cache, block, keep, timer)
            length += keep
            if cache.get_seq_length() != length:
                raise RuntimeError(
                    f"cache holds {cache.get_seq_length()} tokens after rollback, expected {length}"
                )
            if step >= warmup:
                rows.append(row)
    med = {k: statistics.median(r[k] for r in rows) for k in ("snapshot_ms", "verify_ms", "rollback_ms")}
    return {
        "median_ms": med,
        "rollback_over_verify": med["rollback_ms"] / med["verify_ms"],
        "snapshot_plus_rollback_over_verify": (med["snapshot_ms"] + med["rollback_ms"]) / med["verify_ms"],
        "steps": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="hybrid.json")
    ap.add_argument("--tiny", action="store_true", help="small fp32 shape on the CPU")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["recompute", "replay"],
        choices=["recompute", "replay"],
        help="run order; repeats allowed (a mode run twice shows warm-up effects)",
    )
    args = ap.parse_args()
    import transformers

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    torch.manual_seed(args.seed)
    t = time.time()
    model, shape = build(args.tiny, device, dtype)
    record = {
        "env": {
            "argv": sys.argv,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        },
        "kernels": kernels(),
        "shape": {**shape, "dtype": str(dtype), "layer_types": list(model.config.layer_types)},
        "build_seconds": time.time() - t,
        "block": BLOCK,
        "prompt_tokens": args.prompt_tokens,
        "modes": {},
    }
    prompt = torch.randint(
        0, model.config.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)
    )
    for n, mode in enumerate(args.modes):
        res = run_mode(model, mode, prompt.tolist(), args.steps, args.warmup, args.seed)
        key = mode if args.modes.count(mode) == 1 else f"{mode}#{n}"
        record["modes"][key] = res
        print(key, json.dumps({k: v for k, v in res.items() if k != "steps"}), file=sys.stderr, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"kernels: {record['kernels']}; wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
