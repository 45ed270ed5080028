"""`train` / `eval` never lose a user's files or finished work: output and checkpoint handling, early checks.

Every case runs the CLI as a user would (in-process through `dflash_zoo.cli.main`, or a subprocess where
directories must be read-only or the process killed) on a tiny local target.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dflash_zoo.cli import main
from dflash_zoo.engine.checkpoint import load_drafter
from dflash_zoo.training import checkpoints
from tests.cli_runner import run_captured
from tests.readonly import cli, run_on_mount, run_readonly
from tests.tiny import save_tiny_pair, tiny_tokenizer

TINY = ["--draft-layers", "1", "--block-size", "4", "--batch-size", "2", "--anchors-per-seq", "8",
        "--device", "cpu", "--seed", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))[0]


@pytest.fixture
def data(tmp_path) -> Path:
    rng = random.Random(0)
    f = tmp_path / "data.jsonl"
    rows = [{"prompt": "".join(rng.choice("abcdefgh ") for _ in range(10)),
             "response": "".join(rng.choice("abcdefgh ") for _ in range(24))} for _ in range(6)]  # fmt: skip
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


@pytest.fixture(autouse=True)
def _warnings_shown(monkeypatch):
    monkeypatch.setenv("DFLASH_ZOO_VERBOSITY", "WARNING")  # what a user sees by default
    monkeypatch.setenv("COLUMNS", "400")  # long temporary paths stay on one line


run = run_captured  # (exit code, stdout, stderr) of `dflash-zoo ARGS`


def train(capsys, target, data, out, *extra, steps: int = 1):
    return run(
        capsys, "train", "--target", target, "--data", data, "--out", out, "--steps", steps, *TINY, *extra
    )


# --- --out never deletes what the tool did not write ------------------------------------------------


def test_out_with_foreign_files_is_refused_before_any_model_loads(capsys, tmp_path, data):
    out = tmp_path / "d"
    out.mkdir()
    (out / "precious.txt").write_text("x")
    # a target that does not exist: the refusal must come first, before anything is loaded
    code, _, err = train(capsys, tmp_path / "no-target", data, out)
    assert code == 2, err
    assert f"{out} is not empty and was not written by dflash-zoo" in err and "--overwrite" in err
    assert (out / "precious.txt").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "data.jsonl"]  # no checkpoint, no temp dir


def test_overwrite_replaces_a_foreign_directory(capsys, tmp_path, target, data):
    out = tmp_path / "d"
    out.mkdir()
    (out / "precious.txt").write_text("x")
    code, _, err = train(capsys, target, data, out, "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "training_args.json"]
    load_drafter(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "data.jsonl"]


@pytest.mark.parametrize("holds", ["--data", "--target"])
def test_overwrite_never_replaces_a_directory_holding_the_runs_inputs(capsys, tmp_path, target, data, holds):
    out = tmp_path / "d"
    out.mkdir()
    if holds == "--data":
        data = shutil.copy(data, out / "data.jsonl")
    else:
        target = shutil.copytree(target, out / "target")
    code, _, err = train(capsys, target, data, out, "--overwrite")
    assert code == 2 and f"refusing to replace {out}: it holds the {holds} input" in " ".join(err.split()), (
        err
    )
    assert Path(data).is_file() and (Path(target) / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "data.jsonl"]


def test_current_directory_is_never_replaced(capsys, tmp_path, target, data, monkeypatch):
    (tmp_path / "precious.txt").write_text("x")
    monkeypatch.chdir(tmp_path)
    code, _, err = train(capsys, target, data, ".", "--overwrite")
    assert code == 2 and "it holds the current directory" in err, err
    assert (tmp_path / "precious.txt").read_text() == "x"


def test_own_output_is_replaced_and_empty_dir_used(capsys, tmp_path, target, data):
    out = tmp_path / "d"
    out.mkdir()  # an empty directory is fine
    assert train(capsys, target, data, out)[0] == 0
    first = (out / "model.safetensors").read_bytes()
    code, _, err = train(capsys, target, data, out, steps=2)  # our own output: no --overwrite needed
    assert code == 0, err
    assert (out / "model.safetensors").read_bytes() != first
    assert json.loads((out / "training_args.json").read_text())["steps_done"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "data.jsonl"]


def test_leftovers_of_an_interrupted_swap_are_recovered_and_named(capsys, tmp_path, target, data):
    out = tmp_path / "d"
    assert train(capsys, target, data, out)[0] == 0
    # the state a kill between "rename old aside" and "rename new in" leaves, plus an older temp dir
    os.rename(out, tmp_path / ".d.old-0a1b2c3d")
    half = tmp_path / ".d.tmp-4e5f6a7b"
    half.mkdir()
    (half / "config.json").write_text("{")
    (half / ".tmpAb12Cd").write_bytes(b"half")  # safetensors' own temporary file, killed before its rename
    legacy = tmp_path / ".d.previous"  # early versions' mkdtemp name, or a user's hidden copy: never removed
    shutil.copytree(out.parent / ".d.old-0a1b2c3d", legacy)
    foreign = tmp_path / ".d.tmp-99999999"  # the same pattern, but a user's file inside: left alone
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    code, _, err = train(capsys, target, data, out)
    assert code == 0, err
    err = " ".join(err.split())
    assert "restored" in err and ".d.old-0a1b2c3d" in err
    assert f"removed {half}" in err and f"{legacy} may be left by an early dflash-zoo version" in err
    assert f"removed {legacy}" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".d.previous", ".d.tmp-99999999", "d", "data.jsonl"]
    load_drafter(legacy)
    assert (foreign / "notes.txt").read_text() == "mine"
    load_drafter(out)


def _untagged_drafter(src: Path, dst: Path, extra: dict[str, str] | None = None) -> dict[str, bytes]:
    """A drafter as another tool writes it (no dflash-zoo tag in its weights) at `dst`; returns its files."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        save_file({k: f.get_tensor(k) for k in f.keys()}, str(dst / "model.safetensors"), {"format": "pt"})
    for name, text in (extra or {}).items():
        (dst / name).write_text(text)
    return {p.name: p.read_bytes() for p in dst.iterdir()}


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir()}


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, target) -> Path:
    """A small drafter of the tiny target, trained here (tagged as ours, with training_args.json)."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    base = tmp_path_factory.mktemp("drafter")
    rows = [{"text": "abcdefgh " * 6} for _ in range(4)]
    (base / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["train", "--target", str(target), "--data", str(base / "data.jsonl"), "--out", str(base / "d"),
            "--steps", "1", *TINY]  # fmt: skip
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        main(argv)
    return base / "d"


@pytest.mark.parametrize("tagged", [False, True], ids=["another-tools-drafter", "our-earlier-drafter"])
@pytest.mark.parametrize("save_every", ["0", "1"])
def test_init_from_out_checkpoint_never_deletes_it(
    capsys, tmp_path, target, data, drafter, tagged, save_every
):
    """`train --init mine-checkpoint --out mine`: the natural fine-tuning command keeps its own input."""
    mine = tmp_path / "mine-checkpoint"
    if tagged:
        shutil.copytree(drafter, mine)
        before = _files(mine)
    else:
        before = _untagged_drafter(drafter, mine)
    code, _, err = train(capsys, target, data, tmp_path / "mine", "--init", mine, "--save-every", save_every)
    assert _files(mine) == before  # nothing removed, nothing written
    if save_every == "0":  # no checkpoint is written: the sibling is not ours and is left alone
        assert code == 0, err
        load_drafter(tmp_path / "mine")
    else:  # checkpoints would go there: refused before anything loads
        assert code == 2, err
        assert f"checkpoint directory {mine} holds files dflash-zoo did not write" in " ".join(err.split())
        assert not (tmp_path / "mine").exists()


def test_a_sibling_named_like_our_checkpoints_is_never_removed(capsys, tmp_path, target, data):
    """`mkdir m-checkpoint; echo '{}' > m-checkpoint/config.json; train --out m --save-every 0`."""
    root = tmp_path / "m-checkpoint"
    root.mkdir()
    (root / "config.json").write_text("{}")
    code, _, err = train(capsys, target, data, tmp_path / "m", "--save-every", "0")
    assert code == 0, err
    assert (root / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl", "m", "m-checkpoint"]


def test_a_fresh_run_beside_kept_checkpoints_refuses(capsys, tmp_path, target, data):
    """Checkpoints kept by an earlier run (`--keep-checkpoints`) are not deleted by a run without --resume."""
    out, root = tmp_path / "d", tmp_path / "d-checkpoint"
    assert train(capsys, target, data, out, "--keep-checkpoints", steps=2)[0] == 0
    kept = _files(root / "step-00000002")
    for extra in ([], ["--save-every", "1"], ["--keep-checkpoints"]):
        code, _, err = train(capsys, tmp_path / "no-target", data, out, *extra)  # refused before loading
        assert code == 2, err
        err = " ".join(err.split())
        assert f"{root} holds the checkpoints of an earlier run (newest: step-00000002)" in err, err
        assert "--resume" in err and "--overwrite" in err
        assert _files(root / "step-00000002") == kept
    code, _, err = train(capsys, target, data, out, "--resume", "--keep-checkpoints", steps=3)
    assert code == 0, err
    assert (root / "step-00000003" / checkpoints.DONE_FILE).is_file()
    code, _, err = train(capsys, target, data, out, "--overwrite")  # starting afresh deletes them
    assert code == 0, err
    assert not root.exists()


def test_out_pointing_at_a_kept_checkpoint_is_refused_naming_it(capsys, tmp_path, target, data):
    """A checkpoint holds optimizer state: `--out` at it (our own files) needs --overwrite like a foreign dir."""
    out = tmp_path / "d"
    assert train(capsys, target, data, out, "--keep-checkpoints", steps=2)[0] == 0
    step = tmp_path / "d-checkpoint" / "step-00000002"
    kept = _files(step)
    code, _, err = train(capsys, tmp_path / "no-target", data, step)  # refused before loading
    assert code == 2, err
    err = " ".join(err.split())
    assert f"{step} is a training checkpoint (it holds COMPLETE, trainer_state.pt)" in err, err
    assert "--overwrite" in err
    assert _files(step) == kept
    code, _, err = train(capsys, target, data, step, "--overwrite")
    assert code == 0, err
    assert f"{step} holds a training checkpoint (--overwrite): it is replaced" in " ".join(err.split())
    assert not (step / checkpoints.STATE_FILE).exists()


def test_a_drafter_from_elsewhere_with_training_args_needs_overwrite(capsys, tmp_path, target, data, drafter):
    """File names prove nothing: a drafter another tool wrote (even with a training_args.json) is the user's."""
    out = tmp_path / "d"
    before = _untagged_drafter(drafter, out, {"training_args.json": '{"lr": 1}'})
    code, _, err = train(capsys, tmp_path / "no-target", data, out)
    assert code == 2, err
    assert f"{out} is not empty and was not written by dflash-zoo" in " ".join(err.split())
    assert _files(out) == before
    code, _, err = train(capsys, target, data, out, "--overwrite")
    assert code == 0, err
    assert f"{out} holds files dflash-zoo did not write (--overwrite): it is replaced" in " ".join(
        err.split()
    )
    assert json.loads((out / "training_args.json").read_text())["steps_done"] == 1


