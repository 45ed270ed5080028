"""Where a model's files come from: a local directory as it is, or a Hub repo id fetched (or found offline) in
the HF cache, limited to the files a drafter (`DRAFT_FILES`) or a target (`TARGET_FILES`) needs.

The engine reads local directories only (engine/checkpoint.py); the loading layer (`loading.py`, `pipeline.py`,
the trainer's target loading) resolves a name to a directory here first.
"""

from __future__ import annotations

import os
from pathlib import Path

from dflash_zoo.errors import NotFoundError, looks_like_path, missing_directory

DRAFT_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json"]
# what a target needs: configs, weights, tokenizer files and chat templates
TARGET_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def resolve_dir(
    source: str | os.PathLike, revision: str | None = None, patterns: list[str] | None = None
) -> Path:
    """A local directory as is; otherwise a Hub repo id fetched (or found offline) in the HF cache, the files
    matching `patterns` (default: a drafter's)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    text = str(source)
    if path.exists() or looks_like_path(text):
        raise missing_directory(text)
    if text.count("/") != 1:
        raise NotFoundError(
            f"{text} is neither a local directory nor a Hub repo id", hint="check the path or id"
        )
    from dflash_zoo.zoo.hub import snapshot

    return snapshot(text, revision=revision, allow_patterns=patterns or DRAFT_FILES)
