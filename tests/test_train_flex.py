"""Block-sparse drafter attention for training (training/attention.py) against the dense reference.

The reference is the engine's own rule (`Span.mask`) through SDPA. On CPU, PyTorch's flex attention runs
forward only: losses are compared there, and gradients through the flex path's layout and mask rule with the
kernel swapped for SDPA over the rule's dense mask; the GPU tests compare the compiled flex kernel itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dflash_zoo.adapters import get_adapter

from dflash_zoo.engine.config import normalize_draft_config
from dflash_zoo.engine.drafter import DFlashDrafter, Span
from dflash_zoo.errors import InvalidArgumentError
from dflash_zoo.training import attention as A
from dflash_zoo.training.blocks import block_loss, loss_weights, make_batch, make_blocks
from dflash_zoo.training.forward import TrainingDrafter
from dflash_zoo.training.head_loss import head_loss
from tests.tiny import VOCAB, draft_config_dict, tiny_dflash2, tiny_target

MASK = VOCAB - 1
SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=7)
# bidirectional full layers; a causal sliding layer + a bidirectional full one; every layer causal; DFlash 2
# (its convolutions read across slots of one block only: the packed blocks of a training row stay apart)
DRAFTERS = {"full": {}, "sliding": SLIDING, "causal": {"causal": True}, "dflash2": SLIDING}


def _drafter(target, kind: str, block: int = 4) -> DFlashDrafter:
    if kind == "dflash2":
        return tiny_dflash2(target, seed=1, block_size=block, **SLIDING).float().train()
    kw = dict(DRAFTERS[kind])
    causal = kw.pop("causal", None)
    raw = draft_config_dict(target, block_size=block, **kw)
    if causal:  # every layer causal inside the block (a config's `dflash_config.causal: true`)
        raw["dflash_config"]["causal"] = True
    torch.manual_seed(1)
    return DFlashDrafter(normalize_draft_config(raw)).float()


def _batch(lengths=(300, 141), anchors=((1, 4, 9, 20, 100, 150, 296), (0, 7, 30, 99)), seed=0):
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, MASK, (n,), generator=gen).tolist() for n in lengths]
    return seqs, make_batch(seqs, [torch.tensor(a) for a in anchors])


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


SPANS = {
    "training": lambda: make_blocks(_batch()[1], 4, MASK, loss_weights(4))[3],
    "one-row": lambda: make_blocks(_batch((60,), ((3, 20, 57),))[1], 8, MASK, loss_weights(8))[3],
    "no-limit": lambda: Span(q_pos=torch.arange(10, 22), ctx_pos=torch.arange(10)),
    "segments-only": lambda: Span(
        q_pos=torch.arange(5, 17), ctx_pos=torch.arange(5), q_segment=torch.arange(3).repeat_interleave(4)
    ),  # fmt: skip
}


@pytest.mark.parametrize("span_name", SPANS)
@pytest.mark.parametrize(
    ("causal", "window"), [(False, None), (True, None), (True, 7), (False, 7), (False, 1)]
)
def test_rule_equals_the_engine_mask_everywhere(span_name, causal, window):
    span = SPANS[span_name]()
    rows = span.q_pos.shape[0] if span.q_pos.dim() == 2 else 1
    lay = A.layout(span, rows)
    got = A.dense_mask(lay, causal, window)  # [R, N, Cp + N]
    want = span.mask(causal, window)
    c = lay.ctx_len
    if want is None:  # the engine's "everything visible"
        want = torch.ones(rows, lay.q_len, c + lay.q_len, dtype=torch.bool)
    want = want.expand(rows, lay.q_len, c + lay.q_len)
    assert torch.equal(got[..., :c], want[..., :c])
    assert torch.equal(got[..., lay.ctx_pad :], want[..., c:])
    assert not got[..., c : lay.ctx_pad].any()  # tile padding is never visible
    assert lay.ctx_pad % A.TILE == 0 and lay.ctx_pad - c < A.TILE


@pytest.mark.parametrize(("causal", "window"), [(False, None), (True, 7)])
def test_block_mask_tiles_match_the_rule(causal, window):
    """Skipped tiles hold no visible entry, full tiles only visible ones: the kernel computes all it must."""
    from torch.nn.attention.flex_attention import create_block_mask

    _, batch = _batch((700, 333), (tuple(range(0, 690, 9)), tuple(range(5, 320, 4))))
    span = make_blocks(batch, 4, MASK, loss_weights(4))[3]  # several query and key tiles
    lay = A.layout(span, 2)
    bm = A.block_mask(lay, causal, window)
    dense = A.dense_mask(lay, causal, window)
    nq, nk = -(-lay.q_len // A.TILE), -(-lay.kv_len // A.TILE)
    padded = F.pad(dense, (0, nk * A.TILE - lay.kv_len, 0, nq * A.TILE - lay.q_len))
    counts = padded.view(2, nq, A.TILE, nk, A.TILE).sum((2, 4))
    assert torch.equal(bm.to_dense()[:, 0].bool(), counts > 0)
    full = torch.zeros_like(counts, dtype=torch.bool)
    for r in range(2):
        for i in range(nq):
            full[r, i, bm.full_kv_indices[r, 0, i, : bm.full_kv_num_blocks[r, 0, i]].long()] = True
    assert torch.equal(full, counts == A.TILE * A.TILE)
    ref = create_block_mask(A.visible(lay, causal, window), 2, None, lay.q_len, lay.kv_len, device="cpu")
    assert torch.equal(ref.to_dense(), bm.to_dense())


def test_block_mask_skips_most_tiles_at_recipe_proportions():
    """T = 1,024 with 128 random anchors of block 16 (the paper's 3,072 / 512 / 16, scaled by 1/3 and 1/4):
    a query tile computes about half its context prefix and its own blocks' tile, not the 24 the dense mask
    spans."""
    gen = torch.Generator().manual_seed(0)
    anchors = torch.randperm(1022, generator=gen)[:128].sort().values
    batch = make_batch([torch.randint(0, MASK, (1024,), generator=gen).tolist()], [anchors])
    lay = A.layout(make_blocks(batch, 16, MASK, loss_weights(16))[3], 1)
    visited = A.block_mask(lay, False, None).to_dense().float().mean()
    assert lay.q_len == 2048 and lay.kv_len == 3072
    assert visited < 0.3, visited  # dense: every tile of [2048, 3072]


def test_training_forward_equals_the_engine_forward_exactly(target):
    """The training kernel's dense path in the drafter's forward is the engine's own attention, bit for bit."""
    for kind in DRAFTERS:
        d = _drafter(target, kind)
        _, batch = _batch()
        block, _, _, span = make_blocks(batch, 4, MASK, loss_weights(4))
        emb = get_adapter("qwen3")(target).embed(block)
        feats = torch.randn(2, 300, d.fc.in_features, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            want = d(emb, feats, span)
            got = d(emb, feats, span, attend=A.Attend(span, 2, "dense"))
        assert torch.equal(got, want), kind


def _loss(target, d, kind, seed=0):
    seqs, batch = _batch(seed=seed)
    feats = torch.nn.utils.rnn.pad_sequence(
        [
            torch.randn(len(s), d.fc.in_features, generator=torch.Generator().manual_seed(i))
            for i, s in enumerate(seqs)
        ],
        batch_first=True,
    )
    module = kind if isinstance(kind, torch.nn.Module) else TrainingDrafter(d, kind)
    return block_loss(module, get_adapter("qwen3")(target), batch, feats, MASK, loss_weights(4), head_rows=37)


@pytest.mark.parametrize("drafter_kind", DRAFTERS)
def test_flex_loss_equals_dense_loss_on_cpu(target, drafter_kind):
    d = _drafter(target, drafter_kind)
    with torch.no_grad():
        dense, flex = _loss(target, d, "dense"), _loss(target, d, "flex")
    torch.testing.assert_close(flex.loss, dense.loss, rtol=1e-6, atol=1e-6)
    assert torch.equal(flex.tau, dense.tau) and torch.equal(flex.supervised, dense.supervised)


class _SdpaKernel(A.Attend):
    """The flex path (padded key layout, casts, the rule) with SDPA over the rule's dense mask as kernel."""

    def kernel(self, q, k, v, causal, window, gqa):
        mask = A.dense_mask(self.lay, causal, window)[:, None]  # [R, 1, N, Cp + N]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class _SdpaDrafter(TrainingDrafter):
    def forward(self, emb, feats, span):
        return self.drafter(emb, feats, span, attend=_SdpaKernel(span, emb.shape[0], "flex"))


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("drafter_kind", DRAFTERS)
def test_flex_layout_gradients_equal_dense_gradients_on_cpu(target, drafter_kind):
    d = _drafter(target, drafter_kind)
    ref = _loss(target, d, "dense")
    ref.loss.backward()
    want = _grads(d)
    d.zero_grad(set_to_none=True)
    got = _loss(target, d, _SdpaDrafter(d, "flex"))
    got.loss.backward()
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-6, atol=1e-6)
    grads = _grads(d)
    assert grads.keys() == want.keys() and len(grads) > 10
    for name in want:  # fp32 sums over another key order: absolute error relative to the gradient's scale
        scale = max(1.0, float(want[name].abs().max()))
        torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=3e-6 * scale, msg=name)


