"""Applying a `PlacementPlan` (plan.py): the target's modules moved one at a time to their planned devices, and
forward pre-hooks (never patches) that move each module's incoming tensors to its device (docs/multi-gpu.md).

The hooks sit on the embedding (and the stem's other modules next to the layers), each decoder layer, the final
norm and the head; they move ids, hidden states, masks, position ids and (cos, sin) tuples. The cache object
passes through, since each `DynamicCache` layer allocates on the device of its first keys.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dflash_zoo.cuda.placement.plan import PlacementPlan, TargetParts, target_parts
from dflash_zoo.errors import ConfigError

if TYPE_CHECKING:
    from dflash_zoo.adapters.base import TargetAdapter

log = logging.getLogger("dflash_zoo")


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
    parts = target_parts(model, adapter)
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
    parts = target_parts(model, adapter)
    for mod, dev in _planned_modules(parts, plan):
        mod.to_empty(device=dev)
    stem = torch.device(plan.devices[plan.stem_device])
    for mod in model.modules():  # what is left on meta (rotary tables, containers) goes to the stem's device
        if any(t.is_meta for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]):
            mod.to_empty(device=stem, recurse=False)
    with torch.no_grad():  # (to_empty unties a tied head; apply_placement ties it again)
        for mod in model.modules():
            model._init_weights(mod)


def _planned_modules(parts: TargetParts, plan: PlacementPlan) -> list[tuple[torch.nn.Module, torch.device]]:
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
