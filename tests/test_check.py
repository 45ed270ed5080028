"""`check_pair` on golden config fixtures: known-good pairs, known-bad pairs, config sources, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dflash_zoo.adapters import find_adapter

from dflash_zoo.errors import InvalidArgumentError, NotFoundError, OfflineError
from dflash_zoo.zoo import check as check_mod
from dflash_zoo.zoo.check import CheckReport, check_pair
from dflash_zoo.zoo.registry import load_registry, write_lock

pytest_plugins = ["tests.hub_fixtures"]  # hub_env: a loopback Hub server (never the network)

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
# every golden pair (where the drafter's config is not public, a gated or preview one, only its target is here)
GOOD = sorted(p.name for p in FIXTURES.iterdir() if (p / "draft.json").is_file())
SLUGS = [e.slug for e in load_registry()]  # every registry entry, with or without a golden config
MARKED = [e.slug for e in load_registry() if e.declared_status == "unsupported-here"]  # listed, not runnable
SHA = "1234567890abcdef1234567890abcdef12345678"


def fx(slug: str, side: str) -> Path:
    return FIXTURES / slug / f"{side}.json"


def rows(report: CheckReport) -> dict[str, list[str]]:
    """check name -> statuses (a check may appear more than once)."""
    out: dict[str, list[str]] = {}
    for r in report.rows:
        out.setdefault(r.check, []).append(r.status)
    return out


def as_dir(tmp_path: Path, slug: str, side: str) -> Path:
    folder = tmp_path / f"{slug}-{side}"
    folder.mkdir()
    (folder / "config.json").write_text(fx(slug, side).read_text())
    return folder


def cache_repo(repo: str, config: dict, commit: str = SHA, ref: str | None = "main") -> None:
    """Lay out `config.json` of `repo` in the HF cache as the hub client does."""
    from dflash_zoo.zoo.hub import repo_cache_dir

    root = repo_cache_dir(repo)
    (root / "snapshots" / commit).mkdir(parents=True)
    (root / "snapshots" / commit / "config.json").write_text(json.dumps(config))
    if ref:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)


pytestmark = pytest.mark.usefixtures("offline_zoo_home")


# ---- known-good pairs -----------------------------------------------------------------------------


@pytest.mark.parametrize("slug", GOOD)
def test_known_good_pairs(slug):
    report = check_pair(slug, config=fx(slug, "target"), draft_config=fx(slug, "draft"), offline=True)
    model_type = json.loads(fx(slug, "target").read_text())["model_type"]
    got = rows(report)
    for name in ("hidden size", "taps", "vocab", "block size"):
        assert got[name] == ["PASS"], (name, report.rows)
    assert report.entry == slug and got["pair"] == ["PASS"]
    assert report.target_source.startswith("config file") and report.draft_source.startswith("config file")
    if find_adapter(model_type) is None:  # family adapter not installed here: only that row fails
        assert report.verdict == "incompatible"
        assert [r.check for r in report.rows if r.status == "FAIL"] == ["adapter"]
    else:
        assert report.verdict == "compatible" and report.compatible
        assert "FAIL" not in {r.status for r in report.rows}


def test_pair_specifics():
    llama = check_pair("llama3.1-8b-instruct", config=fx("llama3.1-8b-instruct", "target"),
                       draft_config=fx("llama3.1-8b-instruct", "draft"))  # fmt: skip
    assert rows(llama)["mask id"] == ["WARN"]  # early config: no mask id
    assert llama.draft_fingerprint.target_layer_ids == (1, 8, 15, 22, 29)  # default rule, L=32
    assert llama.draft_fingerprint.block_size == 10
    q35 = check_pair("qwen3.5-9b", config=fx("qwen3.5-9b", "target"), draft_config=fx("qwen3.5-9b", "draft"))
    assert rows(q35)["registry fingerprint"] == ["WARN"]  # older revision than the registry's fingerprint
    assert rows(q35)["revision"] == ["WARN"]
    q3 = check_pair("qwen3-8b", config=fx("qwen3-8b", "target"), draft_config=fx("qwen3-8b", "draft"))
    assert "registry fingerprint" not in rows(q3)
    assert "enable_thinking=False" in next(r.detail for r in q3.rows if r.check == "thinking")


# ---- known-bad pairs ------------------------------------------------------------------------------

BAD = [
    # target fixture, draft fixture, checks that must FAIL
    ("qwen3-8b", "gpt-oss-20b", {"hidden size", "mask id"}),  # mask 200000 >= 151936 rows
    ("llama3.1-8b-instruct", "qwen3-8b", {"taps", "mask id"}),  # H 4096 matches; 36-layer taps, Qwen mask
    ("llama3.1-8b-instruct", "qwen3.5-9b", {"mask id"}),  # only the mask id lies outside the table
    ("gpt-oss-20b", "gemma4-31b-it", {"hidden size", "taps"}),
]


@pytest.mark.parametrize("target,draft,fails", BAD)
def test_known_bad_pairs(tmp_path, target, draft, fails):
    report = check_pair(str(as_dir(tmp_path, target, "target")), draft=str(as_dir(tmp_path, draft, "draft")))
    assert report.verdict == "incompatible"
    assert {r.check for r in report.rows if r.status == "FAIL"} == fails
    assert rows(report)["pair"] == ["WARN"]  # an unregistered (local) drafter


def test_registered_drafter_on_wrong_target():
    report = check_pair("Qwen/Qwen3-4B", draft="qwen3-8b", offline=True)
    assert report.verdict == "incompatible" and rows(report)["hidden size"] == ["FAIL"]
    assert "trained for Qwen/Qwen3-8B" in next(r.detail for r in report.rows if r.check == "pair")


def test_transformers_too_old(monkeypatch):
    monkeypatch.setattr(check_mod, "_installed", lambda dist: "4.57.1")
    report = check_pair("qwen3-8b", config=fx("qwen3-8b", "target"), draft_config=fx("qwen3-8b", "draft"))
    assert rows(report)["transformers"] == ["FAIL"] and not report.compatible


# ---- base model vs Instruct drafter ---------------------------------------------------------------


def test_llama_base_is_compatible_with_warning():
    report = check_pair(
        "meta-llama/Llama-3.1-8B", draft_config=fx("llama3.1-8b-instruct", "draft"), offline=True
    )
    assert report.verdict == "compatible" and report.entry == "llama3.1-8b-instruct"
    assert report.target_source.startswith("registry llama3.1-8b-instruct")
    got = rows(report)
    assert got["pair"] == ["PASS"] and got["acceptance"] == ["WARN"]
    assert "variant" in next(r.detail for r in report.rows if r.check == "pair")


def test_unknown_dir_matched_by_fingerprint(tmp_path):
    report = check_pair(str(as_dir(tmp_path, "llama3.1-8b-instruct", "target")), offline=True)
    assert report.entry == "llama3.1-8b-instruct" and report.compatible
    assert rows(report)["acceptance"] == ["WARN"]
    assert report.draft_source == "registry llama3.1-8b-instruct (draft fingerprint)"
    assert rows(report)["draft config"] == ["WARN"]


# ---- config sources -------------------------------------------------------------------------------


def test_registry_only_when_offline_and_uncached():
    report = check_pair("qwen3-8b", offline=True)
    assert report.target_source == "registry qwen3-8b (target fingerprint)"
    assert report.draft_source == "registry qwen3-8b (draft fingerprint)"
    assert report.compatible and rows(report)["draft config"] == ["WARN"]


def test_hf_cache_sources_and_locked_commit():
    cache_repo("Qwen/Qwen3-8B", json.loads(fx("qwen3-8b", "target").read_text()))
    draft = json.loads(fx("qwen3-8b", "draft").read_text())
    cache_repo("z-lab/Qwen3-8B-DFlash-b16", draft, commit=SHA, ref=None)  # only the locked commit is cached
    write_lock("qwen3-8b", "z-lab/Qwen3-8B-DFlash-b16", "main", SHA)
    report = check_pair("Qwen/Qwen3-8B", offline=True)
    assert report.target_source == "hf cache Qwen/Qwen3-8B"
    assert report.draft_source == f"hf cache z-lab/Qwen3-8B-DFlash-b16@{SHA}"
    assert rows(report)["revision"] == ["PASS"] and report.compatible


def test_local_dirs(tmp_path):
    report = check_pair(
        str(as_dir(tmp_path, "gpt-oss-20b", "target")), draft=str(as_dir(tmp_path, "gpt-oss-20b", "draft"))
    )
    assert report.target_source.startswith("local ") and report.draft_source.startswith("local ")
    assert report.entry is None and rows(report)["hidden size"] == ["PASS"]


def test_hub_download_of_config_only(hub_env):
    for slug, repo, side in [
        ("qwen3-8b", "Qwen/Qwen3-8B", "target"),
        ("qwen3-8b", "z-lab/Qwen3-8B-DFlash-b16", "draft"),
    ]:
        hub_env.add_file(repo, "config.json", fx(slug, side).read_bytes())
        hub_env.add_file(repo, "model.safetensors", b"\0" * 1024)
    report = check_pair(
        "some-org/qwen3-8b-copy", draft="z-lab/Qwen3-8B-DFlash-b16", config=fx("qwen3-8b", "target")
    )
    assert report.draft_source == "hub z-lab/Qwen3-8B-DFlash-b16@main" and report.compatible
    assert all("model.safetensors" not in r.path for r in hub_env.requests)


def test_gated_drafter_falls_back_to_fingerprint(hub_env):
    hub_env.add_file("z-lab/Qwen3-8B-DFlash-b16", "config.json", fx("qwen3-8b", "draft").read_bytes())
    hub_env.gated.add("z-lab/Qwen3-8B-DFlash-b16")
    report = check_pair("qwen3-8b")
    assert report.draft_source == "registry qwen3-8b (draft fingerprint)"
    assert "gated" in next(r.detail for r in report.rows if r.check == "draft config")


# ---- errors ---------------------------------------------------------------------------------------


def test_unknown_repo_offline():
    with pytest.raises(OfflineError, match="some-org/unknown"):
        check_pair("some-org/unknown", offline=True)


def test_unknown_name_suggests():
    with pytest.raises(NotFoundError) as err:
        check_pair("qwen3-8", offline=True)
    assert "qwen3-8b" in err.value.hint


def test_drafter_given_as_target():
    with pytest.raises(InvalidArgumentError):
        check_pair("z-lab/Qwen3-8B-DFlash-b16", offline=True)


def test_gated_unknown_drafter_is_unverified():
    report = check_pair("minimax-m2.5", offline=True)
    assert report.verdict == "unverified" and not report.compatible
    row = next(r for r in report.rows if r.check == "draft config")
    assert row.status == "FAIL" and "gated" in row.detail and "--draft-config" in row.detail
    assert report.draft_fingerprint.block_size is None and report.entry == "minimax-m2.5"


def test_no_registered_drafter(tmp_path):
    cfg = json.loads(fx("qwen3-8b", "target").read_text()) | {"num_hidden_layers": 28}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotFoundError, match="no registered drafter"):
        check_pair(str(tmp_path), offline=True)


def test_report_is_json_ready():
    data = check_pair("gpt-oss-20b", offline=True).to_dict()
    json.dumps(data)
    assert {"verdict", "compatible", "rows", "target", "draft", "target_source", "draft_source"} <= set(data)
    assert set(data["rows"][0]) == {"check", "status", "detail"}


# ---- offline verdicts for every registry entry -----------------------------------------------------


def test_golden_fixtures_cover_every_entry():
    """A golden target.json for every entry whose target shape is known; the others (no public source gives
    the shape) are unsupported-here with a null shape, and have no fixture at all: none is made up."""
    reg = load_registry()
    shaped = {e.slug for e in reg if e.target.known}
    assert {p.name for p in FIXTURES.iterdir() if (p / "target.json").is_file()} == shaped
    for e in reg:
        if e.slug not in shaped:
            assert e.status == e.declared_status == "unsupported-here", e.slug
            assert (e.target.hidden_size, e.target.num_hidden_layers, e.target.vocab_size) == (None,) * 3
            assert not (FIXTURES / e.slug).exists(), e.slug
    known = {
        e.slug
        for e in reg
        if e.slug in shaped and None not in (e.draft.block_size, e.draft.target_layer_ids, e.draft.num_layers)
    }
    assert set(GOOD) == known  # a draft.json for every drafter whose config is public


@pytest.mark.parametrize("slug", sorted(set(GOOD)))
def test_offline_check_of_every_supported_entry(slug):
    """No cached config: the registry-built config has the family's real shape, so the verdict is right."""
    from dflash_zoo.zoo.registry import load_registry

    entry = load_registry().resolve(slug)
    report = check_pair(entry.target_repo, offline=True)
    assert report.target_source.startswith("registry") and report.entry == slug
    assert report.verdict == "compatible", [r for r in report.rows if r.status == "FAIL"]
    mask = [r for r in report.rows if r.check == "mask id"]
    want = "WARN" if entry.draft.mask_token_id is None else "PASS"
    assert [r.status for r in mask] == [want], mask
    assert "layer_types" not in rows(report)  # the built config has the family's layer layout
    if want == "WARN":
        assert "vLLM needs" in mask[0].detail and "SGLang falls back" in mask[0].detail
        assert "fix:" in mask[0].detail


