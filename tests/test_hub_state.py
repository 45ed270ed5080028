"""`pull` / `rm` / `info` and the state they leave, against the loopback Hub server (tests/hubserver.py).

`rm` refuses before it says "removing" and frees the bytes it announced; `--json` prints an object for every
failure, unexpected ones too; a read-only `HF_HOME` (no `HF_HUB_CACHE`) is named as such; a disk that fills
up during a transfer stops it with one line, no truncated blob stored; a registry `target.revision` is what
`pull --with-target` resolves and pins; a drafter config.json that is not UTF-8 is one line naming the file.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_zoo.zoo import hub as zh
from tests.hubserver import DRAFT_FILES, DRAFT_REPO, TARGET_REPO, file_etag
from tests.readonly import readonly_mounts_work, run_readonly
from tests.test_cli_hub import cli

pytest_plugins = ["tests.hub_fixtures"]  # fixtures: hub, hub_env, zoo_registry
REPORT_IT = "report it"


def lock() -> dict:
    from dflash_zoo.zoo.registry import read_lock

    return read_lock()


def dz(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash_zoo", *args]


def test_rm_refuses_before_it_says_removing(zoo_registry, hub_env):
    assert cli("pull", "tiny-test", "-q").code == 0
    run = cli("rm", "tiny-test")  # not a TTY, no --yes
    assert run.code == 2 and "pass --yes" in run.stderr
    assert "removing" not in run.stderr and run.stdout == ""
    assert zh.repo_cache_dir(DRAFT_REPO).is_dir() and lock()["tiny-test"]


def test_rm_with_read_only_state_folder_refuses_before_deleting(zoo_registry, hub_env):
    assert cli("pull", "tiny-test", "-q").code == 0
    before = lock()
    state = Path(os.environ["DFLASH_ZOO_HOME"])
    done = run_readonly(dz("rm", "tiny-test", "--yes"), [state], env=dict(os.environ))
    assert done.returncode == 1, done.stderr
    error, hint = done.stderr.splitlines()
    assert (
        error
        == f"error: cannot write to the zoo state folder {state} (DFLASH_ZOO_HOME): Read-only file system"
    )
    assert "DFLASH_ZOO_HOME" in hint and REPORT_IT not in hint
    assert "removing" not in done.stderr and done.stdout == ""
    assert zh.repo_cache_dir(DRAFT_REPO).is_dir() and lock() == before


def test_read_only_hf_home_is_named_when_it_chose_the_cache(zoo_registry, hub_env, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    home = Path(os.environ["HF_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    done = run_readonly(dz("pull", "tiny-test", "--json"), [home], env=dict(os.environ))
    assert done.returncode == 1, done.stderr
    doc = json.loads(done.stdout)
    assert (
        doc["error"]
        == f"cannot write to the Hugging Face cache {home / 'hub'} (HF_HOME): Read-only file system"
    )
    assert doc["hint"] == "make it writable, or point HF_HOME at a writable folder" and doc["exit_code"] == 1
    assert done.stderr.splitlines()[-2] == f"error: {doc['error']}" and REPORT_IT not in done.stderr
    assert hub_env.file_gets() == []


def test_json_reports_failures_the_cli_did_not_foresee(zoo_registry, hub_env):
    blobs = zh.repo_cache_dir(DRAFT_REPO) / "blobs"
    blobs.parent.mkdir(parents=True)
    blobs.write_bytes(b"")  # a file where the blob folder belongs
    run = cli("pull", "tiny-test", "--json")
    doc = json.loads(run.stdout)
    assert run.code == doc["exit_code"] == 1
    assert doc["error"].startswith("FileExistsError: ") and REPORT_IT in doc["hint"]
    assert f"error: {doc['error']}" in run.stderr


def test_json_reports_a_read_only_lock_folder_in_one_line(zoo_registry, hub_env):
    locks = zh.hub_cache_dir() / ".locks"
    locks.mkdir(parents=True)  # the cache root is writable; only the client's lock folder is not
    done = run_readonly(dz("pull", "tiny-test", "--json"), [locks], env=dict(os.environ))
    doc = json.loads(done.stdout)
    assert done.returncode == doc["exit_code"] == 1, done.stderr
    assert doc["error"].startswith(f"cannot write to {locks}/") and "read-only file system" in doc["error"]
    assert "HF_HUB_CACHE" in doc["hint"] and REPORT_IT not in done.stderr
    assert hub_env.file_gets() == []


def test_registry_target_revision_is_resolved_and_pinned(zoo_registry, hub_env):
    sha = hub_env.commit(TARGET_REPO)
    text = zoo_registry.read_text()  # the entry's target, pinned to the served commit
    zoo_registry.write_text(
        text.replace(f"{{repo: {TARGET_REPO},", f"{{repo: {TARGET_REPO}, revision: {sha},")
    )
    run = cli("pull", "tiny-test", "--with-target", "--json")
    assert run.code == 0, run.stderr
    target = json.loads(run.stdout)["repos"][1]
    assert (target["repo_id"], target["revision"], target["commit"]) == (TARGET_REPO, sha, sha)
    rec = lock()["tiny-test"]
    assert (rec["target_revision"], rec["target_commit"], rec["draft_commit"]) == (
        sha,
        sha,
        hub_env.commit(DRAFT_REPO),
    )
    assert not (zh.repo_cache_dir(TARGET_REPO) / "refs" / "main").exists()  # only the sha was asked for
    assert json.loads(cli("info", "tiny-test", "--json").stdout)["pins"]["target"] == sha
    hub_env.reset_log()
    offline = cli("pull", "tiny-test", "--with-target", "--offline", "--json")
    assert offline.code == 0 and json.loads(offline.stdout)["lock"] is None and hub_env.requests == []
    assert lock()["tiny-test"] == rec  # offline pulls resolve nothing, so they pin nothing
    removed = cli("rm", TARGET_REPO, "--yes", "--json")
    assert json.loads(removed.stdout)["pins_removed"] == ["tiny-test (target)"]
    assert json.loads(cli("info", "tiny-test", "--json").stdout)["pins"] == {
        "draft": rec["draft_commit"], "target": None}  # fmt: skip


def test_drafter_config_that_is_not_utf8_is_one_line_naming_it(zoo_registry, hub_env):
    hub_env.add_file("someone/latin1", "config.json", b'{"hidden_size": 64, "name": "caf\xe9"}')
    run = cli("serve", "someone/latin1", "--engine", "vllm", "--target", "t/t", "--dry-run")
    assert run.code == 1
    error, hint = run.stderr.splitlines()[-2:]
    snap = zh.repo_cache_dir("someone/latin1") / "snapshots" / hub_env.commit("someone/latin1")
    assert error == f"error: {snap / 'config.json'} is not valid UTF-8 (byte 32: 0xe9)"
    assert hint.startswith("hint: ") and REPORT_IT not in run.stderr


def test_rm_frees_what_it_said_and_keeps_files_a_link_points_at(zoo_registry, hub_env, tmp_path):
    path = Path(cli("pull", "tiny-test", "-q").stdout.strip())
    mine = tmp_path / "my-notes.bin"
    mine.write_bytes(b"x" * 8000)
    (path / "notes.bin").symlink_to(mine)  # a user's link in the snapshot, to a file outside the cache
    said = json.loads(cli("rm", "tiny-test", "--dry-run", "--json").stdout)["expected_freed_bytes"]
    done = json.loads(cli("rm", "tiny-test", "--yes", "--json").stdout)
    assert done["bytes_freed"] == said == done["expected_freed_bytes"]
    assert mine.read_bytes() == b"x" * 8000 and not zh.repo_cache_dir(DRAFT_REPO).exists()


def test_rm_keeps_a_users_own_files_in_the_cache(zoo_registry, hub_env):
    """A regular file the Hub client never writes (a user's own, in a snapshot) is listed and kept."""
    path = Path(cli("pull", "tiny-test", "-q").stdout.strip())
    own = path / "my-lora" / "adapter.bin"
    own.parent.mkdir()
    own.write_bytes(b"y" * 1000)
    said = json.loads(cli("rm", "tiny-test", "--dry-run", "--json").stdout)
    assert said["repos"][0]["kept_files"] == [str(own)]
    assert "kept: not from the Hub" in cli("rm", "tiny-test", "--dry-run").stdout
    done = json.loads(cli("rm", "tiny-test", "--yes", "--json").stdout)
    assert done["bytes_freed"] == said["expected_freed_bytes"] > 0
    assert own.read_bytes() == b"y" * 1000 and not (zh.repo_cache_dir(DRAFT_REPO) / "blobs").exists()
    assert sorted(p.name for p in path.iterdir()) == ["my-lora"]  # the drafter's files are gone


def test_rm_of_a_repo_folder_linked_elsewhere_removes_only_the_link(zoo_registry, hub_env, tmp_path):
    """A repo moved to another disk and linked back: `rm` unlinks it and deletes nothing there."""
    cli("pull", TARGET_REPO, "-q")
    folder = zh.repo_cache_dir(TARGET_REPO)
    moved = tmp_path / "otherdisk" / folder.name
    moved.parent.mkdir()
    folder.rename(moved)
    folder.symlink_to(moved)
    (moved / "NOTES.txt").write_text("mine")
    before = sorted(str(p.relative_to(moved)) for p in moved.rglob("*"))
    run = cli("rm", TARGET_REPO, "--yes", "--json")
    assert run.code == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["bytes_freed"] == 0 and doc["repos"][0]["linked_to"] == str(moved)
    assert not folder.exists() and not folder.is_symlink()
    assert sorted(str(p.relative_to(moved)) for p in moved.rglob("*")) == before


def test_an_alias_spelling_a_repo_id_never_redirects_rm(zoo_registry, hub_env):
    """An extra entry may alias a repo id (`info` / `check` then pick that entry), but `rm ORG/NAME` and
    `pull ORG/NAME` act on that repo only, never on the aliased entry's drafter."""
    zoo_registry.write_text(
        zoo_registry.read_text().replace('["tiny:test"]', f'["tiny:test", "{TARGET_REPO}"]')
    )
    assert cli("pull", "tiny-test", "--with-target", "-q").code == 0
    run = cli("rm", TARGET_REPO, "--yes", "--json")
    assert run.code == 0, run.stderr
    assert [r["repo_id"] for r in json.loads(run.stdout)["repos"]] == [TARGET_REPO]
    assert not zh.repo_cache_dir(TARGET_REPO).exists() and zh.repo_cache_dir(DRAFT_REPO).is_dir()


FILL_DISK = """
mount -t tmpfs -o size=256k tmpfs {cache} || exit 90
{pull} >{out}/stdout 2>{out}/stderr &
pid=$!
i=0
while [ "$(stat -c %s {partial} 2>/dev/null || echo 0)" -lt 5000 ] && [ $i -lt 600 ]; do i=$((i+1)); sleep 0.1; done
dd if=/dev/zero of={cache}/filler bs=4k 2>/dev/null
touch {out}/full
wait $pid
echo $? >{out}/rc
ls {blobs} >{out}/blobs
"""


def test_disk_filling_up_during_a_pull_is_one_line_and_keeps_the_partial(zoo_registry, hub_env, tmp_path):
    """Room at the check, none a moment later (another writer): the transfer stops with the next step."""
    if not readonly_mounts_work():  # the same private mount namespace, here for a 256 KiB tmpfs
        pytest.skip("private mounts (unshare -m) are not available here")
    weights = DRAFT_FILES["model.safetensors"]
    hub_env.stall_after[f"{DRAFT_REPO}/model.safetensors"] = 5000
    cache, out = Path(os.environ["HF_HUB_CACHE"]), tmp_path / "out"
    cache.mkdir(parents=True)
    out.mkdir()
    blobs = zh.repo_cache_dir(DRAFT_REPO) / "blobs"
    partial = blobs / f"{file_etag(weights)}.incomplete"
    script = FILL_DISK.format(cache=cache, out=out, partial=partial, blobs=blobs,
                              pull=shlex.join(dz("pull", "tiny-test")))  # fmt: skip
    child = subprocess.Popen(["unshare", "-m", "sh", "-c", script], env=dict(os.environ))
    try:
        for _ in range(900):  # up to ~90 s: the child starts, receives 5000 bytes, the disk fills
            if (out / "full").exists() or child.poll() is not None:
                break
            time.sleep(0.1)
        hub_env.release.set()  # the stalled connection drops; the client resumes into a full disk
        child.wait(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    stderr = (out / "stderr").read_text()
    assert (out / "rc").read_text().strip() == "1", stderr
    error, hint = stderr.splitlines()[-2:]
    assert error == (
        f"error: the disk filled up while writing {partial} (model.safetensors of {DRAFT_REPO}@"
        f"{hub_env.commit(DRAFT_REPO)[:12]}); the partial file is kept"
    )
    assert hint.startswith("hint: free space there and pull again") and REPORT_IT not in stderr
    assert partial.name in (out / "blobs").read_text().split()


def test_answering_no_at_the_rm_prompt_removes_nothing_and_exits_0(zoo_registry, hub_env):
    """On a terminal `rm` asks; "n" is an answer (exit 0, nothing removed), not an interruption (130)."""
    import pty
    import select

    assert cli("pull", "tiny-test", "-q").code == 0
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        dz("rm", "tiny-test"), stdin=slave, stdout=slave, stderr=slave, env=dict(os.environ)
    )
    os.close(slave)
    seen, deadline = b"", time.monotonic() + 60
    while time.monotonic() < deadline and b"?" not in seen:  # the question
        if select.select([master], [], [], 1)[0]:
            seen += os.read(master, 4096)
    os.write(master, b"n\n")
    assert proc.wait(timeout=60) == 0
    os.close(master)
    assert zh.repo_cache_dir(DRAFT_REPO).is_dir() and lock()["tiny-test"]


def test_the_lock_file_is_an_ordinary_file(zoo_registry, hub_env):
    from dflash_zoo.zoo.registry import lock_path

    old = os.umask(0o022)
    try:
        assert cli("pull", "tiny-test", "-q").code == 0
    finally:
        os.umask(old)
    assert lock_path().stat().st_mode & 0o777 == 0o644
