"""One device call: the fast path's kernel-count variants on the Qwen3-8B shape (issue #6, perf-notes Version 2).

Variants (FastEngine flags): baseline (plain HF modules), fused (q/k/v and gate/up as one GEMM each),
fused+rms_norm (+ `F.rms_norm`), fused+rms_norm+compile (+ `torch.compile` of both steps; last, guarded).
Per variant: fp32 token identity on CUDA for tiny qwen3/llama (tests/tiny.py: fast DFlash and fast AR against
eager AR); then, on the random 8B shape in bf16 with a 512-token prompt, AR tok/s over 512 new tokens and
DFlash tok/s at what-if acceptance 6.5 (508 new tokens), each the median of 3 runs after a short warm-up,
plus compile / capture seconds, peak memory, and where bf16 fast DFlash first differs from fast AR (2 prompts).

Run (PYTHONPATH=. cannot see the `dflash_zoo.adapters` package-dir mapping, hence the symlink):
    ln -sfn ../adapters dflash_zoo/adapters
    PYTHONPATH=. python3 scripts/gpu_fast_variants.py --out $OUT/fast.json
CPU smoke test of the script itself: --device cpu --shape tiny-qwen3 --variants baseline fused+rms_norm
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import torch
from _repo import T0, first_diff, say  # scripts/ is on sys.path when run as a script
from dflash_zoo.adapters import get_adapter

from dflash_zoo.bench import meta as benchmeta
from dflash_zoo.bench import runner as B
from dflash_zoo.cuda.fast import FastEngine
from dflash_zoo.engine.decode import autoregressive_generate
from dflash_zoo.engine.results import GenerationConfig
from tests.tiny import VOCAB, tiny_drafter, tiny_target

VARIANTS = {
    "baseline": {"fuse": False, "fast_norm": False},
    "fused": {"fuse": True, "fast_norm": False},
    "fused+rms_norm": {"fuse": True, "fast_norm": True},
    "fused+rms_norm+compile": {"fuse": True, "fast_norm": True, "compile": True},
}
TAU, PROMPT, NEW, REPEATS, DIV_NEW = 6.5, 512, 512, 3, 64


def guarded(fn, *a) -> dict:
    """Run one section; an exception becomes {"error": ...} so the other variants still report."""
    try:
        return fn(*a)
    except Exception as exc:  # a benchmark records failures instead of losing the run
        say("FAILED", fn.__name__, exc)
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def tiny_identity(flags: dict, dev: torch.device) -> dict:
    """fp32: fast DFlash and fast AR equal eager AR token for token (2 prompts, tiny qwen3 and llama)."""
    out = {}
    for model_type in ("qwen3", "llama"):
        target = tiny_target(model_type).to(dev)
        adapter, drafter = get_adapter(model_type)(target), tiny_drafter(target, taps=[0, 2]).to(dev)
        eng = FastEngine(adapter, drafter, VOCAB - 1, 128, **flags)
        cfg, ok = GenerationConfig(max_new_tokens=32), []
        for seed in range(2):
            prompt = torch.randint(
                0, VOCAB - 1, (16,), generator=torch.Generator().manual_seed(seed)
            ).tolist()
            ref = autoregressive_generate(adapter, prompt, cfg, dev).output_ids
            spec, ar = eng.speculative(prompt, cfg).output_ids, eng.autoregressive(prompt, cfg).output_ids
            ok += [spec == ref, ar == ref]
        out[model_type] = all(ok)
    return out


def kernels_per_step(eng: FastEngine, name: str) -> int:
    """Device kernels (+ memcpy / memset) one step launches, counted by the profiler, state restored after.

    Runs the raw step function (`_steps`, private): a graph replay would show as a single launch.
    """
    from torch.profiler import ProfilerActivity, profile

    saved = eng.pos.clone(), eng.bonus.clone()
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng._steps[name]()
        torch.cuda.synchronize()
    eng.pos.copy_(saved[0]), eng.bonus.copy_(saved[1])
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def median_tok_s(fn) -> tuple[float, list[float]]:
    runs = [fn().tokens_per_second for _ in range(REPEATS)]
    return statistics.median(runs), runs


def speed(sub: B.Subject, flags: dict, dev: torch.device) -> dict:
    """AR and what-if DFlash tok/s of one variant on the 8B shape, plus one-off costs and bf16 divergence."""
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    eng = FastEngine(sub.adapter, sub.drafter, sub.mask_token_id, PROMPT + NEW + 64, **flags)
    override = B.whatif_schedule(TAU, eng.block)
    ar_cfg = GenerationConfig(max_new_tokens=NEW)
    spec_cfg = GenerationConfig(max_new_tokens=B.whatif_new_tokens(TAU, NEW))
    warm = GenerationConfig(max_new_tokens=40)  # compiles (if on) and captures both steps, not timed
    eng.autoregressive(sub.prompt, warm)
    eng.speculative(sub.prompt, warm, override)
    say("  warm:", f"compile {eng.compile_seconds:.1f} s, capture {eng.capture_seconds:.1f} s")
    ar, ar_runs = median_tok_s(lambda: eng.autoregressive(sub.prompt, ar_cfg))
    spec, spec_runs = median_tok_s(lambda: eng.speculative(sub.prompt, spec_cfg, override))
    kernels = {}
    if cuda:  # the kernel-count model of perf-notes (~2.5 us each), checked per variant
        kernels = {m: guarded(kernels_per_step, eng, m) for m in ("ar", "spec")}
    div, div_cfg = [], GenerationConfig(max_new_tokens=DIV_NEW)
    ar_ids = []
    for seed in (100, 101):
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, sub.mask_token_id, (PROMPT,), generator=gen).tolist()
        ar_ids.append(eng.autoregressive(prompt, div_cfg).output_ids)
        div.append(first_diff(eng.speculative(prompt, div_cfg).output_ids, ar_ids[-1]))
    res = {
        "ar_tok_s": ar,
        "ar_ms_per_token": 1e3 / ar,
        "dflash_tok_s": spec,
        "dflash_ms_per_step": 1e3 * TAU / spec,
        "ar_runs": ar_runs,
        "dflash_runs": spec_runs,
        "kernels_per_step": kernels,
        "compile_s": eng.compile_seconds,
        "capture_s": eng.capture_seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "allocated_gib": torch.cuda.memory_allocated() / 2**30 if cuda else 0.0,
        "bf16_first_diff_dflash_vs_ar": div,
        "ar_ids": ar_ids,  # to compare variants' bf16 AR outputs with the baseline's
    }
    return res  # the engine (K/V buffers, graphs) goes with this frame


def norm_check(dev: torch.device) -> dict:
    """bf16: HF's RMSNorm module vs `weight * F.rms_norm` (fast_norm), bitwise."""
    from dflash_zoo.cuda.static import _Norms

    norm = type(tiny_target("qwen3").model.norm)(4096, eps=1e-6).to(dev, torch.bfloat16)  # Qwen3RMSNorm
    with torch.no_grad():
        norm.weight.normal_(1, 0.2)
    x = torch.randn(1, 16, 4096, device=dev).bfloat16()
    diff = (_Norms(norm.variance_epsilon, fast=True)(norm, x) - norm(x)).abs().max().item()
    return {"max_abs_diff": diff, "bitwise_equal": diff == 0.0}


