"""Two-GPU placement check (issue #6 part 4; docs/multi-gpu.md). Needs 2 CUDA devices; about 2-4 minutes.

1. lossless: tiny fp32 qwen3 and qwen3_5_text targets split over cuda:0 / cuda:1; greedy speculative and AR
   output must equal the unsplit (cuda:0) AR output;
2. a Qwen3-32B-shaped random bf16 target (`bench.SHAPES["qwen3-32b"]`, ~65 GB) built on `meta`, planned, then
   materialised module by module on its planned GPU (`bench.random_subject(..., devices)`, as
   `dflash-zoo bench --shape qwen3-32b --devices ...` does), a random 5-layer block-16 drafter on the head's
   GPU: eager AR and DFlash (what-if tau 6.5), 128 new tokens on a 512-token prompt, tok/s, per-GPU peak
   memory, and kernel time against wall time per AR token (`--big-on cuda:0 cuda:0,cuda:1` runs it on one
   GPU and on two).

Run: PYTHONPATH=. python3 scripts/gpu_multi.py --out $OUT/multi.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from _repo import ROOT, T0, map_adapters, say  # scripts/ is on sys.path when run as a script


def lossless(model_type: str, n_prompts: int = 3, new: int = 32) -> dict:
    """fp32 tiny target: split over cuda:0/cuda:1, outputs vs the unsplit target's AR greedy output."""
    from dflash_zoo.adapters import get_adapter

    from dflash_zoo.api import load
    from dflash_zoo.engine.decode import autoregressive_generate
    from dflash_zoo.engine.results import GenerationConfig
    from tests.tiny import tiny_drafter, tiny_target

    model = tiny_target(model_type, seed=0).to("cuda:0")
    drafter = tiny_drafter(model, seed=1, block_size=8)
    prompts = [
        torch.randint(3, 250, (24,), generator=torch.Generator().manual_seed(s)).tolist()
        for s in range(n_prompts)
    ]
    cfg = GenerationConfig(max_new_tokens=new)
    refs = [
        autoregressive_generate(get_adapter(model_type)(model), p, cfg, "cuda:0").output_ids for p in prompts
    ]
    pipe = load(model, drafter, device_map=["cuda:0", "cuda:1"], dtype="fp32")
    pipe.stop_token_ids = ()
    spec = [pipe.generate(p, max_new_tokens=new).output_ids == r for p, r in zip(prompts, refs, strict=True)]
    ar = [
        pipe.generate_autoregressive(p, max_new_tokens=new).output_ids == r
        for p, r in zip(prompts, refs, strict=True)
    ]
    layers = pipe.adapter.layers()
    return {
        "plan": pipe.placement.plan.to_dict(),
        "layer_gpus": sorted({next(layer.parameters()).device.index for layer in layers}),
        "speculative_equals_unsplit_ar": spec,
        "split_ar_equals_unsplit_ar": ar,
        "ok": all(spec) and all(ar),
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_time(ar) -> dict:
    """GPU kernel time per decoded token against wall time per token: is the eager loop host-bound?"""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}

    def run(n: int) -> tuple[float, float, int]:
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            ar(n)
            sync()
            wall = time.perf_counter() - t
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return wall, sum(e.device_time_total for e in events) / 1e6, len(events)

    (w1, k1, n1), (w9, k9, n9) = run(1), run(9)  # prompt + 1 token, prompt + 9: the difference is 8 decodes
    return {
        "wall_ms_per_token": (w9 - w1) / 8 * 1e3,
        "kernel_ms_per_token": (k9 - k1) / 8 * 1e3,
        "kernels_per_token": (n9 - n1) / 8,
        "note": "profiled runs (profiler overhead included in wall)",
    }


