"""Regional compilation of the training step (training/regions.py): which modules compile, that a compiled
step computes the uncompiled one's loss and gradients, that release restores eager modules, and that a failure
of the compiler names `--compile off`.

On CPU the regions compile with dynamo's `eager` backend (the traced graphs run as they are: the test is the
tracing, without a C++ toolchain); the GPU test runs inductor, the backend training uses.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dflash_zoo.engine.drafter import MLP, RMSNorm
from dflash_zoo.errors import InvalidArgumentError, ZooError
from dflash_zoo.training import regions
from dflash_zoo.training.data import Example
from dflash_zoo.training.train import TrainConfig, build_draft_config, new_drafter
from dflash_zoo.training.trainer import Trainer
from tests.tiny import VOCAB, tiny_target

MASK = VOCAB - 1


def _examples(n=4, length=60, seed=0) -> list[Example]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Example(tuple(torch.randint(0, MASK, (length + 7 * i,), generator=gen).tolist()), 2) for i in range(n)
    ]


def _trainer(target, device="cpu", **kw) -> Trainer:
    cfg = TrainConfig(out="unused", draft_layers=2, block_size=4, batch_size=2, anchors_per_seq=6, steps=4,
                      mask_token_id=MASK, target_layer_ids=(0, 1), compile="off", **kw)  # fmt: skip
    torch.manual_seed(0)
    drafter = new_drafter(build_draft_config(target, None, cfg), cfg, None, device)
    return Trainer(cfg, target, drafter, _examples(), device)


def _grads(tr: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in tr.raw.named_parameters() if p.grad is not None}


def _regions(tr: Trainer, backend="eager") -> regions.Regions:
    taps = tr.dcfg.target_layer_ids
    return regions.Regions(
        [*regions.target_regions(tr.adapter, taps), *regions.drafter_regions(tr.raw)], backend
    )


def test_auto_compiles_on_cuda_with_an_unsharded_target_only_once_verified():
    assert regions.resolve("auto", "cuda", sharded=False) == regions.CUDA_VERIFIED
    assert not regions.resolve("auto", "cuda", sharded=True)
    assert not regions.resolve("auto", "cpu", sharded=False)
    assert regions.resolve("on", "cpu", sharded=False) and not regions.resolve("off", "cuda", sharded=False)
    with pytest.raises(InvalidArgumentError, match="auto, on, off"):
        regions.resolve("yes", "cpu", sharded=False)


def test_regions_are_the_run_target_layers_children_and_the_drafter_norms_and_mlps():
    target = tiny_target("qwen3")
    tr = _trainer(target)
    layers = tr.adapter.layers()
    got = list(regions.target_regions(tr.adapter, (0, 1)))
    # layer 2 onwards never runs; the attention stays eager
    assert got == [m for layer in layers[:2] for n, m in layer.named_children() if n != "self_attn"]
    assert len(got) == 3 * 2  # the MLP and two norms of each
    drafted = list(regions.drafter_regions(tr.raw))
    # per drafter layer: its MLP, two layer norms and the attention's q / k norms
    assert len(drafted) == 5 * len(tr.raw.layers)
    assert all(isinstance(m, MLP | RMSNorm) for m in drafted)


def test_a_compiled_step_equals_the_eager_one_and_release_restores_eager_modules():
    target = tiny_target("qwen3")
    out = {}
    for compiled in (False, True):
        tr = _trainer(target)
        if compiled:
            tr.regions = _regions(tr)
            tr.adapter.layers()[0].mlp(torch.zeros(1, 2, target.config.hidden_size))  # a second shape
        stats = [tr.step(s, s / 4) for s in range(2)]
        out[compiled] = (torch.stack([s.loss for s in stats]), _grads(tr))
        if compiled:
            mods = tr.regions.modules
            assert all(m._compiled_call_impl is not None for m in mods)
            tr.release()
            assert tr.regions is None and all(m._compiled_call_impl is None for m in mods)
            copy.deepcopy(tr.raw)  # the saved copy of a released drafter
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-6)
    for name, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_a_compiler_failure_names_the_switch_that_avoids_it():
    def broken(_graph, _inputs):
        raise RuntimeError("no kernel for you")

    tr = _trainer(tiny_target("qwen3"))
    tr.regions = _regions(tr, backend=broken)
    with pytest.raises(ZooError, match="torch.compile failed") as info:
        tr.step(0, 0.0)
    assert "--compile off" in info.value.hint
    tr.release()
    tr.step(0, 0.0)  # eager again


def test_train_writes_an_eager_drafter_after_a_compiled_run(tmp_path, monkeypatch):
    from dflash_zoo.engine.checkpoint import load_drafter
    from dflash_zoo.training.train import train

    target = tiny_target("qwen3")
    cfg = TrainConfig(out=str(tmp_path / "d"), draft_layers=1, block_size=4, batch_size=2, anchors_per_seq=6,
                      steps=2, mask_token_id=MASK, compile="on")  # fmt: skip
    seen = []
    orig = regions.Regions.__init__

    def eager_backend(self, modules, backend="inductor"):  # the CPU test has no C++ toolchain to rely on
        orig(self, modules, "eager")
        seen.append(self)

    monkeypatch.setattr(regions.Regions, "__init__", eager_backend)
    res = train(cfg, target, None, _examples(), "cpu")
    assert seen and seen[0].modules == []  # released when the run ended
    assert all(m._compiled_call_impl is None for m in target.modules())
    assert res.steps == 2 and load_drafter(res.out_dir) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["dense", "flex"])
@pytest.mark.parametrize("part", ["target", "drafter"])
def test_inductor_regions_follow_the_eager_step_on_cuda(part, attention):
    """fp32 on CUDA, one part's regions compiled by inductor at a time: the same losses as eager."""
    target = tiny_target("qwen3").to("cuda")
    losses = {}
    for backend in (None, "inductor"):
        tr = _trainer(target, "cuda", attention=attention)
        if backend:
            taps = tr.dcfg.target_layer_ids
            picked = (
                regions.target_regions(tr.adapter, taps)
                if part == "target"
                else regions.drafter_regions(tr.raw)
            )
            tr.regions = regions.Regions(picked, backend)
        losses[backend] = torch.stack([tr.step(s, s / 4).loss for s in range(4)])
        tr.release()
    torch.testing.assert_close(losses["inductor"], losses[None], rtol=1e-4, atol=1e-5)
