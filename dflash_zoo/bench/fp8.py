"""`bench --fp8`: an FP8 target built from a random-weight shape without the Hub, measured against its bf16 self.

`to_fp8` turns the decoder layers' `nn.Linear` modules into transformers' `FP8Linear` holding their weights in
its fine-grained layout (float8_e4m3fn, one fp32 `weight_scale_inv` per 128 x 128 block, amax / 448:
`ops.fp8.quantize`, the arithmetic of transformers' `Fp8Quantize`) and marks the model as transformers marks a
pre-quantized FP8 checkpoint it loaded (`config.quantization_config`, `hf_quantizer`). The embedding, the LM
head and the norms stay in 16 bits, as FP8 checkpoints keep them. Nothing is fetched: transformers' own FP8
forward needs a kernel from the Hub (`kernels-community/finegrained-fp8`), but the static engine reads the
modules' tensors only.

`run_fp8_bench` measures the bf16 target first (`runner.run_bench`), then the same weights quantized, and
writes one record: the FP8 target's results where `run_bench` puts them, and under `fp8` the bf16 results, the
tok/s ratios, and a divergence report: both targets' greedy outputs on the same random prompts (fast engine,
the bench's activation dtype), the first position where they part per prompt and the share of tokens that
are equal position by position.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn

from dflash_zoo.bench.runner import BenchOptions, Subject, fast_options, run_bench
from dflash_zoo.cuda.ops import fp8 as fp8_ops
from dflash_zoo.engine.factory import build_engine
from dflash_zoo.engine.options import EngineOptions
from dflash_zoo.engine.results import GenerationConfig, first_difference

DIVERGENCE_PROMPTS = 4  # random prompts both targets decode greedily for the divergence report


def to_fp8(model: nn.Module, layers: list[nn.Module]) -> list[str]:
    """Replace every `nn.Linear` inside `layers` (the decoder layers) by transformers' `FP8Linear` with its
    weight block-quantized (bias kept), in place, and mark `model` as a loaded pre-quantized FP8 checkpoint.
    Returns the replaced modules' names within their layer (each layer's, in order)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import FP8Linear
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    block = (fp8_ops.BLOCK, fp8_ops.BLOCK)
    names = []
    with torch.no_grad():
        for layer in layers:
            for name, mod in list(layer.named_modules()):
                if type(mod) is not nn.Linear:
                    continue
                with torch.device("meta"):  # no throwaway full-size weight
                    q = FP8Linear(mod.in_features, mod.out_features, block, has_bias=mod.bias is not None)
                weight, scales = fp8_ops.quantize(mod.weight)
                q.weight = nn.Parameter(weight, requires_grad=False)
                q.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
                q.bias = mod.bias  # [N] in 16 bits, or None
                layer.set_submodule(name, q)
                names.append(name)
    inside = {id(m) for layer in layers for m in layer.modules()}
    keep = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) not in inside]
    config = FineGrainedFP8Config(weight_block_size=list(block), modules_to_not_convert=keep)
    model.config.quantization_config = config
    model.hf_quantizer = FineGrainedFP8HfQuantizer(config, pre_quantized=True)  # as `from_pretrained` sets it
    return names


def greedy_outputs(
    sub: Subject, prompts: list[list[int]], new_tokens: int, opts: BenchOptions
) -> list[list[int]]:
    """Each prompt's greedy continuation by the target alone on the fast engine."""
    cfg = GenerationConfig(max_new_tokens=new_tokens)
    options = EngineOptions(fast=True, fast_options=fast_options(opts))
    longest = max(map(len, prompts)) + new_tokens
    eng, _ = build_engine(sub.adapter, sub.drafter, sub.mask_token_id, options, longest, require="fast")
    return [eng.autoregressive(p, cfg).output_ids for p in prompts]


