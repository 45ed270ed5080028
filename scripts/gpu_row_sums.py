"""One device call: the embedded demo pair, compiled, with and without `row_sums` (issue #5; perf-notes, session 11).

Question: compiled, the demo's DFlash step costs 3.9 autoregressive steps (0.67 against 0.17 ms) because its
16-row matmuls and attention stay cuBLAS / SDPA calls that inductor cannot fuse across. With every matmul and
attention of a step written as products and sums (`FastEngine(row_sums=True)`; the demo's weights fit in L2),
does the step shrink, and the compiled speedup reach 2.5x?

For each setting, the same evaluation as `dflash-zoo eval --data docs/bench/demo-held-out.jsonl
--max-new-tokens 256 --compile` (bf16; warm-up on the longest prompt first, so compile and capture are not timed),
then the same in fp32 with row sums (outputs must all equal autoregressive decoding).

Run (PYTHONPATH=. cannot see the `dflash_zoo.adapters` package-dir mapping, hence the symlink):
    ln -sfn ../adapters dflash_zoo/adapters
    PYTHONPATH=. python3 scripts/gpu_row_sums.py --out $OUT/row_sums.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from _repo import ROOT, say  # scripts/ is on sys.path when run as a script

from dflash_zoo import benchmeta
from dflash_zoo.api import load
from dflash_zoo.evaluate import evaluate, load_prompts
from dflash_zoo.fast import FastEngine

DATA = ROOT / "docs" / "bench" / "demo-held-out.jsonl"


def run(dtype: str, row_sums: bool, args) -> dict:
    pipe = load(device=args.device, dtype=dtype)
    pipe.compile = True
    # the engine `generate` would build, with row_sums set by hand (sized as Pipeline sizes it)
    pipe._engine = FastEngine(
        pipe.adapter, pipe.drafter, pipe.mask_token_id, 2048, compile=True, row_sums=row_sums
    )
    prompts = load_prompts(str(DATA), pipe.tokenizer, False, pipe.chat_template_kwargs, 32, args.limit)
    t = time.time()
    res = evaluate(pipe, prompts, max_new_tokens=args.new_tokens).to_dict()
    eng = pipe._engine
    out = {k: v for k, v in res.items() if not isinstance(v, list | dict)}
    out |= {
        "row_sums": eng.row_sums,
        "decode_attention": eng.decode_attention,
        "compile_seconds": eng.compile_seconds,
        "wall_seconds": time.time() - t,
        "dflash_ms_per_step": 1e3 * res["mean_acceptance_length"] / res["spec_tokens_per_second"],
        "ar_ms_per_token": 1e3 / res["ar_tokens_per_second"],
        "histogram": res["histogram"],
    }
    if args.profile and pipe.device.type == "cuda":
        out["profile"] = {name: profile_step(eng, name) for name in ("spec", "ar")}
    say(dtype, "row_sums" if row_sums else "cublas", {k: v for k, v in out.items() if k != "histogram"})
    return out


def profile_step(eng: FastEngine, name: str) -> dict:
    """Kernel count and time of one raw (uncaptured) compiled step, with the eight largest kernels."""
    from torch.profiler import ProfilerActivity, profile

    rewind = eng._rewind()
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng._steps[name]()
        torch.cuda.synchronize()
    rewind()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    top = sorted(events, key=lambda e: -e.device_time_total)[:8]
    return {
        "kernels": len(events),
        "kernel_us_total": sum(e.device_time_total for e in events),
        "top": [{"name": e.name[:80], "us": e.device_time_total} for e in top],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="row_sums.json")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts only (a CPU dry run)")
    ap.add_argument("--profile", action="store_true", help="kernel profile of one spec and one AR step")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 run checks exact token identity
    rec: dict = {"provenance": benchmeta.provenance(sys.argv, torch.device(args.device)), "runs": {}}
    for name, dtype, rs in (("bf16_row_sums", "bf16", True), ("fp32_row_sums", "fp32", True),
                            ("bf16_cublas", "bf16", False)):  # fmt: skip
        try:
            rec["runs"][name] = run(dtype, rs, args)
        except Exception as exc:  # record and go on
            rec["runs"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            say(name, "FAILED", exc)
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1, default=str)
    say("done", args.out)


if __name__ == "__main__":
    main()
