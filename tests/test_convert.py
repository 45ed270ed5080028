"""`dflash-zoo convert`: every layout written and read back bit-exact, with identical proposals.

Round trips zlab -> speculators -> zlab (DFlash and DFlash 2, full and sliding layers, fp32 and bf16) and
zlab -> hf-native -> zlab where the assistant can express the drafter: the tensors come back with the same names,
dtypes and bits, the config normalises to the same `DraftConfig`, and the eager engine proposes the same tokens
every step on a tiny target. What a layout cannot express is refused before anything is written; outputs never
replace a directory dflash-zoo did not write.
"""

from __future__ import annotations

import json

import pytest
import torch
from dflash_zoo.adapters import get_adapter
from safetensors.torch import load_file

from dflash_zoo.engine.checkpoint import load_drafter, save_drafter
from dflash_zoo.engine.config import normalize_draft_config
from dflash_zoo.engine.decode import EagerEngine
from dflash_zoo.engine.drafter import DFlashDrafter
from dflash_zoo.engine.results import GenerationConfig
from tests.cli_runner import run_cli
from tests.reference import load_reference_drafter
from tests.tiny import draft_config_dict, randomize, tiny_dflash2, tiny_target, tiny_tokenizer

SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny target on disk (a convert --target) and the model itself."""
    root = tmp_path_factory.mktemp("target")
    model = tiny_target("qwen3", seed=0)
    model.save_pretrained(root / "t")
    tiny_tokenizer().save_pretrained(root / "t")
    return root / "t", model


def drafter_of(kind: str, target, dtype=torch.float32, bidirectional: bool = False, **extra) -> DFlashDrafter:
    if kind == "dflash2":
        model = tiny_dflash2(target, seed=3, **extra)
    else:
        torch.manual_seed(3)
        raw = draft_config_dict(target, **extra)
        if bidirectional:
            raw["dflash_config"]["causal"] = False
        model = randomize(DFlashDrafter(normalize_draft_config(raw)), seed=3)
    return model.to(dtype).eval()


def proposals(drafter: DFlashDrafter, target) -> list[list[int]]:
    """Every step's proposals of a greedy generation on the eager engine (fp32 drafter)."""
    drafter = drafter.float()
    engine = EagerEngine(get_adapter("qwen3")(target), drafter, drafter.cfg.mask_token_id)
    cfg = GenerationConfig(max_new_tokens=24)
    return [s.proposed for s in engine.speculative([5, 9, 3, 7, 200, 17], cfg).steps]


