"""Bench helpers: prompts, weight bytes, the copy-bandwidth ceiling, the roofline fraction and provenance.

Roofline: a batch-1 decode step streams every weight once, so its floor is
streamed weight bytes over device bandwidth. Bandwidth is measured in the same run with a large device-to-
device copy (bytes read + written). Streamed bytes leave out an untied input-embedding table (one row is
read per token); a DFlash step streams the target, the drafter and the target's LM head a second time (the
drafter's logits) for `tau` tokens. KV-cache reads are left out: small next to 16 GB of weights at 1k tokens.
A mixture-of-experts layer streams only the experts its rows route to: with E experts, top-k routing and n
rows (1 for an autoregressive step, the block size B for a DFlash verify), uniform independent routing reads
E (1 - (1 - k/E)^n) distinct experts on average (`expected_distinct_experts`); dense parts, routers and shared
experts always count.
Provenance: argv, git commit, package versions, GPU, registry entry (so a record can be reproduced); the fast
engine's options sit whole beside it (`fast_options`; `record_fast_options` reads them back, from older records'
`provenance.environment` too).
"""

from __future__ import annotations

import platform
import subprocess
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path, PurePath
from typing import Any

import torch

PROMPT_TEXT = (
    "def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[len(items) // 2]\n"
    "    left = [x for x in items if x < pivot]\n    middle = [x for x in items if x == pivot]\n"
    "    right = [x for x in items if x > pivot]\n    return quicksort(left) + middle + quicksort(right)\n\n"
    "Explain step by step how this function works, what its complexity is, and how to make it stable.\n"
)


