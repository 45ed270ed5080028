"""`list` / `ls`, `info` / `show`, `check` through click's CliRunner and `cli.main` (fixed width, offline)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_zoo.cli import cli, main
from dflash_zoo.zoo.registry import load_registry, write_lock

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def zoo_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))  # does not exist: must not fail
    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path / "zoo"))
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.delenv("DFLASH_ZOO_REGISTRY", raising=False)


def run(*args: str):
    return CliRunner().invoke(cli, list(args), env={"COLUMNS": "120"})


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """Through `cli.main`, which maps ZooErrors to one line and an exit code."""
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def install(repo: str, tmp_path: Path) -> None:
    snap = tmp_path / "hf" / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots" / SHA
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")


# ---- list -----------------------------------------------------------------------------------------


def test_list_human(tmp_path):
    install("z-lab/Qwen3-8B-DFlash-b16", tmp_path)
    result = run("list")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["ID", "TARGET", "DRAFT", "ARCH", "BLOCK", "STATUS", "SIZE", "INSTALLED"]
    assert len(lines) == 1 + len(load_registry().entries)  # one line per entry: nothing wrapped
    row = next(line.split() for line in lines if line.startswith("qwen3-8b "))
    assert row == [
        "qwen3-8b",
        "Qwen/Qwen3-8B",
        "z-lab/Qwen3-8B-DFlash-b16",
        "dflash",
        "16",
        "supported",
        "2.1",
        "GB",
        "yes",
    ]
    assert next(line for line in lines if line.startswith("qwen3-4b ")).split()[-1] == "-"
    assert next(line for line in lines if line.startswith("minimax-m2.5")).split()[4] == "?"
    assert next(line for line in lines if line.startswith("qwen3.8-27b ")).split()[3:5] == ["dflash2", "8"]


def test_ls_pattern_and_quiet():
    assert run("ls", "qwen3.5*", "-q").stdout.split() == [e.slug for e in load_registry().match("qwen3.5*")]
    assert run("list", "-q").stdout.split() == [e.slug for e in load_registry()]
    assert run("list", "GOOGLE/*", "-q").stdout.split() == [
        "gemma4-31b-it",
        "gemma4-26b-a4b-it",
        "gemma4-12b-it",
    ]


def test_list_json(tmp_path):
    install("z-lab/gpt-oss-20b-DFlash", tmp_path)
    write_lock("gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash", "main", SHA)
    result = run("list", "gpt-oss*", "--json")
    data = json.loads(result.stdout)
    assert [d["slug"] for d in data] == ["gpt-oss-20b", "gpt-oss-120b"]
    assert data[0]["installed"] is True and data[1]["installed"] is False
    assert data[0]["draft_revision"] == "main" and data[0]["locked"]["commit"] == SHA
    assert data[0]["draft"]["target_layer_ids"] == [1, 6, 11, 16, 21]


def test_list_plain_word_matches_substrings():
    """`list qwen` (no glob characters): every entry with a name containing the word, any case."""
    want = [e.slug for e in load_registry() if any("qwen" in n.lower() for n in e.names())]
    assert len(want) > 3
    assert run("list", "qwen", "-q").stdout.split() == want
    assert run("list", "CODER", "-q").stdout.split() == [
        e.slug for e in load_registry() if any("coder" in n.lower() for n in e.names())
    ]
    assert run("list", "qwen3-8", "-q").stdout.split()[0] == "qwen3-8b"


@pytest.mark.parametrize("columns", ["80", "120"])
def test_list_never_folds_ids_into_a_pipe(columns):
    """Piped (grep, awk): each entry is one line holding its ids whole, whatever the width."""
    result = CliRunner().invoke(cli, ["list"], env={"COLUMNS": columns, "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    entries = list(load_registry())
    assert [r[:3] for r in rows] == [[e.slug, e.target_repo, e.draft_repo] for e in entries]


@pytest.mark.parametrize("columns", [100, 80])
def test_list_fits_the_terminal(columns):
    """On a terminal the table fits its width: one line per entry, the id whole, long repo ids cut with an
    ellipsis (`info ID`, `--json` and pipes show them whole)."""
    env = {"COLUMNS": str(columns), "NO_COLOR": "1", "FORCE_COLOR": "1"}
    result = CliRunner().invoke(cli, ["list"], env=env)
    assert result.exit_code == 0, result.output
    lines = [_plain(line) for line in result.stdout.splitlines()]
    assert max(len(line) for line in lines) <= columns, "\n".join(lines)
    entries = list(load_registry())
    assert len(lines) == 1 + len(entries)
    for line, e in zip(lines[1:], entries, strict=True):
        slug, target, draft = line.split()[:3]
        assert slug == e.slug
        for shown, full in ((target, e.target_repo), (draft, e.draft_repo)):
            assert shown == full or (shown.endswith("…") and full.startswith(shown[:-1])), (shown, full)
    assert any(line.split()[2].endswith("…") for line in lines[1:])  # the natural table is wider


def _plain(line: str) -> str:
    """`line` without ANSI escapes (FORCE_COLOR styles the header)."""
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", line)


def test_list_and_info_name_the_cached_variant(tmp_path):
    """With the drafter's config.json in the HF cache, `list` and `info` show its variant (a JetSpec export:
    "dflash (in-block causal)"); without it, the registry's architecture."""
    draft = json.loads((FIXTURES / "qwen3-8b" / "draft.json").read_text())
    draft["dflash_config"]["causal"] = True
    snap = tmp_path / "hf" / "hub" / "models--z-lab--Qwen3-8B-DFlash-b16" / "snapshots" / SHA
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(draft))
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text(SHA)
    data = {d["slug"]: d for d in json.loads(run("list", "--json").stdout)}
    assert data["qwen3-8b"]["draft"]["architecture"] == "dflash"  # the registry's word, in JSON
    row = next(line for line in run("list").stdout.splitlines() if line.startswith("qwen3-8b "))
    assert "dflash (in-block causal)" in row
    assert "dflash (in-block causal)" in run("info", "qwen3-8b").stdout
    assert json.loads(run("info", "qwen3-8b", "--json").stdout)["architecture"] == "dflash (in-block causal)"


