"""`dflash_zoo.zoo.hub` against the loopback Hub server (tests/hubserver.py): the real client, no mocks."""

from __future__ import annotations

import time

import pytest

from dflash_zoo.errors import NotFoundError, OfflineError
from dflash_zoo.zoo import hub as zh
from dflash_zoo.zoo import removal
from tests.hubserver import DRAFT_FILES, DRAFT_REPO, TARGET_REPO, file_etag, git_blob_id

pytest_plugins = ["tests.hub_fixtures"]  # fixtures: hub, hub_env, offline_env

DRAFT_BYTES = sum(len(d) for d in DRAFT_FILES.values())


def _pull(repo_id: str = DRAFT_REPO, **kwargs) -> zh.PullResult:
    return zh.download(zh.plan_pull(repo_id, **kwargs), progress=False)


def test_plan_lists_files_sizes_and_commit_without_downloading(hub_env):
    plan = zh.plan_pull(DRAFT_REPO)
    assert plan.commit == hub_env.commit(DRAFT_REPO)
    assert {f.path: f.size for f in plan.files} == {p: len(d) for p, d in DRAFT_FILES.items()}
    assert plan.total_bytes == plan.missing_bytes == DRAFT_BYTES
    digests = {f.path: f.digest for f in plan.files}  # LFS files: sha256; others: the git blob id
    assert digests["model.safetensors"] == file_etag(DRAFT_FILES["model.safetensors"])
    assert digests["config.json"] == git_blob_id(DRAFT_FILES["config.json"])
    assert not plan.up_to_date
    assert hub_env.file_gets() == []
    assert not zh.repo_cache_dir(DRAFT_REPO).exists()


def test_pull_lands_in_hf_cache_layout(hub_env):
    result = _pull()
    storage = zh.repo_cache_dir(DRAFT_REPO)
    assert result.path == storage / "snapshots" / result.commit
    assert (storage / "refs" / "main").read_text().strip() == result.commit
    for path, data in DRAFT_FILES.items():
        assert (result.path / path).read_bytes() == data
    assert result.downloaded_bytes == DRAFT_BYTES and not result.up_to_date
    assert str(storage).startswith(str(zh.hub_cache_dir()))


def test_second_pull_downloads_nothing(hub_env):
    _pull()
    hub_env.reset_log()
    again = _pull()
    assert again.up_to_date and again.downloaded_bytes == 0
    assert hub_env.file_gets() == []
    assert [r.method for r in hub_env.requests] == ["GET"]  # one revision lookup, nothing else


def test_pull_at_commit_sha_and_allow_patterns(hub_env):
    sha = hub_env.commit(DRAFT_REPO)
    result = _pull(revision=sha, allow_patterns=["*.json"])
    assert result.commit == sha
    assert sorted(p.name for p in result.path.iterdir()) == ["config.json"]
    assert not (zh.repo_cache_dir(DRAFT_REPO) / "refs" / sha).exists()


def test_interrupted_transfer_resumes_with_range(hub_env):
    data = DRAFT_FILES["model.safetensors"]
    hub_env.truncate_once[f"{DRAFT_REPO}/model.safetensors"] = 5000
    result = _pull()
    assert (result.path / "model.safetensors").read_bytes() == data
    gets = [r for r in hub_env.file_gets() if r.path.endswith("model.safetensors")]
    assert [r.range for r in gets] == [None, "bytes=5000-"]


def test_stale_partial_blob_does_not_corrupt(hub_env):
    data = DRAFT_FILES["model.safetensors"]
    blobs = zh.repo_cache_dir(DRAFT_REPO) / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{file_etag(data)}.incomplete").write_bytes(b"garbage" + data[:5000])
    result = _pull()
    assert (result.path / "model.safetensors").read_bytes() == data


def test_missing_repo(hub_env):
    with pytest.raises(NotFoundError, match="no such repo: nobody/nothing"):
        zh.plan_pull("nobody/nothing")


