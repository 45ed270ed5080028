"""Downloads you can trust: `pull` / `rm` / `info` against the loopback Hub server (tests/hubserver.py).

Corrupt bytes are refused, cached files are re-hashed, a pull killed with SIGKILL resumes in the next process
with a Range request, repo ids act on that repo only, byte counts are the bytes that really moved, and the
lock file keeps (and forgets) both pins. All through the real CLI and the real hub client; no mocks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_zoo.zoo import hub as zh
from tests.hubserver import DRAFT_FILES, DRAFT_REPO, TARGET_FILES, TARGET_REPO, file_etag, flip, git_blob_id
from tests.readonly import run_readonly
from tests.test_cli_hub import cli

pytest_plugins = ["tests.hub_fixtures"]  # fixtures: hub, hub_env, zoo_registry, offline_env
DRAFT_BYTES = sum(len(d) for d in DRAFT_FILES.values())
WEIGHTS = DRAFT_FILES["model.safetensors"]
WEIGHTS_KEY = f"{DRAFT_REPO}/model.safetensors"
REF_BYTES = 40  # refs/main holds the 40-hex commit


def blobs(repo_id: str = DRAFT_REPO) -> Path:
    return zh.repo_cache_dir(repo_id) / "blobs"


def snapshot_files(repo_id: str, commit: str) -> list[str]:
    snap = zh.repo_cache_dir(repo_id) / "snapshots" / commit
    return sorted(p.name for p in snap.iterdir()) if snap.is_dir() else []


def lock() -> dict:
    from dflash_zoo.zoo.registry import read_lock

    return read_lock()


# ---- integrity ------------------------------------------------------------------------------------


def test_served_corrupt_weights_are_refused_and_nothing_enters_the_snapshot(zoo_registry, hub_env):
    hub_env.corrupt[WEIGHTS_KEY] = 4096  # right size, right ETag and listing, 4 KiB inverted
    run = cli("pull", "tiny-test")
    assert run.code == 1
    error = run.stderr.splitlines()[-2]
    assert (
        error.startswith("error: model.safetensors of zoo-test/tiny-draft@")
        and "failed verification" in error
    )
    assert "sha256" in error and "nothing was stored" in error
    commit = hub_env.commit(DRAFT_REPO)
    assert snapshot_files(DRAFT_REPO, commit) == []  # not even the files that verified
    assert not (blobs() / file_etag(WEIGHTS)).exists()
    assert not any(p.name.endswith(".incomplete") for p in blobs().iterdir())
    assert lock() == {}
    as_json = cli("pull", "tiny-test", "--json")
    doc = json.loads(as_json.stdout)
    assert as_json.code == 1 and doc["exit_code"] == 1 and "model.safetensors" in doc["error"] and doc["hint"]
    del hub_env.corrupt[WEIGHTS_KEY]
    good = cli("pull", "tiny-test", "-q")
    assert good.code == 0 and (Path(good.stdout.strip()) / "model.safetensors").read_bytes() == WEIGHTS


def test_corrupt_small_cached_file_is_caught_by_a_plain_pull(zoo_registry, hub_env):
    path = Path(cli("pull", "tiny-test", "-q").stdout.strip())
    blob = blobs() / git_blob_id(DRAFT_FILES["config.json"])  # a non-LFS file: its blob is its git id
    assert (path / "config.json").resolve() == blob.resolve()
    blob.write_bytes(flip(blob.read_bytes(), 0, 8))
    run = cli("pull", "tiny-test")
    assert run.code == 1 and "corrupt: config.json of zoo-test/tiny-draft (git-sha1" in run.stderr
    assert "already up to date" in run.stderr  # the plan says cached; the hash says otherwise
    assert "error: 1 cached file(s) failed verification: config.json" in run.stderr
    assert "--verify --force" in run.stderr


def test_verify_reports_corrupt_weights_and_force_refetches(zoo_registry, hub_env, monkeypatch):
    path = Path(cli("pull", "tiny-test", "-q").stdout.strip())
    blob = blobs() / file_etag(WEIGHTS)
    blob.write_bytes(flip(WEIGHTS, 8192))
    monkeypatch.setattr(zh, "ALWAYS_VERIFY_BYTES", 1024)  # weights above the always-hashed size
    assert cli("pull", "tiny-test").code == 0  # a plain pull re-hashes small files only
    hub_env.reset_log()
    checked = cli("pull", "tiny-test", "--verify", "--json")
    assert checked.code == 1 and "model.safetensors" in json.loads(checked.stdout)["error"]
    assert "corrupt: model.safetensors of zoo-test/tiny-draft (sha256" in checked.stderr
    assert hub_env.file_gets() == []
    fixed = cli("pull", "tiny-test", "--verify", "--force", "--json")
    assert fixed.code == 0, fixed.stderr
    repo = json.loads(fixed.stdout)["repos"][0]
    assert repo["fetched"] == ["model.safetensors"] and repo["downloaded_bytes"] == len(WEIGHTS)
    assert [r.path.rsplit("/", 1)[-1] for r in hub_env.file_gets()] == ["model.safetensors"]
    assert (path / "model.safetensors").read_bytes() == WEIGHTS
    everything = json.loads(cli("pull", "tiny-test", "--force", "--json").stdout)["repos"][0]
    assert (
        sorted(everything["fetched"]) == sorted(DRAFT_FILES) and everything["downloaded_bytes"] == DRAFT_BYTES
    )
    assert cli("pull", "tiny-test", "--force", "--offline").code == 2
    blob.write_bytes(flip(WEIGHTS, 0))
    hub_env.reset_log()
    offline = cli("pull", "tiny-test", "--offline", "--verify")  # offline, the blob name is the hash
    assert offline.code == 1 and "corrupt: model.safetensors" in offline.stderr and hub_env.requests == []


def test_a_mirror_listing_no_sizes_pulls_with_sizes_from_the_download(zoo_registry, hub_env):
    """A Hub-compatible mirror whose revision listing gives no sizes: every file once failed "expected 0
    bytes"; the size now comes from the download (HEAD / Content-Length) and the hash is still checked."""
    hub_env.listing_sizes = False
    plan = json.loads(cli("pull", "tiny-test", "--dry-run", "--json").stdout)["repos"][0]
    assert {f["path"]: f["size"] for f in plan["files"]} == dict.fromkeys(DRAFT_FILES)  # not 0: unknown
    dry = cli("pull", "tiny-test", "--dry-run")
    assert dry.code == 0 and "3 files of unknown size" in dry.stderr, dry.stderr
    run = cli("pull", "tiny-test", "--json")
    assert run.code == 0, run.stderr
    repo = json.loads(run.stdout)["repos"][0]
    assert sorted(repo["fetched"]) == sorted(DRAFT_FILES) and repo["downloaded_bytes"] == DRAFT_BYTES
    snap = Path(repo["path"])
    assert {p: (snap / p).read_bytes() for p in DRAFT_FILES} == DRAFT_FILES
    assert (snap / "model.safetensors").resolve() == (blobs() / file_etag(WEIGHTS)).resolve()
    again = json.loads(cli("pull", "tiny-test", "--json").stdout)["repos"][0]  # sizes from the cached files
    assert again["up_to_date"] and {f["size"] for f in again["files"]} == {
        len(d) for d in DRAFT_FILES.values()
    }