def test_replacing_our_own_earlier_output_is_announced(capsys, tmp_path, target, data):
    out = tmp_path / "d"
    assert train(capsys, target, data, out)[0] == 0
    code, _, err = train(capsys, target, data, out)
    assert code == 0, err
    assert f"{out} holds an earlier dflash-zoo output: it is replaced when this run finishes" in " ".join(
        err.split()
    )


@pytest.mark.parametrize("where", ["draft", "draft-new", "package"])
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_the_installed_package_is_never_an_output(capsys, tmp_path, data, where, overwrite):
    """`--out "$(dflash-zoo info demo --json | jq -r .draft)"` once rewrote the installed demo drafter."""
    import dflash_zoo
    from dflash_zoo import demo

    draft = Path(demo.draft_dir())
    out = {"draft": draft, "draft-new": draft.parent / "new", "package": Path(dflash_zoo.__file__).parent}[
        where
    ]
    before = _files(draft)
    # a target that does not exist: if the refusal ever went missing, the run still stops before writing
    code, _, err = train(capsys, tmp_path / "no-target", data, out, *overwrite)
    assert code == 2, err
    assert "it is or holds the installed dflash-zoo package" in " ".join(err.split())
    assert _files(draft) == before and not (draft.parent / "new").exists()
    assert not (draft.parent / "new-checkpoint").exists()


