"""Split a target across the devices of one host: contiguous decoder-layer ranges balanced by parameter bytes.

Rules (docs/multi-gpu.md):
- decoder layers form contiguous ranges, one per device, chosen to minimise the largest per-device byte total;
- the final norm (the adapter's `final_norm_path`) and the LM head go on the last device, and so does the drafter (`reserve_bytes`): the drafter
  projects its logits through that head every step;
- the stem (input embedding, rotary tables, a VLM's vision tower: everything outside layers, norm and head) goes
  on the first device, or, when the embedding is tied to the head, on the last: one weight cannot live on two
  devices, and with both there the drafter embeds its block and projects its logits without a copy;
- forward pre-hooks (never patches) on the embedding (and the other stem modules next to the layers), each
  decoder layer, the final norm and the head move the incoming tensors (ids, hidden states, masks, position ids, (cos, sin) tuples) to the module's device; the
  cache object passes through, since each `DynamicCache` layer allocates on the device of its first keys.

Longer than the ~300 lines we aim for: planning, applying and checking a placement are one algorithm, kept in one reading.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
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


@dataclass
class Placement:
    """An applied plan: the hook handles, removable with `remove()` (weights stay where they are)."""

    plan: PlacementPlan
    handles: list[Any] = field(default_factory=list)

    def attach_drafter(self, drafter: torch.nn.Module) -> None:
        """Move the drafter to the head's device; its inputs (embeddings, tapped features) follow it there."""
        device = torch.device(self.plan.head)
        drafter.to(device)
        self.handles.append(drafter.register_forward_pre_hook(_mover_hook(device), with_kwargs=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


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
class _Parts:
    embed: torch.nn.Module
    layers: Any  # the decoder-layer ModuleList
    norm: torch.nn.Module
    head: torch.nn.Module
    parent: torch.nn.Module  # the module holding layers and norm (its other children are stem modules)
    names: dict[str, str]  # part -> qualified module name ("layers.<i>" for each layer)


def _parts(model: torch.nn.Module, adapter: TargetAdapter) -> _Parts:
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
    return _Parts(embed, adapter.layers(), norm, head, parent, names)


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
    parts = _parts(model, adapter)
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


# ---- applying -------------------------------------------------------------------------------------
def _move(x: Any, device: torch.device, memo: dict | None = None) -> Any:
    """Tensors in `x` (nested tuples / lists / dicts) moved to `device`; other values pass through (the cache).

    With `memo`, a tensor already moved to a device is reused: the mask and (cos, sin) then cross once per
    device per forward instead of once per layer (HF never edits them in place).
    """
    if isinstance(x, torch.Tensor):
        if x.device == device:
            return x
        if memo is None:
            return x.to(device)
        hit = memo.get((id(x), device))
        if hit is None or hit[0] is not x:
            hit = memo[(id(x), device)] = (x, x.to(device))  # holding x keeps its id from being reused
        return hit[1]
    if type(x) in (tuple, list):
        return type(x)(_move(v, device, memo) for v in x)
    if type(x) is dict:
        return {k: _move(v, device, memo) for k, v in x.items()}
    return x


def _mover_hook(device: torch.device, memo: dict | None = None, reset: bool = False):
    def hook(_module, args, kwargs):
        if reset and memo is not None:  # the embedding starts every forward: earlier copies are stale
            memo.clear()
        return _move(args, device), _move(kwargs, device, memo)  # hidden states (args) cross once anyway

    return hook


def apply_placement(model: torch.nn.Module, adapter: TargetAdapter, plan: PlacementPlan) -> Placement:
    """Move the target's modules as `plan` says and register the input-moving pre-hooks.

    Modules move one at a time, so a model loaded on the CPU never sits whole on one GPU.
    """
    parts = _parts(model, adapter)
    if len(parts.layers) != len(plan.layer_devices):
        raise ConfigError(f"plan for {len(plan.layer_devices)} layers, target has {len(parts.layers)}")
    stem = torch.device(plan.devices[plan.stem_device])
    planned = _planned_modules(parts, plan)
    for m, dev in planned:
        m.to(dev)
    _move_rest(model, set(parts.names.values()), stem)
    if plan.tied and parts.head.weight is not parts.embed.weight:
        parts.head.weight = parts.embed.weight  # a device move that rebuilt the Parameter must not untie them
    memo: dict = {}
    hooked = [(m, dev, m is parts.embed) for m, dev in planned]  # the embedding starts a forward: resets memo
    # the stem's other modules (rotary tables, Gemma's per-layer embeddings) may read the caller's ids too
    own = (parts.layers, parts.norm, parts.embed)
    hooked += [(m, stem, False) for m in parts.parent.children() if not any(m is o for o in own)]
    handles = [
        m.register_forward_pre_hook(_mover_hook(d, memo, reset), with_kwargs=True) for m, d, reset in hooked
    ]
    handles.append(parts.norm.register_forward_hook(lambda *_: memo.clear()))  # the last user of masks
    log.info("%s", plan.describe())
    return Placement(plan, handles)


def materialise(model: torch.nn.Module, adapter: TargetAdapter, plan: PlacementPlan) -> None:
    """Allocate a target built on `meta` module by module on its planned device, then initialise it there.

    For random-weight targets too large for one device (`bench --shape ... --devices`): the model is never whole
    on one device. Weights, and buffers such as rotary tables, come from HF's own `_init_weights`.
    """
    parts = _parts(model, adapter)
    for mod, dev in _planned_modules(parts, plan):
        mod.to_empty(device=dev)
    stem = torch.device(plan.devices[plan.stem_device])
    for mod in model.modules():  # what is left on meta (rotary tables, containers) goes to the stem's device
        if any(t.is_meta for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]):
            mod.to_empty(device=stem, recurse=False)
    with torch.no_grad():  # (to_empty unties a tied head; apply_placement ties it again)
        for mod in model.modules():
            model._init_weights(mod)


def _planned_modules(parts: _Parts, plan: PlacementPlan) -> list[tuple[torch.nn.Module, torch.device]]:
    """(module, device) for every decoder layer, the final norm, the head and the embedding (the stem's slot,
    which is the head's when they are tied)."""
    devs = [torch.device(d) for d in plan.devices]
    head, stem = devs[plan.head_device], devs[plan.stem_device]
    placed = [(layer, devs[plan.layer_devices[i]]) for i, layer in enumerate(parts.layers)]
    return placed + [(parts.norm, head), (parts.head, head), (parts.embed, stem)]


def _move_rest(model: torch.nn.Module, placed: set[str], device: torch.device) -> None:
    """Everything outside the placed modules goes to `device`; their ancestors move only their own tensors."""
    ancestors = {n.rsplit(".", k)[0] for n in placed for k in range(1, n.count(".") + 1)} | {""}
    done = set(placed)
    for name, mod in model.named_modules():
        if name in ancestors:
            _move_own(mod, device)
        elif not any(name == p or name.startswith(p + ".") for p in done):
            mod.to(device)
            done.add(name)


def _move_own(mod: torch.nn.Module, device: torch.device) -> None:
    for name, p in list(mod.named_parameters(recurse=False)):
        if p.device != device:
            setattr(mod, name, torch.nn.Parameter(p.data.to(device), requires_grad=p.requires_grad))
    for name, b in list(mod.named_buffers(recurse=False)):
        if b.device != device:
            setattr(mod, name, b.to(device))
