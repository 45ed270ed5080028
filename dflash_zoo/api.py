"""The Python API: `load(target, draft)` returns a `Pipeline` whose `generate` the CLI only wraps.

    pipe = dflash_zoo.load("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", device="cuda")
    res = pipe.generate("Explain KV caches", max_new_tokens=128)
    print(res.text, res.mean_acceptance_length, res.tokens_per_second)

`target` / `draft` are local directories, Hub ids, registry slugs, or already-built objects
(a transformers model and a `DFlashDrafter`). With neither, the embedded demo pair is used.
The pieces live in `pipeline.py` (the pair and its entry points) and `loading.py` (resolving and checking).
"""

from __future__ import annotations

from dflash_zoo.loading import (
    check_pair,
    default_device,
    load,
    load_drafter,
    load_target,
    locked_revision,
    parse_dtype,
    resolve_devices,
)
from dflash_zoo.pipeline import Pipeline, TextStream
from dflash_zoo.sources import TARGET_FILES

__all__ = [
    "TARGET_FILES",
    "Pipeline",
    "TextStream",
    "check_pair",
    "default_device",
    "load",
    "load_drafter",
    "load_target",
    "locked_revision",
    "parse_dtype",
    "resolve_devices",
]
