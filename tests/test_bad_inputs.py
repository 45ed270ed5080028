"""An audit of bad inputs across every command, run as a user would meet them (the table: tests/bad_inputs.py).

Each row goes through the CLI entry point in-process (click's CliRunner), and must be refused with the exit
code of its kind (2 usage, 1 runtime, 3 incompatible), ONE actionable line on stderr (`error: ...` then
`hint: ...`, nothing after them), no traceback and no generic "report it" message, nothing on stdout (or, with
`--json`, one JSON object `{"error", "hint", "exit_code"}`), and, unless the row says the check needs a model,
no target loaded before the refusal. Rows marked `torch_free` are run once more in a fresh interpreter that
must not import torch; `unreadable` rows run in a subprocess without root's capability to read any file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bad_inputs import CASES, Case
from tests.cli_runner import run_cli

pytest_plugins = ["tests.hub_fixtures"]  # hub_env, zoo_registry: the loopback Hub server

GENERIC = re.compile(r"^error: [A-Z]\w*(Error|Exception|Interrupt)\b")  # "error: ValueError: ..." = unmapped
DROP_READ = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]  # root then obeys file modes

# per-row environment (placeholders allowed) and Hub server set-up
ENV = {
    "list-registry-file-missing": {"DFLASH_ZOO_REGISTRY": "{tmp}/no-such-registry.yaml"},
    "list-json-registry-broken": {"DFLASH_ZOO_REGISTRY": "{broken_registry}"},
}
HUB_SETUP = {
    "pull-gated": lambda hub: (
        hub.add_file("zoo-test/gated-draft", "config.json", b"{}"),
        hub.gated.add("zoo-test/gated-draft"),
    ),
    "pull-hub-down": lambda hub: setattr(hub, "fail_status", 503),
    "pull-corrupt": lambda hub: hub.corrupt.update({"zoo-test/tiny-draft/model.safetensors": 4096}),
    "rm-without-yes-not-interactive": lambda hub: _pulled(),
    "rm-json-without-yes": lambda hub: _pulled(),
    "serve-tp-not-dividing-kv-heads": lambda hub: hub.add_file(
        "zoo-test/tiny-target",
        "config.json",
        json.dumps({**QWEN3_8B_HEADS, "num_attention_heads": 24, "num_key_value_heads": 6}).encode(),
    ),
}
QWEN3_8B_HEADS = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "vocab_size": 151936,
                  "num_attention_heads": 32, "num_key_value_heads": 8}  # fmt: skip


def test_the_audit_covers_every_command_with_enough_rows():
    from dflash_zoo.cli import COMMANDS, HIDDEN_ALIASES

    assert len(CASES) >= 140
    commands = {c.argv[0] for c in CASES.values() if c.argv}
    assert set(COMMANDS) - HIDDEN_ALIASES <= commands


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_actionable_line(name, world, tmp_path, monkeypatch, request):
    case = CASES[name]
    values = {**world, "tmp": str(tmp_path)}
    argv = [a.format(**values) for a in case.argv]
    env = {k: v.format(**values) for k, v in ENV.get(name, {}).items()}
    if case.hub:
        hub = request.getfixturevalue("hub_env")
        request.getfixturevalue("zoo_registry")
        hub.add_file("zoo-test/tiny-target", "config.json", json.dumps(QWEN3_8B_HEADS).encode())
        HUB_SETUP.get(name, lambda hub: None)(hub)
    else:
        _offline_home(monkeypatch, tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if case.unreadable:
        code, out, err = _unprivileged(argv)
        loaded = []
    else:
        loaded = _spy_on_loading(monkeypatch)
        code, out, err = run_cli(*argv)
    _assert_refused(case, argv, code, out, err)
    if not case.loads:
        assert loaded == [], f"a target was loaded before the refusal: {loaded}"
    elif not case.unreadable:
        assert loaded, "the row says the check needs a model, but none was loaded"
    if case.torch_free:
        assert _imports_torch(argv, env) is False, "torch was imported before the refusal"


def _assert_refused(case: Case, argv: list[str], code: int, out: str, err: str) -> None:
    shown = f"dflash-zoo {' '.join(argv)}\n--- stdout\n{out}--- stderr\n{err}"
    assert code == case.code, shown
    lines = err.rstrip("\n").splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert len(errors) == 1, shown
    at = errors[0]
    assert lines[at + 1 :][:1] and lines[at + 1].startswith("hint: ") and len(lines) == at + 2, shown
    assert case.chatter or at == 0, shown  # nothing before the error unless the row expects progress lines
    assert "Traceback" not in err and "report it" not in err and not GENERIC.match(lines[at]), shown
    for needle in case.says:
        assert needle in lines[at], shown
    if "--json" in argv:
        doc = json.loads(out)
        assert doc == {"error": lines[at].removeprefix("error: "), "hint": lines[at + 1].removeprefix("hint: "),
                       "exit_code": case.code}, shown  # fmt: skip
    else:
        assert out == "", shown


def _offline_home(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path / "zoo"))
    monkeypatch.delenv("DFLASH_ZOO_REGISTRY", raising=False)


def _spy_on_loading(monkeypatch) -> list[str]:
    """Record every target load (the real one still runs)."""
    import dflash_zoo.api as api
    import dflash_zoo.loading as loading

    calls: list[str] = []
    real = loading.load_target

    def spy(source, *args, **kw):
        calls.append(str(source))
        return real(source, *args, **kw)

    monkeypatch.setattr(loading, "load_target", spy)
    monkeypatch.setattr(api, "load_target", spy)
    return calls


def _pulled() -> None:
    assert run_cli("pull", "tiny-test", "-q").code == 0


CHILD = """
import sys
from dflash_zoo.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else 1
else:
    code = 0