# --- early checks: every input and output before any model is loaded ---------------------------------


def test_missing_or_bad_data_is_reported_before_the_target_loads(capsys, tmp_path):
    ghost = tmp_path / "no-target"  # never reached: the data error comes first
    code, _, err = train(capsys, ghost, tmp_path / "missing.jsonl", tmp_path / "d")
    assert code == 2 and "no such data file" in err and "missing.jsonl" in err, err
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    code, _, err = train(capsys, ghost, bad, tmp_path / "d")
    assert code == 2 and f"{bad}:2: not valid UTF-8" in err, err
    code, _, err = run(capsys, "eval", "-t", ghost, "-d", ghost, "--data", bad)
    assert code == 2 and f"{bad}:2: not valid UTF-8" in err, err
    code, _, err = run(capsys, "eval", "-t", ghost, "-d", ghost, "--data", tmp_path / "missing.jsonl")
    assert code == 2 and "no such data file" in err, err
    assert not (tmp_path / "d").exists()


def test_responses_cut_away_by_max_length_are_named_apart_from_missing_ones(capsys, tmp_path, target, data):
    """Every line has a response, but the chat-templated prompt alone fills --max-length 12."""
    code, _, err = train(capsys, target, data, tmp_path / "d", "--max-length", "12")
    assert code == 2, err
    err = " ".join(err.split())
    assert "skipped 6 record(s) whose response --max-length 12 cut away" in err, err
    assert "no usable training examples" in err and "hint: raise --max-length" in err
    assert "use --regenerate" not in err and "needs --regenerate" not in err


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (["--max-new-tokens", "1"], "6 response(s) under 2 tokens (raise --max-new-tokens)"),
        (["--max-new-tokens", "8", "--max-length", "12"], "6 prompt(s) at or past --max-length 12"),
    ],
    ids=["short-responses", "long-prompts"],
)
@pytest.mark.parametrize("only", [[], ["--regenerate-only"]], ids=["train", "regenerate-only"])
def test_regeneration_leaving_no_example_says_why(
    capsys, tmp_path, target, data, extra, why, only, monkeypatch
):
    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path / "zoo"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in map(json.loads, data.open()))
    )
    code, _, err = train(capsys, target, prompts, tmp_path / "d", "--regenerate", *extra, *only)
    assert code == 2, err
    assert f"no usable training examples: {why}" in " ".join(err.split()), err


