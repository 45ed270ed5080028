"""Where the zoo keeps its own state (lock file, bench records, regenerated training data); torch-free.

Models never live here: they stay in the Hugging Face cache (`HF_HOME`, `HF_HUB_CACHE`).
"""

from __future__ import annotations

import os
from pathlib import Path


def zoo_home() -> Path:
    """`$DFLASH_ZOO_HOME`, else `$XDG_CACHE_HOME/dflash-zoo`, else `~/.cache/dflash-zoo` (not created)."""
    env = os.environ.get("DFLASH_ZOO_HOME")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg).expanduser() / "dflash-zoo"
