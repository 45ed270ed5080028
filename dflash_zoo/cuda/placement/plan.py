"""Split a target across the devices of one host: contiguous decoder-layer ranges balanced by parameter bytes.

Rules (docs/multi-gpu.md):
- decoder layers form contiguous ranges, one per device, chosen to minimise the largest per-device byte total;
- the final norm (the adapter's `final_norm_path`) and the LM head go on the last device, and so does the drafter (`reserve_bytes`): the drafter
  projects its logits through that head every step;
- the stem (input embedding, rotary tables, a VLM's vision tower: everything outside layers, norm and head) goes
  on the first device, or, when the embedding is tied to the head, on the last: one weight cannot live on two
  devices, and with both there the drafter embeds its block and projects its logits without a copy;
- a plan is checked against each GPU's memory before anything moves; hooks.py applies it (moves the modules,
  and moves each module's inputs to its device with forward pre-hooks).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, groupby
from typing import TYPE_CHECKING, Any

import torch

from dflash_zoo.errors import ConfigError, UnsupportedModelError
from dflash_zoo.output import human_size

if TYPE_CHECKING:
    from dflash_zoo.adapters.base import TargetAdapter

log = logging.getLogger("dflash_zoo")


@dataclass(frozen=True)
class PlacementPlan:
    """Where each part of the target goes; `device_bytes` are planned parameter + buffer bytes per slot."""

    devices: tuple[str, ...]  # device slots, normalised ("cuda" -> "cuda:<current>")
    layer_devices: tuple[int, ...]  # decoder layer i -> slot index
    stem_device: int  # embedding and everything outside layers / norm / head
    head_device: int  # final norm, LM head and the drafter
    device_bytes: tuple[int, ...]
    tied: bool  # input embedding shares its weight with the LM head

    @property
    def head(self) -> str:
        return self.devices[self.head_device]

    def layer_ranges(self) -> list[tuple[str, int, int]]:
        """[(device, first layer, last layer)] for each slot holding layers, in order."""
        out: list[tuple[str, int, int]] = []
        for slot, group in groupby(enumerate(self.layer_devices), key=lambda x: x[1]):
            ids = [i for i, _ in group]
            out.append((self.devices[slot], ids[0], ids[-1]))
        return out

    def describe(self) -> str:
        ranges = ", ".join(f"layers {a}-{b} on {d}" for d, a, b in self.layer_ranges())
        gib = ", ".join(f"{d} {human_size(b)}" for d, b in zip(self.devices, self.device_bytes, strict=True))
        stem = self.devices[self.stem_device]
        return f"placement: {ranges}; embeddings on {stem}; norm + head + drafter on {self.head} ({gib})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": list(self.devices),
            "layer_ranges": [list(r) for r in self.layer_ranges()],
            "stem": self.devices[self.stem_device],
            "head": self.head,
            "device_bytes": list(self.device_bytes),
            "tied": self.tied,
        }


# ---- devices --------------------------------------------------------------------------------------
def parse_devices(spec: str | Sequence[str]) -> list[str]:
    """'auto' (every visible GPU), 'cuda:0,cuda:1' or a list of device strings -> normalised device strings."""
    if isinstance(spec, str) and spec.strip() == "auto":
        n = torch.cuda.device_count()
        if n == 0:
            raise ConfigError("--devices auto needs CUDA GPUs and none is visible", hint="pass --device cpu")
        return [f"cuda:{i}" for i in range(n)]
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s).strip() for s in spec]
    if not names or any(not s for s in names):
        raise ConfigError(
            f"bad device list {spec!r}", hint="use e.g. --devices cuda:0,cuda:1 or --devices auto"
        )
    return [_normalise(s) for s in names]


def _normalise(name: str) -> str:
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"unknown device {name!r}", hint="use cpu, cuda, cuda:0, cuda:1 ...") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r}: only cpu and cuda devices can hold a placed target")
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if dev.index is None and count else dev.index
        if index is None or index >= count:
            raise ConfigError(f"device {name!r} is not visible ({count} CUDA devices)")
        return f"cuda:{index}"
    return "cpu"


# ---- planning -------------------------------------------------------------------------------------
def balance(layer_bytes: Sequence[int], extra: Sequence[int]) -> list[int]:
    """Slot index per layer: contiguous ranges minimising max_d(extra[d] + bytes of slot d's layers).

    Exact min-max partition by dynamic programming, O(D L^2); a slot may get no layers.
    """
    n, L = len(extra), len(layer_bytes)
    pre = [0, *accumulate(layer_bytes)]
    best = [[float("inf")] * (L + 1) for _ in range(n)]  # best[d][j]: first j layers on slots 0..d
    cut = [[0] * (L + 1) for _ in range(n)]  # cut[d][j]: first layer of slot d in that optimum
    best[0] = [extra[0] + pre[j] for j in range(L + 1)]
    for d in range(1, n):
        for j in range(L + 1):
            for i in range(j + 1):
                cost = max(best[d - 1][i], extra[d] + pre[j] - pre[i])
                if cost < best[d][j]:
                    best[d][j], cut[d][j] = cost, i
    slots, j = [0] * L, L
    for d in range(n - 1, 0, -1):
        i = cut[d][j]
        slots[i:j] = [d] * (j - i)
        j = i
    return slots


@dataclass(frozen=True)
class TargetParts:
    embed: torch.nn.Module
    layers: Any  # the decoder-layer ModuleList
    norm: torch.nn.Module
    head: torch.nn.Module
    parent: torch.nn.Module  # the module holding layers and norm (its other children are stem modules)
    names: dict[str, str]  # part -> qualified module name ("layers.<i>" for each layer)


def target_parts(model: torch.nn.Module, adapter: TargetAdapter) -> TargetParts:
    parent_path, _, _ = adapter.layers_path.rpartition(".")
    parent = operator.attrgetter(parent_path)(model) if parent_path else model
    norm_path = adapter.final_norm_path()
    try:
        norm = operator.attrgetter(norm_path)(model)
    except AttributeError:
        norm = None
    head = model.get_output_embeddings()
    if not isinstance(norm, torch.nn.Module) or head is None:
        raise UnsupportedModelError(
            f"cannot place {type(model).__name__} across devices: no final norm at "
            f"{norm_path} or no output embeddings",
            hint="run this target on one device (--device)",
        )
    by_id = {id(m): n for n, m in model.named_modules()}
    embed = model.get_input_embeddings()
    names = {"embed": by_id[id(embed)], "norm": by_id[id(norm)], "head": by_id[id(head)]}
    names.update({f"layers.{i}": by_id[id(layer)] for i, layer in enumerate(adapter.layers())})
    return TargetParts(embed, adapter.layers(), norm, head, parent, names)


def _bytes(modules: Sequence[torch.nn.Module], seen: set[int]) -> int:
    """Parameter + buffer bytes of `modules`, each tensor counted once across calls sharing `seen`."""
    total = 0
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def module_bytes(module: torch.nn.Module) -> int:
    return _bytes([module], set())


def plan_placement(adapter: TargetAdapter, devices: Sequence[str], reserve_bytes: int = 0) -> PlacementPlan:
    """Plan a split of `adapter.model` over `devices` (slots; repeats allowed, e.g. ["cpu", "cpu"] in tests).

    Args:
        adapter: the target's adapter (layers path, model); the model may still be on the CPU or on `meta`.
        devices: device strings, first = stem, last = norm + head.
        reserve_bytes: extra bytes planned on the head's device (the drafter).
    Returns:
        A `PlacementPlan`; nothing is moved.
    """
    devs = tuple(parse_devices(list(devices)))
    model = adapter.model
    parts = target_parts(model, adapter)
    tied = parts.embed.weight is parts.head.weight
    seen: set[int] = set()
    tail = _bytes([parts.norm, parts.head], seen) + reserve_bytes  # a tied embedding is counted here
    layer_bytes = [_bytes([layer], seen) for layer in parts.layers]
    stem = _bytes([model], seen)  # whatever is left
    head_slot = len(devs) - 1
    stem_slot = head_slot if tied else 0
    extra = [0] * len(devs)
    extra[stem_slot] += stem
    extra[head_slot] += tail
    slots = balance(layer_bytes, extra)
    per = list(extra)
    for i, s in enumerate(slots):
        per[s] += layer_bytes[i]
    plan = PlacementPlan(devs, tuple(slots), stem_slot, head_slot, tuple(per), tied)
    _check_fits(plan)
    return plan


def _check_fits(plan: PlacementPlan) -> None:
    """Refuse a plan whose weights alone exceed a GPU; warn above 90% (the KV cache needs room too)."""
    per_device: dict[str, int] = {}
    for d, b in zip(plan.devices, plan.device_bytes, strict=True):
        per_device[d] = per_device.get(d, 0) + b
    for d, b in per_device.items():
        if not d.startswith("cuda"):
            continue
        total = torch.cuda.get_device_properties(torch.device(d)).total_memory
        if b > total:
            raise ConfigError(
                f"the placement puts {human_size(b)} of weights on {d} ({human_size(total)})",
                hint="add devices (--devices cuda:0,cuda:1,...) or use a smaller dtype",
            )
        if b > 0.9 * total:
            log.warning("placement: %s of weights on %s leaves little room for the cache", human_size(b), d)
