"""`train --arch dflash2` on a tiny target: the loss falls, the drafter drafts better than untrained, its
selector helps, the saved drafter loads in z-lab's reference and proposes as it does there; `--init` upgrades a
DFlash drafter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_zoo.drafters.dflash2 import DFlash2Drafter
from dflash_zoo.engine.checkpoint import load_drafter, save_drafter
from dflash_zoo.engine.config import load_draft_config
from dflash_zoo.errors import InvalidArgumentError
from dflash_zoo.training.train import TrainConfig, build_draft_config, new_drafter, train
from tests.cli_runner import run_cli
from tests.reference import load_reference_drafter, reference_run
from tests.test_dflash2 import assert_conforms, ours
from tests.test_train import MASK, _acceptance, _cfg, _prompts, tiny_setup
from tests.tiny import save_tiny_pair


@pytest.fixture(scope="module")
def setup():
    return tiny_setup()


def _cfg2(tmp_path, **kw) -> TrainConfig:
    from dflash_zoo.drafters import DFlash2Params

    return _cfg(tmp_path, arch="dflash2", dflash2=DFlash2Params(2, 16, 16, 8), **kw)


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory):
    target, tok, examples = setup
    cfg = _cfg2(tmp_path_factory.mktemp("train2"))
    return cfg, train(cfg, target, tok, examples)


def test_loss_falls_and_the_drafter_drafts(setup, trained):
    target, tok, _ = setup
    cfg, res = trained
    assert res.history[-1][1] < 0.5 * res.history[0][1]
    drafter = load_drafter(cfg.out)
    assert type(drafter) is DFlash2Drafter and drafter.cfg.dflash2 == cfg.dflash2
    raw = json.loads((Path(cfg.out) / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    fresh = new_drafter(build_draft_config(target, tok, cfg), cfg, None, "cpu")
    held_out = _prompts(99, 4)
    assert _acceptance(target, tok, drafter, held_out) > _acceptance(target, tok, fresh, held_out) + 1.0


def test_trained_drafter_conforms_to_reference(setup, trained):
    target, _, examples = setup
    cfg, _ = trained
    ref = load_reference_drafter(cfg.out, dflash2=True)
    prompt = list(examples[0].ids[: examples[0].start])  # a prompt the target answers as it was trained on
    with torch.no_grad():
        expected = reference_run(ref, target, prompt, 40)
    result = ours(target, load_drafter(cfg.out), prompt, 40)
    assert_conforms(result, expected, cfg.block_size)
    assert result.mean_acceptance_length > 1.2  # drafts are accepted: the comparison covers real proposals


def test_init_upgrades_a_dflash_drafter(setup, tmp_path):
    target, tok, examples = setup
    v1 = train(_cfg(tmp_path / "v1", steps=2), target, tok, examples)
    cfg = _cfg2(tmp_path / "v2", steps=1)
    upgraded = new_drafter(None, cfg, v1.out_dir, "cpu")
    assert type(upgraded) is DFlash2Drafter
    v1_state = load_drafter(v1.out_dir).state_dict()
    assert all(torch.equal(upgraded.state_dict()[k], v) for k, v in v1_state.items())
    saved = str(save_drafter(upgraded, tmp_path / "saved2"))
    with pytest.raises(InvalidArgumentError, match="is a dflash2 drafter; it cannot become dflash"):
        new_drafter(None, _cfg(tmp_path / "x", arch="dflash"), saved, "cpu")


def test_cli_train_arch_dflash2(tmp_path):
    """Through the CLI: --arch dflash2 with its options writes a DFlash 2 drafter; bad options are usage errors."""
    target_dir, _ = save_tiny_pair(tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": "ab", "response": "cdefgh " * 12}) for _ in range(4)))
    args = ["train", "--target", str(target_dir), "--data", str(data), "--out", str(tmp_path / "o"),
            "--steps", "2", "--batch-size", "2", "--block-size", "4", "--draft-layers", "1", "--raw",
            "--mask-token-id", str(MASK), "--device", "cpu", "--arch", "dflash2", "--selector-rank", "8",
            "--selector-top-k", "4"]  # fmt: skip
    res = run_cli(*args)
    assert res.code == 0, res.stderr
    assert load_draft_config(tmp_path / "o").arch == "dflash2"
    bad = run_cli(*args, "--conv-kernel-size", "9")
    assert bad.code == 2 and "exceeds --block-size" in bad.stderr


def test_eval_reports_the_selectors_effect(setup, trained):
    """eval on a DFlash 2 drafter reports tau without the selector too (the same drafter, each slot's argmax),
    which the selector-off run measures for real: it equals a run of the drafter with its selector off."""
    from dflash_zoo.api import Pipeline
    from dflash_zoo.training.evaluate import evaluate

    target, tok, examples = setup
    cfg, _ = trained
    drafter = load_drafter(cfg.out)
    pipe = Pipeline(model=target, drafter=drafter, tokenizer=tok, mask_token_id=MASK)
    prompts = [list(e.ids[: e.start]) for e in examples[:3]]
    res = evaluate(pipe, prompts, max_new_tokens=24, baseline=False)
    with drafter.selector_off():
        plain = [a for p in prompts for a in pipe.generate(p, max_new_tokens=24).acceptance_lengths]
    assert res.mean_acceptance_length_without_selector == sum(plain) / len(plain)
    assert res.to_dict()["mean_acceptance_length_without_selector"] is not None
    assert evaluate(
        Pipeline(model=target, drafter=_dflash(target, tok, cfg), tokenizer=tok, mask_token_id=MASK),
        prompts[:1], max_new_tokens=8, baseline=False,
    ).mean_acceptance_length_without_selector is None  # fmt: skip


def _dflash(target, tok, cfg):
    import dataclasses

    return new_drafter(
        build_draft_config(target, tok, dataclasses.replace(cfg, arch="dflash")), cfg, None, "cpu"
    )