def text_prompt(tokenizer: Any, n: int, mask_id: int, vocab: int) -> list[int]:
    """`n` prompt ids: a fixed text repeated (with a tokenizer), else a fixed pseudo-random id list."""
    if tokenizer is not None:
        ids = tokenizer.encode(PROMPT_TEXT)
        return (ids * (n // max(len(ids), 1) + 1))[:n]
    gen = torch.Generator().manual_seed(0)
    return [i if i != mask_id else 0 for i in torch.randint(0, vocab, (n,), generator=gen).tolist()]


def registry_entry(name: str | None) -> dict[str, Any] | None:
    """The registry entry a name resolves to (slug, repos, pinned draft revision), if any."""
    if not name or Path(name).expanduser().exists():
        return None
    try:
        from dflash_zoo.zoo.registry import load_registry

        found = load_registry().lookup(name)
    except Exception:  # a bench of a plain Hub id must not fail on registry problems
        return None
    if found is None:
        return None
    entry = found[0]
    keys = ("slug", "target_repo", "draft_repo", "draft_revision", "status")
    return {k: str(getattr(entry, k, None)) for k in keys}


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, reps: int = 10) -> float | None:
    """Device copy bandwidth in bytes/s (read + write), median of `reps` event-timed copies; None on CPU."""
    if device.type != "cuda":
        return None
    src = torch.randn(nbytes // 4, device=device)  # random data: a copy of zeros can be faster than real data
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 2:  # two warm-ups
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / sorted(times)[len(times) // 2]


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


# how MoE configs name their expert count and their top-k (both differ across families and versions)
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
TOP_K_KEYS = ("num_experts_per_tok", "top_k_experts")  # gemma4: top_k_experts


def missed_share(experts: int, top_k: int, rows: int) -> float:
    """(1 - k/E)^n: the chance that none of `rows` tokens routes to a given expert.

    Each token picks its k experts uniformly at random without replacement, independently of the other
    tokens, so it misses a given expert with probability (E-1 choose k) / (E choose k) = 1 - k/E.
    """
    if experts < 1 or not 0 <= top_k <= experts or rows < 0:
        raise ValueError(f"no routing of {rows} rows to top-{top_k} of {experts} experts")
    return (1 - top_k / experts) ** rows


def expected_distinct_experts(experts: int, top_k: int, rows: int) -> float:
    """E (1 - (1 - k/E)^n): how many distinct experts of one layer `rows` tokens read, on average."""
    return experts * (1 - missed_share(experts, top_k, rows))


def moe_routing(text: Any) -> tuple[int, int]:
    """(experts, top_k) of a text config, (0, 0) where it names no routed experts."""
    experts = next((getattr(text, k) for k in EXPERT_COUNT_KEYS if getattr(text, k, None)), 0)
    top_k = next((getattr(text, k) for k in TOP_K_KEYS if getattr(text, k, None)), 0)
    return (experts, top_k) if experts and top_k else (0, 0)


def weight_bytes(adapter: Any, drafter: Any, block: int = 1) -> dict[str, int]:
    """Streamed bytes per forward: target (minus an untied input embedding), drafter, LM head.

    A mixture-of-experts target streams only the experts it routes to: of a layer's E experts, one token reads
    k (`target_streamed`) and a B-token verify E (1 - (1 - k/E)^B) on average under uniform routing
    (`target_streamed_verify`); everything outside `.experts.` (attention, dense and shared-expert MLPs,
    routers, norms) is streamed by both. Dense targets stream everything either way.
    """
    model, text = adapter.model, adapter.text_config
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    # tied: one tensor (identity also holds on the meta device, where every data_ptr() is 0)
    tied = emb is head or (not emb.is_meta and emb.data_ptr() == head.data_ptr())
    total = _bytes(model.parameters())
    streamed = total - (0 if tied else _bytes([emb]))
    experts = _bytes(p for n, p in model.named_parameters() if ".experts." in n)
    n_experts, top_k = moe_routing(text)

    def routed(rows: int) -> int:  # streamed bytes less the expert bytes no row of `rows` reads
        if not (experts and n_experts):
            return streamed
        return streamed - round(experts * missed_share(n_experts, top_k, rows))

    return {
        "target_total": total,
        "target_streamed": routed(1),
        "target_streamed_verify": routed(block),
        "drafter": _bytes(drafter.parameters()),
        "lm_head": _bytes([head]),
    }


def add_roofline(ar: dict, spec: dict, wb: dict[str, int], bw: float | None) -> None:
    """Add `roofline_tokens_per_second` and `roofline_fraction` to both mode records (None on CPU)."""
    step_bytes = wb["target_streamed_verify"] + wb["drafter"] + wb["lm_head"]
    for rec, roof in (
        (ar, bw / wb["target_streamed"] if bw else None),
        (spec, bw * spec["mean_acceptance_length"] / step_bytes if bw else None),
    ):
        rec["roofline_tokens_per_second"] = roof
        rec["roofline_fraction"] = rec["tokens_per_second"] / roof if roof else None


def _git_commit() -> dict[str, Any]:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True, timeout=10
        )
        if sha.returncode != 0:  # not a git checkout (e.g. a copied tree)
            return {"commit": None, "dirty": None}
        return {"commit": sha.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _portable(argv: list[str]) -> list[str]:
    """argv with the `--out` value cut to its file name: the folder a record was first written to names a
    machine, not the measurement."""
    out, cut = [], False
    for arg in argv:
        if cut:
            arg = PurePath(arg).name
        elif arg.startswith("--out="):
            arg = "--out=" + PurePath(arg.removeprefix("--out=")).name
        out.append(arg)
        cut = arg == "--out"
    return out


def provenance(argv: list[str], device: torch.device) -> dict[str, Any]:
    """argv (`--out` as its file name), git commit, package versions, GPU: everything needed to reproduce or
    distrust a number."""
    import transformers

    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {
            "name": props.name,
            "memory_bytes": props.total_memory,
            "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
        }
    return {
        "argv": _portable(argv),
        "git": _git_commit(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "dflash_zoo": _version("dflash-zoo"),
            "huggingface_hub": _version("huggingface_hub"),
            "triton": _version("triton"),  # the fast path's kernels (kernels.py) on CUDA
        },
        "gpu": gpu,
        "host": platform.node(),
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def record_fast_options(record: dict[str, Any]) -> Any:
    """The `FastOptions` a bench record ran with: its `fast_options`, or for a record written before they were
    recorded whole, the environment switches its provenance copied (`FastOptions.from_env` of those)."""
    from dflash_zoo.engine.options import FastOptions

    if "fast_options" in record:
        return FastOptions.from_dict(record["fast_options"])
    old = record.get("options", {})
    env = record.get("provenance", {}).get("environment", {})
    return FastOptions.from_env(env, graphs=old.get("graphs"), compile=bool(old.get("compile", False)))


def default_out(name: str) -> Path:
    """`$DFLASH_ZOO_HOME/bench/<utc time>-<name>.json` (`paths.zoo_home`)."""
    from dflash_zoo.paths import zoo_home

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in name)
    return zoo_home() / "bench" / f"{stamp}-{safe}.json"
