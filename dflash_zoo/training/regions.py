"""Regional compilation of the training step (`TrainConfig.compile`, `train --compile`).

`torch.compile` runs on small regions, not on the whole step:
- the target: each direct child of every decoder layer that runs (0 .. the last tapped one) except its
  attention: its MLP and norms. The decoder layers themselves stay eager, so the adapter's tap hooks and the
  hook that stops the forward after the last tap run as they do uncompiled. The attention stays eager because
  inductor got it wrong on CUDA: on one H100 (torch 2.11, a tiny fp32 Qwen3 target with a padded batch) the
  compiled `self_attn` was 4e-2 from an fp64 reference where eager SDPA (any backend) and `aot_eager` were
  2e-8, while its MLP and norms compiled matched eager to 2e-8;
- the drafter: its norms and MLPs. Its attention stays eager around the flex kernel, which is compiled on its
  own (`attention.py`), and DFlash 2's convolutions are called through methods a module compile does not reach.

One compiled graph serves every layer of a kind (parameters are graph inputs), and a new sequence length
compiles once more with dynamic shapes. What it buys: the norms, rotary embeddings and gated activations run
as a few fused kernels instead of one memory pass per eager op (docs/training.md, "Speed").

`release` puts every region back to eager (the drafter is saved and may be evaluated afterwards, the target
too, by engines that never run compiled modules).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from dflash_zoo.errors import InvalidArgumentError

CHOICES = ("auto", "on", "off")
# a decoder layer's attention children (`self_attn`, `linear_attn`, ...), kept eager (module docstring)
ATTENTION_NAMES = ("attn", "attention")
# `auto` compiles on CUDA: the GPU test `test_inductor_regions_follow_the_eager_step_on_cuda` passed on one H100
# (torch 2.11) for both parts and both drafter attentions once the target's attention stayed eager
CUDA_VERIFIED = True


def resolve(choice: str, device: torch.device | str, sharded: bool) -> bool:
    """`auto` -> on for CUDA (once verified, `CUDA_VERIFIED`) and an unsharded target; `on` / `off` as given."""
    if choice not in CHOICES:
        raise InvalidArgumentError(f"unknown --compile {choice!r}; use one of {', '.join(CHOICES)}")
    if choice == "auto":
        return CUDA_VERIFIED and torch.device(device).type == "cuda" and not sharded
    return choice == "on"


def target_regions(adapter: Any, taps: Iterable[int]) -> Iterator[nn.Module]:
    """The direct children of the target's decoder layers 0 .. max(taps), attention modules left out."""
    for layer in adapter.layers()[: max(taps) + 1]:
        for name, child in layer.named_children():
            if not name.endswith(ATTENTION_NAMES):
                yield child


def drafter_regions(drafter: nn.Module) -> Iterator[nn.Module]:
    """The drafter layers' norms and MLPs."""
    from dflash_zoo.engine.drafter import MLP, RMSNorm

    for module in drafter.layers.modules():
        if isinstance(module, MLP | RMSNorm):
            yield module


class Regions:
    """Modules compiled in place (`nn.Module.compile`) until `release`."""

    def __init__(self, modules: Iterable[nn.Module], backend: str | Callable = "inductor"):
        self.modules = list(modules)
        for m in self.modules:
            m.compile(backend=backend, dynamic=None)  # static first, dynamic once a second shape comes

    def release(self) -> None:
        """Every region back to eager: the compiled call is an instance attribute over the class's None."""
        for m in self.modules:
            m.__dict__.pop("_compiled_call_impl", None)
        self.modules = []


def compile_error(exc: BaseException) -> bool:
    """True for a failure of torch.compile itself (tracing or code generation), not of the model."""
    name = type(exc).__module__
    return name.startswith(("torch._dynamo", "torch._inductor"))