def big_run(new_tokens: int, prompt_tokens: int, devices: list[str], shape: str) -> dict:
    from dflash_zoo.bench import runner as B
    from dflash_zoo.engine.decode import SpeculativeDecoder, autoregressive_generate
    from dflash_zoo.engine.results import GenerationConfig

    t = time.time()
    dtype = torch.float32 if devices[0] == "cpu" else torch.bfloat16
    opts = B.BenchOptions(prompt_tokens=prompt_tokens)
    sub = B.random_subject(shape, devices[0], dtype, opts, devices if len(devices) > 1 else None)
    head = str(next(sub.drafter.parameters()).device)
    sync()
    build_s = time.time() - t
    say(f"built and placed in {build_s:.1f} s")
    override = B.whatif_schedule(6.5, 16)
    spec_new = B.whatif_new_tokens(6.5, new_tokens)

    def spec(n):
        cfg = GenerationConfig(max_new_tokens=n)
        dec = SpeculativeDecoder(sub.adapter, sub.drafter, sub.prompt, cfg, sub.mask_token_id, override)
        for _ in dec:
            pass
        return dec.result

    def ar(n):
        return autoregressive_generate(sub.adapter, sub.prompt, GenerationConfig(max_new_tokens=n), head)

    ar(4), spec(14)  # warm-up: kernels, allocator
    out = {
        "plan": sub.source["placement"],
        "build_and_place_seconds": build_s,
        "kernel_time": kernel_time(ar),
    }
    gpus = sorted({torch.device(d) for d in devices if d.startswith("cuda")}, key=str)
    for name, fn, n in (("autoregressive", ar, new_tokens), ("dflash_whatif_6.5", spec, spec_new)):
        for d in gpus:
            torch.cuda.reset_peak_memory_stats(d)
        res = fn(n)
        out[name] = {
            "tokens_per_second": res.tokens_per_second,
            "new_tokens": len(res.output_ids),
            "mean_acceptance_length": res.mean_acceptance_length if res.steps else 1.0,
            "ttft_seconds": res.prefill_seconds,
            "peak_memory_gib": {str(d): torch.cuda.max_memory_allocated(d) / 2**30 for d in gpus},
        }
        say(name, out[name])
    out["speedup"] = (
        out["dflash_whatif_6.5"]["tokens_per_second"] / out["autoregressive"]["tokens_per_second"]
    )
    out["note"] = "random weights; DFlash row is a projection (accept decisions forced to a tau-6.5 schedule)"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="multi.json")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument(
        "--big-on",
        nargs="*",
        default=["cuda:0,cuda:1"],
        help="device lists for the 32B shape, e.g. cuda:0 cuda:0,cuda:1 (one GPU holds it: isolates the split)",
    )
    ap.add_argument("--skip-lossless", action="store_true")
    ap.add_argument(
        "--cpu-debug", action="store_true", help="tiny shape on ['cpu', 'cpu'], no lossless checks"
    )
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))  # tests.tiny
    map_adapters()
    import transformers

    record: dict = {
        "env": {
            "argv": sys.argv,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "gpus": [torch.cuda.get_device_name(d) for d in range(torch.cuda.device_count())],
        },
        "sections": {},
    }

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1, default=str))

    if args.cpu_debug:
        jobs = [
            (
                "tiny_shape_cpu",
                lambda: big_run(args.new_tokens, args.prompt_tokens, ["cpu", "cpu"], "tiny-qwen3"),
            )
        ]
    elif torch.cuda.device_count() < 2:
        record["error"] = f"needs 2 CUDA devices, found {torch.cuda.device_count()}"
        save()
        sys.exit(record["error"])
    else:
        torch.backends.cuda.matmul.allow_tf32 = False  # the lossless check runs in true fp32
        jobs = [] if args.skip_lossless else [
            ("lossless_qwen3", lambda: lossless("qwen3")),
            ("lossless_qwen3_5_text", lambda: lossless("qwen3_5_text")),
        ]  # fmt: skip
        for spec in args.big_on:
            devs = spec.split(",")
            name = "qwen3_32b_shape" + ("" if len(devs) == 2 else f"_on_{len(devs)}")
            jobs.append((name, lambda d=devs: big_run(args.new_tokens, args.prompt_tokens, d, "qwen3-32b")))
    for name, job in jobs:
        say(name, "start")
        try:
            record["sections"][name] = job()
        except Exception as exc:  # record and go on: one broken section must not lose the others
            record["sections"][name] = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}
            say(name, "FAILED", exc)
        say(name, json.dumps(record["sections"][name], default=str)[:400])
        save()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    record["wall_seconds"] = time.time() - T0
    save()
    say("done")


if __name__ == "__main__":
    main()
