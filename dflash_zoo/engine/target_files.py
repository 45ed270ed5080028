"""Checks of a target's files before anything heavy loads (torch-free).

`read_config` reads a `config.json` and names what is wrong with it in one line: missing, unreadable
(permissions), not UTF-8, not JSON, not an object. `check_target_dir` adds what loading a target needs: a
`model_type` that a family adapter knows, and weights whose safetensors headers fit their files (a truncated
download fails here, naming the file, instead of deep inside transformers' loader). Headers are read with
the numpy framework so that nothing here imports torch.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

from dflash_zoo.errors import CheckpointError, ConfigError

INDEX_FILE = "model.safetensors.index.json"


def read_config(path: Path, what: str = "config") -> dict[str, Any]:
    """The JSON object in `path`; `ConfigError` naming the file and the fix otherwise."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"no {what} file at {path}", hint="check the path") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory, not a {what} file", hint="check the path") from None
    except OSError as exc:
        raise unreadable(path, exc) from exc
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path} is not valid UTF-8 (byte {exc.start})", hint="save it as UTF-8 JSON, or copy it again"
        ) from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
            hint="fix the file, or copy it again from the model's repository",
        ) from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object", hint="a config.json holds one {...} object")
    return raw


def unreadable(path: Path, exc: OSError) -> ConfigError:
    """The one message for a file that exists but cannot be read."""
    if exc.errno in (errno.EACCES, errno.EPERM):
        return ConfigError(
            f"cannot read {path}: permission denied",
            hint=f"make it readable (chmod a+r {path}), or run as a user who can read it",
        )
    return ConfigError(f"cannot read {path}: {exc.strerror or exc}", hint="check the file, or copy it again")


def model_type_of(raw: dict[str, Any], path: Path) -> str:
    """The config's `model_type`, which picks the family adapter; `ConfigError` when it is missing."""
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(
            f"{path} has no model_type",
            hint='add the model\'s family, e.g. "model_type": "qwen3", from the model\'s own config.json; '
            "`dflash-zoo list` shows the supported families",
        )
    return model_type


def check_target_dir(directory: Path) -> dict[str, Any]:
    """Check a local target directory: config readable with a supported `model_type`, weights whole.

    Returns:
        The raw config dict.
    Raises:
        ConfigError, UnsupportedModelError, CheckpointError: one line naming the file.
    """
    from dflash_zoo.adapters import get_adapter

    path = directory / "config.json"
    raw = read_config(path, "target config")
    get_adapter(model_type_of(raw, path))  # UnsupportedModelError names the type
    check_weights(directory)
    return raw


def check_weights(directory: Path) -> None:
    """Every safetensors file of `directory` (and every shard its index names) is there and its header fits
    the file: a cheap read of each header, no tensor data."""
    files = sorted(directory.glob("*.safetensors"))
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"cannot read the weight index {index}: {exc}", hint=_REFETCH) from exc
        missing = sorted(s for s in shards if not (directory / s).is_file())
        if missing:
            raise CheckpointError(
                f"{directory} lacks weight shard {missing[0]}"
                + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                + f" named in {INDEX_FILE}",
                hint=_REFETCH,
            )
    for f in files:
        _check_header(f)


_REFETCH = (
    "download the weights again (`dflash-zoo pull ID --with-target --verify --force` for a registry target), "
    "or save the model again"
)


def _check_header(path: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:  # validates the header against the file's length
            f.keys()
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise CheckpointError(
                f"cannot read {path}: permission denied",
                hint=f"make it readable (chmod a+r {path}), or run as a user who can read it",
            ) from exc
        raise CheckpointError(f"cannot read target weights {path}: {exc}", hint=_REFETCH) from exc
    except Exception as exc:  # safetensors' own error type differs across versions
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(
            f"target weights {path} are truncated or corrupt ({why})", hint=_REFETCH
        ) from exc