def _cli_check(*args: str) -> tuple[int, str]:
    from click.testing import CliRunner

    from dflash_zoo.cli import main

    with CliRunner().isolation() as streams:  # (stdout, stderr, ...) as bytes
        try:
            main(["check", *args])
            code = 0
        except SystemExit as exc:
            code = exc.code
        return code, streams[0].getvalue().decode() + streams[1].getvalue().decode()


@pytest.mark.parametrize("slug", SLUGS)
def test_cli_offline_check_of_every_entry(slug):
    """`check --offline` with nothing cached: exit 0 for a pair the registry can vouch for, exit 3 with the
    reason for one it cannot (target shape not public, drafter config unknown, family adapter missing)."""
    from dflash_zoo.adapters import find_adapter

    e = load_registry().resolve(slug)
    unknown = None in (e.draft.block_size, e.draft.target_layer_ids, e.draft.num_layers)
    code, out = _cli_check("--target", slug, "--offline")
    if e.declared_status == "unsupported-here":
        assert code == 3 and "unverified" in out and "unsupported-here:" in out, out
    if not e.target.known:
        assert "not public" in " ".join(out.split()), out
    elif unknown:
        assert code == 3 and "unverified" in out and "does not know its" in out, out
    elif find_adapter(e.adapter) is None:
        assert code == 3 and "no adapter for model_type" in out, out
    else:
        assert code == 0 and out.rstrip().splitlines()[-1].startswith("compatible"), out


