"""The embedded default pair: a small target trained on Python source and its DFlash drafter.

Files live next to this module (`target/`, `draft/`, `PROVENANCE.md`); `scripts/build_demo_pair.py` rebuilds
them. Used when `generate` / `chat` get no model argument, so a newcomer sees DFlash work offline on CPU.
`dflash-zoo env` prints both directories (`train --target` / `eval --target` take the target's).
"""

from __future__ import annotations

from pathlib import Path

from dflash_zoo.errors import NotFoundError

HERE = Path(__file__).resolve().parent


def _need(sub: str) -> Path:
    path = HERE / sub
    if not (path / "config.json").is_file():
        raise NotFoundError(
            f"the embedded demo pair is not in this install ({path} missing)",
            hint="pass --target and --draft, or rebuild it with `python scripts/build_demo_pair.py`",
        )
    return path


def target_dir() -> Path:
    return _need("target")


def draft_dir() -> Path:
    return _need("draft")


def available() -> bool:
    return all((HERE / s / "config.json").is_file() for s in ("target", "draft"))


def report() -> dict[str, str | None]:
    """The demo pair's directories for `env` (None where this install lacks them); torch-free."""
    return {
        f"demo_{sub}": str(HERE / sub) if (HERE / sub / "config.json").is_file() else None
        for sub in ("target", "draft")
    }