def test_a_mirror_listing_no_sizes_still_refuses_corrupt_bytes(zoo_registry, hub_env):
    hub_env.listing_sizes = False
    hub_env.corrupt[WEIGHTS_KEY] = 4096
    run = cli("pull", "tiny-test")
    assert run.code == 1 and "model.safetensors of zoo-test/tiny-draft@" in run.stderr, run.stderr
    assert "failed verification" in run.stderr and "sha256" in run.stderr
    assert snapshot_files(DRAFT_REPO, hub_env.commit(DRAFT_REPO)) == []
    assert not (blobs() / file_etag(WEIGHTS)).exists()


# ---- interrupted pulls ----------------------------------------------------------------------------


def _killed_pull(hub_env, tmp_path: Path, check_while_running=None) -> Path:
    """Run `dflash-zoo pull` in a child, stall the weights after 5000 bytes, SIGKILL it; the partial file."""
    hub_env.stall_after[WEIGHTS_KEY] = 5000
    partial = blobs() / f"{file_etag(WEIGHTS)}.incomplete"
    log = (tmp_path / "child.log").open("w")
    child = subprocess.Popen([sys.executable, "-m", "dflash_zoo", "pull", DRAFT_REPO, "-q"],
                             env=dict(os.environ), stdout=log, stderr=log)  # fmt: skip
    try:
        for _ in range(600):  # up to ~60 s for the child to start and receive the first 5000 bytes
            if partial.is_file() and partial.stat().st_size >= 5000 or child.poll() is not None:
                break
            time.sleep(0.1)
        assert child.poll() is None, (tmp_path / "child.log").read_text()
        if check_while_running is not None:
            check_while_running()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
        hub_env.release.set()
        log.close()
    assert partial.stat().st_size == 5000
    return partial


