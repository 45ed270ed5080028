"""A DFlash drafter with a reduced draft vocabulary (speculators `draft_vocab_size` < the target's, `d2t`).

Such a drafter has a head of its own, `lm_head: H -> Vd` (speculators fills it with the target head's rows that
`t2d` selects), and `d2t [Vd]` maps draft id d to target id d + d2t[d] (the EAGLE-3 convention vLLM and
speculators share). Its drafter logits are the head's, placed at their target ids of a full-vocabulary row
that is -inf elsewhere: the greedy proposal is the draft argmax mapped through `d2t` (an exact tie goes to the
lower target id, the lower draft id too where the map increases, as speculators builds it), and a sampled q is
zero outside the draft vocabulary, which speculative sampling covers through the residual. The static engine projects through the target's head,
so these drafters run on the eager engine (`static_supported`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from dflash_zoo.engine.drafter import DFlashDrafter


class ReducedVocabDrafter(DFlashDrafter):
    """A DFlash drafter whose logits come from its own head over a subset of the target's vocabulary."""

    arch: ClassVar[str] = "dflash (reduced draft vocabulary)"
    static_supported: ClassVar[bool] = False

    def __init__(self, cfg: Any):
        if not cfg.draft_vocab_size:
            raise ValueError("ReducedVocabDrafter needs a config with draft_vocab_size")
        super().__init__(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    def draft_logits(self, h: torch.Tensor, head: Any) -> torch.Tensor:
        """[..., H] final states -> [..., V]: the own head's [..., Vd] logits at their target ids, -inf elsewhere
        (`head`, the target's, is not used), then the config's multiplier and soft-cap as for any drafter."""
        x = self.lm_head(h)  # [..., Vd]
        if self.cfg.output_multiplier != 1.0:
            x = x * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        x = torch.tanh(x / cap) * cap if cap else x
        full = x.new_full((*x.shape[:-1], self.cfg.vocab_size), float("-inf"))  # [..., V]
        ids = torch.arange(x.shape[-1], device=x.device) + self.d2t  # [Vd] target ids
        return full.index_copy(-1, ids, x)


def build(cfg: Any) -> DFlashDrafter:
    """The drafter module a config needs: the reduced-vocabulary one, or its architecture's (dflash_zoo/drafters)."""
    from dflash_zoo import drafters

    return ReducedVocabDrafter(cfg) if cfg.draft_vocab_size else drafters.build(cfg)
