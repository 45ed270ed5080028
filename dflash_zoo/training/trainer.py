"""One training step of the recipe, split at the points a benchmark times: target features, the drafter's
forward and backward (LM head and loss included), the optimizer.

Speed rules (docs/training.md, "Speed"): the frozen target runs in its own dtype under `no_grad` and stops
after the last tapped layer; the drafter keeps fp32 master weights under bf16 autocast on CUDA, with fused
AdamW; drafter attention is block-sparse (`attention.py`, flex on CUDA); the LM head's loss runs in chunks
(`head_loss.py`); inputs reach the GPU through pinned memory, and nothing in a step reads a device value on
the host (loss and tau stay tensors until the loop logs them).

The drafter architecture picks its loss from `LOSSES` (by `drafter.arch`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_zoo.errors import InvalidArgumentError, ZooError
from dflash_zoo.training import distributed, regions
from dflash_zoo.training.attention import resolve_kind
from dflash_zoo.training.blocks import (
    LossOut,
    block_loss,
    dflash_loss,
    loss_weights,
    lr_factor,
    make_batch,
    sample_anchors,
    to_device,
    weight_sum,
)
from dflash_zoo.training.data import Example
from dflash_zoo.training.features import target_features
from dflash_zoo.training.forward import TrainingDrafter
from dflash_zoo.training.head_loss import chunk_rows

log = logging.getLogger("dflash_zoo")
MAX_SLOTS = 16384  # block slots (queries) per drafter call


def _dflash2_loss(drafter: Any, cfg: Any) -> Callable[..., LossOut]:
    from dflash_zoo.training.selector_loss import dflash2_loss

    return functools.partial(
        dflash2_loss, selector=drafter.candidate_selector, alpha=cfg.selector_loss_weight
    )


# the loss of each drafter architecture: (drafter, TrainConfig) -> loss_fn(h, head, labels, w, real, rows)
LOSSES: dict[str, Callable[[Any, Any], Callable[..., LossOut]]] = {
    "dflash": lambda _drafter, _cfg: dflash_loss,
    "dflash2": _dflash2_loss,
    "laguna_dflash": lambda _drafter, _cfg: dflash_loss,  # its differences are in the forward, not the loss
}


@dataclass(frozen=True)
class StepStats:
    """One step's results: loss and tau as device tensors (reading them syncs), tokens trained on."""

    loss: torch.Tensor
    tau: torch.Tensor
    tokens: int


def _no_marks(_name: str) -> None:
    return None


