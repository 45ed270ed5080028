"""`bench`: autoregressive vs DFlash on the same target and prompt, with a provenance record.

Sources: a real pair (`--target/--draft` or a registry id, via `api.load`), the embedded demo pair, or a
random-weight target of a named shape (`shapes.py`, from published config.json files; nothing is downloaded).
Paths: `eager` (decode.py, the reference) and `fast` (cuda/static/fast.py: static caches + CUDA graphs), each
built by the engine factory (engine/factory.py) with the fast engine's options from the environment
(`FastOptions.from_env`, with `graphs` and `compile` from the bench options), written whole into the record.
Reported per path and mode: tok/s (median over repeats), speedup, mean acceptance length + histogram, time to
first token, peak GPU memory, and the fraction of the bandwidth roofline (streamed weight bytes over a device
copy bandwidth measured in the same run). `what_if_acceptance` forces the accept decision to a schedule with
exactly that mean (target and drafter still run for real): such records are labelled "projection".

Longer than the ~300 lines we aim for: subjects, schedules, measurement and the record schema of one benchmark, read together.
"""

from __future__ import annotations

import logging
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from math import floor
from typing import Any

import torch

from dflash_zoo.bench import meta as benchmeta
from dflash_zoo.bench.shapes import CODER_MOE, SHAPES, Shape, shape_target  # noqa: F401 (re-exported)
from dflash_zoo.bench.shapes import shape_drafter as _random_drafter
from dflash_zoo.cuda.ops import fp8, gemv, moe
from dflash_zoo.engine.factory import build_engine
from dflash_zoo.engine.options import EngineOptions, FastOptions
from dflash_zoo.engine.results import GenerationConfig, GenerationResult, first_difference
from dflash_zoo.errors import InvalidArgumentError

log = logging.getLogger("dflash_zoo")
SCHEMA = "dflash-zoo.bench/1"


@dataclass(frozen=True)
class BenchOptions:
    prompt_tokens: int = 512
    new_tokens: int = 512
    block_size: int | None = None
    warmup: int = 1
    repeats: int = 3
    graphs: bool | None = None  # --graphs: CUDA graphs on the fast path (None: on for CUDA)
    compile: bool = False  # --compile: torch.compile the fast path's steps (compile time reported apart)
    paths: tuple[str, ...] = ("fast",)
    what_if_acceptance: float | None = None
    seed: int = 0
    temperature: float = 0.0  # > 0: speculative sampling (the acceptance rule named in the record)
    top_p: float = 1.0
    top_k: int = 0
    profile: bool = False  # --profile: per-step device time and kernels of the fast path (bench/profile.py)
    draft_arch: str | None = None  # --draft-arch: a --shape's drafter as this architecture (None: its own)


@dataclass
class Subject:
    """What is benchmarked: the adapter, drafter, prompt and a description for the record."""

    adapter: Any
    drafter: Any
    mask_token_id: int
    prompt: list[int]
    source: dict[str, Any]
    placement: Any = None  # a `placement.Placement` when the target is split across devices (eager only)
    # a prompt set (bench/prompts.py): each repeat decodes all of them; `prompt` is then the longest one
    prompts: list[list[int]] = field(default_factory=list)


# ---- what-if acceptance -----------------------------------------------------------------------------
def whatif_schedule(tau: float, block_size: int) -> Callable[[int, int], int]:
    """Forced accepted-draft counts whose committed tokens per step (na + 1) average exactly `tau`.

    Step s commits floor((s+1) tau) - floor(s tau) tokens (alternating floor / ceil for tau = 6.5), so any
    whole number of periods (`whatif_new_tokens`) has mean exactly tau.
    """
    frac = Fraction(str(tau)).limit_denominator(1000)
    if not 1 <= frac <= block_size:
        raise InvalidArgumentError(
            f"--what-if-acceptance {tau} must lie in [1, block size {block_size}]: a step commits at most "
            "one block",
            hint=f"use a value from 1 to {block_size}, or a larger --block-size where the drafter allows it",
        )

    def override(step: int, num_drafts: int) -> int:
        return floor((step + 1) * frac) - floor(step * frac) - 1

    return override