def test_info_shows_architecture_and_uploads():
    out = " ".join(run("info", "qwen3.5-122b-a10b").stdout.split())
    assert "architecture dflash" in out
    assert "uploads 2026-06-19 retrain (2274357); 2026-04 original (6c7242c)" in out
    data = json.loads(run("info", "qwen3.8-27b", "--json").stdout)
    assert data["architecture"] == "dflash2" and data["draft"]["architecture"] == "dflash2"
    assert (
        data["revisions"][0]["commit"] == data["draft_revision"] == "50307d4c4cde6860d4eee73e2547cd786fe8e8a4"
    )


MARKED = ("glm-5.3-flash", "alpamayo-r1-10b", "alpamayo-1.5-10b")  # published, listed, not runnable here


def test_list_shows_the_entries_marked_unsupported_here():
    """Published drafters dflash-zoo cannot run are listed with their status, in the table and in JSON."""
    rows = {line.split()[0]: line.split() for line in run("list").stdout.splitlines()[1:]}
    for slug in MARKED:
        assert "unsupported-here" in rows[slug], rows[slug]
    assert rows["alpamayo-1.5-10b"][3:5] == ["dflash", "8"] and rows["glm-5.3-flash"][3:5] == ["dflash2", "8"]
    data = {d["slug"]: d for d in json.loads(run("list", "alpamayo*", "--json").stdout)}
    assert set(data) == {"alpamayo-r1-10b", "alpamayo-1.5-10b"}
    one = data["alpamayo-1.5-10b"]
    assert one["status"] == one["declared_status"] == "unsupported-here" and "mask embedding" in one["reason"]
    assert one["target"] == {"model_type": "alpamayo1_5", "hidden_size": None, "num_hidden_layers": None,
                             "vocab_size": None}  # fmt: skip


def test_info_of_a_marked_entry_shows_its_facts_and_reason():
    e = load_registry().resolve("alpamayo-1.5-10b")
    out = " ".join(run("info", "alpamayo-1.5-10b").stdout.split())
    assert f"status unsupported-here ({e.reason})" in out
    assert "hidden size not public layers not public vocab not public" in out
    assert "shape from not public" in out and "taps [24, 30, 31, 32, 34]" in out and "block size 8" in out
    assert "dflash-zoo pull alpamayo-1.5-10b" not in out  # `pull` refuses it: no hint to run it
    flash = " ".join(run("info", "glm-5.3-flash").stdout.split())
    assert "hidden size 4096 layers 45 vocab 154880" in flash and "no glm5_next adapter" in flash