def test_cli_offline_check_by_repo_and_json():
    assert _cli_check("--target", "Qwen/Qwen3.5-9B", "--offline")[0] == 0
    code, out = _cli_check("--target", "minimax-m2.5", "--offline", "--json")
    data = json.loads(out[: out.rindex("}") + 1])
    assert code == 3 and data["verdict"] == "unverified" and data["compatible"] is False
    row = next(r for r in data["rows"] if r["check"] == "draft config")
    assert (
        row["status"] == "FAIL"
        and "gated" in row["detail"]
        and "dflash-zoo pull minimax-m2.5" in row["detail"]
    )


@pytest.mark.parametrize("slug", MARKED)
def test_marked_entries_are_unverified_with_their_reason(slug):
    """An entry its author marked unsupported-here: exit 3, a FAIL status row carrying the whole reason, and
    no hint to `pull` its slug (pull refuses it); a target shape that is not public stays null in the report."""
    e = load_registry().resolve(slug)
    code, out = _cli_check("--target", slug, "--offline", "--json")
    data = json.loads(out[: out.rindex("}") + 1])
    assert code == 3 and data["verdict"] == "unverified" and data["entry"] == slug
    status = [r for r in data["rows"] if r["check"] == "status"]
    assert status == [{"check": "status", "status": "FAIL", "detail": f"unsupported-here: {e.reason}"}]
    assert f"dflash-zoo pull {slug}" not in out
    assert (data["target_fingerprint"]["hidden_size"] is None) == (not e.target.known)
    failed = {r["check"] for r in data["rows"] if r["status"] == "FAIL"}
    assert failed == {"adapter", "status", "draft config" if e.target.known else "target config"}