def whatif_new_tokens(tau: float, requested: int) -> int:
    """New tokens (first token + a whole number of schedule periods) closest to `requested` from below."""
    frac = Fraction(str(tau)).limit_denominator(1000)
    period = frac.denominator
    steps = max(period, int((requested - 1) / frac) // period * period)
    return 1 + int(steps * frac)


# ---- building subjects ---------------------------------------------------------------------------
def random_subject(
    name: str, device: str, dtype: torch.dtype, opts: BenchOptions, devices: list[str] | None = None
) -> Subject:
    """A random-weight target of shape `name` and a random drafter for it (no download).

    devices: split the target over these devices. It is built on `meta` and each module is allocated and
    initialised on its planned device (`placement.materialise`), so it never sits whole on one; the drafter
    goes on the head's device.
    """
    from dflash_zoo.adapters import get_adapter

    s = SHAPES[name]
    torch.manual_seed(opts.seed)
    positions = max(40960, opts.prompt_tokens + opts.new_tokens + 64)
    placement = None
    if devices:
        from dflash_zoo.cuda.placement.hooks import apply_placement, materialise
        from dflash_zoo.cuda.placement.plan import module_bytes, plan_placement

        model = shape_target(s, "meta", dtype, positions)
        adapter = get_adapter(s.model_type)(model)
        reserve = module_bytes(_random_drafter(s, "meta", dtype, opts.draft_arch))
        plan = plan_placement(adapter, devices, reserve_bytes=reserve)
        materialise(model, adapter, plan)
        placement = apply_placement(model, adapter, plan)
        drafter = _random_drafter(s, plan.head, dtype, opts.draft_arch)
        placement.attach_drafter(drafter)
    else:
        adapter = get_adapter(s.model_type)(shape_target(s, device, dtype, positions))
        drafter = _random_drafter(s, device, dtype, opts.draft_arch)
    gen = torch.Generator().manual_seed(opts.seed)
    # ids below the mask id, which sits near the top of most tables; a mask id low in the table (Gemma 4's 4)
    # would leave a handful of ids, so there the whole table is drawn from, the mask id moved one up
    high = s.mask_token_id if s.mask_token_id >= s.vocab // 2 else s.vocab
    ids = torch.randint(0, high, (opts.prompt_tokens,), generator=gen).tolist()
    prompt = [t + 1 if t == s.mask_token_id else t for t in ids]
    source = {
        "kind": "shape",
        "shape": name,
        **{k: v for k, v in vars(s).items() if k != "extra"},
        "weights": "random",
        "placement": placement.plan.to_dict() if placement else None,
        "draft_arch": drafter.arch,
    }
    return Subject(adapter, drafter, s.mask_token_id, prompt, source, placement)


def pair_subject(
    target: str | None,
    draft: str | None,
    device: str,
    dtype: torch.dtype,
    opts: BenchOptions,
    devices: str | None = None,
    prompt_set: Any = None,
    raw: bool = False,
) -> Subject:
    """A real pair (paths, Hub ids, a registry id) or, with neither, the embedded demo pair.

    devices: split the target over these devices ("cuda:0,cuda:1" / "auto"; api.load's `device_map`).
    prompt_set: a `prompts.PromptSet` to decode (raw: no chat template); None: one fixed prompt.
    """
    from dflash_zoo.api import load
    from dflash_zoo.bench.prompts import token_ids

    pipe = load(target, draft, device=None if devices else device, dtype=dtype, device_map=devices)
    prompts = []
    if prompt_set is not None:
        prompts = token_ids(prompt_set, pipe.tokenizer, opts.prompt_tokens, raw, pipe.chat_template_kwargs)
        prompt = max(prompts, key=len)
    else:
        prompt = benchmeta.text_prompt(
            pipe.tokenizer, opts.prompt_tokens, pipe.mask_token_id, pipe.drafter.cfg.vocab_size
        )
    source = {
        "kind": "demo" if target is None and draft is None else "pair",
        "target": target,
        "draft": draft,
        "registry": benchmeta.registry_entry(target),
        "placement": pipe.placement.plan.to_dict() if pipe.placement else None,
        "prompts": None if prompt_set is None else {"set": prompt_set.name, "count": len(prompts)},
    }
    return Subject(pipe.adapter, pipe.drafter, pipe.mask_token_id, prompt, source, pipe.placement, prompts)


# ---- measuring -------------------------------------------------------------------------------------
def _measure(
    fn: Callable[[], GenerationResult],
    opts: BenchOptions,
    devices: list[torch.device],
    warm: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Median tok/s over `opts.repeats` runs; peak memory summed over `devices` (all of a split target).

    warm: what a warm-up runs (default `fn`; for a prompt set, its longest prompt alone).
    """
    gpus = [d for d in devices if d.type == "cuda"]
    for _ in range(opts.warmup):
        (warm or fn)()
    for d in gpus:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)
    runs = [fn() for _ in range(opts.repeats)]
    res = runs[-1]
    tps = [r.tokens_per_second for r in runs]
    return {
        "tokens_per_second": statistics.median(tps),
        "tokens_per_second_runs": tps,
        "new_tokens": len(res.output_ids),
        "steps": len(res.steps),
        "mean_acceptance_length": res.mean_acceptance_length if res.steps else 1.0,
        "histogram": {str(k): v for k, v in res.histogram.items()},
        "ttft_seconds": statistics.median(r.prefill_seconds for r in runs),
        "peak_memory_bytes": sum(torch.cuda.max_memory_allocated(d) for d in gpus) if gpus else None,
        "peak_memory_bytes_per_device": {str(d): torch.cuda.max_memory_allocated(d) for d in gpus} or None,
        "output_ids": res.output_ids,
    }


def fast_options(opts: BenchOptions) -> FastOptions:
    """The fast engine's options for a bench: the environment's, with the bench's `graphs` and `compile`."""
    return FastOptions.from_env(graphs=opts.graphs, compile=opts.compile)


def _runners(path: str, sub: Subject, cfg: GenerationConfig, override, max_len: int, fast: FastOptions):
    """(autoregressive, dflash) callables for one engine ("eager" or "fast"), and the engine."""
    options = EngineOptions(fast=path == "fast", fast_options=fast)
    eng, _ = build_engine(
        sub.adapter, sub.drafter, sub.mask_token_id, options, max_len, block_size=cfg.block_size,
        split=sub.placement is not None, require=path,
    )  # fmt: skip
    ar, spec = (
        (lambda p=sub.prompt: eng.autoregressive(p, cfg)),
        (lambda p=sub.prompt: eng.speculative(p, cfg, accept_override=override)),
    )
    return ar, spec, eng


def _engine_settings(eng: Any) -> dict[str, Any]:
    """What the fast path ran with, for the record: the kernels chosen for the device from its options (those
    are in `fast_options`), the inductor options when compiled, and the kernels' tuned configs."""
    k = eng.kernels
    return {
        "graphs": eng.graphs,
        "compile": eng.compile,
        "compile_options": eng.compile_options if eng.compile else None,
        "decode_attention": k.decode_attention,
        "block_attention": k.block_attention,
        "gemv": k.gemv,
        "gemv_configs": gemv.tuned_configs() if k.gemv else None,  # (rows, K tile, programs/SM, warps)
        "fused_ops": k.fused_ops,
        "moe_rows": k.moe_rows,
        "dependent_launch": k.dependent_launch,
        "expert_configs": moe.tuned_configs() if k.moe_rows else None,  # (rows, K tile, warps)
        # an FP8 target's projections (cuda/static/fp8.py): the mode, and the FP8 kernels' timed configs
        **({"fp8": k.fp8, "fp8_configs": fp8.tuned_configs() or None} if eng.target.fp8_weights else {}),
    }


def run_bench(sub: Subject, opts: BenchOptions, argv: list[str] | None = None) -> dict[str, Any]:
    """Measure every requested path; returns the JSON record (schema `SCHEMA`)."""
    from dflash_zoo.bench.prompts import over_set

    device = next(sub.drafter.parameters()).device
    devices = [torch.device(d) for d in sub.placement.plan.devices] if sub.placement else [device]
    if sub.placement and "fast" in opts.paths:
        raise ValueError("a target split across devices runs the eager path only (--path eager)")
    new_tokens, override = opts.new_tokens, None
    block = opts.block_size or sub.drafter.cfg.block_size
    if opts.what_if_acceptance is not None:
        override = whatif_schedule(opts.what_if_acceptance, block)
        new_tokens = whatif_new_tokens(opts.what_if_acceptance, opts.new_tokens)
    cfg = GenerationConfig(
        max_new_tokens=new_tokens,
        block_size=block,
        temperature=opts.temperature,
        top_p=opts.top_p,
        top_k=opts.top_k,
        seed=opts.seed if opts.temperature > 0 else None,
    )
    bw = benchmeta.copy_bandwidth(device)
    wbytes = benchmeta.weight_bytes(sub.adapter, sub.drafter, block)
    fast = fast_options(opts)
    results: dict[str, Any] = {}
    for path in opts.paths:
        log.info("bench: %s path", path)
        ar_fn, spec_fn, eng = _runners(path, sub, cfg, override, len(sub.prompt) + new_tokens, fast)
        if sub.prompts:  # each repeat decodes the whole set; a warm-up only its longest prompt (`sub.prompt`)
            ar, spec = (_measure(over_set(f, sub.prompts), opts, devices, warm=f) for f in (ar_fn, spec_fn))
        else:
            ar, spec = _measure(ar_fn, opts, devices), _measure(spec_fn, opts, devices)
        benchmeta.add_roofline(ar, spec, wbytes, bw)
        results[path] = {
            "autoregressive": ar,
            "dflash": spec,
            "speedup": spec["tokens_per_second"] / max(ar["tokens_per_second"], 1e-9),
            # greedy with real drafts: the first token where the DFlash output leaves the autoregressive one
            # (None: equal), the bf16 verify-versus-decode numerics check; not defined for projections
            "first_divergence": first_difference(spec["output_ids"], ar["output_ids"])
            if override is None and opts.temperature == 0
            else None,
            # one-off costs, paid in the warm-up runs (not in tok/s when warmup >= 1); None for eager
            "compile_seconds": eng.compile_seconds if path == "fast" else None,
            "capture_seconds": eng.capture_seconds if path == "fast" else None,
            "engine": _engine_settings(eng) if path == "fast" else None,
        }
        if opts.profile and path == "fast":
            from dflash_zoo.bench.profile import profile_steps

            results[path]["profile"] = profile_steps(eng, sub.prompt, cfg)
    return {
        "schema": SCHEMA,
        "kind": "projection" if override else "measurement",
        "projection": None
        if override is None
        else {
            "what_if_acceptance": opts.what_if_acceptance,
            "note": "accept decisions follow a fixed schedule with this mean; drafts are not checked",
        },
        "options": {
            **vars(opts),
            "paths": list(opts.paths),
            "new_tokens_effective": new_tokens,
            "block_size": block,
        },
        "subject": {**sub.source, "prompt_tokens": len(sub.prompt), "weight_bytes": wbytes},  # longest prompt
        "device": {"type": device.type, "copy_bandwidth_bytes_per_s": bw},
        "results": results,
        "fast_options": fast.to_dict(),  # how the fast path was asked to run (`FastOptions.from_dict` reads it)
        "provenance": benchmeta.provenance(argv if argv is not None else sys.argv, device),
    }
