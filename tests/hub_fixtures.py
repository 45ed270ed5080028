"""pytest fixtures for Hub tests: a loopback Hub server and an environment that points at it.

Use from a test module with `pytest_plugins = ["tests.hub_fixtures"]`. `hub_env` points `HF_ENDPOINT` at the
server and `HF_HOME` / `HF_HUB_CACHE` / `DFLASH_ZOO_HOME` at temporary folders, and turns offline mode off;
`zoo_registry` adds an extra registry file with entries that point at the server's sample repos.

huggingface_hub reads `HF_ENDPOINT` and `HF_HUB_OFFLINE` once, at import, so a test process that imported it
earlier keeps the old values. `dflash_zoo.zoo.hub` passes endpoint and cache folder explicitly; on top of that the
fixture patches the client's import-time constants, so that nothing the client does on its own (hub 2.x fetches
`/api/agent-harnesses` for its user agent) can leave 127.0.0.1, and an inherited `HF_HUB_OFFLINE=1` does not
block the online tests.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hubserver import HubServer

TEST_REGISTRY = """
version: 1
entries:
  - slug: tiny-test
    aliases: ["tiny:test"]
    adapter: qwen3
    target: {repo: zoo-test/tiny-target, model_type: qwen3, hidden_size: 64, num_hidden_layers: 4, vocab_size: 1000}
    draft: {repo: zoo-test/tiny-draft, revision: main, block_size: 16, target_layer_ids: [1], mask_token_id: 999, num_layers: 1, architecture: dflash}
    license: apache-2.0
    status: supported
  - slug: tiny-unsupported
    adapter: qwen3
    target: {repo: zoo-test/other-target, model_type: qwen3, hidden_size: 64, num_hidden_layers: 4, vocab_size: 1000}
    draft: {repo: zoo-test/other-draft, revision: main, block_size: 16, target_layer_ids: [1], mask_token_id: 999, num_layers: 1, architecture: dflash}
    license: apache-2.0
    status: unsupported-here
    reason: "test entry that never runs here"
"""


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HubServer]:
    """A started server with `SAMPLE_REPOS` (a tiny drafter and target); stopped after the test."""
    with HubServer(tmp_path / "hub-root").add_samples() as server:
        yield server


@pytest.fixture
def hub_env(hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HubServer:
    """Point the environment (and the hub client's import-time constants) at `hub` and temp folders."""
    import huggingface_hub.constants as constants

    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path / "zoo-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    # both together: the client rewrites template URLs only when they start with `constants.ENDPOINT`
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    if hasattr(constants, "AGENT_HARNESSES_PATH"):
        monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(home / ".agent_harnesses.json"))
    _quiet_agent_detection(monkeypatch)
    _loopback_only(monkeypatch)
    return hub


def _loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any name lookup other than the loopback fail at once, so a stray request cannot leave the host."""
    real = socket.getaddrinfo

    def guarded(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost", "::1", None):
            raise OSError(f"test guard: non-loopback address {host!r} refused")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", guarded)


def _quiet_agent_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hub 2.x: pre-seed an empty agent-harness registry so the client does not fetch one (keeps logs clean)."""
    try:
        from huggingface_hub.utils import _detect_agent
    except ImportError:  # hub 1.x has no agent detection
        return
    if hasattr(_detect_agent, "_registry"):
        monkeypatch.setattr(_detect_agent, "_registry", {"standardEnvVars": [], "harnesses": {}})


@pytest.fixture
def zoo_registry(hub_env: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`hub_env` plus `DFLASH_ZOO_REGISTRY` naming `TEST_REGISTRY` (entries `tiny-test`, `tiny-unsupported`)."""
    path = tmp_path / "registry.yaml"
    path.write_text(TEST_REGISTRY)
    monkeypatch.setenv("DFLASH_ZOO_REGISTRY", str(path))
    return path


@pytest.fixture
def offline_env(hub_env: HubServer, monkeypatch: pytest.MonkeyPatch) -> HubServer:
    """`hub_env` with `HF_HUB_OFFLINE=1` (for the zoo and the client alike); the server log starts empty."""
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub_env.reset_log()
    return hub_env