def test_a_config_without_the_text_shape_is_unverified_not_an_error(tmp_path):
    """A registered target whose shape is not public: its own config (the Alpamayo release's carries no text
    shape) leaves the pair unverified; a drafter paired with another target is unverified too (its width is
    its target's)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "alpamayo1_5"}))
    report = check_pair("alpamayo-1.5-10b", config=tmp_path / "config.json", offline=True)
    row = next(r for r in report.rows if r.check == "target config")
    assert report.verdict == "unverified" and row.status == "FAIL" and "lacks it" in row.detail
    report = check_pair("qwen3-8b", draft="alpamayo-1.5-10b", offline=True)
    row = next(r for r in report.rows if r.check == "draft config")
    assert report.verdict == "unverified" and "text shape is not public" in row.detail
    assert "dflash-zoo pull z-lab/Alpamayo-1.5-10B-DFlash" in row.detail  # the repo id, not the refused slug


def test_vlm_registry_config_is_nested():
    from dflash_zoo.zoo.check_sources import registry_config
    from dflash_zoo.zoo.registry import load_registry

    reg = load_registry()
    assert set(registry_config(reg.resolve("qwen3.5-9b"))) == {"model_type", "text_config"}
    assert registry_config(reg.resolve("qwen3-8b"))["hidden_size"] == 4096


@pytest.mark.parametrize("slug", sorted(set(GOOD)))
def test_registry_config_validates_like_the_golden_config(slug):
    """The config `check` builds from the registry gets the same problems as the family's real config.json."""
    from dflash_zoo.adapters.base import TargetAdapter

    from dflash_zoo.engine.config import normalize_draft_config
    from dflash_zoo.zoo.check_sources import registry_config
    from dflash_zoo.zoo.registry import load_registry

    golden = json.loads(fx(slug, "target").read_text())
    built = registry_config(load_registry().resolve(slug))
    assert built["model_type"] == golden["model_type"]
    assert (built.get("text_config") or {}).get("model_type") == (golden.get("text_config") or {}).get(
        "model_type"
    )
    cls = find_adapter(golden["model_type"]) or TargetAdapter
    draft = normalize_draft_config(json.loads(fx(slug, "draft").read_text()))
    problems = {(p.severity, p.code) for p in cls.validate(built, draft)}
    assert problems == {(p.severity, p.code) for p in cls.validate(golden, draft)}