def divergence(bf16: list[list[int]], fp8: list[list[int]]) -> dict[str, Any]:
    """Per prompt the first position where the FP8 output leaves the bf16 one (None: equal), and over all of
    them the share of positions holding the same token and the share before each first divergence."""
    firsts = [first_difference(a, b) for a, b in zip(bf16, fp8, strict=True)]
    total = sum(len(a) for a in bf16)
    same = sum(x == y for a, b in zip(bf16, fp8, strict=True) for x, y in zip(a, b, strict=False))
    before = sum(len(a) if f is None else f for a, f in zip(bf16, firsts, strict=True))
    return {
        "prompts": len(bf16),
        "new_tokens": [len(a) for a in bf16],
        "first_divergence": firsts,
        "identical_share": same / max(total, 1),
        "prefix_share": before / max(total, 1),
    }


def _prompts(sub: Subject, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` random prompts: the bench's, then more drawn as `runner.random_subject` draws it."""
    vocab, mask = sub.source["vocab"], sub.mask_token_id
    high = mask if mask >= vocab // 2 else vocab
    gen = torch.Generator().manual_seed(seed + 1)
    more = [torch.randint(0, high, (length,), generator=gen).tolist() for _ in range(n - 1)]
    return [sub.prompt, *[[t + 1 if t == mask else t for t in p] for p in more]]


def run_fp8_bench(sub: Subject, opts: BenchOptions, argv: list[str] | None = None) -> dict[str, Any]:
    """The bf16 target's record and greedy outputs, then the same weights as an FP8 target: its record with the
    comparison under `fp8` (the subject is quantized in place)."""
    prompts = _prompts(sub, DIVERGENCE_PROMPTS, len(sub.prompt), opts.seed)
    bf16_out = greedy_outputs(sub, prompts, opts.new_tokens, opts)
    bf16 = run_bench(sub, opts, argv)
    _release(sub)
    names = to_fp8(sub.adapter.model, sub.adapter.layers())
    fp8_out = greedy_outputs(sub, prompts, opts.new_tokens, opts)
    record = run_bench(sub, opts, argv)
    record["subject"]["quantization"] = {
        "method": "fp8",
        "weight_block_size": [fp8_ops.BLOCK, fp8_ops.BLOCK],
        "converted_per_layer": sorted(set(names)),
        "bf16_weight_bytes": bf16["subject"]["weight_bytes"],
        "note": "random weights quantized in memory (bench/fp8.py); embedding, LM head, norms in 16 bits",
    }
    record["fp8"] = {
        "bf16_results": bf16["results"],
        "speedup_vs_bf16": {
            path: {
                mode: r[mode]["tokens_per_second"]
                / max(bf16["results"][path][mode]["tokens_per_second"], 1e-9)
                for mode in ("autoregressive", "dflash")
            }
            for path, r in record["results"].items()
        },
        "divergence": divergence(bf16_out, fp8_out),
    }
    return record


def _release(sub: Subject) -> None:
    """Drop the bf16 engines' buffers and graphs before the weights are quantized (two 8B copies fit, three
    may not)."""
    gc.collect()
    if next(sub.adapter.model.parameters()).is_cuda:
        torch.cuda.empty_cache()


def summary(record: dict[str, Any]) -> list[str]:
    """Lines for stderr: the FP8 / bf16 tok/s ratios and the divergence report."""
    d = record["fp8"]["divergence"]
    lines = [
        f"{path}: FP8 / bf16 tok/s: autoregressive {r['autoregressive']:.2f}x, dflash {r['dflash']:.2f}x"
        for path, r in record["fp8"]["speedup_vs_bf16"].items()
    ]
    firsts = ", ".join("none" if f is None else str(f) for f in d["first_divergence"])
    lines.append(
        f"greedy FP8 vs bf16 over {d['prompts']} prompts: first divergence at {firsts}; "
        f"{d['identical_share']:.1%} of tokens identical ({d['prefix_share']:.1%} before the first divergence)"
    )
    return lines