def test_flex_needs_cuda_for_gradients():
    assert A.resolve_kind("auto", "cpu") == "dense"
    assert A.resolve_kind("flex", "cpu", grad=False) == "flex"
    with pytest.raises(InvalidArgumentError, match="no backward pass on cpu"):
        A.resolve_kind("flex", "cpu")
    with pytest.raises(InvalidArgumentError, match="unknown attention"):
        A.resolve_kind("sparse", "cpu")


@pytest.mark.parametrize("rows", [1, 5, 1000])
def test_chunked_head_loss_equals_one_pass(rows):
    """Chunked weighted CE (through a soft-capped head) equals the plain one, value and input gradient."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 16, generator=gen)

    def head(x):  # a head with a soft-cap, as adapters may have: differentiated as written
        return 30 * torch.tanh(x @ weight.T / 30)

    h = torch.randn(23, 16, generator=gen, requires_grad=True)
    labels, w = torch.randint(0, 50, (23,), generator=gen), torch.rand(23, generator=gen)
    w[3] = 0
    total, hits = head_loss(head, h, labels, w, rows)
    (2 * total).backward()
    got = h.grad.clone()
    h.grad = None
    logits = head(h)
    want = (F.cross_entropy(logits, labels, reduction="none") * w).sum()
    (2 * want).backward()
    torch.testing.assert_close(total, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, h.grad, rtol=1e-5, atol=2e-6)
    assert torch.equal(hits, logits.argmax(-1) == labels)


# ---- GPU: the compiled flex kernel itself --------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("drafter_kind", DRAFTERS)
def test_compiled_flex_matches_dense_loss_and_gradients_on_cuda(drafter_kind):
    torch.manual_seed(0)
    target = tiny_target("qwen3").cuda()
    d = _drafter(target, drafter_kind).cuda()
    seqs, batch = _batch()
    batch = make_batch(seqs, [batch.anchors[i][batch.real[i]].cpu() for i in range(2)], "cuda")
    feats = torch.randn(2, 300, d.fc.in_features, device="cuda")
    adapter = get_adapter("qwen3")(target)
    out = {}
    for kind in ("dense", "flex"):
        d.zero_grad(set_to_none=True)
        res = block_loss(TrainingDrafter(d, kind), adapter, batch, feats, MASK, loss_weights(4))
        res.loss.backward()
        out[kind] = (res.loss.detach(), _grads(d))
    torch.testing.assert_close(out["flex"][0], out["dense"][0], rtol=1e-4, atol=1e-5)
    for name, g in out["dense"][1].items():
        torch.testing.assert_close(out["flex"][1][name], g, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_trainer_steps_with_flex_follow_dense_in_bf16_on_cuda():
    """The real step (bf16 target, autocast drafter, fused AdamW, compiled flex): the same losses as dense."""
    from dflash_zoo.training.data import Example
    from dflash_zoo.training.train import TrainConfig, build_draft_config, new_drafter
    from dflash_zoo.training.trainer import Trainer

    target = tiny_target("qwen3").to("cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    exs = [Example(tuple(torch.randint(0, MASK, (400,), generator=gen).tolist()), 0) for _ in range(4)]
    losses = {}
    for kind in ("dense", "flex"):
        cfg = TrainConfig(out="unused", draft_layers=2, block_size=8, batch_size=2, anchors_per_seq=48, steps=3,
                          mask_token_id=MASK, attention=kind)  # fmt: skip
        drafter = new_drafter(build_draft_config(target, None, cfg), cfg, None, "cuda")
        tr = Trainer(cfg, target, drafter, exs, "cuda")
        losses[kind] = torch.stack([tr.step(s, s / 3).loss for s in range(3)])
    torch.testing.assert_close(losses["flex"], losses["dense"], rtol=2e-2, atol=2e-2)