def test_negative_mask_id_fails(tmp_path):
    draft = json.loads(fx("qwen3-8b", "draft").read_text())
    draft["dflash_config"]["mask_token_id"] = -1
    (tmp_path / "draft.json").write_text(json.dumps(draft))
    report = check_pair("qwen3-8b", config=fx("qwen3-8b", "target"), draft_config=tmp_path / "draft.json")
    assert rows(report)["mask id"] == ["FAIL"] and not report.compatible


def test_unreachable_hub_fails_fast_or_falls_back(tmp_path, monkeypatch):
    """No Hub reachable (a closed loopback port): a registered pair falls back to the registry fingerprint
    with a WARN; an unknown repo is one error line plus a hint; neither waits on retries nor prints their
    noise."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: connections are refused
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    cmd = [sys.executable, "-m", "dflash_zoo", "check", "--target"]
    start = time.monotonic()
    ok = subprocess.run([*cmd, "Qwen/Qwen3-8B", "--json"], capture_output=True, text=True, timeout=120)
    bad = subprocess.run([*cmd, "some-org/unknown"], capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 20  # two runs, each at most an interpreter start and one refused call
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["draft_source"] == "registry qwen3-8b (draft fingerprint)"
    assert any(r["status"] == "WARN" and "could not reach" in r["detail"] for r in report["rows"])
    assert bad.returncode == 1 and bad.stdout == ""
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), bad.stderr
    assert "retry" not in ok.stderr.lower() + lines[0].lower()


def test_pinned_target_commit_and_registry_id_use_the_cache():
    """A registry id reads its target's cached config, the commit `pull --with-target` pinned before main;
    a draft pin recorded for another repo (the entry changed) is not used."""
    target = json.loads(fx("qwen3-8b", "target").read_text())
    cache_repo("Qwen/Qwen3-8B", target, commit="a" * 40)  # main
    cache_repo("Qwen/Qwen3-8B", target | {"num_hidden_layers": 36}, commit="b" * 40, ref=None)  # the pin
    write_lock("qwen3-8b", "z-lab/Qwen3-8B-DFlash-b16", "main", SHA,
               target_repo="Qwen/Qwen3-8B", target_commit="b" * 40)  # fmt: skip
    report = check_pair("qwen3-8b", offline=True)
    assert report.target_source == f"hf cache Qwen/Qwen3-8B@{'b' * 40}"
    write_lock("qwen3-8b", "someone/old-drafter", "main", SHA)
    assert check_pair("qwen3-8b", offline=True).draft_source == "registry qwen3-8b (draft fingerprint)"
    cache_repo("z-lab/Qwen3-8B-DFlash-b16", json.loads(fx("qwen3-8b", "draft").read_text()), ref=None)
    stale = check_pair("qwen3-8b", offline=True)  # only the commit of the other repo's pin is cached
    assert stale.draft_source == "registry qwen3-8b (draft fingerprint)"


# ---- architectures and uploads --------------------------------------------------------------------


def test_architecture_row_names_the_variant(tmp_path):
    q38 = check_pair(
        "qwen3.8-27b", config=fx("qwen3.8-27b", "target"), draft_config=fx("qwen3.8-27b", "draft")
    )
    arch = next(r for r in q38.rows if r.check == "architecture")
    assert (
        arch.status == "PASS"
        and arch.detail.startswith("dflash2: DFlash 2")
        and "(fast engine)" in arch.detail
    )
    assert q38.draft_fingerprint.architecture == "dflash2" and rows(q38)["upload"] == ["PASS"]
    jetspec = json.loads(fx("qwen3-8b", "draft").read_text())
    jetspec["dflash_config"]["causal"] = True  # NeMo's JetSpec export: causal attention inside the block
    (tmp_path / "draft.json").write_text(json.dumps(jetspec))
    report = check_pair("qwen3-8b", config=fx("qwen3-8b", "target"), draft_config=tmp_path / "draft.json")
    assert next(r for r in report.rows if r.check == "architecture").detail.startswith(
        "dflash (in-block causal)"
    )
    assert report.compatible


def test_a_dflash_config_for_a_dflash2_entry_is_flagged(tmp_path):
    """The registry says DFlash 2: a plain DFlash config in its place differs from the fingerprint."""
    draft = json.loads(fx("qwen3.8-27b", "draft").read_text())
    draft["architectures"] = ["DFlashDraftModel"]
    for key in ("conv_group_size", "conv_kernel_size", "selector_rank", "selector_top_k"):
        del draft["dflash_config"][key]
    (tmp_path / "draft.json").write_text(json.dumps(draft))
    report = check_pair(
        "qwen3.8-27b", config=fx("qwen3.8-27b", "target"), draft_config=tmp_path / "draft.json"
    )
    detail = next(r.detail for r in report.rows if r.check == "registry fingerprint")
    assert "architecture dflash vs dflash2" in detail
    assert rows(report)["upload"] == ["WARN"]


def test_check_says_which_upload_is_cached():
    """A cached config of the April 122B upload is named as that upload (commit quoted)."""
    old = json.loads(fx("qwen3.5-122b-a10b", "draft").read_text())
    old |= {"num_hidden_layers": 4, "sliding_window": 2048,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}  # fmt: skip
    old["dflash_config"]["target_layer_ids"] = [1, 10, 19, 28, 37, 46]
    cache_repo("z-lab/Qwen3.5-122B-A10B-DFlash", old)
    report = check_pair("qwen3.5-122b-a10b", offline=True)
    assert report.draft_source.startswith("hf cache z-lab/Qwen3.5-122B-A10B-DFlash")
    upload = next(r for r in report.rows if r.check == "upload")
    assert upload.status == "PASS"
    assert upload.detail == "your cached copy is the 2026-04 original upload (commit 6c7242c)"
    assert rows(report)["registry fingerprint"] == ["WARN"]  # and it is not the shape the registry pins


# ---- what `generate` would refuse, `check` says first -------------------------------------------------------


def test_a_bad_drafter_config_is_named_and_mistyped_fields_are_one_line(tmp_path):
    from dflash_zoo.errors import ConfigError

    target = as_dir(tmp_path, "qwen3-8b", "target")
    draft = as_dir(tmp_path, "qwen3-8b", "draft")
    for edit in ({"architectures": 1.5}, {"dflash_config": {"block_size": 1}}):
        (draft / "config.json").write_text(
            json.dumps({**json.loads(fx("qwen3-8b", "draft").read_text()), **edit})
        )
        with pytest.raises(ConfigError) as err:
            check_pair(str(target), str(draft))
        assert str(err.value).startswith(str(draft / "config.json")), err.value
    (draft / "config.json").write_text(fx("qwen3-8b", "draft").read_text())
    raw = json.loads(fx("qwen3-8b", "target").read_text())
    for edit in (
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": 128}},
        {"text_config": "x"},
    ):
        (target / "config.json").write_text(json.dumps({**raw, **edit}))
        with pytest.raises(ConfigError, match="must be a"):
            check_pair(str(target), str(draft))


def test_a_dflash2_drafter_with_fewer_tokens_than_the_target_fails(tmp_path):
    """Its candidate selector has a row per drafter token and is indexed by target token ids."""
    target = as_dir(tmp_path, "qwen3.8-27b", "target")
    draft = as_dir(tmp_path, "qwen3.8-27b", "draft")
    raw = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**raw, "vocab_size": raw["vocab_size"] - 1000}))
    report = check_pair(str(target), str(draft))
    assert report.verdict == "incompatible" and "FAIL" in rows(report)["vocab"], rows(report)


def test_a_registry_shape_says_nothing_of_the_quantization():
    report = check_pair("gpt-oss-20b", offline=True)  # MXFP4 experts, its config not cached
    (quant,) = [r for r in report.rows if r.check == "quantization"]
    assert quant.status == "WARN" and quant.detail.startswith("unknown")


def test_no_mask_id_anywhere_fails_where_the_targets_tokenizer_is_at_hand(tmp_path):
    """No mask id in the draft config: `generate` falls back on the tokenizer's <|MASK|> token, or refuses."""
    demo = Path(__file__).resolve().parents[1] / "dflash_zoo" / "demo"
    draft = tmp_path / "draft"
    draft.mkdir()
    raw = json.loads((demo / "draft" / "config.json").read_text())
    raw["dflash_config"].pop("mask_token_id")
    (draft / "config.json").write_text(json.dumps(raw))
    target = tmp_path / "target"
    target.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (target / name).write_text((demo / "target" / name).read_text())
    assert rows(check_pair(str(target), str(draft)))["mask id"] == ["WARN"]  # it has <|MASK|>
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).write_text((target / name).read_text().replace("<|MASK|>", "<|PAD2|>"))
    report = check_pair(str(target), str(draft))
    assert rows(report)["mask id"] == ["FAIL"] and report.verdict == "incompatible"


