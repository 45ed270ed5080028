"""pytest fixtures for Hub tests: a loopback Hub server and an environment that points at it.

Use from a test module with `from tests.hub_fixtures import hub, hub_env  # noqa: F401` (or list the module in
`pytest_plugins`). `hub_env` points `HF_ENDPOINT` at the server and `HF_HOME` / `HF_HUB_CACHE` /
`DFLASH_ZOO_HOME` at temporary folders, and turns offline mode off.

huggingface_hub reads `HF_ENDPOINT` and `HF_HUB_OFFLINE` once, at import, so a test process that imported it
earlier keeps the old values. `dflash_zoo.hub` passes endpoint and cache folder explicitly; on top of that the
fixture patches the client's import-time constants, so that nothing the client does on its own (hub 2.x fetches
`/api/agent-harnesses` for its user agent) can leave 127.0.0.1, and an inherited `HF_HUB_OFFLINE=1` does not
block the online tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hubserver import HubServer

DRAFT_REPO = "zoo-test/tiny-draft"
TARGET_REPO = "zoo-test/tiny-target"
DRAFT_FILES = {
    "config.json": b'{"model_type": "qwen3", "block_size": 16}\n',
    "model.safetensors": bytes(range(256)) * 64,  # 16 KiB
    "README.md": b"# tiny draft\n",
}
TARGET_FILES = {"config.json": b'{"model_type": "qwen3"}\n', "model.safetensors": b"\x01" * 4096}


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HubServer]:
    """A started server with two repos (`DRAFT_REPO`, `TARGET_REPO`); stopped after the test."""
    server = HubServer(tmp_path / "hub-root")
    for repo_id, files in ((DRAFT_REPO, DRAFT_FILES), (TARGET_REPO, TARGET_FILES)):
        for path, data in files.items():
            server.add_file(repo_id, path, data)
    with server:
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
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    if hasattr(constants, "AGENT_HARNESSES_PATH"):
        monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(home / ".agent_harnesses.json"))
    _quiet_agent_detection(monkeypatch)
    return hub


def _quiet_agent_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hub 2.x: pre-seed an empty agent-harness registry so the client does not fetch one (keeps logs clean)."""
    try:
        from huggingface_hub.utils import _detect_agent
    except ImportError:  # hub 1.x has no agent detection
        return
    if hasattr(_detect_agent, "_registry"):
        monkeypatch.setattr(_detect_agent, "_registry", {"standardEnvVars": [], "harnesses": {}})


@pytest.fixture
def offline_env(hub_env: HubServer, monkeypatch: pytest.MonkeyPatch) -> HubServer:
    """`hub_env` with `HF_HUB_OFFLINE=1` (for the zoo and the client alike); the server log starts empty."""
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub_env.reset_log()
    return hub_env
