"""`pull`, `rm`, `env`, `serve` through the real CLI entry point, against the loopback Hub server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_zoo.zoo import hub as zh
from dflash_zoo.zoo.serve import ServeSpec, sglang_command, vllm_command
from tests.cli_runner import run_cli as cli
from tests.hubserver import DRAFT_FILES, DRAFT_REPO, TARGET_REPO

pytest_plugins = ["tests.hub_fixtures"]  # fixtures: hub, hub_env, zoo_registry, offline_env
DRAFT_BYTES = sum(len(d) for d in DRAFT_FILES.values())


def test_pull_entry_prints_path_and_writes_lock(zoo_registry, hub_env):
    from dflash_zoo.zoo.registry import read_lock

    run = cli("pull", "tiny-test")
    assert run.code == 0, run.stderr
    path = run.stdout.strip()
    assert path == str(zh.repo_cache_dir(DRAFT_REPO) / "snapshots" / hub_env.commit(DRAFT_REPO))
    assert f"{DRAFT_REPO} (drafter of tiny-test) @ main" in run.stderr and "to download" in run.stderr
    lock = read_lock()["tiny-test"]
    assert lock["commit"] == lock["draft_commit"] == hub_env.commit(DRAFT_REPO)
    assert lock["requested_revision"] == lock["draft_revision"] == "main" and lock["draft_repo"] == DRAFT_REPO
    assert "target_commit" not in lock  # no --with-target: no target pin


def test_second_pull_is_up_to_date_and_quiet_prints_only_the_path(zoo_registry, hub_env):
    first = cli("pull", "tiny-test", "-q")
    assert first.code == 0 and first.stderr == ""
    hub_env.reset_log()
    again = cli("pull", "tiny:test")
    assert again.code == 0 and "already up to date" in again.stderr
    assert again.stdout == first.stdout and hub_env.file_gets() == []


def test_dry_run_json_lists_files_and_downloads_nothing(zoo_registry, hub_env):
    run = cli("pull", "tiny-test", "--with-target", "--dry-run", "--json")
    assert run.code == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["dry_run"] is True
    assert [r["repo_id"] for r in doc["repos"]] == [DRAFT_REPO, TARGET_REPO]
    assert doc["repos"][0]["total_bytes"] == DRAFT_BYTES
    assert {f["path"] for f in doc["repos"][0]["files"]} == set(DRAFT_FILES)
    assert hub_env.file_gets() == [] and not zh.repo_cache_dir(DRAFT_REPO).exists()


def test_pull_plain_repo_id_with_target_flag_refused(zoo_registry, hub_env):
    from dflash_zoo.zoo.registry import read_lock

    run = cli("pull", DRAFT_REPO, "--json")  # a repo id acts on that repo, registry or not; pins only by id
    assert run.code == 0 and json.loads(run.stdout)["repos"][0]["downloaded_bytes"] == DRAFT_BYTES
    assert json.loads(run.stdout)["lock"] is None and read_lock() == {}
    hub_env.add_file("someone/else", "config.json", b"{}")
    plain = cli("pull", "someone/else", "-q")
    assert plain.code == 0 and plain.stdout.strip().endswith(hub_env.commit("someone/else"))
    assert cli("pull", "someone/else", "--with-target").code == 2


def test_pull_errors_are_one_line_with_hint(zoo_registry, hub_env):
    missing = cli("pull", "nobody/nothing")
    assert missing.code == 1 and missing.stderr.startswith("error: no such repo")
    unknown = cli("pull", "tiny-tset")
    assert unknown.code == 1 and "did you mean: tiny-test" in unknown.stderr
    hub_env.gated.add(DRAFT_REPO)
    gated = cli("pull", "tiny-test")
    assert gated.code == 1 and "hf auth login" in gated.stderr and "license" in gated.stderr
    hub_env.gated.clear()
    hub_env.fail_status = 503
    down = cli("pull", "tiny-test")
    assert down.code == 1 and "HTTP 503" in down.stderr and len(down.stderr.splitlines()) == 2


def test_offline_pull_never_touches_the_network(zoo_registry, offline_env):
    run = cli("pull", "tiny-test")
    assert run.code == 1
    assert "offline" in run.stderr and "dflash-zoo pull tiny-test" in run.stderr
    assert cli("pull", "tiny-test", "--offline", "--dry-run").code == 1
    assert offline_env.requests == []


def test_offline_flag_uses_the_cache(zoo_registry, hub_env):
    online = cli("pull", "tiny-test", "-q")
    hub_env.reset_log()
    offline = cli("pull", "tiny-test", "--offline", "-q")
    assert offline.code == 0 and offline.stdout == online.stdout
    assert hub_env.requests == []
    weights = Path(online.stdout.strip()) / "model.safetensors"
    weights.resolve().unlink()  # a cache cleaner took the blob: the snapshot's link dangles
    gone = cli("pull", "tiny-test", "--offline", "--verify")
    assert gone.code == 1 and "model.safetensors" in gone.stderr and "gone" in gone.stderr


def test_rm_requires_yes_non_interactively_and_dry_run_keeps_files(zoo_registry, hub_env):
    path = zh.download(zh.plan_pull(DRAFT_REPO), progress=False).path
    refused = cli("rm", "tiny-test")
    assert refused.code == 2 and "--yes" in refused.stderr and path.exists()
    dry = cli("rm", "tiny-test", "--dry-run")
    freed = DRAFT_BYTES + 40  # the blobs and refs/main (a 40-byte sha); snapshot symlinks take no bytes
    assert dry.code == 0 and f"would free 16.7 kB ({freed} bytes)" in dry.stdout and path.exists()
    assert "nothing deleted" in dry.stderr and "would free" not in dry.stderr
    done = cli("rm", "tiny-test", "--yes", "--json")
    assert done.code == 0, done.stderr
    assert json.loads(done.stdout)["bytes_freed"] == freed and not path.exists()
    again = cli("rm", "tiny-test", "-y")
    assert again.code == 0 and "nothing to delete" in again.stderr


def test_env_json_keys(hub_env):
    run = cli("env", "--json")
    assert run.code == 0, run.stderr
    doc = json.loads(run.stdout)
    keys = {"python", "platform", "torch", "cuda", "gpus", "transformers", "huggingface_hub", "dflash_zoo"}
    assert keys | {
        "triton",
        "flash_linear_attention",
        "hf_home",
        "hf_hub_cache",
        "hf_endpoint",
        "dflash_zoo_home",
        "offline",
    } <= set(doc)
    assert doc["hf_hub_cache"] == str(zh.hub_cache_dir()) and doc["offline"] is False
    assert "- huggingface_hub:" in cli("env").stdout


def test_serve_builders_use_block_size():
    spec = ServeSpec("org/target", "org/draft", 16, draft_revision="a" * 40, port=8000, extra_args=("--x",))
    argv = vllm_command(spec)
    assert argv[:3] == ["vllm", "serve", "org/target"] and argv[-1] == "--x"
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config == {
        "method": "dflash",
        "model": "org/draft",
        "num_speculative_tokens": 15,
        "revision": "a" * 40,
        "attention_backend": "flash_attn",  # the drafter's own backend, never forced onto the target
    }
    assert "--attention-backend" not in argv
    sg = sglang_command(spec)
    assert sg[:3] == ["python", "-m", "sglang.launch_server"]
    assert sg[sg.index("--speculative-algorithm") + 1] == "DFLASH"
    assert sg[sg.index("--speculative-num-draft-tokens") + 1] == "16"
    assert sg[sg.index("--port") + 1] == "8000"


def test_serve_dry_run_for_entries_and_plain_repos(zoo_registry, hub_env):
    run = cli("serve", "tiny-test", "--engine", "vllm", "--dry-run", "--json", "--", "--max-model-len", "64")
    assert run.code == 0, run.stderr
    argv = json.loads(run.stdout)["argv"]
    assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 15
    assert argv[-2:] == ["--max-model-len", "64"]
    text = cli("serve", "tiny-test", "--engine", "sglang", "--dry-run", "--port", "30000").stdout
    assert "--speculative-num-draft-tokens 16" in text and "--port 30000" in text
    assert cli("serve", DRAFT_REPO.replace("draft", "x"), "--engine", "vllm", "--dry-run").code == 2
    hub_env.add_file("someone/draft", "config.json", DRAFT_FILES["config.json"])
    plain = cli("serve", "someone/draft", "--engine", "vllm", "--target", "t/t", "--dry-run", "--json")
    assert plain.code == 0 and "not in the registry" in plain.stderr
    assert '"num_speculative_tokens": 7' in json.loads(plain.stdout)["command"]  # block 8 from config.json


def test_serve_refuses_unsupported_and_missing_engine(zoo_registry, hub_env, tmp_path, monkeypatch):
    bad = cli("serve", "tiny-unsupported", "--engine", "vllm", "--dry-run")
    assert bad.code == 1 and "unsupported here" in bad.stderr
    monkeypatch.setenv("PATH", str(tmp_path))
    missing = cli("serve", "tiny-test", "--engine", "vllm")
    assert missing.code == 1 and "vllm" in missing.stderr and "pip install" in missing.stderr


def test_pull_refuses_an_entry_marked_unsupported_but_not_its_repo_id(zoo_registry, hub_env):
    """`pull SLUG` of an entry its author marked unsupported-here fetches nothing and names the reason (as
    `serve` refuses it); the drafter's exact repo id still fetches that repo alone, with no pin."""
    from dflash_zoo.zoo.registry import read_lock

    hub_env.add_file("zoo-test/other-draft", "config.json", b"{}")
    hub_env.reset_log()
    for flags in ([], ["--dry-run"], ["--with-target"]):
        run = cli("pull", "tiny-unsupported", *flags)
        assert run.code == 1 and run.stdout == "", run.stderr
        assert "tiny-unsupported is marked unsupported here: test entry that never runs here" in run.stderr
        assert "`dflash-zoo pull zoo-test/other-draft`" in run.stderr
    assert hub_env.requests == [] and not zh.repo_cache_dir("zoo-test/other-draft").exists()
    by_id = cli("pull", "zoo-test/other-draft", "-q")
    assert by_id.code == 0 and by_id.stdout.strip().endswith(hub_env.commit("zoo-test/other-draft"))
    assert read_lock() == {}


@pytest.mark.parametrize("command", ["pull", "rm", "env", "serve"])
def test_help_has_examples_and_environment(command):
    run = cli(command, "--help")
    assert run.code == 0
    assert "Examples:" in run.stdout and "HF_HUB_OFFLINE" in run.stdout
    examples = run.stdout.split("Examples:")[1].split("Options:")[0]
    assert (
        2
        <= sum(
            line.strip().startswith("dflash-zoo") or "dflash-zoo " in line for line in examples.splitlines()
        )
        <= 5
    )
