"""One device call: Version 3 of the fast path on the Qwen3-8B shape (issue #6; docs/perf-notes.md, Version 3).

Question: where do the 5.83 ms of a compiled autoregressive step go above the 3.6 ms of weight streaming, and
does inductor's coordinate descent tuning (batch-1 matmuls lowered to tuned Triton GEMVs) or the explicit-sum
attention ("sums": reductions over every key instead of one SDPA block per KV head) close the gap to 5 ms?

Sections, each guarded and skipped past `--budget` seconds:
1. GEMV bandwidth per weight shape of the 8B (one layer's q/k/v, o, gate/up, down and the LM head):
   cuBLAS `F.linear` vs the same call compiled with coordinate descent tuning (timed as CUDA graphs).
2. Attention per layer at S = the engine's key length, T = 1 (decode) and T = 16 (verify): masked SDPA
   eager vs "sums" compiled.
3. Kernel time by name of one uncompiled autoregressive step (profiler): the largest consumers.
4. Engines (compile + coordinate descent): autoregressive tok/s per `--decode` attention (the T = 1 step);
   then DFlash tok/s at what-if acceptance 6.5 (its verify and draft use SDPA whatever the decode attention);
   then fp32 token identity on CUDA for tiny qwen3 / llama.
Second call: `--sections identity --decode flex --dflash flex` (flex_attention was an option then, since
removed: it measured slower than SDPA at T = 1).
Session 12 (the Triton kernels of kernels.py; records docs/bench/2026-12-01-h200-split-*.json):
    --sections attention uncompiled --decode chunks --dflash split --block split --budget 380
    --sections gemv uncompiled --decode --dflash split --block split --gemv --budget 200
Session 13 (uncompiled only, the fused norm/rotary/K-V write of kernels.rope_store):
    --sections uncompiled --decode --variants split_gemv split_gemv_fused

Run (PYTHONPATH=. cannot see the `dflash_zoo.adapters` package-dir mapping, hence the symlink):
    ln -sfn ../adapters dflash_zoo/adapters
    PYTHONPATH=. python3 scripts/gpu_fast_v3.py --out $OUT/v3.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from _repo import say  # scripts/ is on sys.path when run as a script

from dflash_zoo.bench import meta as benchmeta
from dflash_zoo.bench import runner as B
from dflash_zoo.cuda import kernels
from dflash_zoo.cuda.fast import COMPILE_OPTIONS, FastEngine
from dflash_zoo.cuda.static import BLOCK_ATTENTION, DECODE_ATTENTION, _group_mask, _grouped_sdpa
from dflash_zoo.engine.results import GenerationConfig
from scripts.gpu_fast_variants import NEW, PROMPT, TAU, guarded, median_tok_s, tiny_identity

REPS = 20  # calls per captured graph in the micro-benchmarks


def graph_us(fn) -> float:
    """Microseconds per call of `fn`, REPS calls captured in one CUDA graph, median of 5 replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / REPS)
    return sorted(times)[2]


def compiled(fn):
    return torch.compile(fn, options=dict(COMPILE_OPTIONS), dynamic=False, fullgraph=True)


def gemv(sub: B.Subject) -> dict:
    """Achieved read bandwidth of each batch-1 projection of the 8B: cuBLAS vs coordinate-descent Triton."""
    attn, mlp = sub.adapter.layers()[0].self_attn, sub.adapter.layers()[0].mlp
    with torch.no_grad():
        shapes = {
            "qkv": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
            "o": attn.o_proj.weight,
            "gate_up": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
            "down": mlp.down_proj.weight,
            "lm_head": sub.adapter.model.get_output_embeddings().weight,
        }
    out = {}
    for name, w in shapes.items():
        x = torch.randn(1, 1, w.shape[1], device=w.device, dtype=w.dtype)
        row = {"shape": list(w.shape), "mbytes": w.numel() * w.element_size() / 1e6}
        with torch.inference_mode():
            row["cublas_us"] = graph_us(lambda w=w, x=x: F.linear(x, w))
            tuned = compiled(lambda x, w: F.linear(x, w))
            tuned(x, w)  # compile + tune outside the timing
            row["tuned_us"] = graph_us(lambda w=w, x=x, f=tuned: f(x, w))
        for k in ("cublas", "tuned"):
            row[f"{k}_tb_s"] = row["mbytes"] / row[f"{k}_us"]  # MB/us = TB/s
        out[name] = row
        say("gemv", name, row)
    return out


