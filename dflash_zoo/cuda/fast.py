"""Fast decode path: static KV buffers, fixed-shape steps, one CUDA graph per step (decode.py stays the reference).

What differs from the eager loop (`decode.SpeculativeDecoder`), and why:
- the target runs through an own forward over its HF modules (norms, projections, MLP, rotary embedding)
  with pre-allocated K/V buffers, so a step has fixed shapes; rollback is only a position counter: rejected
  rows stay in the buffer, hidden by the mask, and the next verify overwrites them;
- the drafter keeps its context K/V in a static buffer too; the block's own K/V are written just past the
  context (scratch that the next context append overwrites), so nothing is concatenated per step;
- one step = draft a block + verify it + accept + append the verified rows' features to the drafter context,
  all on device with tensor positions, captured as one CUDA graph; the host reads back `na` and the tokens
  once per step (the only sync); taps are written straight into one [1, B, K*H] buffer;
- the drafter always sees the full B verified rows; only the first na + 1 get valid positions below the new
  context length, the rest are masked and overwritten (no variable shapes).
- fewer kernels per step (static.py): fused q/k/v and gate/up weights, `F.rms_norm`, and optionally
  `torch.compile` (inductor, no cudagraphs) of the two step functions before capture; compile time is kept
  apart from capture time and from throughput (`compile_seconds`, `capture_seconds`). On CUDA with triton, the
  attention of every step and the one-row o/down projections run our Triton kernels (kernels.py), measured
  fastest compiled or not, and so, uncompiled, does the elementwise work between GEMMs (fused_ops.py);
  without triton, compiled one-row steps use explicit sums over key chunks.
Scope: greedy decoding, batch 1, full-attention targets whose adapter sets `static_qk_norm` (dense, or sparse MoE
blocks whose experts implementation does not sync with the host when graphs are on). Everything else uses decode.py.
On CPU the same static path runs without graphs; tests compare it token for token with decode.py (fp32).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from dflash_zoo.cuda import kernels
from dflash_zoo.cuda.static import (
    BLOCK_ATTENTION,
    DECODE_ATTENTION,
    StaticDrafter,
    StaticTarget,
    unsupported_reason,
)
from dflash_zoo.engine.decode import AcceptOverride, _truncate
from dflash_zoo.engine.results import GREEDY_RULE, GenerationConfig, GenerationResult, StepRecord

log = logging.getLogger("dflash_zoo")
# inductor settings of compiled steps: with coordinate descent tuning, inductor lowers batch-1 matmuls (every
# GEMV of an autoregressive step) to Triton reductions it tunes, in place of cuBLAS (docs/perf-notes.md, Version 3)
COMPILE_OPTIONS: dict[str, Any] = {"coordinate_descent_tuning": True}
# without the Triton kernels (no triton), compiled 8B-shape AR step on one H200 host: "chunks" 187 tok/s,
# "sums" 173; SDPA lost to sums (perf-notes)
COMPILED_DECODE_ATTENTION = "chunks"


def _kernel_choice(
    device, compile: bool, decode: str | None, block: str | None, gemv: bool | None, fused: bool | None
):
    """`FastEngine`'s (decode_attention, block_attention, gemv, fused_ops): defaults filled in, then checked.

    `DFLASH_ZOO_KERNELS=0` turns the Triton kernels off by default (an escape hatch; explicit choices stand).
    """
    why = kernels.available(device)  # None: the kernels can run here
    wanted = os.environ.get("DFLASH_ZOO_KERNELS", "1") != "0"
    triton_ok = wanted and device.type == "cuda" and why is None
    if decode is None:
        decode = "split" if triton_ok else COMPILED_DECODE_ATTENTION if compile else "sdpa"
    block = block or ("split" if triton_ok else "sdpa")
    gemv = triton_ok if gemv is None else gemv
    # compiled, inductor fuses those ops itself; the kernels were measured uncompiled only
    fused = triton_ok and not compile if fused is None else fused
    for what, name, table in [("decode", decode, DECODE_ATTENTION), ("block", block, BLOCK_ATTENTION)]:
        if name not in table:
            raise ValueError(f"{what}_attention must be one of {sorted(table)}, not {name!r}")
        if name == "split" and why:
            raise ValueError(f"{what}_attention='split': {why}")
    for name, on in [("gemv", gemv), ("fused_ops", fused)]:
        if on and why:
            raise ValueError(f"{name}: {why}")
    return decode, block, gemv, fused


class FastEngine:
    """Static buffers + captured steps for one (target, drafter) pair; reusable across prompts.

    Args:
        max_len: longest prompt + new tokens this engine will see (a block of slack is added).
        graphs: capture CUDA graphs (default: on for CUDA). False runs the same static steps eagerly.
        block_size: verify block (default and maximum: the drafter's trained block size).
        fuse: one GEMM for q/k/v and one for gate/up; the modules' weights become views of the fused
            tensors (no extra memory; the HF forward and the drafter's checkpoint names are unchanged).
        fast_norm: RMSNorm through `F.rms_norm` (same numerics as HF's formula; fewer kernels).
        compile: `torch.compile` the two step functions (inductor, no dynamic shapes, no inductor cudagraphs:
            graphs are captured here) with `compile_options` (default `COMPILE_OPTIONS`).
        decode_attention: attention of the autoregressive step (`static.DECODE_ATTENTION`): "split" is the
            Triton kernel of kernels.py (CUDA only); "sums" and "chunks" are fast only when compiled.
        block_attention: attention of the verify and draft steps (`static.BLOCK_ATTENTION`).
        gemv: the autoregressive step's o and down projections through the split-K Triton GEMV of kernels.py.
        fused_ops: the elementwise work between GEMMs (q/k norm + rotary + K/V writes, RMSNorms, SwiGLU
            products) through the Triton kernels of fused_ops.py.
        Defaults: on CUDA with triton, "split", "split", True (measured fastest compiled and not, perf-notes
        session 12) and True uncompiled (session 13); otherwise `COMPILED_DECODE_ATTENTION` when compiling,
        else "sdpa"; "sdpa"; False; False.
    """

    def __init__(
        self,
        adapter,
        drafter,
        mask_token_id: int,
        max_len: int,
        graphs: bool | None = None,
        block_size: int | None = None,
        fuse: bool = True,
        fast_norm: bool = True,
        compile: bool = False,  # shadows the builtin in __init__ only: the public name of the flag
        compile_options: dict[str, Any] | None = None,
        decode_attention: str | None = None,
        block_attention: str | None = None,
        gemv: bool | None = None,
        fused_ops: bool | None = None,
    ):
        self.device = next(adapter.layers()[0].parameters()).device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        reason = unsupported_reason(adapter, graphs=self.graphs)
        if reason:
            raise ValueError(reason)
        self.adapter, self.drafter, self.mask_id = adapter, drafter, mask_token_id
        self.block = GenerationConfig(block_size=block_size).validated(drafter.cfg.block_size).block_size
        size = -(-(max_len + 2 * self.block) // 64) * 64  # multiple of 64: aligned rows for the masked kernel
        self.max_len, self.size = max_len, size
        kinds = _kernel_choice(self.device, compile, decode_attention, block_attention, gemv, fused_ops)
        self.decode_attention, self.block_attention, self.gemv, self.fused_ops = kinds
        self.target = StaticTarget(adapter, size, drafter.cfg.target_layer_ids, fuse, fast_norm, *kinds)
        self.sdraft = StaticDrafter(drafter, size, fuse, fast_norm, self.block_attention, self.fused_ops)
        dev, b = self.device, self.block
        self.pos = torch.zeros((), dtype=torch.long, device=dev)  # committed tokens in the target cache
        self.bonus = torch.zeros(1, dtype=torch.long, device=dev)  # last committed token, not yet verified
        self.force = torch.full((), -1, dtype=torch.long, device=dev)  # what-if: forced accepted count
        self.blk = torch.full((1, b), mask_token_id, dtype=torch.long, device=dev)
        width = len(drafter.cfg.target_layer_ids) * adapter.text_config.hidden_size
        self.vtaps = torch.zeros(1, b, width, device=dev, dtype=self.target.k[0].dtype)
        self.out = torch.zeros(b + 1, dtype=torch.long, device=dev)  # [na, drafts (b-1), next]
        self._graph: dict[str, Any] = {}
        self._steps = {"spec": self._spec_step, "ar": self._ar_step}
        self.compile_options = dict(COMPILE_OPTIONS if compile_options is None else compile_options)
        if compile:  # compiled lazily on the first call (`_warm`), which is timed as compile_seconds
            opts = dict(options=self.compile_options, fullgraph=False, dynamic=False)
            self._steps = {name: torch.compile(fn, **opts) for name, fn in self._steps.items()}
        self.compile, self._warmed = compile, set()
        self.capture_seconds = self.compile_seconds = 0.0

    # ---- the fixed-shape steps ---------------------------------------------------------------
    def _spec_step(self) -> None:
        b, emb_of = self.block, self.adapter.embed
        self.blk[:, :1].copy_(self.bonus[None])
        h = self.sdraft.draft(emb_of(self.blk), self.pos)  # [1, B, H]
        drafts = self.adapter.logits(h[0, 1:].to(self.vtaps.dtype)).argmax(-1)  # [B-1]
        verify = torch.cat([self.bonus, drafts])[None]  # [1, B]
        target = self.target.forward(emb_of(verify), self.pos, self.vtaps)[0].argmax(-1)  # [B]
        # greedy match: accepted = longest prefix where draft i equals the target's argmax at slot i
        na = torch.cumprod((drafts == target[:-1]).long(), 0).sum()
        na = torch.where(self.force >= 0, self.force.clamp(max=b - 1), na)
        nxt = target.index_select(0, na.view(1))  # [1]
        self.sdraft.append(self.vtaps, self.pos)  # rows past na + 1 are masked, then overwritten
        self.out[0].copy_(na)
        self.out[1:b].copy_(drafts)
        self.out[b:].copy_(nxt)
        self.pos.add_(na + 1)
        self.bonus.copy_(nxt)

    def _ar_step(self) -> None:
        logits = self.target.forward(self.adapter.embed(self.bonus[None]), self.pos)  # [1, 1, V]
        self.bonus.copy_(logits[0].argmax(-1))
        self.out[:1].copy_(self.bonus)
        self.pos.add_(1)

    def _run_step(self, name: str) -> None:
        fn = self._steps[name]
        if self.compile and name not in self._warmed:
            self._warm(fn)
            self._warmed.add(name)
        if not self.graphs:
            fn()
        else:
            if name not in self._graph:
                self._graph[name] = self._capture(fn)
            self._graph[name].replay()

    def _rewind(self) -> Callable[[], None]:
        """A function that puts pos and bonus back as they are now, for steps run only to warm or capture.

        K/V rows such a step writes lie at or past pos: scratch that the real step overwrites.
        """
        pos, bonus = self.pos.clone(), self.bonus.clone()

        def rewind() -> None:
            self.pos.copy_(pos)
            self.bonus.copy_(bonus)

        return rewind

    def _warm(self, fn) -> None:
        """First call of a compiled step (this is when it compiles), state restored after; timed on its own."""
        t0 = time.perf_counter()
        rewind = self._rewind()
        fn()
        rewind()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.compile_seconds += time.perf_counter() - t0

    def _capture(self, fn) -> Any:
        """Warm up on a side stream (state restored after each call), then capture one step."""
        t0 = time.perf_counter()
        rewind = self._rewind()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
                rewind()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        rewind()
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - t0
        return graph

    # ---- whole generations -------------------------------------------------------------------
    def _prefill(self, prompt_ids: list[int], taps: bool) -> int:
        if len(prompt_ids) + self.block > self.size or not prompt_ids:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens does not fit this engine (max_len {self.max_len})"
            )
        ids = torch.tensor([prompt_ids], device=self.device)
        feats = None
        if taps:
            feats = torch.empty(
                1, len(prompt_ids), self.vtaps.shape[-1], device=self.device, dtype=self.vtaps.dtype
            )
        self.pos.zero_()
        logits = self.target.forward(self.adapter.embed(ids), self.pos, feats, prefill=True, last_only=True)
        self.bonus.copy_(logits[0, -1:].argmax(-1))
        if taps:
            self.sdraft.append(feats, self.pos)
        self.pos.fill_(len(prompt_ids))
        return int(self.bonus)  # sync: the first token is out

    def speculative(
        self, prompt_ids: list[int], cfg: GenerationConfig, accept_override: AcceptOverride | None = None
    ):
        """Greedy DFlash decoding; same tokens and result type as `decode.SpeculativeDecoder`."""
        cfg = cfg.validated(self.block)
        if not cfg.greedy or cfg.block_size != self.block:
            raise ValueError("the fast path runs greedy decoding at the drafter's own block size")
        res = GenerationResult([], "", len(prompt_ids), acceptance_rule=GREEDY_RULE, block_size=self.block)
        stops, host = (
            set(cfg.stop_token_ids),
            torch.zeros(self.block + 1, dtype=torch.long, pin_memory=self._pin()),
        )
        with torch.inference_mode():
            t0 = time.perf_counter()
            first = self._prefill(prompt_ids, taps=True)
            res.prefill_seconds = time.perf_counter() - t0
            t1 = time.perf_counter()
            res.output_ids, reason = _truncate([first], stops, cfg.max_new_tokens)
            self.force.fill_(-1)  # no override: stays -1 (one write per generation, not per step)
            while reason is None:
                room = cfg.max_new_tokens - len(res.output_ids)
                if accept_override is not None:
                    self.force.fill_(accept_override(len(res.steps), self.block - 1))
                self._run_step("spec")
                host.copy_(self.out, non_blocking=True)
                if self.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()  # the one host sync per step
                na, row = int(host[0]), host.tolist()
                committed, reason = _truncate(row[1 : 1 + na] + [row[-1]], stops, room)
                res.steps.append(StepRecord(row[1 : self.block], na, len(committed)))
                res.output_ids += committed
            res.decode_seconds = time.perf_counter() - t1
        res.stop_reason = reason
        return res

    def autoregressive(self, prompt_ids: list[int], cfg: GenerationConfig) -> GenerationResult:
        """Plain greedy decoding through the same static target (the fast baseline)."""
        res = GenerationResult([], "", len(prompt_ids), acceptance_rule="autoregressive")
        stops = set(cfg.stop_token_ids)
        with torch.inference_mode():
            t0 = time.perf_counter()
            tok = self._prefill(prompt_ids, taps=False)
            res.prefill_seconds = time.perf_counter() - t0
            t1 = time.perf_counter()
            while True:
                res.output_ids.append(tok)
                if tok in stops or len(res.output_ids) >= cfg.max_new_tokens:
                    res.stop_reason = "stop_token" if tok in stops else "max_new_tokens"
                    break
                self._run_step("ar")
                tok = int(self.out[0])  # the one host sync per token
            res.decode_seconds = time.perf_counter() - t1
        return res

    def _pin(self) -> bool:
        return self.device.type == "cuda"