def test_killed_pull_resumes_with_range_in_the_next_process(zoo_registry, hub_env, tmp_path):
    def rm_refuses_a_running_download():
        busy = cli("rm", DRAFT_REPO, "--yes")
        assert busy.code == 1 and "being downloaded by another process" in busy.stderr
        assert zh.repo_cache_dir(DRAFT_REPO).is_dir()

    partial = _killed_pull(hub_env, tmp_path, rm_refuses_a_running_download)
    hub_env.reset_log()
    run = cli("pull", DRAFT_REPO, "--json")
    assert run.code == 0, run.stderr
    repo = json.loads(run.stdout)["repos"][0]
    assert repo["downloaded_bytes"] == len(WEIGHTS) - 5000  # README / config were complete blobs already
    gets = [r for r in hub_env.file_gets() if r.path.endswith("model.safetensors")]
    assert [r.range for r in gets] == ["bytes=5000-"]
    assert (Path(repo["path"]) / "model.safetensors").read_bytes() == WEIGHTS
    assert not partial.exists()


def test_rm_counts_and_removes_orphaned_partial_downloads(zoo_registry, hub_env, tmp_path):
    _killed_pull(hub_env, tmp_path)
    done_blobs = len(DRAFT_FILES["README.md"]) + len(DRAFT_FILES["config.json"])
    dry = cli("rm", DRAFT_REPO, "--dry-run")
    assert dry.code == 0 and "partial download" in dry.stdout
    assert f"({done_blobs + 5000} bytes)" in dry.stdout and "would free" in dry.stdout
    done = cli("rm", DRAFT_REPO, "--yes", "--json")
    doc = json.loads(done.stdout)
    assert done.code == 0 and doc["bytes_freed"] == doc["expected_freed_bytes"] == done_blobs + 5000
    assert [p["size"] for p in doc["repos"][0]["partial_files"]] == [5000]
    assert not zh.repo_cache_dir(DRAFT_REPO).exists()


# ---- repo ids are repo ids ------------------------------------------------------------------------


def test_repo_id_acts_on_that_repo_and_slug_on_the_drafter(zoo_registry, hub_env):
    target = cli("pull", TARGET_REPO, "-q")  # the registry knows it as tiny-test's target: still that repo
    assert target.code == 0 and target.stdout.strip().endswith(hub_env.commit(TARGET_REPO))
    assert not zh.repo_cache_dir(DRAFT_REPO).exists() and lock() == {}
    cli("pull", "tiny-test", "-q")
    run = cli("rm", TARGET_REPO.upper(), "--yes")  # ids match case-insensitively, in the registry's spelling
    assert run.code == 0, run.stderr
    assert f"removing {TARGET_REPO} (repo id, the target of tiny-test)" in run.stderr
    assert TARGET_REPO in run.stdout and DRAFT_REPO not in run.stdout + run.stderr
    assert not zh.repo_cache_dir(TARGET_REPO).exists() and zh.repo_cache_dir(DRAFT_REPO).is_dir()
    refused = cli("rm", TARGET_REPO, "--with-target", "--yes")
    assert refused.code == 2 and "`dflash-zoo rm tiny-test --with-target`" in refused.stderr
    slug = cli("rm", "tiny-test", "--yes")
    assert slug.code == 0 and f"removing {DRAFT_REPO} (drafter of tiny-test)" in slug.stderr
    assert not zh.repo_cache_dir(DRAFT_REPO).exists()


