"""One device call: where the embedded demo pair's decode time goes on a GPU (issue #5's speedup ratio).

For each kernel setting of `FastEngine` (decode attention, block attention, one-row GEMV, fused elementwise
ops: `SETTINGS`) on the demo pair:
- the held-out eval through the real loop (`evaluate`: tau, tok/s both ways, speedup, identical outputs);
- GPU time per step: the captured graph replayed back to back with no host sync in between (the draft accepts
  nothing, `force = 0`, so 300 replays advance 300 positions), against the wall time per step of the eval;
  the difference is the host's share (sync, reading the results, Python);
- kernels per step and kernel time per step from `torch.profiler` (20 replays), with the largest kernels.
Then the default setting once more in fp32 (outputs must equal autoregressive decoding token for token).

    python scripts/gpu_demo_profile.py --out $OUT/profile.json [--draft DIR] [--data docs/bench/demo-held-out.jsonl]
Session 13 (docs/perf-notes.md): call 4 `--settings default,no-rope,sdpa` (rope_store was then the whole of
fused_ops, and "no-rope" is today's "no-fused"), call 5 `--settings default,rope-only`.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

import torch

from dflash_zoo import api
from dflash_zoo.cuda.fast import FastEngine
from dflash_zoo.training.evaluate import evaluate, load_prompts

SETTINGS = {  # name -> (decode_attention, block_attention, gemv, fused_ops)
    "default": (None, None, None, None),
    "rope-only": ("split", "split", True, "rope"),  # session 13, call 4: rope_store alone
    "no-fused": ("split", "split", True, False),  # session 12's default
    "no-gemv": ("split", "split", False, True),
    "sdpa": ("sdpa", "sdpa", False, False),  # no Triton kernel at all
}


def gpu_ms(eng: FastEngine, name: str, n: int = 300) -> float:
    """Milliseconds per graph replay of step `name`, replays back to back (no host sync between them)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    eng.force.fill_(0)  # spec: accept nothing, pos advances one row a step
    graph = eng._graph[name]
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    eng.force.fill_(-1)
    return start.elapsed_time(end) / n


def kernels_per_step(eng: FastEngine, name: str, n: int = 20) -> dict:
    """Kernel count and kernel time per replay, and the largest kernels by time (profiler, CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    eng.force.fill_(0)
    graph = eng._graph[name]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
    eng.force.fill_(-1)
    times, counts = collections.Counter(), collections.Counter()
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and ev.device_time > 0:
            times[ev.name[:90]] += ev.device_time
            counts[ev.name[:90]] += 1
    top = [
        {"kernel": k, "us_per_step": round(t / n, 2), "per_step": counts[k] / n}
        for k, t in times.most_common(15)
    ]
    return {"kernels": sum(counts.values()) / n, "kernel_us": sum(times.values()) / n, "top": top}


def one_setting(pipe, prompts, setting, dtype_name: str) -> dict:
    decode, block, gemv, fused = setting
    pipe._engine = None
    eng = FastEngine(pipe.adapter, pipe.drafter, pipe.mask_token_id, 2048, decode_attention=decode,
                     block_attention=block, gemv=gemv, fused_ops=bool(fused) if fused is not None else None)  # fmt: skip
    if fused == "rope":  # rope_store alone (session 13, call 4): the norm and SwiGLU kernels off again
        for part in (eng.target, eng.sdraft):
            part.norm.kernel = part.swiglu = False
    pipe._engine = eng  # evaluate() runs through this engine (max_len 2048 covers every prompt)
    t0 = time.perf_counter()
    r = evaluate(pipe, prompts, max_new_tokens=256)
    out = {
        "dtype": dtype_name,
        "decode_attention": eng.decode_attention,
        "block_attention": eng.block_attention,
        "gemv": eng.gemv,
        "fused_ops": fused if fused == "rope" else eng.fused_ops,
        "eval_seconds": time.perf_counter() - t0,
        "tau": r.mean_acceptance_length,
        "spec_tok_s": r.spec_tokens_per_second,
        "ar_tok_s": r.ar_tokens_per_second,
        "speedup": r.speedup,
        "identical": r.outputs_match_autoregressive,
        "prompts": r.prompts,
        "steps": r.steps,
        "first_divergence": r.first_divergence,
    }
    out["spec_wall_ms_per_step"] = 1e3 * r.mean_acceptance_length / r.spec_tokens_per_second
    out["ar_wall_ms_per_token"] = 1e3 / r.ar_tokens_per_second
    if not eng.graphs:  # CPU smoke run: the eval only
        return out
    with torch.inference_mode():
        eng._prefill(prompts[0], taps=True)
        out["spec_gpu_ms_per_step"] = gpu_ms(eng, "spec")
        eng._prefill(prompts[0], taps=False)
        out["ar_gpu_ms_per_token"] = gpu_ms(eng, "ar")
        eng._prefill(prompts[0], taps=True)
        out["spec_profile"] = kernels_per_step(eng, "spec")
        eng._prefill(prompts[0], taps=False)
        out["ar_profile"] = kernels_per_step(eng, "ar")
    out["step_cost_in_ar_steps_wall"] = out["spec_wall_ms_per_step"] / out["ar_wall_ms_per_token"]
    out["step_cost_in_ar_steps_gpu"] = out["spec_gpu_ms_per_step"] / out["ar_gpu_ms_per_token"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--draft", default=None, help="drafter directory (default: the embedded demo drafter)")
    ap.add_argument("--data", default="docs/bench/demo-held-out.jsonl")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--no-fp32", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts only")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    record: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "runs": {},
    }
    for dtype in ["bfloat16"] + ([] if args.no_fp32 else ["float32"]):
        pipe = api.load(None, args.draft, device=args.device, dtype=dtype)
        prompts = load_prompts(args.data, pipe.tokenizer, True, {}, 32, args.limit)
        names = args.settings.split(",") if dtype == "bfloat16" else ["default"]
        for name in names:
            key = f"{name} [{dtype}]"
            record["runs"][key] = res = one_setting(pipe, prompts, SETTINGS[name], dtype)
            brief = {k: res[k] for k in ("tau", "spec_tok_s", "ar_tok_s", "speedup", "identical")}
            brief |= {k: round(res[k], 4) for k in res if "ms_per" in k or "ar_steps" in k}
            if cuda:
                brief |= {
                    "spec_kernels": res["spec_profile"]["kernels"],
                    "ar_kernels": res["ar_profile"]["kernels"],
                }
            print(key, json.dumps(brief), file=sys.stderr, flush=True)
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
    best = record["runs"]["default [bfloat16]"]
    for step in ("spec", "ar") if cuda else ():
        print(f"\n{step}: largest kernels (default, bf16)", file=sys.stderr)
        for row in best[f"{step}_profile"]["top"]:
            print(f"  {row['us_per_step']:8.2f} us  x{row['per_step']:<5} {row['kernel']}", file=sys.stderr)


if __name__ == "__main__":
    main()
