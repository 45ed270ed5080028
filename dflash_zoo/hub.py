"""Everything that touches the Hugging Face Hub, behind a few functions with clear offline errors.

Models live in the standard HF cache (`HF_HOME` / `HF_HUB_CACHE`); the zoo invents no model cache.
Offline (`HF_HUB_OFFLINE=1`) calls always pass `local_files_only=True` (hub 1.x otherwise tries the network).
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import NotFoundError, OfflineError, ZooError


def is_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def snapshot(
    repo_id: str,
    revision: str | None = None,
    allow_patterns: list[str] | None = None,
    offline: bool | None = None,
) -> Path:
    """Local snapshot folder of `repo_id` at `revision`, downloading what is missing unless offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = is_offline() if offline is None else offline
    try:
        return Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=allow_patterns, local_files_only=offline)
        )
    except GatedRepoError as exc:
        raise ZooError(
            f"{repo_id} is gated",
            hint=f"run `hf auth login` and accept the licence at https://huggingface.co/{repo_id}",
        ) from exc
    except RepositoryNotFoundError as exc:
        raise NotFoundError(f"no such repo or directory: {repo_id}", hint="check the id, or `hf auth login` if private") from exc
    except RevisionNotFoundError as exc:
        raise NotFoundError(f"{repo_id} has no revision {revision!r}") from exc
    except LocalEntryNotFoundError as exc:
        raise OfflineError(
            f"{repo_id} is not in the local cache and offline mode is on",
            hint=f"run `dflash-zoo pull {repo_id}` while online",
        ) from exc