def test_a_speculators_drafter_names_its_verifier(tmp_path):
    """The copies it carries must equal the target's (`generate` compares them): a config can only warn."""
    spec = Path(__file__).parent / "fixtures" / "formats" / "speculators-qwen3-8b-dflash.json"
    report = check_pair("qwen3-8b", draft_config=spec, offline=True)
    (row,) = [r for r in report.rows if r.check == "verifier"]
    assert row.status == "PASS" and "Qwen/Qwen3-8B's embedding and LM head" in row.detail
    finetune = tmp_path / "my-finetune"
    finetune.mkdir()
    (finetune / "config.json").write_text(fx("qwen3-8b", "target").read_text())
    report = check_pair(str(finetune), draft_config=spec, offline=True)
    (row,) = [r for r in report.rows if r.check == "verifier"]  # the same shape, other weights maybe
    assert row.status == "WARN" and "refuses it unless the target's are identical" in row.detail
    assert report.verdict == "compatible"
    raw = json.loads(spec.read_text())
    raw["speculators_config"]["verifier"]["name_or_path"] = str(finetune)
    (tmp_path / "draft.json").write_text(json.dumps(raw))
    report = check_pair(str(finetune), draft_config=tmp_path / "draft.json", offline=True)
    assert [r.status for r in report.rows if r.check == "verifier"] == ["PASS"]