def test_missing_revision(hub_env):
    with pytest.raises(NotFoundError, match="has no revision 'v9'"):
        zh.plan_pull(DRAFT_REPO, revision="v9")


def test_missing_file_by_pattern(hub_env):
    with pytest.raises(NotFoundError, match=r"no file matching \['\*.gguf'\]"):
        zh.plan_pull(DRAFT_REPO, allow_patterns=["*.gguf"])


def test_file_missing_at_download(hub_env):
    plan = zh.plan_pull(DRAFT_REPO)
    hub_env.unresolvable.add(f"{DRAFT_REPO}/README.md")
    with pytest.raises(NotFoundError, match="README.md") as info:
        zh.download(plan, progress=False)
    assert "\n" not in str(info.value)


def test_server_error_is_one_line(hub_env):
    hub_env.fail_status = 500
    start = time.monotonic()
    with pytest.raises(zh.HubUnavailableError, match="HTTP 500") as info:
        zh.plan_pull(DRAFT_REPO)
    assert "\n" not in str(info.value) and info.value.hint
    assert time.monotonic() - start < 60


def test_gated_repo_points_to_login_and_license(hub_env):
    hub_env.gated.add(DRAFT_REPO)
    with pytest.raises(zh.GatedRepoError) as info:
        zh.plan_pull(DRAFT_REPO)
    assert "hf auth login" in info.value.hint and f"{hub_env.url}/{DRAFT_REPO}" in info.value.hint


def test_offline_never_contacts_the_server(offline_env):
    with pytest.raises(OfflineError) as info:
        zh.plan_pull(DRAFT_REPO, name="tiny")
    assert "dflash-zoo pull tiny" in info.value.hint
    with pytest.raises(OfflineError):
        zh.snapshot(DRAFT_REPO)
    assert offline_env.requests == []


def test_offline_uses_the_cache(hub_env, monkeypatch):
    online = _pull()
    hub_env.reset_log()
    plan = zh.plan_pull(DRAFT_REPO, offline=True)
    assert plan.up_to_date and plan.commit == online.commit
    assert zh.download(plan).path == online.path
    assert zh.snapshot(DRAFT_REPO, offline=True) == online.path
    with pytest.raises(OfflineError, match="no cached revision 'v2'"):
        zh.plan_pull(DRAFT_REPO, revision="v2", offline=True)
    assert hub_env.requests == []


def test_removal_frees_bytes_and_dry_plan_keeps_files(hub_env):
    kept = _pull(TARGET_REPO)
    result = _pull()
    plan = removal.plan_removal([DRAFT_REPO, "nobody/nothing"])
    assert [r.commit for r in plan.revisions] == [result.commit]
    assert plan.revisions[0].size_bytes == DRAFT_BYTES and plan.revisions[0].refs == ("main",)
    assert plan.not_cached == ("nobody/nothing",)
    assert plan.expected_freed_bytes == DRAFT_BYTES + 40  # blobs + refs/main
    assert result.path.exists()  # planning deletes nothing
    assert removal.execute_removal(plan) == DRAFT_BYTES + 40
    assert not zh.repo_cache_dir(DRAFT_REPO).exists() and removal.cached_revisions(DRAFT_REPO) == []
    assert kept.path.exists()


def test_removal_with_no_cache_is_empty(hub_env):
    plan = removal.plan_removal([DRAFT_REPO])
    assert plan.revisions == () and plan.expected_freed_bytes == 0
    assert removal.execute_removal(plan) == 0


def test_unreachable_hub_falls_back_to_a_cached_snapshot(hub_env):
    hub_env.fail_status = 503
    with pytest.raises(zh.HubUnavailableError):
        zh.snapshot(DRAFT_REPO)  # nothing cached yet
    hub_env.fail_status = None
    online = _pull()
    hub_env.fail_status = 503
    assert zh.snapshot(DRAFT_REPO, allow_patterns=["config.json"]) == online.path