def test_regeneration_cache_follows_the_chat_template(capsys, tmp_path, target, data, monkeypatch):
    """Another chat_template.jinja renders other prompts: the regeneration cache is not reused."""
    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path / "zoo"))
    tgt = tmp_path / "target"
    shutil.copytree(target, tgt)
    regen = tmp_path / "zoo" / "regen"
    for _ in range(2):  # the second run reads the first one's cache
        assert train(capsys, tgt, data, tmp_path / "d", "--regenerate", "--regenerate-only")[0] == 0
        assert len(list(regen.glob("*.jsonl"))) == 1
    (tgt / "chat_template.jinja").write_text(
        "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<<assistant>> {% endif %}"
    )
    assert train(capsys, tgt, data, tmp_path / "d", "--regenerate", "--regenerate-only")[0] == 0
    assert len(list(regen.glob("*.jsonl"))) == 2


@pytest.mark.parametrize("where", ["parent", "out", "checkpoint"])
def test_unwritable_locations_fail_before_training(tmp_path, target, data, where):
    ro = tmp_path / "ro"
    ro.mkdir()
    out = ro / "d" if where == "parent" else tmp_path / "d"
    if where == "out":
        ro, out = out, out
        out.mkdir()
    if where == "checkpoint":
        ro = tmp_path / "d-checkpoint"
        ro.mkdir()
    argv = cli("train", "--target", str(target), "--data", str(data), "--out", str(out), "--steps", "2",
               "--save-every", "1", *TINY)  # fmt: skip
    done = run_readonly(argv, [ro], env={**os.environ, "DFLASH_ZOO_VERBOSITY": "WARNING"}, timeout=300)
    assert done.returncode == 1, done.stderr
    what = "checkpoint directory" if where == "checkpoint" else "output directory"
    assert f"{what} " in done.stderr and "is not writable" in done.stderr
    assert "step 1/" not in done.stderr  # nothing was trained
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted({"data.jsonl", "ro", ro.name}), left  # no checkpoint sibling, no temp dirs