def test_list_no_match_and_bad_flags():
    result = run("list", "nothing*")
    assert result.exit_code == 0 and result.stdout == "" and "no entry matches" in result.stderr
    assert run("list", "--json", "-q").exit_code == 2


# ---- info -----------------------------------------------------------------------------------------


def test_info_human():
    result = run("info", "qwen3-8b")
    assert result.exit_code == 0, result.output
    out = result.stdout
    for section in ("Target", "Draft", "Compatibility", "Requires", "Cache paths"):
        assert f"\n{section}\n" in out
    assert "[1, 9, 17, 25, 33]" in out and "151669" in out and "not pulled" in out
    assert "enable_thinking=False" in out and "models--z-lab--Qwen3-8B-DFlash-b16" in out


def test_show_alias_json_and_lock():
    write_lock("llama3.1-8b-instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", "main", SHA)
    data = json.loads(run("show", "meta-llama/Llama-3.1-8B-Instruct", "--json").stdout)
    assert data["slug"] == "llama3.1-8b-instruct" and data["locked"]["commit"] == SHA
    assert data["requires"]["gated"] is True and data["requires"]["license"] == "llama3.1"
    assert data["draft"]["mask_token_id"] is None and data["cache"]["lock_file"].endswith("lock.json")
    assert SHA in run("info", "llama3.1:8b").stdout


def test_info_unknown_is_one_line_error(capsys):
    code, out, err = run_main(capsys, "info", "qwen3-9b")
    assert code == 1 and out == ""
    assert err.splitlines()[0] == "error: no registry entry named 'qwen3-9b'"
    assert "qwen3-8b" in err.splitlines()[1]


# ---- check ----------------------------------------------------------------------------------------


def fx(slug: str, side: str) -> str:
    return str(FIXTURES / slug / f"{side}.json")


def test_check_human_compatible():
    result = run("check", "--target", "qwen3-8b", "--config", fx("qwen3-8b", "target"),
                 "--draft-config", fx("qwen3-8b", "draft"))  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[2].split() == ["CHECK", "STATUS", "DETAIL"]
    assert any(line.split()[:3] == ["hidden", "size", "PASS"] for line in lines)
    assert lines[-1].startswith("compatible: 0 failed")


def test_check_incompatible_exit_3(tmp_path):
    args = ("check", "-t", "llama3.1-8b-instruct", "--config", fx("llama3.1-8b-instruct", "target"),
            "-d", "qwen3-8b", "--draft-config", fx("qwen3-8b", "draft"))  # fmt: skip
    result = run(*args)
    assert result.exit_code == 3
    assert result.stdout.splitlines()[-1].startswith("incompatible: 2 failed")
    assert "hint:" in result.stderr


def test_check_exit_3_through_main(capsys):
    code, out, _ = run_main(capsys, "check", "-t", "Qwen/Qwen3-4B", "-d", "qwen3-8b", "--offline", "--json")
    data = json.loads(out)
    assert code == 3 and data["verdict"] == "incompatible" and data["compatible"] is False
    assert {
        "check": "hidden size",
        "status": "FAIL",
        "detail": "drafter hidden size 4096 != target 2560",
    } in data["rows"]


def test_check_json_llama_base():
    result = run("check", "--target", "meta-llama/Llama-3.1-8B", "--offline", "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["verdict"] == "compatible" and data["entry"] == "llama3.1-8b-instruct"
    assert data["target"] == "meta-llama/Llama-3.1-8B" and data["draft"].startswith("z-lab/LLaMA3.1")
    assert {"check": "pair", "status": "PASS"}.items() <= next(
        r for r in data["rows"] if r["check"] == "pair"
    ).items()
    assert any(r["check"] == "acceptance" and r["status"] == "WARN" for r in data["rows"])


def test_check_usage_and_runtime_errors(capsys, tmp_path):
    assert run("check").exit_code == 2  # --target is required
    assert run("check", "-t", "qwen3-8b", "--config", str(tmp_path / "missing.json")).exit_code == 2
    code, _, err = run_main(capsys, "check", "-t", "some-org/unknown", "--offline")
    assert code == 1 and err.startswith("error: no config for some-org/unknown")
    code, _, err = run_main(capsys, "check", "-t", "z-lab/Qwen3-8B-DFlash-b16")
    assert code == 2 and "is a drafter" in err


# ---- help and imports -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cmd,env", [("list", "DFLASH_ZOO_REGISTRY"), ("info", "HF_HUB_CACHE"), ("check", "HF_HUB_OFFLINE")]
)
def test_help_has_examples_and_env(cmd, env):
    out = run(cmd, "--help").stdout
    assert "Examples:" in out and f"dflash-zoo {cmd}" in out and env in out and "DFLASH_ZOO_HOME" in out