# ---- byte counts and disk space -------------------------------------------------------------------


def test_byte_counts_are_bytes_moved(zoo_registry, hub_env):
    first = json.loads(cli("pull", "tiny-test", "--json").stdout)["repos"][0]
    assert first["downloaded_bytes"] == DRAFT_BYTES
    readme = b"# tiny draft, v2\n"
    hub_env.add_file(DRAFT_REPO, "README.md", readme)  # a new commit that changes only the README
    second = cli("pull", "tiny-test")
    assert second.code == 0 and f"downloaded {len(readme)} B ({len(readme)} bytes)" in second.stderr
    assert lock()["tiny-test"]["draft_commit"] == hub_env.commit(DRAFT_REPO)
    # two revisions share config and weights: each blob is counted once, the links not at all
    freed = json.loads(cli("rm", "tiny-test", "--yes", "--json").stdout)["bytes_freed"]
    assert freed == DRAFT_BYTES + len(readme) + REF_BYTES


def test_file_fetched_by_another_process_counts_zero(hub_env):
    stale = zh.plan_pull(DRAFT_REPO)
    assert zh.download(zh.plan_pull(DRAFT_REPO), progress=False).downloaded_bytes == DRAFT_BYTES
    hub_env.reset_log()
    late = zh.download(stale, progress=False)  # its plan still says "missing"; the blobs are there now
    assert late.downloaded_bytes == 0 and hub_env.file_gets() == []
    assert (late.path / "model.safetensors").read_bytes() == WEIGHTS


def test_full_disk_is_one_line_before_any_download(zoo_registry, hub_env):
    hub_env.advertise_size[WEIGHTS_KEY] = 10**16  # 10 PB: more than any test disk has free
    run = cli("pull", "tiny-test")
    error, hint = run.stderr.splitlines()[-2:]  # after the line naming the repo
    assert run.code == 1 and hint.startswith("hint: ")
    assert error.startswith("error: not enough disk space for zoo-test/tiny-draft: ")
    assert f"({10**16 + DRAFT_BYTES - len(WEIGHTS)} bytes) to download" in error
    assert "free in " in error and str(zh.hub_cache_dir().parent.parent) in error
    assert "HF_HUB_CACHE" in run.stderr and "report it" not in run.stderr
    assert hub_env.file_gets() == []