def test_an_out_that_cannot_be_swapped_into_fails_before_training(capsys, tmp_path, target, data):
    """A mount point cannot be renamed over, and a name near the limit leaves no room for the temporary
    sibling: both are refused before the target loads, not after the work (which was then lost)."""
    long = tmp_path / ("d" * 243)
    code, _, err = train(capsys, target, data, long)
    assert code == 2 and "is too long here" in err and "step 1/" not in err, err
    volume, source = tmp_path / "vol", tmp_path / "vol-src"
    volume.mkdir()
    source.mkdir()
    argv = cli(
        "train", "--target", str(target), "--data", str(data), "--out", str(volume), "--steps", "1", *TINY
    )
    done = run_on_mount(argv, volume, source, timeout=300)
    assert done.returncode == 2 and "is a mount point" in done.stderr and "step 1/" not in done.stderr, (
        done.stderr
    )


def test_a_feature_cache_inside_out_is_refused_before_training(capsys, tmp_path, target, data):
    for cache in (tmp_path / "d" / "features", tmp_path / "d", tmp_path / "d-checkpoint" / "f"):
        code, _, err = train(capsys, target, data, tmp_path / "d", "--cache-features", cache)
        assert code == 2 and "--cache-features" in err and "would be lost" in err, err
        assert "step 1/" not in err and not cache.exists()


def test_target_layer_ids_outside_the_target_is_a_usage_error(capsys, tmp_path, target, data):
    code, _, err = train(capsys, target, data, tmp_path / "d", "--target-layer-ids", "1,99")
    assert code == 2, err
    assert "--target-layer-ids 99 outside the target's layers 0..3" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]


def test_declared_mask_token_is_used(capsys, tmp_path, target, data):
    t = tmp_path / "target"
    shutil.copytree(target, t)
    tok = tiny_tokenizer()
    tok.add_special_tokens({"mask_token": "<mask>"})
    tok.save_pretrained(t)
    code, _, err = train(capsys, t, data, tmp_path / "d")
    assert code == 0, err
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == tok.mask_token_id == 100  # not the last row (255)


# --- checkpoints --------------------------------------------------------------------------------------


def test_checkpoints_are_announced_and_removed_on_success(capsys, tmp_path, target, data):
    code, _, err = train(capsys, target, data, tmp_path / "d", "--save-every", "1", steps=2)
    assert code == 0, err
    assert f"checkpoints: {tmp_path / 'd-checkpoint'}" in " ".join(err.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "data.jsonl"]


def test_outputs_have_normal_permissions(capsys, tmp_path, target, data):
    old = os.umask(0o022)
    try:
        code, _, err = train(capsys, target, data, tmp_path / "d", "--keep-checkpoints")
    finally:
        os.umask(old)
    assert code == 0, err
    (step,) = (p for p in (tmp_path / "d-checkpoint").iterdir() if p.is_dir())
    for d in (tmp_path / "d", tmp_path / "d-checkpoint", step):
        assert d.stat().st_mode & 0o777 == 0o755, d
        for f in d.iterdir():
            if f.is_file():
                assert f.stat().st_mode & 0o777 == 0o644, f