NO_HEAVY = """
import sys
from dflash_zoo.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
assert not heavy, heavy[:5]
"""


@pytest.mark.parametrize(
    "argv", [["--help"], ["list"], ["info", "qwen3-8b"], ["info", "demo"], ["check", "--target", "DIR"]]
)
def test_commands_do_not_import_torch_or_transformers(tmp_path, argv):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(Path(fx("qwen3-8b", "target")).read_text())
    argv = [str(target) if a == "DIR" else a for a in argv]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "DFLASH_ZOO_HOME": str(tmp_path),
    }
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", NO_HEAVY, *argv], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_one_size_format_everywhere():
    """list/info, pull/rm, bench and placements share one formatter: decimal units, as the Hub shows sizes."""
    from dflash_zoo.output import human_size

    assert [human_size(n) for n in (None, 999, 16_400, 2_090_000_000, 5 * 10**12)] == [
        "?",
        "999 B",
        "16.4 kB",
        "2.1 GB",
        "5.0 TB",
    ]
    # no other size formatting (binary units, hand-made GB) in the package's user-facing strings
    root = Path(__file__).resolve().parents[1]
    sources = [*(root / "dflash_zoo").rglob("*.py"), *(root / "adapters").glob("*.py")]
    offenders = [p.name for p in sources if re.search(r"GiB|MiB|KiB|2\*\*30|/ 1e9", p.read_text())]
    assert offenders == []


def test_user_facing_text_says_license():
    """One spelling: `license` (the registry key) in what `info` shows, registry notes included."""
    assert "license" in run("info", "llama3.1-8b-instruct").stdout
    for e in load_registry():
        assert "licence" not in run("info", e.slug).stdout.lower(), e.slug


def _commands(group, prefix=()):
    import click

    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*prefix, name))
        else:
            yield (*prefix, name), cmd


def test_help_mentions_only_options_the_command_has():
    """A help text naming --offline (or any --flag of another command) belongs to a command that has it."""
    for path, cmd in _commands(cli):
        text = run(*path, "--help").stdout
        opts = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        for flag in ("--offline", "--revision", "--json"):
            if re.search(rf"(?<![\w-]){flag}(?![\w-])", text) and flag not in opts:
                raise AssertionError(f"`{' '.join(path)} --help` mentions {flag}, which it does not have")


def test_info_demo_prints_the_demo_folders():
    """`info demo`: the embedded pair's folders on stdout (what `train --target` takes), also as JSON."""
    from dflash_zoo import demo

    result = run("info", "demo")
    assert result.exit_code == 0, result.output
    want = demo.report()
    assert result.stdout.split() == ["target", str(want["demo_target"]), "draft", str(want["demo_draft"])]
    assert "train --target" in result.stderr
    data = json.loads(run("info", "Demo", "--json").stdout)
    assert data == {"slug": "demo", "target": want["demo_target"], "draft": want["demo_draft"]}


def test_info_separates_target_and_drafter_licence_gate_and_shape_source():
    out = " ".join(run("info", "qwen3.6-27b").stdout.split())
    assert "gated yes, the drafter" in out and "when last checked is not recorded" in out
    assert (
        "license apache-2.0 (target)" in out and "draft license unknown: see the drafter's model card" in out
    )
    assert "draft license mit" in " ".join(run("info", "qwen3-coder-next").stdout.split())
    assert "shape from MiniMaxAI/MiniMax-M2" in " ".join(run("info", "minimax-m2.5").stdout.split())
    data = json.loads(run("info", "qwen3-coder-next", "--json").stdout)
    assert (
        data["draft_license"] == data["requires"]["draft_license"] == "mit"
        and data["license"] == "apache-2.0"
    )
