"""`bench --train`: the trainer's own step on a random-weight target of a named shape (`shapes.py`).

The step is `training.trainer.Trainer.step` unchanged, on random token sequences of `seq_len` tokens (all
supervised, so every sequence has its `anchors` blocks). After `warmup` unmeasured steps (compilation, caches),
each measured step is timed on the device at its split points: target forward (features) / drafter forward +
backward (LM head and loss included) / optimizer. CUDA events are recorded at those points and the host
waits once, at the end of the step.

Model FLOPs of one step (docs/training.md, "Model FLOPs"), per sequence of T tokens with n blocks of B slots:
- target forward: 2 * N_run * T, N_run the parameters of the decoder layers that run (0 .. last tap);
- drafter layers, forward + backward: 6 * N_layers * n*B (block slots, their K/V projections included);
- context K/V projections, forward + backward: 6 * N_kv * T (each drafter layer's k_proj + v_proj);
- fc, forward + weight gradient: 4 * N_fc * T (its input, the target's features, needs no gradient);
- LM head, forward + input gradient over the supervised slots: 4 * V * H * n*(B-1).
Attention score FLOPs are not counted. MFU = FLOPs / step time / the card's dense bf16 peak (`PEAK_BF16`).

The record also times the drafter's attention alone, dense mask vs block-sparse flex, at the step's shapes
(forward + backward on CUDA; forward only elsewhere, where flex has no backward).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from dflash_zoo.bench import meta as benchmeta
from dflash_zoo.bench.shapes import SHAPES, shape_target

SCHEMA = "dflash-zoo.bench-train/1"
# dense bf16 tensor-core peaks (NVIDIA H100 / H200 datasheets: the sparsity figures halved); first match wins
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12))
PARTS = ("target_forward", "drafter_forward_backward", "optimizer")


@dataclass(frozen=True)
class TrainBenchOptions:
    seq_len: int = 3072
    anchors: int = 512
    batch_size: int = 1  # sequences per step
    draft_layers: int | None = None  # None: the shape's drafter
    block_size: int | None = None
    attention: str = "auto"
    compile: str = "auto"  # regional torch.compile (`training/regions.py`)
    warmup: int = 3
    steps: int = 5
    seed: int = 0


def peak_for(name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of a card by its CUDA name, None when it is not listed."""
    return next((rate for key, rate in PEAK_BF16 if key in name), None)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, None when unknown (or not a GPU)."""
    return peak_for(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def _params(modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def step_flops(adapter: Any, drafter: Any, seq_lens: list[int], anchors: int) -> dict[str, float]:
    """Model FLOPs of one step over sequences of `seq_lens` tokens, `anchors` blocks each (module docstring)."""
    cfg = drafter.cfg
    b, tokens = cfg.block_size, sum(seq_lens)
    slots, supervised = len(seq_lens) * anchors * b, len(seq_lens) * anchors * (b - 1)
    run = adapter.layers()[: max(cfg.target_layer_ids) + 1]
    kv = [m for layer in drafter.layers for m in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
    head = adapter.model.get_output_embeddings().weight.numel()
    parts = {
        "target_forward": 2 * _params(run) * tokens,
        "drafter_layers": 6 * _params(drafter.layers) * slots,
        "context_kv": 6 * _params(kv) * tokens,
        "fc": 4 * drafter.fc.weight.numel() * tokens,
        "lm_head": 4 * head * supervised,
    }
    return {k: float(v) for k, v in parts.items()} | {"total": float(sum(parts.values()))}


class _Marks:
    """Times between the trainer's split points: CUDA events (one host wait per step), else the host clock."""

    def __init__(self, device: torch.device):
        self.cuda, self.at = device.type == "cuda", {}

    def __call__(self, name: str) -> None:
        if self.cuda:
            self.at[name] = torch.cuda.Event(enable_timing=True)
            self.at[name].record()
        else:
            self.at[name] = time.perf_counter()

    def seconds(self) -> dict[str, float]:
        names = ["start", "features", "drafter", "optimizer"]
        if self.cuda:
            self.at["optimizer"].synchronize()
            gap = [self.at[a].elapsed_time(self.at[b]) / 1e3 for a, b in zip(names, names[1:], strict=False)]
        else:
            gap = [self.at[b] - self.at[a] for a, b in zip(names, names[1:], strict=False)]
        return dict(zip(PARTS, gap, strict=True))


