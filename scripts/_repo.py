"""What the GPU scripts share: the repository root, the `dflash_zoo.adapters` mapping without an install, a
timestamped progress line and the first index where two outputs differ."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
T0 = time.time()  # a script's start: its first import of this module


def say(*a) -> None:
    """Progress on stderr, stamped with the seconds since T0."""
    print(f"[{time.time() - T0:6.1f}s]", *a, file=sys.stderr, flush=True)


def first_diff(a: list[int], b: list[int]) -> int | None:
    """First index where two outputs differ (None: identical)."""
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return n if n is not None or len(a) == len(b) else min(len(a), len(b))


def map_adapters() -> None:
    """Without an install, `dflash_zoo.adapters` (a package-dir mapping of adapters/) must be mapped by hand."""
    try:
        import dflash_zoo.adapters  # noqa: F401
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location(
            "dflash_zoo.adapters",
            ROOT / "adapters" / "__init__.py",
            submodule_search_locations=[str(ROOT / "adapters")],
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["dflash_zoo.adapters"] = mod
        spec.loader.exec_module(mod)