def test_resume_of_a_finished_run_prints_json(capsys, tmp_path, target, data):
    out = tmp_path / "d"
    assert train(capsys, target, data, out, "--keep-checkpoints", steps=2)[0] == 0
    code, stdout, err = train(capsys, target, data, out, "--resume", "--json", "--keep-checkpoints", steps=2)
    assert code == 0, err
    res = json.loads(stdout)  # NaN would not parse
    assert res["steps"] == 2 and res["loss"] is None and res["tau"] is None
    # without --keep-checkpoints the finished run's checkpoint goes; a later --resume says so before loading
    assert train(capsys, target, data, out, "--resume", steps=2)[0] == 0
    code, _, err = train(capsys, tmp_path / "no-target", data, out, "--resume")
    assert code == 1 and "nothing to resume" in err and "--keep-checkpoints" in err, err


@pytest.mark.parametrize(
    ("first", "extra", "message"),
    [
        ([], ["--draft-layers", "3"], "--draft-layers 3 differs from the checkpoint's layers 1"),
        ([], ["--block-size", "8"], "--block-size 8 differs from the checkpoint's block size 4"),
        ([], ["--target-layer-ids", "0,2"], "--target-layer-ids 0,2 differs from the checkpoint's taps 2"),
        ([], ["--arch", "dflash2"], "--arch dflash2 differs from the checkpoint's architecture dflash"),
        ([], ["--no-target-features"], "was trained without --no-target-features"),
        (["--no-target-features"], [], "was trained with --no-target-features"),
    ],
    ids=["layers", "block", "taps", "arch", "features-added", "features-dropped"],
)
def test_resume_with_other_shape_options_is_a_usage_error(
    capsys, tmp_path, target, data, first, extra, message
):
    """A resumed run continues the checkpoint's drafter: an option saying otherwise is named with its value."""
    out = tmp_path / "d"
    assert train(capsys, target, data, out, "--keep-checkpoints", *first)[0] == 0
    code, _, err = train(capsys, target, data, out, "--resume", *extra, steps=2)
    assert code == 2, err
    err = " ".join(err.split())
    assert message in err and str(tmp_path / "d-checkpoint" / "step-00000001") in err, err