def _examples(n: int, length: int, vocab: int, mask: int, seed: int) -> list:
    from dflash_zoo.training.data import Example

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab - 1, (length,), generator=gen)
        out.append(Example(tuple(torch.where(ids == mask, vocab - 1, ids).tolist()), 0))  # never the mask id
    return out


def build_trainer(shape: str, device: torch.device, dtype: torch.dtype, opts: TrainBenchOptions) -> Any:
    """The trainer of the recipe for a random target of `shape`, on random data (one sequence per step)."""
    from dflash_zoo.training.train import TrainConfig, build_draft_config, new_drafter
    from dflash_zoo.training.trainer import Trainer

    s = SHAPES[shape]
    model = shape_target(s, str(device), dtype, max_positions=max(40960, opts.seq_len + 64))
    model.requires_grad_(False)
    cfg = TrainConfig(
        out="unused", draft_layers=opts.draft_layers or s.draft_layers, block_size=opts.block_size or s.block_size,
        batch_size=opts.batch_size, anchors_per_seq=opts.anchors, mask_token_id=s.mask_token_id,
        steps=opts.warmup + opts.steps, seed=opts.seed, attention=opts.attention, max_length=opts.seq_len,
        compile=opts.compile,
    )  # fmt: skip
    drafter = new_drafter(build_draft_config(model, None, cfg), cfg, None, device)
    count = opts.batch_size * (opts.warmup + opts.steps)
    data = _examples(count, opts.seq_len, s.vocab, s.mask_token_id, opts.seed)
    return Trainer(cfg, model, drafter, data, device)


def measure_steps(tr: Any, opts: TrainBenchOptions) -> list[dict[str, float]]:
    """Per measured step, seconds of each part (`PARTS`)."""
    runs = []
    total = opts.warmup + opts.steps
    for i in range(total):
        if i == opts.warmup and tr.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(tr.device)
        marks = _Marks(tr.device)
        tr.step(i, i / total, marks)
        parts = marks.seconds()
        if i >= opts.warmup:
            runs.append(parts)
    return runs


def run_train_bench(
    shape: str, device: Any, dtype: torch.dtype, opts: TrainBenchOptions, argv: list[str]
) -> dict:
    """Build, measure and describe: the bench record (schema `SCHEMA`)."""
    from dflash_zoo.bench.train_attention import attention_times

    device = torch.device(device)
    tr = build_trainer(shape, device, dtype, opts)
    runs = measure_steps(tr, opts)
    step = [sum(r.values()) for r in runs]
    seconds = statistics.median(step)
    flops = step_flops(tr.adapter, tr.raw, [opts.seq_len] * opts.batch_size, opts.anchors)
    peak = peak_flops(device)
    memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "schema": SCHEMA,
        "kind": "train-step",
        "shape": shape,
        "options": asdict(opts)
        | {
            "attention": tr.attention,
            "compile": tr.regions is not None,
            "dtype": str(dtype).removeprefix("torch."),
        },
        "drafter": {
            "layers": tr.dcfg.num_hidden_layers,
            "block_size": tr.dcfg.block_size,
            "taps": list(tr.dcfg.target_layer_ids),
            "parameters": _params([tr.raw]),
        },  # fmt: skip
        "step": {
            "seconds": seconds,
            "seconds_runs": step,
            "parts_seconds": {p: statistics.median(r[p] for r in runs) for p in PARTS},
            "tokens_per_second": opts.seq_len * opts.batch_size / seconds,
            "flops": flops,
            "flops_per_second": flops["total"] / seconds,
            "peak_flops_per_second": peak,
            "mfu": flops["total"] / seconds / peak if peak else None,
            "peak_memory_bytes": memory,
        },
        "attention": attention_times(tr, opts),
        "provenance": benchmeta.provenance(argv, device),
    }