@pytest.mark.parametrize("var", ["HF_HUB_CACHE", "DFLASH_ZOO_HOME"])
def test_read_only_cache_or_state_is_one_line_naming_path_and_variable(zoo_registry, hub_env, var):
    folder = Path(os.environ[var])
    folder.mkdir(parents=True, exist_ok=True)
    done = run_readonly(
        [sys.executable, "-m", "dflash_zoo", "pull", "tiny-test"], [folder], env=dict(os.environ)
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()[-2:]  # after the line naming the repo
    assert lines[0].startswith("error: cannot write to ") and f"{folder} ({var})" in lines[0]
    assert "Read-only file system" in lines[0] and var in lines[1]
    assert hub_env.file_gets() == []


def test_rm_on_read_only_cache_is_one_line(zoo_registry, hub_env):
    cli("pull", "tiny-test", "-q")
    folder = Path(os.environ["HF_HUB_CACHE"])
    done = run_readonly([sys.executable, "-m", "dflash_zoo", "rm", "tiny-test", "--yes"], [folder],
                        env=dict(os.environ))  # fmt: skip
    error = done.stderr.splitlines()[-2]
    assert done.returncode == 1 and error.startswith(
        f"error: cannot write to the Hugging Face cache {folder}"
    )
    assert "(HF_HUB_CACHE): Read-only file system" in error and zh.repo_cache_dir(DRAFT_REPO).is_dir()


# ---- pins -----------------------------------------------------------------------------------------


def test_pins_round_trip_through_pull_info_rm(zoo_registry, hub_env):
    draft, target = hub_env.commit(DRAFT_REPO), hub_env.commit(TARGET_REPO)
    assert cli("pull", "tiny-test", "--with-target", "-q").code == 0
    rec = lock()["tiny-test"]
    assert (rec["draft_repo"], rec["draft_commit"], rec["target_repo"], rec["target_commit"]) == (
        DRAFT_REPO, draft, TARGET_REPO, target)  # fmt: skip
    assert rec["draft_revision"] == rec["target_revision"] == "main" and rec["pulled_at"]
    info = json.loads(cli("info", "tiny-test", "--json").stdout)
    assert info["pins"] == {"draft": draft, "target": target}
    text = cli("info", "tiny-test").stdout
    assert text.count("pinned commit") == 2 and draft in text and target in text
    assert cli("pull", "tiny-test", "-q").code == 0  # a draft-only pull keeps the target pin
    assert lock()["tiny-test"]["target_commit"] == target
    removed = cli("rm", "tiny-test", "--yes")
    assert removed.code == 0 and "lock pins removed: tiny-test (draft)" in removed.stderr
    assert json.loads(cli("info", "tiny-test", "--json").stdout)["pins"] == {"draft": None, "target": target}
    assert cli("rm", "tiny-test", "--with-target", "--yes").code == 0
    assert lock() == {} and "not pulled" in cli("info", "tiny-test").stdout


def test_offline_pull_writes_no_pins_and_json_errors(zoo_registry, hub_env):
    from dflash_zoo.zoo.registry import lock_path

    assert cli("pull", "tiny-test", "-q").code == 0
    lock_path().unlink()
    offline = cli("pull", "tiny-test", "--offline", "--json")
    assert offline.code == 0 and json.loads(offline.stdout)["lock"] is None and not lock_path().exists()
    missing = cli("pull", "nobody/nothing", "--json")
    doc = json.loads(missing.stdout)
    assert missing.code == 1 and doc["error"] == "no such repo: nobody/nothing" and doc["exit_code"] == 1
    usage = cli("pull", "nobody/nothing", "--with-target", "--json")
    assert usage.code == 2 and json.loads(usage.stdout)["exit_code"] == 2


NO_TORCH = """
import sys
from dflash_zoo.cli import main
for argv in (["pull", "tiny-test", "-q"], ["pull", "tiny-test", "--verify"], ["info", "tiny-test"],
             ["rm", "tiny-test", "--dry-run"], ["rm", "tiny-test", "--yes"], ["env", "--help"]):
    try:
        main(argv)
    except SystemExit as exc:
        assert exc.code in (0, None), (argv, exc.code)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
assert not heavy, heavy[:5]
"""


def test_pull_rm_info_env_help_do_not_import_torch(zoo_registry, hub_env):
    argv = [sys.executable, "-c", NO_TORCH]
    proc = subprocess.run(argv, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert hub_env.file_gets() and not zh.repo_cache_dir(DRAFT_REPO).exists()


def test_target_files_are_verified_too(zoo_registry, hub_env):
    hub_env.corrupt[f"{TARGET_REPO}/model.safetensors"] = 0
    run = cli("pull", "tiny-test", "--with-target")
    assert run.code == 1 and "model.safetensors of zoo-test/tiny-target@" in run.stderr
    assert "target_commit" not in lock().get("tiny-test", {})
    # the drafter came first and verified: it is pinned although the target failed
    assert lock()["tiny-test"]["draft_commit"] == hub_env.commit(DRAFT_REPO)
    assert len(TARGET_FILES["model.safetensors"]) == 4096  # the whole file inverted, same size
