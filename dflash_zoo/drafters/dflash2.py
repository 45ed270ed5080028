"""DFlash 2 (`DFlash2DraftModel`): the DFlash drafter with convolutions along the block and a candidate selector.

Architecture (z-lab `dflash` 0.1.0, `dflash/model.py`; vLLM `qwen3_dflash2.py`; SpecForge / speculators DFlash 2):
- every layer is a DFlash layer (engine/drafter.py) whose attention and MLP each sit inside a grouped dynamic
  causal convolution: `prepare` convolves the sublayer's input and hands on the second half of its dynamic
  coefficients, `finish` convolves the sublayer's output with them;
- a convolution has K taps reading backwards along the block (tap j reads slot t - j; zero across the block's
  start, and across block boundaries when training packs several blocks in a row), a static per-channel kernel
  `base_kernel [2, K, H]` (row 0 before the sublayer, row 1 after) plus per-slot coefficients from one projection
  `kernel_projection: H -> 2 * K * (H / g)`, each shared by a group of g channels;
- the candidate selector replaces the per-slot argmax: each slot keeps the top-k of its drafter logits; walking
  the block left to right, a candidate's score is its logit plus a rank-r transition score between the token
  chosen for the previous slot (the anchor for slot 1) and the candidate, modulated by the slot's state:
  `<pred[prev] * proj(h_t), succ[cand]>`. Greedy takes the best score; sampling draws from softmax(scores / T),
  and speculative sampling uses that q, zero outside the k candidates (the residual p - q covers the rest).
Quirks:
- the codebooks are stored as bare tensors (`candidate_selector.predecessor_codebook`, no `.weight`); a
  checkpoint that spells them with `.weight` loads too (engine/checkpoint.py);
- drafter logits are the target's bare LM head times `output_multiplier`, then the drafter's own soft-cap; the
  block is embedded as raw table rows times `input_embedding_scale`, 1 when absent, bypassing any embedding
  scale or norm of the target (drafter.py `draft_logits`, `embed_block`);
- under sampling the selector's q ignores top-k / top-p (upstream: temperature only).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from dflash_zoo.drafters import DFlash2Params
from dflash_zoo.engine.config import DraftConfig
from dflash_zoo.engine.drafter import DecoderLayer, DFlashDrafter, Span

if TYPE_CHECKING:
    from dflash_zoo.engine.sampling import Sampler


def shift(x: torch.Tensor, j: int, segment: torch.Tensor | None) -> torch.Tensor:
    """x [b, N, ...] -> y with y[:, t] = x[:, t - j] inside a block, else 0 (before slot 0, across blocks).

    segment: None (the N slots are one block) or the block id of each slot, [N] or [b, N].
    """
    if j == 0:
        return x
    n = x.shape[1]
    if j >= n:
        return torch.zeros_like(x)
    y = torch.cat([x.new_zeros(x.shape[0], j, *x.shape[2:]), x[:, : n - j]], dim=1)
    if segment is None:
        return y
    same = segment[..., j:] == segment[..., : n - j]  # [..., N - j]: slot t and t - j share a block
    keep = F.pad(same, (j, 0)).to(x.dtype)  # [N] or [b, N]
    keep = keep if keep.dim() == 2 else keep[None]  # [1 or b, N]
    return y * keep.reshape(*keep.shape, *([1] * (x.dim() - 2)))


class GroupedDynamicConv(nn.Module):
    """The convolution around one sublayer: K taps, static per-channel weights plus dynamic per-group ones."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group, self.groups = kernel, group, hidden // group
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * self.groups, bias=False)

    def convolve(self, x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, segment) -> torch.Tensor:
        """x [b, N, H], dyn [b, N, K, G] (coefficients of each output slot), base [K, H] -> [b, N, H]."""
        b, n, h = x.shape
        blocks = x.view(b, n, self.groups, self.group)  # [b, N, G, g]
        out = torch.zeros_like(blocks)
        for j in range(self.kernel):
            tap = shift(blocks, j, segment)  # [b, N, G, g]: slot t - j
            out = out + base[j].view(self.groups, self.group).to(x.dtype) * tap
            out = torch.addcmul(out, dyn[:, :, j, :, None], tap)
        return out.view(b, n, h)

    def prepare(self, x: torch.Tensor, segment=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input x [b, N, H] -> (its convolution, the coefficients for `finish` [b, N, K, G])."""
        dyn = self.kernel_projection(x).view(*x.shape[:2], 2, self.kernel, self.groups)
        return self.convolve(x, dyn[:, :, 0], self.base_kernel[0], segment), dyn[:, :, 1]

    def finish(self, out: torch.Tensor, dyn: torch.Tensor, segment=None) -> torch.Tensor:
        """The sublayer's output [b, N, H] convolved with the coefficients `prepare` computed from its input."""
        return self.convolve(out, dyn, self.base_kernel[1], segment)


class DFlash2Layer(DecoderLayer):
    """A DFlash layer whose attention and MLP each run inside a `GroupedDynamicConv`."""

    def __init__(self, cfg: DraftConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        p = cfg.dflash2
        self.attention_conv = GroupedDynamicConv(cfg.hidden_size, p.conv_kernel_size, p.conv_group_size)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, p.conv_kernel_size, p.conv_group_size)

    def forward(self, x, ctx, rope_q, rope_ctx, past, span: Span, attend=None):
        seg = span.q_segment
        h, dyn = self.attention_conv.prepare(self.input_layernorm(x), seg)
        attn, ctx_kv = self.self_attn(h, ctx, rope_q, rope_ctx, past, span, attend)
        x = x + self.attention_conv.finish(attn, dyn, seg)
        h, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(x), seg)
        return x + self.mlp_conv.finish(self.mlp(h), dyn, seg), ctx_kv