def _header_only_safetensors(path: Path, dtype: str) -> None:
    """A safetensors file of one 2-element tensor, written without torch."""
    header = json.dumps({"w.weight": {"dtype": dtype, "shape": [2], "data_offsets": [0, 2]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0")


def test_cached_files_are_read_like_local_ones():
    """A cached drafter quantized in its tensors, and a cached target tokenizer without the mask token."""
    from dflash_zoo.zoo.hub import repo_cache_dir

    demo = Path(__file__).resolve().parents[1] / "dflash_zoo" / "demo"
    raw = json.loads((demo / "draft" / "config.json").read_text())
    cache_repo("me/fp8-drafter", raw)
    snapshot = repo_cache_dir("me/fp8-drafter") / "snapshots" / SHA
    _header_only_safetensors(snapshot / "model.safetensors", "F8_E4M3")
    cache_repo("me/target", json.loads((demo / "target" / "config.json").read_text()))
    report = check_pair("me/target", "me/fp8-drafter", offline=True)
    (row,) = [r for r in report.rows if r.check == "drafter quantization"]
    assert row.status == "FAIL" and "tensor w.weight is F8_E4M3" in row.detail
    raw["dflash_config"].pop("mask_token_id")
    cache_repo("me/plain-drafter", raw)
    target = repo_cache_dir("me/target") / "snapshots" / SHA
    for name in ("tokenizer.json", "tokenizer_config.json"):
        text = (demo / "target" / name).read_text()
        (target / name).write_text(text.replace("<|MASK|>", "<|PAD2|>"))
    assert rows(check_pair("me/target", "me/plain-drafter", offline=True))["mask id"] == ["FAIL"]


def test_a_last_layer_tap_warns_that_proposals_differ_from_the_reference(tmp_path):
    """z-lab's reference reads hidden_states[L] (after the final norm); dflash-zoo the layer's raw output."""
    demo = Path(__file__).resolve().parents[1] / "dflash_zoo" / "demo"
    layers = json.loads((demo / "target" / "config.json").read_text())["num_hidden_layers"]
    raw = json.loads((demo / "draft" / "config.json").read_text())
    for taps, status in (([0, layers - 2], "PASS"), ([0, layers - 1], "WARN")):
        raw["dflash_config"]["target_layer_ids"] = taps
        (tmp_path / "draft.json").write_text(json.dumps(raw))
        report = check_pair(str(demo / "target"), draft_config=tmp_path / "draft.json", offline=True)
        (row,) = [r for r in report.rows if r.check == "taps"]
        assert row.status == status and (status == "PASS" or "after the final norm" in row.detail)