sys.stdout.flush()
sys.stderr.write("TORCH=%s\\n" % ("torch" in sys.modules))
sys.exit(code)
"""


def _child(argv: list[str], env: dict[str, str], prefix: list[str] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-c", CHILD, *argv], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])  # fmt: skip


def _imports_torch(argv: list[str], env: dict[str, str]) -> bool:
    done = _child(argv, env)
    return done.stderr.rstrip().splitlines()[-1] == "TORCH=True"


def _unprivileged(argv: list[str]) -> tuple[int, str, str]:
    """The CLI in a subprocess that cannot read a file its mode forbids (root without CAP_DAC_*)."""
    prefix = DROP_READ if os.geteuid() == 0 else []
    if prefix and shutil.which(prefix[0]) is None:
        pytest.skip("setpriv is not available to drop root's read capability")
    done = _child(argv, {}, prefix)
    err = "\n".join(line for line in done.stderr.splitlines() if not line.startswith("TORCH=")) + "\n"
    return done.returncode, done.stdout, err


# ---- the files the rows name -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, str]:
    """Every file a row names, made once: a tiny pair and broken copies of it, data files, outputs."""
    from dflash_zoo import demo
    from tests.tiny import save_tiny_pair

    base = tmp_path_factory.mktemp("world")
    target, draft = save_tiny_pair(base / "pair")
    w: dict[str, str] = {"target": str(target), "draft": str(draft), "demo_draft": str(demo.draft_dir())}
    w.update(_broken_targets(base, target))
    w.update(_data_files(base))
    w.update(_outputs(base, draft))
    w["wide_draft"] = str(_wide_drafter(base / "wide-draft"))
    w["file"] = str(_write(base / "a-file.txt", b"not a model\n"))
    w["empty_file"] = str(_write(base / "empty.json", b""))
    w["broken_registry"] = str(_write(base / "broken.yaml", b"version: 1\nentries: [{slug: x\n"))
    w["empty"] = ""
    w["not_utf8"] = os.fsdecode(b"caf\xe9")
    w["long_prompt"] = "a" * 3000
    return w


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _target_copy(base: Path, target: Path, name: str, edit=None, raw: bytes | None = None) -> str:
    """A copy of the tiny target with its config.json edited (a dict function) or replaced by bytes."""
    out = base / name
    shutil.copytree(target, out)
    if edit is not None:
        cfg = json.loads((out / "config.json").read_text())
        edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    if raw is not None:
        (out / "config.json").write_bytes(raw)
    return str(out)


def _broken_targets(base: Path, target: Path) -> dict[str, str]:
    w = {
        "nomt": _target_copy(base, target, "no-model-type", lambda c: c.pop("model_type")),
        "mt_number": _target_copy(base, target, "model-type-number", lambda c: c.update(model_type=5)),
        "gpt2": _target_copy(base, target, "gpt2", lambda c: c.update(model_type="gpt2")),
        "notjson": _target_copy(base, target, "not-json", raw=b"{not json"),
        "jsonlist": _target_copy(base, target, "json-list", raw=b"[1, 2]"),
        "cfg_latin1": _target_copy(base, target, "latin1", raw=b'{"model_type": "caf\xe9"}'),
        "unreadable": _target_copy(base, target, "unreadable"),
        "trunc": _target_copy(base, target, "truncated"),
        "noconfig": _target_copy(base, target, "no-config"),
        "missing_shard": _target_copy(base, target, "missing-shard"),
    }
    os.chmod(Path(w["unreadable"]) / "config.json", 0)
    weights = Path(w["trunc"]) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (Path(w["noconfig"]) / "config.json").unlink()
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (Path(w["missing_shard"]) / "model.safetensors.index.json").write_text(json.dumps(index))
    return w


def _data_files(base: Path) -> dict[str, str]:
    rows = [{"prompt": "abc def", "response": "ghi jkl mno pqr"} for _ in range(4)]
    data_in_out = base / "data-in-out"
    _write(data_in_out / "data.jsonl", b'{"text": "hello world"}\n')
    return {
        "data": str(_write(base / "data.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())),
        "empty_data": str(_write(base / "empty.jsonl", b"\n\n")),
        "bad_json_data": str(_write(base / "bad.jsonl", b'{"text": "fine"}\n{"text": oops}\n')),
        "latin1_data": str(_write(base / "latin1.jsonl", b'{"text": "caf\xe9"}\n')),
        "wrong_keys_data": str(_write(base / "keys.jsonl", b'{"question": "hi"}\n')),
        "empty_prompt_data": str(_write(base / "empty-prompt.jsonl", b'{"text": "hello"}\n{"text": ""}\n')),
        "data_in_out": str(data_in_out),
    }


def _outputs(base: Path, draft: Path) -> dict[str, str]:
    """A foreign output, kept checkpoints of an earlier run, a user's drafter in OUT-checkpoint/."""
    foreign = base / "foreign-out"
    _write(foreign / "notes.txt", b"mine\n")
    kept = base / "kept"
    step = base / "kept-checkpoint" / "step-00000003"
    shutil.copytree(draft, step)  # its weights carry dflash-zoo's tag (save_drafter wrote them)
    _write(step / "trainer_state.pt", b"")
    _write(step / "COMPLETE", b'{"step": 3}\n')
    shutil.copytree(draft, kept)
    shutil.copytree(draft, base / "mine-checkpoint")
    return {"foreign_out": str(foreign), "kept": str(kept), "mine": str(base / "mine")}


def _wide_drafter(out: Path) -> Path:
    """A drafter whose hidden size (32) is not the tiny target's (64)."""
    from dflash_zoo.engine.checkpoint import save_drafter
    from dflash_zoo.engine.config import normalize_draft_config
    from dflash_zoo.engine.drafter import DFlashDrafter
    from tests.tiny import draft_config_dict

    cfg = draft_config_dict(None, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    save_drafter(DFlashDrafter(normalize_draft_config(cfg)), out)
    return out
