"""The error table: every expected failure is a `ZooError` with a one-line message and a next step.

The CLI prints `error: <message>` and `hint: <hint>` on stderr and exits with `exit_code`; full tracebacks
appear only with `DFLASH_ZOO_DEBUG=1`. Library callers catch `ZooError` (or a subclass).
"""

from __future__ import annotations


class ZooError(Exception):
    """Base class: a user-facing failure with an optional hint naming the next command."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


class ConfigError(ZooError):
    """A draft or target config is malformed or inconsistent."""


class CheckpointError(ZooError):
    """Weights are missing, corrupted or do not fit the config."""


class IncompatiblePairError(ZooError):
    """Target and drafter do not fit together (hidden size, taps, mask id, ...)."""

    exit_code = 3


class UnsupportedModelError(ZooError):
    """No adapter for this model type, or its cache cannot be rolled back."""


class InvalidArgumentError(ZooError):
    """A generation argument is out of range (block size, max tokens, temperature...)."""

    exit_code = 2


class NotFoundError(ZooError):
    """A path, repo, revision or registry entry does not exist."""


class OfflineError(ZooError):
    """Offline mode is on and what was asked for is not cached."""
