"""`serve` for every registry entry and both engines, human and JSON, refusals, pins and engine versions.

Engine versions are detected through importlib.metadata: tests give the CLI subprocess a fake installed
distribution (a `*.dist-info/METADATA` on PYTHONPATH), never a mock of the detection.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_zoo.zoo import serve as sv
from dflash_zoo.zoo.registry import load_registry
from tests.cli_runner import run_cli as cli

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = [e.slug for e in load_registry()]
REFUSED = {("minimax-m2.5", "sglang"), ("minimax-m2.7", "sglang")}  # SGLang <= 0.5.23: no minimax_m2 capture
UNKNOWN_BLOCK = {e.slug for e in load_registry() if e.draft.block_size is None}
# listed but not runnable (the author's unsupported-here): `serve` refuses them with their reason
MARKED = {e.slug for e in load_registry() if e.declared_status == "unsupported-here"}
SHA_D, SHA_T = "d" * 40, "e" * 40


@pytest.fixture(autouse=True)
def zoo_env(offline_zoo_home, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU: tensor parallelism comes from the hint


def serve(slug: str, engine: str, *more: str) -> tuple[int, str, str]:
    extra = ("--block-size", "16") if slug in UNKNOWN_BLOCK else ()
    return cli("serve", slug, "--engine", engine, "--dry-run", *extra, *more)


@pytest.mark.parametrize("engine", sv.ENGINES)
@pytest.mark.parametrize("slug", ENTRIES)
def test_every_entry_and_engine(slug, engine):
    entry = load_registry().resolve(slug)
    code, out, err = serve(slug, engine, "--json")
    human = serve(slug, engine)
    if slug in MARKED:  # no command: the reason, on stderr and (with --json) as the JSON error
        why = f"{slug} is marked unsupported here: {entry.reason}"
        assert code == 1 and human[0] == 1 and human[1] == "" and json.loads(out)["error"] == why
        assert why in " ".join(err.split()) and why in " ".join(human[2].split())
        return
    if (slug, engine) in REFUSED:
        assert code == 3 and human[0] == 3
        assert "cannot serve" in err and "vllm" in err  # the reason and what would work
        return
    assert code == 0 and human[0] == 0, err
    doc = json.loads(out)
    argv = doc["argv"]
    assert human[1].strip().endswith(doc["command"])  # human mode prints the same command
    block = entry.draft.block_size or 16
    pinned = entry.draft_revision if entry.draft_revision != "main" else None
    minimum = sv.ARCH_MIN_VERSIONS.get(entry.draft.architecture, {}).get(engine)
    assert doc["min_engine_version"] == (minimum or sv.recipe_for(entry.adapter, engine, slug).min_version)
    if engine == "vllm":
        config = json.loads(argv[argv.index("--speculative-config") + 1])
        assert config["num_speculative_tokens"] == block - 1 and config["model"] == entry.draft_repo
        assert config["method"] == "dflash" and config.get("revision") == pinned  # DFlash 2: same method
        assert config["attention_backend"] == "flash_attn"  # drafter backend inside the speculative config
        forced = argv[argv.index("--attention-backend") + 1] if "--attention-backend" in argv else None
        assert forced == ("triton_attn" if entry.adapter in ("gemma4", "gemma4_unified") else None)
        assert doc["env"] == {}
    else:
        assert argv[argv.index("--speculative-num-draft-tokens") + 1] == str(block)
        assert argv[argv.index("--speculative-algorithm") + 1] == "DFLASH"
        assert doc["env"] == {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
        flag = "--speculative-draft-model-revision"
        assert (argv[argv.index(flag) + 1] if flag in argv else None) == pinned
        assert (
            "--mamba-scheduler-strategy" not in argv and "--speculative-dflash-draft-window-size" not in argv
        )
    assert ("--trust-remote-code" in argv) == (entry.adapter == "kimi_k25")
    assert doc["tensor_parallel"] == entry.tp_hint
    assert ("--revision" in argv) is False  # no target is pinned: every target revision is main


def _ci_module():
    """.ci/engine_parsers.py, imported as a module (it imports the engines only inside its checks)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("engine_parsers", ROOT / ".ci" / "engine_parsers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ci_engine_step_lists_marked_entries_as_refused(monkeypatch, capsys):
    """The CI engine-parser step does not skip a marked entry: it expects `serve` to refuse it (exit 1, naming
    the reason) and prints it as refused; a marked entry that `serve` accepted would fail the step."""
    from dataclasses import asdict

    ci = _ci_module()
    monkeypatch.setattr(ci, "registry", lambda: {e.slug: asdict(e) for e in load_registry()})
    monkeypatch.setattr(ci, "serve_json", lambda slug, engine: serve(slug, engine, "--json"))
    assert MARKED  # the registry lists published drafters it cannot run
    for slug in sorted(MARKED):
        for engine in sv.ENGINES:
            assert ci.check_pair(slug, engine) == []
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 * len(MARKED) and all("refused (unsupported here)" in line for line in printed)
    monkeypatch.setattr(ci, "serve_json", lambda slug, engine: (0, {"argv": []}, ""))  # a stale refusal
    assert ci.check_pair(sorted(MARKED)[0], "vllm")


def test_big_targets_get_tensor_parallel_hints():
    code, out, _ = serve("kimi-k2.5", "vllm", "--json")
    argv = json.loads(out)["argv"]
    assert code == 0 and argv[argv.index("--tensor-parallel-size") + 1] == "8"
    code, out, _ = serve("qwen3.5-122b-a10b", "sglang", "--json", "--tp", "2")
    argv = json.loads(out)["argv"]
    assert argv[argv.index("--tp-size") + 1] == "2"  # --tp overrides the hint


def test_tensor_parallel_from_gpu_memory():
    gib80, gib141 = 80 * 2**30, 141 * 2**30
    assert sv.tensor_parallel_size(16 * 10**9, [gib80]) == 1
    assert sv.tensor_parallel_size(244 * 10**9, [gib80] * 8) == 4
    assert sv.tensor_parallel_size(244 * 10**9, [gib141] * 8) == 4  # 244 GB > 2 x 0.8 x 141 GiB
    assert sv.tensor_parallel_size(160 * 10**9, [gib141] * 8) == 2
    assert sv.tensor_parallel_size(2000 * 10**9, [gib80] * 4) == 4  # never more than the visible GPUs
    assert sv.tensor_parallel_size(None, [], hint=8) == 8
    assert sv.tensor_parallel_size(None, [gib80] * 8, hint=8) == 8  # size unknown: the hint, not 1
    assert sv.tensor_parallel_size(None, [gib80] * 4, hint=8) == 4  # capped at the visible GPUs


def test_minimax_without_block_size_is_a_clear_error():
    code, _, err = cli("serve", "minimax-m2.5", "--engine", "vllm", "--dry-run")
    assert code == 1 and "block size" in err and "--block-size" in err and "Traceback" not in err


def test_pins_from_the_lock_file(tmp_path):
    lock = {"qwen3-8b": {"draft_repo": "z-lab/Qwen3-8B-DFlash-b16", "draft_commit": SHA_D,
                         "target_repo": "Qwen/Qwen3-8B", "target_commit": SHA_T}}  # fmt: skip
    (tmp_path / "zoo").mkdir()
    (tmp_path / "zoo" / "lock.json").write_text(json.dumps(lock))
    argv = json.loads(serve("qwen3-8b", "vllm", "--json")[1])["argv"]
    assert json.loads(argv[argv.index("--speculative-config") + 1])["revision"] == SHA_D
    assert argv[argv.index("--revision") + 1] == SHA_T
    sg = json.loads(serve("qwen3-8b", "sglang", "--json")[1])["argv"]
    assert sg[sg.index("--speculative-draft-model-revision") + 1] == SHA_D
    assert sg[sg.index("--revision") + 1] == SHA_T
    other = json.loads(serve("qwen3-8b", "vllm", "--json", "--target", "me/finetune")[1])["argv"]
    assert "--revision" not in other  # a target pin never applies to another target
    same = json.loads(serve("qwen3-8b", "vllm", "--json", "--target", "Qwen/Qwen3-8B")[1])["argv"]
    assert same[same.index("--revision") + 1] == SHA_T  # naming the registered target keeps its pin


def fake_engine(tmp_path: Path, dist: str, version: str) -> dict[str, str]:
    site = tmp_path / "fake-site"
    info = site / f"{dist}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from dflash_zoo.cli import main; main()", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize(
    "dist,version,code",
    [("sglang", "0.5.10", 3), ("sglang", "0.5.11", 0), ("vllm", "0.20.0", 3), ("vllm", "0.33.0", 0)],
)
def test_installed_engine_version(tmp_path, dist, version, code):
    run = run_cli(
        fake_engine(tmp_path, dist, version), "serve", "qwen3-8b", "--engine", dist, "--dry-run", "--json"
    )
    assert run.returncode == code, run.stderr
    if code == 3:
        assert f"{dist} {version} is installed" in run.stderr and "pip install -U" in run.stderr
    else:
        assert json.loads(run.stdout)["engine_installed"] == version


def test_serve_does_not_import_torch():
    code = "import sys; from dflash_zoo.cli import main\ntry: main(sys.argv[1:])\nexcept SystemExit: pass\n"
    code += "assert 'torch' not in sys.modules, 'torch imported'"
    for args in (["serve", "kimi-k2.5", "--engine", "vllm", "--dry-run"], ["list", "-q"],
                 ["check", "--target", "qwen3.5-9b", "--offline"]):  # fmt: skip
        run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, (args, run.stderr)


def test_recipes_are_data():
    assert sv.recipe_for("gemma4", "vllm").target_backend == "triton_attn"
    assert sv.recipe_for("gemma4_unified", "vllm").target_backend == "triton_attn"  # 12B: 512-wide heads too
    assert sv.recipe_for("kimi_k25", "vllm").target_backend is None  # never force a backend onto MLA
    assert sv.recipe_for("unknown_family", "sglang") == sv.recipe_for("qwen3", "sglang")
    assert sv.version_tuple("0.5.11.post1") == (0, 5, 11) and sv.version_tuple("0.21.0rc1") == (0, 21, 0)


def cache_draft_config(tmp_path: Path, repo: str, config: dict) -> None:
    """`config.json` of `repo` in the HF cache at main, laid out as the hub client does."""
    root = tmp_path / "hf" / "hub" / ("models--" + repo.replace("/", "--"))
    (root / "snapshots" / SHA_D).mkdir(parents=True)
    (root / "snapshots" / SHA_D / "config.json").write_text(json.dumps(config))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(SHA_D)


def test_vllm_needs_a_mask_id_in_the_drafter_config(tmp_path):
    """Registry mask id unknown: vLLM stops on a drafter config without one, so `serve` refuses (exit 3) once
    the cached config shows it missing, and only hints while the config is not cached (SGLang: unaffected)."""
    slug, repo = "llama3.1-8b-instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"
    code, _, err = serve(slug, "vllm")
    assert code == 0 and "mask id" in err and f"dflash-zoo pull {slug}" in err
    draft = json.loads((ROOT / "tests" / "fixtures" / "configs" / slug / "draft.json").read_text())
    cache_draft_config(tmp_path, repo, draft)  # the published early config: no mask id
    code, out, err = serve(slug, "vllm")
    assert code == 3 and out == "" and "mask_token_id" in err and "--engine sglang" in err
    assert serve(slug, "sglang")[0] == 0
    gemma = load_registry().resolve("gemma4-26b-a4b-it")
    config = json.loads(
        (ROOT / "tests" / "fixtures" / "configs" / "gemma4-31b-it" / "draft.json").read_text()
    )
    cache_draft_config(tmp_path, gemma.draft_repo, config)  # a config with a mask id: served, no hint
    code, _, err = serve(gemma.slug, "vllm")
    assert code == 0 and "mask id" not in err


@pytest.mark.parametrize(
    "dist,version,code",
    [("vllm", "0.27.1", 3), ("vllm", "0.28.0", 0), ("sglang", "0.5.18", 3), ("sglang", "0.5.19", 0)],
)
def test_dflash2_needs_its_engine_release(tmp_path, dist, version, code):
    """DFlash 2 arrived in vLLM 0.28.0 and SGLang 0.5.19: older engines are refused with the version that works,
    while a DFlash pair still runs on them."""
    env = fake_engine(tmp_path, dist, version)
    run = run_cli(env, "serve", "qwen3.8-27b", "--engine", dist, "--dry-run", "--json")
    assert run.returncode == code, run.stderr
    if code == 3:
        need = sv.ARCH_MIN_VERSIONS["dflash2"][dist]
        assert f"needs {dist} >= {need}" in run.stderr and "dflash2 drafters" in run.stderr
    assert run_cli(env, "serve", "qwen3-8b", "--engine", dist, "--dry-run").returncode == 0


def test_recipe_minimum_follows_the_architecture():
    assert sv.recipe_for("qwen3_5", "vllm", architecture="dflash2").min_version == "0.28.0"
    assert sv.recipe_for("qwen3_5", "vllm", architecture="dflash").min_version == "0.21.0"
    assert sv.recipe_for("glm_moe_dsa", "sglang", architecture="dflash2").min_version == "0.5.19"
    assert sv.recipe_for("kimi_k25", "vllm", architecture="dflash2").trust_remote_code  # the rest is kept


def test_serve_does_not_need_dflash_zoos_adapter(tmp_path, monkeypatch):
    """An entry downgraded for a missing dflash-zoo adapter is still served (the engine brings its own model
    code), with a hint; one its author marked unsupported-here is refused."""
    import yaml

    from tests.test_registry import entry_dict

    missing = entry_dict("future", adapter="no_such_family")
    marked = entry_dict("blocked", status="unsupported-here", reason="the engines cannot serve it")
    path = tmp_path / "extra.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "entries": [missing, marked]}))
    monkeypatch.setenv("DFLASH_ZOO_REGISTRY", str(path))
    code, out, err = cli("serve", "future", "--engine", "vllm", "--dry-run")
    assert code == 0 and out.startswith("vllm serve me/future-target") and "cannot run future here" in err
    code, _, err = cli("serve", "blocked", "--engine", "vllm", "--dry-run")
    assert code != 0 and "the engines cannot serve it" in err


def test_options_before_the_separator_are_dflash_zoos():
    """A misspelt option is a usage error, not an engine argument (the engine is never launched), and --json
    without --dry-run is refused rather than launching; engine arguments go after `--`."""
    for more in (["--dryrun"], ["--dry_run"], ["--max-model-len", "64"]):
        code, out, err = cli("serve", "qwen3-8b", "--engine", "vllm", *more)
        assert code == 2 and out == "" and "Traceback" not in err, (more, err)
    code, out, _ = cli("serve", "qwen3-8b", "--engine", "vllm", "--json")
    assert code == 2 and "add --dry-run" in json.loads(out)["error"]  # --json: the error as JSON
    code, out, _ = serve("qwen3-8b", "vllm", "--json", "--", "--max-model-len", "64")
    assert code == 0 and json.loads(out)["argv"][-2:] == ["--max-model-len", "64"]


def test_a_drafter_outside_the_registry_meets_its_engine_needs(tmp_path):
    """A drafter named by repo id or local folder is held to what its own config.json needs: DFlash 2's engine
    release and vLLM's mask id, as a registry entry with that config is."""
    fixtures = ROOT / "tests" / "fixtures" / "configs"
    dflash2 = json.loads((fixtures / "qwen3.8-27b" / "draft.json").read_text())
    cache_draft_config(tmp_path, "me/my-dflash2", dflash2)
    env = fake_engine(tmp_path, "vllm", "0.27.1")
    args = (
        "serve",
        "me/my-dflash2",
        "--engine",
        "vllm",
        "--target",
        "Qwen/Qwen3.8-27B",
        "--dry-run",
        "--json",
    )
    run = run_cli(env, *args)
    assert run.returncode == 3 and "dflash2 drafters need vllm >= 0.28.0" in run.stderr
    folder = tmp_path / "my-drafter"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dflash2))
    run = run_cli(env, "serve", str(folder), "--engine", "vllm", "--target", "t/t", "--dry-run", "--json")
    assert run.returncode == 3 and "dflash2 drafters" in run.stderr
    run = run_cli(fake_engine(tmp_path / "new", "vllm", "0.28.0"), "serve", str(folder), "--engine", "vllm",
                  "--target", "t/t", "--dry-run", "--json")  # fmt: skip
    config = json.loads(json.loads(run.stdout)["argv"][4])
    assert run.returncode == 0 and config["model"] == str(folder) and config["num_speculative_tokens"] == 7
    no_mask = json.loads((fixtures / "llama3.1-8b-instruct" / "draft.json").read_text())
    cache_draft_config(tmp_path, "me/llama-drafter", no_mask)
    code, out, err = cli("serve", "me/llama-drafter", "--engine", "vllm", "--target", "t/t", "--dry-run")
    assert code == 3 and out == "" and "mask_token_id" in err
    assert cli("serve", "me/llama-drafter", "--engine", "sglang", "--target", "t/t", "--dry-run")[0] == 0


def test_tensor_parallel_splits_every_layers_heads(tmp_path):
    """Laguna-S-2.1 has 48 query heads on its full layers and 72 on its sliding ones: --tp must split both."""
    target = json.loads(
        (ROOT / "tests" / "fixtures" / "configs" / "laguna-s-2.1" / "target.json").read_text()
    )
    cache_draft_config(tmp_path, "poolside/Laguna-S-2.1", target)
    for tp, code in ((8, 0), (24, 0), (16, 2), (48, 2)):
        got, _, err = serve("laguna-s-2.1", "vllm", "--tp", str(tp))
        assert got == code, (tp, err)
    _, _, err = serve("laguna-s-2.1", "vllm", "--tp", "16")
    assert "72 attention heads" in err and "use --tp 1, 2, 4, 8 or 24" in err