def test_training_args_record_the_drafters_real_shape(capsys, tmp_path, target, data, drafter):
    """With --init and no shape options, training_args.json holds the --init drafter's shape, not defaults."""
    from dflash_zoo.engine.config import load_draft_config

    out = tmp_path / "d"
    code, _, err = run(capsys, "train", "--target", target, "--data", data, "--out", out, "--steps", 1,
                       "--init", drafter, "--batch-size", "2", "--anchors-per-seq", "8", "--device", "cpu")  # fmt: skip
    assert code == 0, err
    args, dcfg = json.loads((out / "training_args.json").read_text()), load_draft_config(out)
    assert (args["draft_layers"], args["block_size"]) == (dcfg.num_hidden_layers, dcfg.block_size) == (1, 4)
    assert args["target_layer_ids"] == list(dcfg.target_layer_ids) and args["arch"] == "dflash"


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_damaged_trainer_state_is_named(capsys, tmp_path, target, data, damage):
    out = tmp_path / "d"
    assert train(capsys, target, data, out, "--keep-checkpoints")[0] == 0
    state = tmp_path / "d-checkpoint" / "step-00000001" / checkpoints.STATE_FILE
    state.write_bytes(b"" if damage == "empty" else state.read_bytes()[: state.stat().st_size // 2])
    code, _, err = train(capsys, target, data, out, "--resume")
    assert code == 1, err  # not 130 ("interrupted")
    assert f"cannot read trainer state {state}" in " ".join(err.split())


@pytest.mark.parametrize("damage", ["header", "data"])
def test_damaged_checkpoint_weights_are_named_before_the_target_loads(capsys, tmp_path, target, data, damage):
    out = tmp_path / "d"
    assert train(capsys, target, data, out, "--keep-checkpoints")[0] == 0
    weights = tmp_path / "d-checkpoint" / "step-00000001" / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[:100] if damage == "header" else raw[:-100])
    code, _, err = train(capsys, tmp_path / "no-target", data, out, "--resume")  # never reached
    assert code == 1, err
    err = " ".join(err.split())
    assert f"cannot read checkpoint weights {weights}" in err and f"remove {weights.parent}" in err


def test_resume_skips_incomplete_checkpoints_and_names_them(capsys, tmp_path, target, data):
    out, root = tmp_path / "d", tmp_path / "d-checkpoint"
    assert train(capsys, target, data, out, "--keep-checkpoints", steps=2)[0] == 0
    good = root / "step-00000002"
    newer = root / "step-00000003"  # what a user copy or a foreign tool might leave: no COMPLETE marker
    shutil.copytree(good, newer)
    (newer / checkpoints.DONE_FILE).unlink()
    partial = root / ".step-00000004.tmp-0123abcd"  # a save killed halfway
    partial.mkdir()
    (partial / "config.json").write_text("{")
    (partial / ".tmpAb12Cd").write_bytes(b"half")  # safetensors' own temporary file, killed before its rename
    code, stdout, err = train(capsys, target, data, out, "--resume", "--json", "--keep-checkpoints", steps=3)
    assert code == 0, err
    err = " ".join(err.split())
    assert (
        f"skipping incomplete checkpoint {newer}" in err
        and f"skipping incomplete checkpoint {partial}" in err
    )
    assert json.loads(stdout)["steps"] == 3
    left = sorted(p.name for p in root.iterdir())
    assert left == [checkpoints.MARKER, "step-00000003"]  # the new one replaced all of them
    assert (root / "step-00000003" / checkpoints.DONE_FILE).is_file()


def _step(p: Path) -> int:
    return int(p.name.removeprefix(".").split("-")[1].split(".")[0])


@pytest.mark.slow
def test_random_kills_always_leave_a_usable_checkpoint(tmp_path, target, data):
    """SIGKILL a real training process 6 times (`--save-every 1`): at a random instant, or just inside a save
    (once its temporary directory appears). `--resume` must always find a complete checkpoint, never behind."""
    out, root = tmp_path / "d", tmp_path / "d-checkpoint"
    rng, last, inside = random.Random(1234), 0, 0
    env = {**os.environ, "DFLASH_ZOO_VERBOSITY": "WARNING"}
    base = [
        "train",
        "--target",
        str(target),
        "--data",
        str(data),
        "--out",
        str(out),
        "--save-every",
        "1",
        *TINY,
    ]

    def saving(after: int) -> bool:  # a save of a step later than `after` is being written
        return any(p.name.startswith(".step-") and _step(p) > after for p in root.iterdir())

    for kill in range(6):
        resume = ["--resume"] if checkpoints.find(root)[0] is not None else []
        proc = subprocess.Popen(cli(*base, "--steps", "100000", *resume), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            for _ in range(30000):  # bounded (~5 min): this run's first new checkpoint
                found = checkpoints.find(root)[0]
                if (found is not None and _step(found) > last) or proc.poll() is not None:
                    break
                time.sleep(0.01)
            if kill % 2:  # just inside the next save
                for _ in range(100000):
                    if saving(_step(found)) or proc.poll() is not None:
                        break
                    time.sleep(0.001)
                time.sleep(rng.uniform(0.0, 0.002))
            else:
                time.sleep(rng.uniform(0.0, 2.0))
            assert proc.poll() is None, "training ended before the kill: nothing was tested"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        found, skipped = checkpoints.find(root)
        inside += bool(skipped)
        assert found is not None and found.parent == root
        step = int(checkpoints.load_state(found)["step"])
        assert step >= max(last, 1)  # never behind the last complete checkpoint
        load_drafter(found)
        last = step
    assert inside >= 1  # at least one kill hit a save halfway (its temporary directory was left)
    done = subprocess.run(cli(*base, "--steps", str(last + 2), "--resume", "--json"), env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["steps"] == last + 2
    load_drafter(out)
    assert not root.exists()