def assert_same_tensors(a_dir, b_dir):
    a, b = load_file(str(a_dir / "model.safetensors")), load_file(str(b_dir / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def assert_reference_reads_it_alike(directory, drafter):
    """z-lab's loader takes a zlab output whole, with the same in-block causality per layer as ours."""
    ref = load_reference_drafter(directory, dflash2=drafter.arch == "dflash2")
    assert [layer.self_attn.is_causal for layer in ref.layers] == list(drafter.cfg.causal)


def convert(src, layout, out, *extra) -> dict:
    res = run_cli("convert", str(src), "--to", layout, str(out), "--json", *extra)
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)


SLOW = pytest.mark.slow  # each round trip with its proposals takes ~20-40 s on a shared 2-core CPU
CASES = [
    pytest.param("dflash", torch.float32, {}, id="dflash"),
    pytest.param("dflash", torch.bfloat16, SLIDING, id="dflash-sliding-bf16", marks=SLOW),
    pytest.param("dflash2", torch.float32, SLIDING, id="dflash2-sliding"),
    pytest.param("dflash2", torch.bfloat16, {}, id="dflash2-bf16", marks=SLOW),
]


@pytest.mark.parametrize("kind,dtype,extra", CASES)
def test_zlab_to_speculators_and_back(tmp_path, target_dir, kind, dtype, extra):
    tdir, target = target_dir
    drafter = drafter_of(kind, target, dtype, **extra)
    save_drafter(drafter, tmp_path / "z")
    got = convert(tmp_path / "z", "speculators", tmp_path / "s", "--target", str(tdir))
    assert (got["source_layout"], got["layout"], got["architecture"]) == ("zlab", "speculators", kind)
    spec = json.loads((tmp_path / "s" / "config.json").read_text())
    assert spec["speculators_model_type"] == kind
    assert spec["aux_hidden_state_layer_ids"] == [i + 1 for i in drafter.cfg.target_layer_ids]
    res = run_cli("convert", str(tmp_path / "s"), "--to", "zlab", str(tmp_path / "z3"))
    assert (
        res.code == 2 and "num_target_layers" in res.stderr and "--target" in res.stderr
    )  # not in speculators
    back = convert(tmp_path / "s", "zlab", tmp_path / "z2", "--target", str(tdir))
    assert back["verifier_copies_checked"] and len(back["verifier_copies_dropped"]) == 4
    assert_same_tensors(tmp_path / "z", tmp_path / "z2")
    again = load_drafter(tmp_path / "z2", dtype=None)
    assert again.cfg == drafter.cfg  # the target's layer count from --target
    assert_reference_reads_it_alike(tmp_path / "z2", drafter)
    expected = proposals(load_drafter(tmp_path / "z"), target)
    assert (
        proposals(again, target) == expected and proposals(load_drafter(tmp_path / "s"), target) == expected
    )


@pytest.mark.parametrize("sliding", [pytest.param(False, marks=SLOW), True])
def test_zlab_to_hf_native_and_back(tmp_path, target_dir, sliding):
    _, target = target_dir
    drafter = drafter_of("dflash", target, bidirectional=True, **(SLIDING if sliding else {}))
    save_drafter(drafter, tmp_path / "z")
    convert(tmp_path / "z", "hf-native", tmp_path / "h")
    assert json.loads((tmp_path / "h" / "config.json").read_text())["model_type"] == "muse_glimmer_assistant"
    convert(tmp_path / "h", "zlab", tmp_path / "z2")
    assert_same_tensors(tmp_path / "z", tmp_path / "z2")
    assert load_drafter(tmp_path / "z2").cfg == drafter.cfg
    assert_reference_reads_it_alike(tmp_path / "z2", drafter)
    expected = proposals(drafter, target)
    assert proposals(load_drafter(tmp_path / "z2"), target) == expected
    assert proposals(load_drafter(tmp_path / "h"), target) == expected


@pytest.mark.parametrize(
    "kind,extra,layout,message",
    [
        ("dflash2", {}, "hf-native", "dflash2 drafter"),
        ("dflash", SLIDING, "hf-native", "causal inside the block"),
        ("dflash2", {"output_multiplier": 0.5}, "speculators", "no drafter logit multiplier"),
        ("dflash", {}, "speculators", "must come from a target"),
    ],
    ids=["dflash2-hf-native", "causal-hf-native", "multiplier-speculators", "speculators-without-target"],
)
def test_what_a_layout_cannot_express_is_refused_before_writing(
    tmp_path, target_dir, kind, extra, layout, message
):
    _, target = target_dir
    save_drafter(drafter_of(kind, target, **extra), tmp_path / "z")
    res = run_cli("convert", str(tmp_path / "z"), "--to", layout, str(tmp_path / "out"))
    assert res.code == 2 and message in res.stderr and "hint:" in res.stderr
    assert not (tmp_path / "out").exists()


def test_speculators_drafter_for_another_target_is_refused(tmp_path, target_dir):
    tdir, target = target_dir
    save_drafter(drafter_of("dflash", target), tmp_path / "z")
    convert(tmp_path / "z", "speculators", tmp_path / "s", "--target", str(tdir))
    other = tiny_target("qwen3", seed=9)
    other.save_pretrained(tmp_path / "other")
    res = run_cli(
        "convert",
        str(tmp_path / "s"),
        "--to",
        "zlab",
        str(tmp_path / "z2"),
        "--target",
        str(tmp_path / "other"),
    )
    assert res.code == 3 and "verifier embedding" in res.stderr and not (tmp_path / "z2").exists()


def test_outputs_never_replace_what_dflash_zoo_did_not_write(tmp_path, target_dir):
    _, target = target_dir
    save_drafter(drafter_of("dflash", target, bidirectional=True), tmp_path / "z")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    res = run_cli("convert", str(tmp_path / "z"), "--to", "hf-native", str(mine))
    assert res.code == 2 and "--overwrite" in res.stderr and (mine / "notes.txt").read_text() == "keep me"
    convert(tmp_path / "z", "hf-native", tmp_path / "h")
    convert(tmp_path / "z", "hf-native", tmp_path / "h")  # its own output: replaced without --overwrite
    res = run_cli("convert", str(tmp_path / "z"), "--to", "zlab", str(tmp_path / "z"), "--overwrite")
    assert res.code == 2 and "holds the SOURCE input" in res.stderr


def test_a_mount_point_is_refused_as_an_output(tmp_path, target_dir):
    """The finished output is renamed into place, which a mount point refuses: said before writing."""
    import sys

    from tests.readonly import run_on_mount

    _, target = target_dir
    save_drafter(drafter_of("dflash", target, bidirectional=True), tmp_path / "z")
    volume, source = tmp_path / "vol", tmp_path / "vol-src"
    volume.mkdir()
    source.mkdir()
    argv = [
        sys.executable,
        "-m",
        "dflash_zoo",
        "convert",
        str(tmp_path / "z"),
        "--to",
        "hf-native",
        str(volume),
    ]
    done = run_on_mount(argv, volume, source)
    assert done.returncode == 2 and "is a mount point" in done.stderr and not any(source.iterdir())


def test_help_has_examples_and_no_torch():
    import subprocess
    import sys

    code = "import sys; from dflash_zoo.cli import main\ntry: main(['convert', '--help'])\nexcept SystemExit: pass\n"
    code += "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "Examples:" in out and "--to speculators" in out and out.strip().endswith("False")
