"""Token selection and the acceptance rules of the verify step, shared by every engine.

Greedy (T = 0): accept the longest prefix of drafts equal to the target's argmax, then take the target's
argmax at the first mismatch (or after the last draft) as the bonus token. Output equals plain greedy decoding.

Sampling (T > 0): speculative sampling (Leviathan et al. 2023; Chen et al. 2023), the "p/q rejection" rule.
Draft slot i is sampled from the drafter's processed distribution q_i; the target's processed distribution
at the same slot is p_i. Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
sample the bonus from norm(max(p_i - q_i, 0)); if every draft is accepted, sample the bonus from p_k.
Each slot is sampled independently from its own q_i, which keeps the standard proof valid for parallel drafts,
so committed tokens are distributed exactly as the target's own sampling with the same settings.

Nothing here syncs with the host, so the static engine runs the same code inside a captured CUDA graph:
sampling uses the exponential race (argmax of p / E with E ~ Exp(1) picks i with probability p_i) instead of
`torch.multinomial`, and every random number comes from the caller's `torch.Generator`, never the global one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim as max, exp and sum: each a kernel that spreads a long row over many thread
    blocks (torch's fused softmax gives a row one block: 16 rows of a 152k vocabulary use 16 SMs)."""
    e = (x - x.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def _kernels_run(device: torch.device) -> bool:
    from dflash_zoo.cuda.ops.runtime import available

    return available(device) is None


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] probabilities -> top-p filtered and renormalised: keep token i when the mass of the tokens
    strictly more probable than i is below top_p (the top token always stays; ties stay or go together).
    On CUDA without a sort (`cuda/ops/nucleus.py`: a kernel op, below this module in the import layers, loaded
    only on CUDA); elsewhere from the sorted probabilities."""
    flat = probs.reshape(-1, probs.shape[-1])
    if flat.is_cuda and _kernels_run(flat.device):
        from dflash_zoo.cuda.ops.nucleus import nucleus_mask

        kept = nucleus_mask(flat.float(), top_p)
    else:
        ordered = torch.sort(flat, dim=-1, descending=True).values
        # the mass before each sorted slot; a tie's first slot has the mass strictly above the tied value
        before = ordered.cumsum(-1) - ordered
        # the last slot whose mass before is below top_p: its value and every larger or equal one are kept
        last = (before < top_p).sum(-1, keepdim=True) - 1
        kept = flat.masked_fill(flat < ordered.gather(-1, last), 0.0)
    return (kept / kept.sum(-1, keepdim=True)).view(probs.shape)


def processed_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities after temperature, top-k and top-p (nucleus) filtering."""
    x = logits.float() / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = _softmax(x)
    return nucleus(probs, top_p) if top_p < 1.0 else probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[N, V] probabilities -> [N] sampled ids, with no host sync (exponential race)."""
    race = torch.empty_like(probs).exponential_(generator=generator)  # [N, V] ~ Exp(1)
    # Exp(1) can round to 0; a zero would turn p / 0 into inf or nan and pick an impossible token
    return (probs / race.clamp_min_(torch.finfo(race.dtype).tiny)).argmax(-1)


def _forced(na: torch.Tensor, force: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What-if mode: `force` >= 0 replaces the accepted count (clamped to k drafts); -1 keeps the real one."""
    if force is None:
        return na, None
    on = force >= 0
    return torch.where(on, force.clamp(max=k), na), on


def accept_greedy(
    drafts: torch.Tensor, target_logits: torch.Tensor, force: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [k], target_logits [k+1, V] -> (accepted count (0-d long), next token [1])."""
    target = target_logits.argmax(-1)  # [k+1]
    # accepted = length of the longest prefix where draft i equals the target's argmax at slot i
    na = torch.cumprod((drafts == target[:-1]).long(), dim=0).sum()
    na, _ = _forced(na, force, drafts.shape[0])
    return na, target.index_select(0, na.view(1))


def accept_rejection(
    drafts: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None,
    force: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling. drafts [k] ~ q [k, V]; p [k+1, V] target probs -> (accepted count, next [1])."""
    k = drafts.shape[0]
    idx = torch.arange(k, device=drafts.device)
    p_d, q_d = p[idx, drafts], q[idx, drafts]  # [k]
    u = torch.rand(k, device=p.device, generator=generator)
    # accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); u * q < p avoids dividing by zero
    na = torch.cumprod((u * q_d < p_d).long(), dim=0).sum()
    na, forced = _forced(na, force, k)
    p_na = p.index_select(0, na.view(1))  # [1, V]
    # slot k has no draft (q = 0 there), so its "residual" is p_k itself: one formula for every slot
    q_na = torch.cat([q, q.new_zeros(1, q.shape[-1])]).index_select(0, na.view(1))
    residual = (p_na - q_na).clamp_min(0)
    total = residual.sum()
    # p == q at this slot leaves no residual mass: the residual is p itself
    dist = torch.where(total > 0, residual / total.clamp_min(1e-30), p_na)
    if forced is not None:  # a forced stop is no rejection: the next token is the target's own sample
        dist = torch.where(forced, p_na, dist)
    return na, sample(dist, generator)


@dataclass(frozen=True)
class Sampler:
    """One decoding mode (greedy or sampling with its filters) for drafts, verify and plain steps alike."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return processed_probs(logits, self.temperature, self.top_k, self.top_p)

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """[N, V] -> [N]: argmax, or a sample of the processed distribution."""
        return logits.argmax(-1) if self.greedy else sample(self.probs(logits), generator)

    def propose(
        self, draft_logits: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[k, V] drafter logits -> (drafts [k], their distribution q [k, V], or None when greedy)."""
        if self.greedy:
            return draft_logits.argmax(-1), None
        q = self.probs(draft_logits)
        return sample(q, generator), q

    def accept(
        self,
        drafts: torch.Tensor,
        q: torch.Tensor | None,
        target_logits: torch.Tensor,
        generator: torch.Generator | None,
        force: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """drafts [k], target logits [k+1, V] -> (accepted count (0-d), next token [1]); no host sync."""
        if self.greedy:
            return accept_greedy(drafts, target_logits, force)
        return accept_rejection(drafts, q, self.probs(target_logits), generator, force)


def seed_generator(gen: torch.Generator, seed: int | None) -> torch.Generator:
    """Seed `gen` with `seed`, or with a fresh random seed for None; the global RNG stream is never touched."""
    if seed is None:
        gen.seed()  # seeds this generator alone from the OS
    else:
        gen.manual_seed(seed)
    return gen


def new_generator(device: torch.device | str, seed: int | None) -> torch.Generator:
    """A private generator for one generation (`seed_generator`)."""
    return seed_generator(torch.Generator(device=device), seed)
