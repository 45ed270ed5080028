"""What the GPU scripts share: the repository root and the `dflash_zoo.adapters` mapping without an install."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