def split_gemv_row(w: torch.Tensor, gated: bool) -> dict:
    """One one-row projection: cuBLAS (SiLU and product as their own kernels), inductor, the split-K kernel."""
    x, gate = (torch.randn(1, 1, w.shape[1], device=w.device, dtype=w.dtype) for _ in range(2))
    g = gate if gated else None

    def torch_path(x, gate, w):
        return F.linear(F.silu(gate) * x if gated else x, w)

    fused = compiled(torch_path)
    row: dict = {"mbytes": w.numel() * w.element_size() / 1e6}
    with torch.inference_mode():
        fused(x, gate, w)
        row["cublas_us"] = graph_us(lambda: torch_path(x, gate, w))
        row["inductor_us"] = graph_us(lambda: fused(x, gate, w))
        ref = torch_path(x.float(), gate.float(), w.float())
        got = kernels.gemv(x, w, None, g)
        row["split_us"] = graph_us(lambda: kernels.gemv(x, w, None, g))
        row["split_config"] = kernels._gemv_config(x, w, g)
        row["max_abs_diff_split_vs_fp32"] = (got.float() - ref).abs().max().item()
        row["max_abs_diff_cublas_vs_fp32"] = (torch_path(x, gate, w).float() - ref).abs().max().item()
    for k in ("cublas", "inductor", "split"):
        row[f"{k}_tb_s"] = row["mbytes"] / row[f"{k}_us"]
    return row


def split_gemv(sub: B.Subject) -> dict:
    """The one-row down (SiLU input fused) and o projections of the 8B."""
    attn, mlp = sub.adapter.layers()[0].self_attn, sub.adapter.layers()[0].mlp
    out = {"down": split_gemv_row(mlp.down_proj.weight, True), "o": split_gemv_row(attn.o_proj.weight, False)}
    say("split_gemv", out)
    return out


def attention_row(t: int, size: int) -> dict:
    """Per-layer masked attention of the 8B (32 q heads, 8 KV heads, d 128): T query rows over `size` keys."""
    dev, scale = torch.device("cuda"), 128**-0.5
    q = torch.randn(1, 32, t, 128, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, size, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    pos = PROMPT + NEW // 2
    visible = torch.arange(size, device=dev)[None, :] <= torch.arange(pos, pos + t, device=dev)[:, None]
    gmask = _group_mask(visible, 4, torch.bfloat16)
    row = {}
    with torch.inference_mode():
        ref = _grouped_sdpa(q, k, v, gmask, scale)
        row["sdpa_us"] = graph_us(lambda: _grouped_sdpa(q, k, v, gmask, scale))
        exact = _grouped_sdpa(q.float(), k.float(), v.float(), gmask.float(), scale)
        row["max_abs_diff_sdpa_vs_fp32"] = (ref.float() - exact).abs().max().item()
        for name in set(DECODE_ATTENTION) - {"sdpa"}:
            fn = compiled(DECODE_ATTENTION[name])
            row[f"max_abs_diff_{name}_vs_fp32"] = (
                (fn(q, k, v, gmask, scale).float() - exact).abs().max().item()
            )
            row[f"{name}_compiled_us"] = graph_us(lambda fn=fn: fn(q, k, v, gmask, scale))
        split = DECODE_ATTENTION["split"]
        for per_sm in (1, 2, 4):  # uncompiled: the custom op is opaque to inductor anyway
            kernels.PROGRAMS_PER_SM = per_sm
            row[f"split_{per_sm}_per_sm_chunks"] = kernels.chunking(size, 8, kernels._sms_of(0))[1]
            row[f"split_{per_sm}_per_sm_us"] = graph_us(lambda: split(q, k, v, gmask, scale))
        kernels.PROGRAMS_PER_SM = 2
    say("attention", t, row)
    return row


def attention(size: int) -> dict:
    """T = 1 (decode) and T = 16 (verify rows)."""
    return {f"T={t}": attention_row(t, size) for t in (1, 16)}


def profile_ar(sub: B.Subject, eng: FastEngine) -> dict:
    """Kernel time by kernel name in one raw (uncaptured) autoregressive step; the ten largest."""
    from torch.profiler import ProfilerActivity, profile

    rewind = eng._rewind()
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng._steps["ar"]()
        torch.cuda.synchronize()
    rewind()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name[:90]][0] += e.device_time_total
            by_name[e.name[:90]][1] += 1
    total = sum(v[0] for v in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:10]
    return {
        "kernel_us_total": total,
        "kernels": sum(v[1] for v in by_name.values()),
        "top": [{"name": n, "us": v[0], "calls": v[1]} for n, v in top],
    }


