"""Token selection and the acceptance rules of the verify step.

Greedy (T = 0): accept the longest prefix of drafts equal to the target's argmax, then take the target's
argmax at the first mismatch (or after the last draft) as the bonus token. Output equals plain greedy decoding.

Sampling (T > 0): speculative sampling (Leviathan et al. 2023; Chen et al. 2023), the "p/q rejection" rule.
Draft slot i is sampled from the drafter's processed distribution q_i; the target's processed distribution
at the same slot is p_i. Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
sample the bonus from norm(max(p_i - q_i, 0)); if every draft is accepted, sample the bonus from p_k.
Each slot is sampled independently from its own q_i, which keeps the standard proof valid for parallel drafts,
so committed tokens are distributed exactly as the target's own sampling with the same settings.
"""

from __future__ import annotations

import torch


def processed_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities after temperature, top-k and top-p (nucleus) filtering."""
    x = logits.float() / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = (cum - sorted_x.softmax(-1)) >= top_p
        x = x.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return x.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[N, V] -> [N] sampled ids."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def accept_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [k], target_logits [k+1, V] -> (number accepted (0-d), bonus token (0-d)). No host sync."""
    target = target_logits.argmax(-1)  # [k+1]
    # accepted = length of the longest prefix where draft i equals the target's argmax at slot i
    na = torch.cumprod((drafts == target[:-1]).int(), dim=0).sum()
    return na, target[na]


def accept_rejection(
    drafts: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling. drafts [k] ~ q [k, V]; p [k+1, V] target probs -> (number accepted, bonus token)."""
    k = drafts.shape[0]
    if k == 0:  # nothing drafted (last token before max_new_tokens): plain sampling from p
        return torch.zeros((), dtype=torch.long), sample(p[:1], generator)[0]
    idx = torch.arange(k, device=drafts.device)
    p_d, q_d = p[idx, drafts], q[idx, drafts]  # [k]
    u = torch.rand(k, device=drafts.device, generator=generator)
    # accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); u * q < p avoids dividing by zero
    na = torch.cumprod((u * q_d < p_d).int(), dim=0).sum()
    if int(na) == k:
        return na, sample(p[k : k + 1], generator)[0]
    residual = (p[na] - q[na]).clamp_min(0)
    total = residual.sum()
    residual = residual / total if total > 0 else p[na]  # p == q at this slot: the residual is p itself
    return na, sample(residual[None], generator)[0]
