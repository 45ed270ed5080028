"""dflash-zoo: DFlash block-diffusion speculative decoding for Hugging Face targets.

Heavy modules load lazily: `import dflash_zoo` does not import torch.

    import dflash_zoo
    pipe = dflash_zoo.load("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16")
    result = pipe.generate("Write a haiku", max_new_tokens=64)
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

try:
    __version__ = metadata.version("dflash-zoo")
except metadata.PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0"

_LAZY = {
    "load": "dflash_zoo.api",
    "Pipeline": "dflash_zoo.api",
    "GenerationConfig": "dflash_zoo.engine.results",
    "GenerationResult": "dflash_zoo.engine.results",
    "StepRecord": "dflash_zoo.engine.results",
    "DFlashDrafter": "dflash_zoo.engine.drafter",
    "load_drafter": "dflash_zoo.loading",
    "save_drafter": "dflash_zoo.engine.checkpoint",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dflash_zoo' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
