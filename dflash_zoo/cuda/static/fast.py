"""The fast engine: static KV buffers, fixed-shape steps, one CUDA graph per step and decoding mode.

It implements the same `Engine` interface as the eager engine (`engine/decode.py`), with the same stop,
truncation and step bookkeeping (`engine/run.py`) and the same acceptance rules (`engine/sampling.py`).
What differs from the eager loop, and why:
- the target runs through an own forward over its HF modules (norms, projections, MLP, rotary embedding)
  with pre-allocated K/V buffers, so a step has fixed shapes; rollback is only a position counter: rejected
  rows stay in the buffer, hidden by the mask, and the next verify overwrites them (Gated-DeltaNet layers'
  conv / recurrent states are moved past the committed rows on device, `StaticTarget.commit`);
- the drafter keeps its context K/V in a static buffer too; the block's own K/V are written just past the
  context (scratch that the next context append overwrites), so nothing is concatenated per step;
- one step = draft a block + verify it + accept + append the verified rows' features to the drafter context,
  all on device with tensor positions, captured as one CUDA graph per decoding mode (greedy, or sampling with
  its settings: random numbers come from the engine's generator, registered with each graph); the host reads
  back `na` and the tokens once per step (the only sync), which is also when they stream to the caller, with
  the next step already queued behind it where the run cannot end by length (`_pipelined`); taps are written
  straight into one [1, B, K*H] buffer;
- the whole block is always drafted and verified; near `max_new_tokens` only the slots that can still be
  committed count (`run.verify_width`), so steps match the eager engine's;
- the drafter always sees the full B verified rows; only the first na + 1 get valid positions below the new
  context length, the rest are masked and overwritten (no variable shapes).
- fewer kernels per step (target.py): fused q/k/v and gate/up weights, `F.rms_norm`, and optionally
  `torch.compile` (inductor, no cudagraphs) of the two step functions before capture; compile time is kept
  apart from capture time and from throughput (`compile_seconds`, `capture_seconds`). On CUDA with triton, the
  attention of every step and the one-row projections run our Triton kernels (cuda/ops/attention.py, gemv.py),
  measured fastest compiled or not, and so, uncompiled, does the elementwise work between GEMMs (fused.py);
  without triton, compiled one-row steps use explicit sums over key chunks (kernel_choice.py). One-row steps
  of sparse MoE blocks run their routed experts as one GEMV per chosen expert (moe.py).
Scope: batch 1, greedy or sampling, targets whose adapter declares a `static_layout` (with sparse MoE blocks
only where their experts implementation does not sync with the host when graphs are on); `engine/select.py`
sends everything else to the eager engine, and on CUDA also layouts not yet verified there unless asked.
graphs.py runs, compiles and captures the steps. On CPU the same static steps run without graphs; tests
compare them token for token with the eager engine (fp32).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dflash_zoo.cuda.static.drafter import StaticDrafter
from dflash_zoo.cuda.static.drafter2 import StaticDFlash2Drafter
from dflash_zoo.cuda.static.graphs import Steps, private_code
from dflash_zoo.cuda.static.kernel_choice import choose_kernels
from dflash_zoo.cuda.static.target import StaticTarget
from dflash_zoo.engine.decode import AR_RULE, sampler_of
from dflash_zoo.engine.options import FastOptions
from dflash_zoo.engine.results import GREEDY_RULE, SAMPLING_RULE, GenerationConfig
from dflash_zoo.engine.run import AcceptOverride, Engine, Generation, Run, verify_width
from dflash_zoo.engine.sampling import Sampler, seed_generator
from dflash_zoo.engine.static_support import drafter_reason, unsupported_reason

if TYPE_CHECKING:
    from dflash_zoo.adapters.base import TargetAdapter
    from dflash_zoo.engine.drafter import DFlashDrafter

log = logging.getLogger("dflash_zoo")
# inductor settings of compiled steps: with coordinate descent tuning, inductor lowers batch-1 matmuls (every
# GEMV of an autoregressive step) to Triton reductions it tunes, in place of cuBLAS (docs/performance.md)
COMPILE_OPTIONS: dict[str, Any] = {"coordinate_descent_tuning": True}


# the static drafter of each drafter architecture (dflash_zoo/drafters)
STATIC_DRAFTERS: dict[str, type[StaticDrafter]] = {"dflash": StaticDrafter, "dflash2": StaticDFlash2Drafter}


class FastEngine(Engine):
    """Static buffers + captured steps for one (target, drafter) pair; reusable across prompts. Built by
    `engine/factory.py: build_engine`, which also says when this engine cannot run a pair.

    Args:
        adapter / drafter / mask_token_id: the pair and the drafter's mask token.
        max_len: longest prompt + new tokens this engine will see (a block of slack is added).
        options: how it runs (`FastOptions`: graphs, compile, fusion, kernels, tuning); the kernels left to the
            engine are chosen for the device (`kernel_choice.choose_kernels`, resolved in `kernels`).
        block_size: verify block (default and maximum: the drafter's trained block size).
    """

    name: ClassVar[str] = "fast"

    def __init__(
        self,
        adapter: TargetAdapter,
        drafter: DFlashDrafter,
        mask_token_id: int,
        max_len: int,
        options: FastOptions = FastOptions(),
        block_size: int | None = None,
    ):
        self.device = next(adapter.layers()[0].parameters()).device
        self.options = options
        self.graphs = self.device.type == "cuda" if options.graphs is None else options.graphs
        reason = unsupported_reason(adapter, graphs=self.graphs) or drafter_reason(drafter)
        if reason:
            raise ValueError(reason)
        if self.graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the target is on {self.device}")
        self.adapter, self.drafter, self.mask_id = adapter, drafter, mask_token_id
        self.block = GenerationConfig(block_size=block_size).validated(drafter.cfg.block_size).block_size
        size = -(-(max_len + 2 * self.block) // 64) * 64  # multiple of 64: aligned rows for the masked kernel
        self.max_len, self.size = max_len, size
        self.kernels = choose_kernels(self.device, options)
        self.target = StaticTarget(
            adapter, size, drafter.cfg.target_layer_ids, options, self.kernels, self.block
        )
        self.sdraft = STATIC_DRAFTERS[drafter.arch](drafter, size, options, self.kernels)
        self._state_tensors(drafter, adapter, mask_token_id)
        self.compile_options = dict(
            COMPILE_OPTIONS if options.compile_options is None else options.compile_options
        )
        compiled = self.compile_options if options.compile else None  # steps compile lazily, on first use
        self.steps = Steps([self.pos, self.bonus, *self.target.states()], self.gen, self.graphs, compiled)

    def _state_tensors(self, drafter: DFlashDrafter, adapter: TargetAdapter, mask_token_id: int) -> None:
        """The tensors a step reads and writes in place, so that a captured graph replays it with no host work."""
        dev, b = self.device, self.block
        self.pos = torch.zeros((), dtype=torch.long, device=dev)  # committed tokens in the target cache
        self.bonus = torch.zeros(1, dtype=torch.long, device=dev)  # last committed token, not yet verified
        self.force = torch.full((), -1, dtype=torch.long, device=dev)  # what-if: forced accepted count
        self.blk = torch.full((1, b), mask_token_id, dtype=torch.long, device=dev)
        width = len(drafter.cfg.target_layer_ids) * adapter.text_config.hidden_size
        self.vtaps = torch.zeros(1, b, width, device=dev, dtype=self.target.dtype)
        self.out = torch.zeros(b + 1, dtype=torch.long, device=dev)  # [na, drafts (b-1), next]
        self.gen = torch.Generator(device=dev)  # sampling only; seeded per generation

    @property
    def compile(self) -> bool:
        return self.options.compile

    @property
    def capture_seconds(self) -> float:
        return self.steps.capture_seconds

    @property
    def compile_seconds(self) -> float:
        return self.steps.compile_seconds

    # ---- the fixed-shape steps (one CUDA graph each per decoding mode) -------------------------------
    def _drafter(self) -> torch.Tensor:
        """The drafter's forward over the block [bonus, mask, ...] -> its final states [1, B, H]."""
        self.blk[:, :1].copy_(self.bonus[None])
        return self.sdraft.draft(self.drafter.embed_block(self.blk, self.adapter), self.pos)

    def _draft(self, sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafter's part of a step: drafts [B-1] and their distribution (None when greedy)."""
        h = self._drafter()  # [1, B, H]
        # the architecture's proposal rule (DFlash: argmax / sample of each slot; DFlash 2: its selector)
        return self.sdraft.propose(
            h[0, 1:].to(self.vtaps.dtype), self.bonus, self.adapter.head, sampler, self.gen
        )

    def _draft_step(self, sampler: Sampler) -> None:
        """The drafter's part alone, as a step of its own (`replays`, for profiling)."""
        self.out[1 : self.block].copy_(self._draft(sampler)[0])

    def _drafter_step(self, sampler: Sampler) -> None:
        """The drafter's forward alone, without the draft logits (`replays`, for profiling)."""
        self._drafter()

    def _spec_step(self, sampler: Sampler) -> None:
        b = self.block
        drafts, q = self._draft(sampler)
        verify = torch.cat([self.bonus, drafts])[None]  # [1, B]
        logits = self.target.forward(verify, self.pos, self.vtaps)[0]  # [B, V]
        na, nxt = sampler.accept(drafts, q, logits, self.gen, self.force)  # 0-d, [1]
        self.target.commit(na + 1)  # GDN states move past the committed rows (attention: nothing to do)
        self.sdraft.append(self.vtaps, self.pos)  # rows past na + 1 are masked, then overwritten
        self.out[0].copy_(na)
        self.out[1:b].copy_(drafts)
        self.out[b:].copy_(nxt)
        self.pos.add_(na + 1)
        self.bonus.copy_(nxt)

    def _ar_step(self, sampler: Sampler) -> None:
        logits = self.target.forward(self.bonus[None], self.pos)  # [1, 1, V]
        self.bonus.copy_(sampler.pick(logits[0], self.gen))
        self.out[:1].copy_(self.bonus)
        self.pos.add_(1)

    def _run_step(self, name: str, sampler: Sampler) -> None:
        fn = getattr(self, f"_{name}_step")  # _spec_step, _ar_step, _draft_step, _drafter_step
        fn = private_code(fn) if self.compile else fn  # compiled: a dynamo cache of this engine's own
        # one graph per step kind, decoding mode and proposal rule (eval switches a DFlash 2 selector off)
        key, build = (name, sampler, self.drafter.use_selector), lambda: partial(fn, sampler)
        # dependent launches in one-row steps only: an 8B shape's AR step 5% faster, blocks none (an early
        # start of a 16-row step's kernels cost 16%; one H100, docs/performance.md)
        self.steps.run(key, build, dependent=self.kernels.dependent_launch and name == "ar")

    def replays(self, prompt_ids: list[int], cfg: GenerationConfig, step: str) -> Callable[[int], None]:
        """For profiling: after a prefill of `prompt_ids`, a function that runs `step` n times back to back
        with no host work in between (graph replays on CUDA). `step`: "spec", "ar", "draft" (the drafter's
        part of a spec step alone: its forward, the draft logits and the drafts) or "drafter" (its forward
        alone). Spec steps accept nothing, so each advances one position; the prompt plus
        n must fit the engine's buffers."""
        cfg = self._fit(prompt_ids, cfg)
        sampler = sampler_of(cfg)
        with torch.inference_mode():
            self._prefill(prompt_ids, taps=step != "ar", sampler=sampler)
            self.force.fill_(0)
            self._run_step(step, sampler)  # built and captured here, not in the timed replays
            self.force.fill_(-1)

        def run(n: int) -> None:
            if int(self.pos) + n + self.block > self.size:
                raise ValueError(f"{n} more replays do not fit this engine's buffers")
            self.force.fill_(0)
            with torch.inference_mode():
                for _ in range(n):
                    self._run_step(step, sampler)
            self.force.fill_(-1)

        return run

    # ---- whole generations ---------------------------------------------------------------------------
    def _speculative(self, prompt_ids, cfg, accept_override, prefill_inputs) -> Generation:
        if prefill_inputs:
            raise ValueError(
                "the fast engine takes token prompts only (image inputs run on the eager engine)"
            )
        cfg = self._fit(prompt_ids, cfg)
        run = Run(cfg, len(prompt_ids), GREEDY_RULE if cfg.greedy else SAMPLING_RULE, self.block)
        return Generation(run, self._spec_steps(prompt_ids, run, accept_override))

    def _autoregressive(self, prompt_ids, cfg) -> Generation:
        cfg = self._fit(prompt_ids, cfg)
        run = Run(cfg, len(prompt_ids), AR_RULE)
        return Generation(run, self._ar_steps(prompt_ids, run))

    def _fit(self, prompt_ids: list[int], cfg: GenerationConfig) -> GenerationConfig:
        """The validated config, checked against this engine's block and buffers; seeds the generator."""
        cfg = cfg.validated(self.block)
        if cfg.block_size != self.block:
            raise ValueError(f"this engine verifies blocks of {self.block}, not {cfg.block_size}")
        if len(prompt_ids) + cfg.max_new_tokens + self.block > self.size:
            raise ValueError(
                f"{len(prompt_ids)} prompt + {cfg.max_new_tokens} new tokens do not fit this engine "
                f"(max_len {self.max_len})"
            )
        if not cfg.greedy:  # greedy steps draw no random numbers
            seed_generator(self.gen, cfg.seed)
        return cfg

    def _prefill(self, prompt_ids: list[int], taps: bool, sampler: Sampler) -> int:
        ids = torch.tensor([prompt_ids], device=self.device)
        feats = None
        if taps:
            feats = torch.empty(
                1, len(prompt_ids), self.vtaps.shape[-1], device=self.device, dtype=self.vtaps.dtype
            )
        self.pos.zero_()
        logits = self.target.forward(ids, self.pos, feats, prefill=True, last_only=True)
        self.bonus.copy_(sampler.pick(logits[0, -1:], self.gen))
        if taps:
            self.sdraft.append(feats, self.pos)
        self.pos.fill_(len(prompt_ids))
        return int(self.bonus)  # sync: the first token is out

    def _spec_steps(
        self, prompt_ids: list[int], run: Run, override: AcceptOverride | None
    ) -> Iterator[list[int]]:
        sampler, b = sampler_of(run.cfg), self.block
        with torch.inference_mode():
            yield run.first(self._prefill(prompt_ids, taps=True, sampler=sampler))
            self.force.fill_(-1)  # no override: stays -1 (one write per generation, not per step)
            forced = None if override is None else lambda i: self.force.fill_(override(i, b - 1))
            for row in self._pipelined("spec", sampler, run, b + 1, b, forced):  # [na, drafts (B-1), next]
                na = row[0]
                # the whole block was verified; near max_new_tokens only the first v slots can be committed
                v = verify_width(b, run.room)
                yield run.step(row[1:v], na, row[1 : 1 + na] + [row[-1]])

    def _ar_steps(self, prompt_ids: list[int], run: Run) -> Iterator[list[int]]:
        sampler = sampler_of(run.cfg)
        with torch.inference_mode():
            yield run.first(self._prefill(prompt_ids, taps=False, sampler=sampler))
            for row in self._pipelined("ar", sampler, run, 1, 1):
                yield run.token(row[0])

    def _pipelined(
        self, name: str, sampler: Sampler, run: Run, width: int, most: int, before: Callable | None = None
    ) -> Iterator[list[int]]:
        """The first `width` slots of `self.out` after each step `name` until `run` is done, one host sync per
        step. Where the run cannot end with a step by length (more room than the `most` tokens it commits), its
        successor is launched before the host waits for it, so the GPU does not idle through the host's turn
        (a stop token then leaves one step's work unread: the next generation's prefill starts over).
        `before(i)`: called before step i is launched (the what-if override's accept count)."""
        cuda = self.device.type == "cuda"
        host = torch.empty(width, dtype=torch.long, pin_memory=cuda)
        ready = torch.cuda.Event() if cuda else None  # recorded anew each step
        i, launched = 0, False
        while not run.done:
            if not launched:
                self._launch(name, sampler, i, before)
            host.copy_(self.out[:width], non_blocking=True)  # read (below) before the next copy is queued
            if ready is not None:
                ready.record()
            launched = run.room > most
            if launched:  # stream order: it overwrites `self.out` after the copy above
                self._launch(name, sampler, i + 1, before)
            if ready is not None:
                ready.synchronize()  # the one host sync per step
            yield host.tolist()
            i += 1

    def _launch(self, name: str, sampler: Sampler, i: int, before: Callable | None) -> None:
        if before is not None:
            before(i)
        self._run_step(name, sampler)