def engine(
    sub: B.Subject,
    attention: str,
    spec: bool,
    block: str = "sdpa",
    compile: bool = True,
    gemv: bool = False,
    fused_ops: bool = False,
) -> dict:
    """Engine (compiled: coordinate descent): AR tok/s, and DFlash tok/s at what-if 6.5 when `spec`."""
    torch.cuda.reset_peak_memory_stats()
    size = PROMPT + NEW + 64
    flags = dict(
        compile=compile, decode_attention=attention, block_attention=block, gemv=gemv, fused_ops=fused_ops
    )
    eng = FastEngine(sub.adapter, sub.drafter, sub.mask_token_id, size, **flags)
    warm = GenerationConfig(max_new_tokens=40)
    eng.autoregressive(sub.prompt, warm)
    res = {"ar_compile_s": eng.compile_seconds}
    ar, runs = median_tok_s(lambda: eng.autoregressive(sub.prompt, GenerationConfig(max_new_tokens=NEW)))
    res |= {"ar_tok_s": ar, "ar_ms_per_token": 1e3 / ar, "ar_runs": runs}
    say("engine", attention, res)
    if spec:
        override = B.whatif_schedule(TAU, eng.block)
        eng.speculative(sub.prompt, warm, override)
        res["spec_compile_s"] = eng.compile_seconds - res["ar_compile_s"]
        cfg = GenerationConfig(max_new_tokens=B.whatif_new_tokens(TAU, NEW))
        tok_s, runs = median_tok_s(lambda: eng.speculative(sub.prompt, cfg, override))
        res |= {"dflash_tok_s": tok_s, "dflash_ms_per_step": 1e3 * TAU / tok_s, "dflash_runs": runs}
    res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if compile:
        res["profile_compiled_ar"] = guarded(profile_ar, sub, eng)
    say("engine", attention, block, gemv, {k: v for k, v in res.items() if k != "profile_compiled_ar"})
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="v3.json")
    ap.add_argument("--budget", type=float, default=530)
    sections = ["micro", "attention", "gemv", "uncompiled", "identity"]  # micro includes attention
    ap.add_argument("--sections", nargs="*", default=["micro", "identity"], choices=sections)
    ap.add_argument("--decode", nargs="*", default=["sums", "sdpa"], choices=sorted(DECODE_ATTENTION))
    ap.add_argument(
        "--dflash", choices=sorted(DECODE_ATTENTION), help="engine for the DFlash run (default: fastest AR)"
    )
    ap.add_argument("--block", default="sdpa", choices=sorted(BLOCK_ATTENTION), help="verify/draft attention")
    ap.add_argument("--gemv", action="store_true", help="split-K kernel for one-row o/down (the DFlash run)")
    ap.add_argument(
        "--variants", nargs="*", default=["sdpa", "split", "split_gemv"], help="uncompiled engines"
    )
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 identity check compares exact argmaxes
    t0, dev = time.time(), torch.device("cuda")
    rec: dict = {"provenance": benchmeta.provenance(sys.argv, dev), "compile_options": COMPILE_OPTIONS}

    def section(name, fn, *a):
        if time.time() - t0 > args.budget:
            rec[name] = {"skipped": "time budget"}
        else:
            rec[name] = guarded(fn, *a)
        with open(args.out, "w") as f:  # after every section: a timeout keeps the finished ones
            json.dump(rec, f, indent=1, default=str)
        return rec[name]

    sub = B.random_subject("qwen3-8b", "cuda", torch.bfloat16, B.BenchOptions(prompt_tokens=PROMPT))
    plain = FastEngine(sub.adapter, sub.drafter, sub.mask_token_id, PROMPT + NEW + 64)  # fused, rms_norm
    if "micro" in args.sections:
        section("gemv", gemv, sub)
    if {"micro", "attention"} & set(args.sections):
        section("attention", attention, plain.size)
    if "gemv" in args.sections:
        section("split_gemv", split_gemv, sub)
    if "micro" in args.sections:
        section("profile_uncompiled_ar", profile_ar, sub, plain)
    del plain
    if "uncompiled" in args.sections:  # the default (uncompiled) engine: SDPA everywhere vs the split kernels
        variants = {
            "sdpa": ("sdpa", False, False),
            "split": ("split", False, False),
            "split_gemv": ("split", True, False),
            "split_gemv_fused": ("split", True, True),  # session 13: + fused_ops.py (call 4: rope_store only)
        }
        for name in args.variants:
            attend, split_k, fused = variants[name]
            section(f"uncompiled_{name}", engine, sub, attend, True, attend, False, split_k, fused)
    for name in args.decode:  # autoregressive step only
        section(f"engine_{name}", engine, sub, name, False)
    if not (args.decode or args.dflash):  # no compiled engine asked for
        rec["wall_s"] = time.time() - t0
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1, default=str)
        return
    runs = {n: rec[f"engine_{n}"].get("ar_tok_s", 0) for n in args.decode}
    best = args.dflash or max(runs, key=runs.get)
    rec["dflash_decode_attention"] = best
    section("engine_with_dflash", engine, sub, best, True, args.block, True, args.gemv)
    if "identity" in args.sections:
        flags = {"compile": True, "decode_attention": best, "block_attention": args.block, "gemv": args.gemv}
        section("tiny_fp32_identity", tiny_identity, flags, dev)
    rec["wall_s"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1, default=str)
    say("done", args.out)


if __name__ == "__main__":
    main()