def print_table(results: dict) -> None:
    cols = f"{'variant':24s} {'AR tok/s':>9s} {'ms/tok':>7s} {'DFlash':>8s} {'ms/step':>8s} {'compile':>8s}"
    cols += f" {'capture':>8s} {'peakGiB':>8s} {'kernels':>10s} {'fp32 ok':>8s}  bf16 div"
    print(cols)
    for name, r in results.items():
        s, ok = r.get("speed", {}), r.get("tiny_fp32", {})
        if "ar_tok_s" not in s:
            print(f"{name:24s} {s.get('error', s.get('skipped', '?'))[:90]}")
            continue
        counts = [s["kernels_per_step"].get(m) for m in ("ar", "spec")]
        kern = "/".join(str(c) if isinstance(c, int) else "-" for c in counts)
        fp32 = "-" if not ok else "err" if "error" in ok else "yes" if all(ok.values()) else "NO"
        print(
            f"{name:24s} {s['ar_tok_s']:9.1f} {s['ar_ms_per_token']:7.2f} {s['dflash_tok_s']:8.1f} "
            f"{s['dflash_ms_per_step']:8.2f} {s['compile_s']:8.1f} {s['capture_s']:8.1f} {s['peak_gib']:8.2f} "
            f"{kern:>10s} {fp32:>8s}  {s['bf16_first_diff_dflash_vs_ar']}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fast_variants.json")
    ap.add_argument("--budget", type=float, default=520, help="seconds; later variants are skipped past it")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--shape", default="qwen3-8b", choices=list(B.SHAPES))
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 identity checks compare exact argmaxes
    dev = torch.device(args.device)
    record: dict = {"provenance": benchmeta.provenance(sys.argv, dev), "variants": {}}
    record["norm_check_bf16"] = guarded(norm_check, dev)
    say("norm check", record["norm_check_bf16"])
    t = time.time()
    sub = B.random_subject(args.shape, args.device, torch.bfloat16, B.BenchOptions(prompt_tokens=PROMPT))
    record["build_s"] = time.time() - t
    record["weight_bytes"] = benchmeta.weight_bytes(sub.adapter, sub.drafter)
    if dev.type == "cuda":  # fused variants must not add to this (the modules' weights become views)
        record["allocated_after_build_gib"] = torch.cuda.memory_allocated() / 2**30
    say(args.shape, "built", f"{record['build_s']:.0f} s")
    for name in args.variants:
        flags, r = VARIANTS[name], record["variants"].setdefault(name, {"flags": VARIANTS[name]})
        if time.time() - T0 > args.budget:
            r["speed"] = {"skipped": "time budget"}
            continue
        say(name, flags)
        r["speed"] = guarded(speed, sub, flags, dev)
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # 8B first: for compile, the number that matters most
        say(name, {k: v for k, v in r["speed"].items() if k not in ("ar_ids", "traceback")})
        if time.time() - T0 < args.budget:
            r["tiny_fp32"] = guarded(tiny_identity, flags, dev)
            say(name, "tiny fp32 identity", r["tiny_fp32"])
        with open(args.out, "w") as f:  # after every variant: a timeout still leaves the finished ones
            json.dump(record, f, indent=1, default=str)
    base = record["variants"].get("baseline", {}).get("speed", {}).get("ar_ids")
    for r in record["variants"].values():
        ids = r.get("speed", {}).get("ar_ids")
        if base and ids:  # bf16: how far each variant's fast AR output agrees with the baseline's
            r["bf16_first_diff_ar_vs_baseline"] = [first_diff(a, b) for a, b in zip(ids, base, strict=True)]
    record["wall_s"] = time.time() - T0
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1, default=str)
    print_table(record["variants"])
    say("done; record in", args.out)


if __name__ == "__main__":
    main()
