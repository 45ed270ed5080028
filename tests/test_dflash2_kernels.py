"""DFlash 2's kernels (cuda/ops/dflash2.py) against the torch modules they replace (drafters/dflash2.py), under
Triton's interpreter on CPU (tests/conftest.py) and on CUDA when present."""

from __future__ import annotations

import pytest
import torch

from dflash_zoo.cuda.ops.dflash2 import block_conv, selector_walk
from dflash_zoo.drafters.dflash2 import CandidateSelector, GroupedDynamicConv
from dflash_zoo.engine.config import normalize_draft_config
from tests.tiny import dflash2_config, tiny_target

pytest.importorskip("triton")


def devices():
    """The CPU under Triton's interpreter (conftest sets it without CUDA), or the GPU where there is one."""
    return ["cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kernel,group,rows", [(2, 16, 8), (3, 8, 16), (4, 32, 3)])
def test_block_conv_equals_the_module(device, kernel, group, rows):
    torch.manual_seed(kernel)
    hidden = 64
    conv = GroupedDynamicConv(hidden, kernel, group).to(device)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(0, 0.2)
    x = torch.randn(1, rows, hidden, device=device)
    out = torch.randn(1, rows, hidden, device=device)
    residual = torch.randn(rows, hidden, device=device)
    with torch.no_grad():
        expected_in, dyn = conv.prepare(x)  # dyn [1, N, K, G]: the output side's coefficients
        expected_out = conv.finish(out, dyn)
        coeff = conv.kernel_projection(x).view(rows, 2, kernel, hidden // group)
        got_in = block_conv(x[0], coeff[:, 0], conv.base_kernel[0])
        got_out = block_conv(out[0], coeff[:, 1], conv.base_kernel[1], residual)
    torch.testing.assert_close(got_in, expected_in[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_out, expected_out[0] + residual, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_selector_walk_equals_the_module(device, temperature):
    target = tiny_target("qwen3", seed=0)
    cfg = normalize_draft_config(dflash2_config(target))
    torch.manual_seed(1)
    sel = CandidateSelector(cfg).to(device)
    with torch.no_grad():
        for p in sel.parameters():
            p.normal_()
    h = torch.randn(7, cfg.hidden_size, device=device)
    logits = torch.randn(7, cfg.vocab_size, device=device) * 3
    anchor = torch.tensor([11], device=device)
    with torch.no_grad():
        unary, cands, _, proj = sel.candidates(h, logits)
        race = None
        if temperature:
            race = torch.empty(7, sel.top_k, device=device).exponential_(
                generator=torch.Generator(device).manual_seed(3)
            )
        drafts, q = selector_walk(
            unary, cands, proj, sel.predecessor_codebook, sel.successor_codebook, anchor, race, temperature
        )
        # the module's walk with the same exponential race
        prev, path, rows = anchor, [], []
        for t in range(7):
            s = sel.scores(prev, unary[t], sel.successor_codebook[cands[t]], proj[t])
            if temperature:
                qt = torch.softmax(s / temperature, -1)
                rows.append(qt)
                idx = (qt / race[t]).argmax(-1, keepdim=True)
            else:
                idx = s.argmax(-1, keepdim=True)
            prev = cands[t].index_select(0, idx)
            path.append(prev)
        if not temperature:
            ref_path, _, _ = sel.walk(h, logits, anchor, 0.0, None)
            assert torch.cat(path).tolist() == ref_path.tolist()
    assert drafts.tolist() == torch.cat(path).tolist()
    if temperature:
        torch.testing.assert_close(q, torch.stack(rows), atol=1e-5, rtol=1e-5)