class CandidateSelector(nn.Module):
    """Re-ranks each slot's top-k drafter candidates with a low-rank transition score from the previous choice."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        p = cfg.dflash2
        self.top_k = p.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, p.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, p.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, p.selector_rank, bias=False)

    def candidates(self, h: torch.Tensor, logits: torch.Tensor):
        """h [n, H], logits [n, V] -> unary [n, k], candidates [n, k], their successor codes [n, k, r], and the
        slots' projected states [n, r]."""
        unary, cands = logits.topk(self.top_k, dim=-1)  # sorted: ties go to the lower id on every device
        return unary, cands, self.successor_codebook[cands], self.hidden_projection(h)

    def scores(self, prev: torch.Tensor, unary_t, succ_t, proj_t) -> torch.Tensor:
        """Slot t's candidate scores [k]: unary + <pred[prev] * proj(h_t), succ[cand]>; prev is a 0-d / [1] id."""
        code = self.predecessor_codebook[prev].reshape(-1) * proj_t  # [r]
        return unary_t + succ_t @ code.to(succ_t.dtype)  # [k]

    def walk(
        self,
        h: torch.Tensor,
        logits: torch.Tensor,
        anchor: torch.Tensor,
        temperature: float,
        gen: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Choose one candidate per slot, left to right. Returns (drafts [n], q over the candidates [n, k] or None
        when greedy, candidates [n, k]). No host sync: a static engine captures it as it is."""
        unary, cands, succ, proj = self.candidates(h, logits)
        race = race_for(cands, temperature, gen)
        prev, path, rows = anchor.reshape(1), [], []
        for t in range(cands.shape[0]):
            s = self.scores(prev, unary[t], succ[t], proj[t])  # [k]
            if race is not None:  # sampling: an exponential race on q = softmax(s / T) picks i with prob q_i
                q = torch.softmax(s.float() / temperature, dim=-1)  # [k]
                idx = (q / race[t]).argmax(-1, keepdim=True)  # [1]
                rows.append(q)
            else:
                idx = s.argmax(-1, keepdim=True)  # [1]
            prev = cands[t].index_select(0, idx)  # [1]
            path.append(prev)
        q = torch.stack(rows) if rows else None
        return torch.cat(path), q, cands


def race_for(cands: torch.Tensor, temperature: float, gen: torch.Generator | None) -> torch.Tensor | None:
    """The walk's random numbers under sampling, drawn at once [n, k] ~ Exp(1) (None when greedy), so the torch
    walk and its kernel (cuda/ops/dflash2.py) consume the same stream."""
    if temperature <= 0:
        return None
    race = torch.empty(cands.shape, dtype=torch.float32, device=cands.device).exponential_(generator=gen)
    return race.clamp_min_(torch.finfo(race.dtype).tiny)  # Exp(1) can round to 0


class DFlash2Drafter(DFlashDrafter):
    """A DFlash 2 draft model: `DFlash2Layer`s and a `CandidateSelector` (state-dict names as z-lab's)."""

    arch: ClassVar[str] = "dflash2"
    static_supported: ClassVar[bool] = True  # cuda/static/drafter2.py
    layer_class: ClassVar[type[nn.Module]] = DFlash2Layer
    has_selector: ClassVar[bool] = True
    raw_block_embedding: ClassVar[bool] = True  # upstream: raw rows times `input_embedding_scale` (default 1)

    def __init__(self, cfg: DraftConfig):
        if cfg.dflash2 is None:
            raise ValueError("DFlash2Drafter needs a config with DFlash 2 parameters")
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(cfg)
        self.use_selector = (
            True  # False: each slot's own argmax / sample, as DFlash ("eval" compares the two)
        )
        self.reset_dflash2_parts()

    @contextmanager
    def selector_off(self) -> Iterator[None]:
        """Propose as DFlash does (no selector) inside the block: the selector's effect on the same drafter."""
        self.use_selector = False
        try:
            yield
        finally:
            self.use_selector = True

    @torch.no_grad()
    def reset_dflash2_parts(self) -> None:
        """DFlash 2's own parts as a neutral start: each convolution the identity (tap 0 of the static kernel 1,
        no dynamic coefficients) and a selector that adds nothing (a zero predecessor codebook), while the
        successor codebook and the state projection start small and random so the transition score can learn
        (a bilinear score with both codebooks at zero would get no gradient)."""
        for layer in self.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0].fill_(1.0)
                conv.kernel_projection.weight.zero_()
        sel = self.candidate_selector
        sel.predecessor_codebook.zero_()
        sel.successor_codebook.normal_(0.0, 0.02)
        sel.hidden_projection.weight.normal_(0.0, 0.02)

    @classmethod
    def from_dflash(cls, drafter: DFlashDrafter, params: DFlash2Params) -> DFlash2Drafter:
        """The upgrade path: a DFlash 2 drafter whose layers, fc and norms are `drafter`'s and whose new parts
        start neutral, so its greedy proposals equal `drafter`'s until training moves them."""
        cfg = replace(drafter.cfg, arch="dflash2", dflash2=params)
        ref = next(drafter.parameters())
        model = cls(cfg).to(device=ref.device, dtype=ref.dtype)
        missing, unexpected = model.load_state_dict(drafter.state_dict(), strict=False)
        assert not unexpected and all("_conv." in k or "candidate_selector." in k for k in missing)
        return model

    def propose(
        self, h: torch.Tensor, anchor: torch.Tensor, head: Any, sampler: Sampler, gen: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h [n, H] slots 1..n, anchor [1] -> (drafts [n], q [n, V] or None): the selector's walk; under sampling
        q is the selector's distribution over each slot's candidates, zero elsewhere."""
        if not self.use_selector:
            return super().propose(h, anchor, head, sampler, gen)
        logits = self.draft_logits(h, head)  # [n, V]
        drafts, q_k, cands = self.candidate_selector.walk(h, logits, anchor, sampler.temperature, gen)
        if q_k is None:
            return drafts, None
        q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)  # [n, V]
        return drafts, q.scatter_(-1, cands, q_k)  # the k candidates are distinct ids: scatter, not add
