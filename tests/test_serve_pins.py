"""Pins end to end against the loopback Hub: `pull` records both commits, `serve` emits them, `rm` drops
them."""

from __future__ import annotations

import json

from tests.cli_runner import run_cli as cli
from tests.hubserver import DRAFT_REPO, TARGET_REPO

pytest_plugins = ["tests.hub_fixtures"]  # hub_env / zoo_registry: a loopback Hub server, never the network


def served(engine: str) -> tuple[str | None, str | None]:
    """(draft revision, target revision) in `serve tiny-test --engine E --dry-run --json`'s argv."""
    run = cli("serve", "tiny-test", "--engine", engine, "--dry-run", "--json")
    assert run.code == 0, run.stderr
    argv = json.loads(run.stdout)["argv"]
    target = argv[argv.index("--revision") + 1] if "--revision" in argv else None
    if engine == "vllm":
        return json.loads(argv[argv.index("--speculative-config") + 1]).get("revision"), target
    flag = "--speculative-draft-model-revision"
    return (argv[argv.index(flag) + 1] if flag in argv else None), target


def test_pull_pins_reach_serve_and_rm_removes_them(zoo_registry, hub_env):
    draft, target = hub_env.commit(DRAFT_REPO), hub_env.commit(TARGET_REPO)
    assert served("vllm") == served("sglang") == (None, None)  # nothing pulled: the engines' default (main)
    assert cli("pull", "tiny-test", "--with-target", "-q").code == 0
    assert served("vllm") == served("sglang") == (draft, target)
    listed = json.loads(cli("list", "tiny-test", "--json").stdout)
    assert listed[0]["pins"] == {"draft": draft, "target": target}  # the lock listing
    assert cli("rm", "tiny-test", "--yes").code == 0  # the drafter only: its pin goes, the target's stays
    assert served("vllm") == served("sglang") == (None, target)
    assert cli("rm", "tiny-test", "--with-target", "--yes").code == 0
    assert served("vllm") == (None, None)