class Trainer:
    """State of one training run: the wrapped drafter, optimizer, data shard and feature source."""

    def __init__(self, cfg: Any, model: Any, drafter: Any, examples: list[Example], device: Any):
        from dflash_zoo.adapters import get_adapter

        self.cfg, self.model, self.device = cfg, model, torch.device(device)
        self.adapter = get_adapter(model.config.model_type)(model)
        self.raw, self.dcfg = drafter, drafter.cfg
        self.rank, self.world, _ = distributed.dist_info()
        self.attention = resolve_kind(cfg.attention, self.device)
        self.module = TrainingDrafter(drafter, self.attention)
        self.drafter = self.module
        if self.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.drafter = torch.nn.parallel.DistributedDataParallel(self.module, device_ids=ids)
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        fused = True if self.device.type == "cuda" else None  # one kernel for all parameters
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
        self.shard = examples[self.rank :: self.world]
        self.steps_per_epoch = max(1, math.ceil(len(examples) // self.world / cfg.batch_size))
        self.total = cfg.steps or max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        self.weights = loss_weights(self.dcfg.block_size, cfg.loss_decay_gamma, cfg.uniform_loss_weights)
        self.gen = torch.Generator().manual_seed(cfg.seed + self.rank)
        self.sharded = distributed.is_sharded(model)
        self.regions = None  # the compiled regions (`regions.py`) until `release`
        if regions.resolve(cfg.compile, self.device, self.sharded):
            taps = self.dcfg.target_layer_ids
            self.regions = regions.Regions(
                [*regions.target_regions(self.adapter, taps), *regions.drafter_regions(drafter)]
            )
        if self.sharded and cfg.cache_features:  # ranks would skip different forwards of a collective model
            raise InvalidArgumentError(
                "features cannot be kept in memory with a sharded target", hint="pass --cache-features DIR"
            )
        self.cache: Any = None  # the disk cache, once `use_disk_cache` opened it
        self.memory: dict[int, torch.Tensor] = {}  # `cache_features` in memory
        self.head_rows = chunk_rows(self.adapter.text_config.vocab_size)
        if drafter.arch not in LOSSES:
            raise InvalidArgumentError(f"dflash-zoo cannot train a {drafter.arch!r} drafter")
        self.loss_fn = LOSSES[drafter.arch](drafter, cfg)
        bf16 = self.device.type == "cuda" and model.dtype == torch.bfloat16
        self.autocast = torch.autocast("cuda", torch.bfloat16) if bf16 else contextlib.nullcontext()

    def batch(self, step: int) -> list[int]:
        """Indices into the shard: a fresh seeded permutation per epoch, so resuming replays the same order."""
        epoch, offset = divmod(step, self.steps_per_epoch)
        order = torch.randperm(
            len(self.shard), generator=torch.Generator().manual_seed(self.cfg.seed * 7919 + epoch)
        )
        bs = self.cfg.batch_size
        return order[offset * bs : (offset + 1) * bs].tolist() or order[:bs].tolist()

    def _target(self, seqs: list[tuple[int, ...]]) -> torch.Tensor:
        return target_features(self.model, self.adapter, self.dcfg.target_layer_ids, seqs, self.device)

    def features(self, idx: list[int]) -> torch.Tensor:
        """[b, T, K*H] right-padded features of the shard's examples `idx` (disk cache, memory, or the target)."""
        exs = [self.shard[i] for i in idx]
        if self.cfg.no_target_features:  # fc is frozen at zero: the features' values cannot matter
            return torch.zeros(len(exs), max(len(ex.ids) for ex in exs), self.feature_width, dtype=self.model.dtype,
                               device=self.device)  # fmt: skip
        if self.cache is not None:
            rows = [self.cache.get(i) for i in idx]  # [T_i, K*H] each, on the host
            return to_device(torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), self.device)
        if not self.cfg.cache_features:
            return self._target([ex.ids for ex in exs])
        todo = [i for i in idx if i not in self.memory]
        if todo:
            feats = self._target([self.shard[i].ids for i in todo])
            for j, i in enumerate(todo):
                self.memory[i] = feats[j, : len(self.shard[i].ids)].clone()
        return torch.nn.utils.rnn.pad_sequence([self.memory[i] for i in idx], batch_first=True)

    def forward_backward(self, idx: list[int], feats: torch.Tensor, anchors: list[torch.Tensor]):
        """Gradients of the batch's loss: all its blocks in as few drafter calls as fit. Returns (loss, tau)."""
        exs = [self.shard[i] for i in idx]
        b = self.dcfg.block_size
        # rows per drafter call: keep the block slots of one call under MAX_SLOTS (bounds activations)
        per_call = max(1, MAX_SLOTS // (b * max(1, max(len(a) for a in anchors))))
        chunks = [range(i, min(i + per_call, len(idx))) for i in range(0, len(idx), per_call)]
        batches = [make_batch([list(exs[i].ids) for i in rows], [anchors[i] for i in rows], self.device)
                   for rows in chunks]  # fmt: skip
        # each chunk's loss is a mean over its own weights: rescaled to the whole batch's weight sum, the
        # accumulated loss and gradient are those of one call (docs/training.md, "Loss")
        weight = [weight_sum(batch, self.weights) for batch in batches]
        blocks = [batch.real.sum() for batch in batches]  # tau is a mean over real blocks
        total, total_blocks = sum(weight).clamp(min=1e-12), sum(blocks).clamp(min=1)
        self.opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        tau_sum = torch.zeros((), device=self.device)
        for j, (rows, batch) in enumerate(zip(chunks, batches, strict=True)):
            f = feats[rows.start : rows.stop, : batch.ids.shape[1]]  # [r, T, K*H]
            sync = self.world == 1 or j == len(chunks) - 1
            with contextlib.nullcontext() if sync else self.drafter.no_sync():
                with self.autocast:
                    out = block_loss(self.drafter, self.adapter, batch, f, self.dcfg.mask_token_id,
                                     self.weights, self.head_rows, self.loss_fn)  # fmt: skip
                (out.loss * weight[j] / total).backward()
            loss_sum += out.loss.detach() * weight[j]
            tau_sum += out.tau * blocks[j]
        return loss_sum / total, tau_sum / total_blocks

    def optimizer_step(self, progress: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = self.cfg.lr * lr_factor(progress, self.cfg.warmup_ratio)
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip, foreach=True)
        self.opt.step()

    def step(self, step: int, progress: float, marks: Callable[[str], None] = _no_marks) -> StepStats:
        """One optimizer step over `batch_size` sequences; `marks(name)` is called after each part
        ("features", "drafter", "optimizer") and once before them ("start")."""
        idx = self.batch(step)
        exs = [self.shard[i] for i in idx]
        b, cfg = self.dcfg.block_size, self.cfg
        anchors = [
            sample_anchors(len(ex.ids), ex.start, b, cfg.anchors_per_seq, cfg.uniform_blocks, self.gen)
            for ex in exs
        ]
        marks("start")
        try:
            feats = self.features(idx)
            marks("features")
            loss, tau = self.forward_backward(idx, feats, anchors)
        except Exception as exc:
            if self.regions is None or not regions.compile_error(exc):
                raise
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ZooError(f"torch.compile failed on the training step: {type(exc).__name__}: {first}",
                           hint="train with --compile off (the step then runs eager)") from exc  # fmt: skip
        marks("drafter")
        self.optimizer_step(progress)
        marks("optimizer")
        return StepStats(loss, tau, sum(len(ex.ids) for ex in exs))

    def release(self) -> None:
        """Compiled regions back to eager (the target and drafter outlive the run)."""
        if self.regions is not None:
            self.regions.release()
            self.regions = None

    @property
    def feature_width(self) -> int:
        return self.dcfg.num_taps * self.dcfg.hidden_size

    def cache_key(self) -> Any:
        """The `feature_cache.CacheKey` of this rank's features (a collective with a sharded target)."""
        from dflash_zoo.training import feature_cache as fc

        cfg = self.cfg
        weights = fc.weights_fingerprint(self.model)
        if self.sharded:  # each rank hashed its own shards: one fingerprint from all of them, in rank order
            weights = fc.combine(distributed.gather_objects(weights))
        return fc.CacheKey(
            target_config=fc.config_fingerprint(self.model), target_weights=weights,
            target_dtype=str(self.model.dtype).removeprefix("torch."), taps=tuple(self.dcfg.target_layer_ids),
            max_length=cfg.max_length, data=fc.file_digest(cfg.data) if cfg.data else "",
            examples=fc.examples_digest(self.shard), dtype=cfg.cache_dtype, rank=self.rank, world=self.world,
        )  # fmt: skip

    def use_disk_cache(self, root: Path, shard_bytes: int | None = None) -> None:
        """Open (or resume) the on-disk feature cache and fill what it lacks; its size is announced and the
        free space checked before anything is computed. `shard_bytes`: features per shard file."""
        from dflash_zoo.training import feature_cache as fc

        cfg, width = self.cfg, self.feature_width
        self.cache = fc.FeatureCache.open(root, self.cache_key(), width, shard_bytes or fc.SHARD_BYTES)
        missing = self.cache.missing(len(self.shard))
        need = fc.estimate_bytes([len(self.shard[i].ids) for i in missing], width, cfg.cache_dtype)
        total = fc.estimate_bytes([len(ex.ids) for ex in self.shard], width, cfg.cache_dtype)
        free = self.cache.free_bytes()
        if self.rank == 0:
            _announce_cache(
                self.cache.dir.parent, len(missing), len(self.shard), need, total, free, self.world
            )
        short = need * distributed.local_world() > free  # the ranks of this host share its disk
        if distributed.agree_max(int(short), self.device):  # every rank stops, not only the short one
            raise fc.FeatureCacheError(
                f"the feature cache needs {_size(need * distributed.local_world())} more in "
                f"{self.cache.dir.parent}, which has {_size(free)} free",
                hint="free space or pass another --cache-features DIR (or leave it out: features are then "
                "recomputed every epoch)",
            )
        if missing or self.sharded:  # a sharded target: every rank joins the others' forwards
            from dflash_zoo.output import status

            if self.rank != 0:
                self.fill_cache()
                return
            with status("computing target features...", lines=True) as st:
                self.fill_cache(lambda d, t: st.update(f"target features: batch {d}/{t}"))

    def fill_cache(self, on_batch: Callable[[int, int], None] | None = None) -> int:
        """Compute and store the features of every shard example the disk cache lacks; returns how many.

        With a sharded target every rank runs the same number of forwards (one-token ones when it has no
        more to compute): each is a collective."""
        missing = sorted(self.cache.missing(len(self.shard)), key=lambda i: len(self.shard[i].ids))
        bs = self.cfg.batch_size
        groups = [missing[i : i + bs] for i in range(0, len(missing), bs)]
        rounds = distributed.agree_max(len(groups), self.device) if self.sharded else len(groups)
        for k in range(rounds):
            if k >= len(groups):
                self._target([(0,)])  # keeps this rank in step with the others' forwards
                continue
            feats = self._target([self.shard[i].ids for i in groups[k]])
            for j, i in enumerate(groups[k]):
                self.cache.add(i, feats[j, : len(self.shard[i].ids)])
            if on_batch is not None:
                on_batch(k + 1, len(groups))
        self.cache.flush()
        return len(missing)


def _size(n: int) -> str:
    from dflash_zoo.output import human_size

    return human_size(n)


def _announce_cache(
    root: Path, missing: int, count: int, need: int, total: int, free: int, world: int
) -> None:
    from dflash_zoo.output import stderr

    ranks = f" (rank 0 of {world}; each rank caches its own examples)" if world > 1 else ""
    what = (
        f"computing {missing} of {count} examples, {_size(need)} to write" if missing else "complete, reused"
    )
    stderr().print(
        f"feature cache {root}: {_size(total)} in all{ranks}; {what}; {_size(free)} free",
        highlight=False,
        markup=False,
    )
