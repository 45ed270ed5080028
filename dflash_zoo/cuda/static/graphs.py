"""Fixed-shape step functions run eagerly, compiled with `torch.compile`, and/or replayed as CUDA graphs.

A step mutates the engine's state tensors in place (positions, the last token, the output row), so a graph
replays it with no host work. Running a step only to compile or capture it must leave no trace: the state
tensors and the sampling generator are put back afterwards (`_rewind`), and K/V rows such a run writes lie
at or past the committed length, where the real step overwrites them.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Hashable
from typing import Any

import torch

from dflash_zoo.cuda.ops.runtime import dependent_launches, no_collection

Step = Callable[[], None]


def private_code(method: Callable) -> Callable:
    """`method` (a bound method) over a private copy of its function's code object.

    Dynamo keeps compiled code, and the guards that pick it, per code object, so every engine's steps would
    share one cache: a step of one target is then checked against guards compiled for another target's engine.
    A guard naming a module the other target lacks (a Gemma 4 VLM's `language_model`, met by a Gemma 4 text
    engine) makes dynamo's own recompile diagnostics raise (`KeyError: 'language_model'`, torch 2.13), and
    from the ninth engine on the cache is full (`recompile_limit`). One code object per engine gives each its
    own cache; nothing about the method changes.
    """
    func = method.__func__
    own = types.FunctionType(
        func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__
    )
    own.__kwdefaults__, own.__qualname__ = func.__kwdefaults__, func.__qualname__
    return types.MethodType(own, method.__self__)


class Steps:
    """Step functions by key (built on first use), each compiled and captured at most once."""

    def __init__(
        self,
        state: list[torch.Tensor],
        generator: torch.Generator,
        graphs: bool,
        compile_options: dict[str, Any] | None,
    ):
        self.state, self.gen, self.graphs = state, generator, graphs
        self.compile_options = compile_options  # None: steps run uncompiled
        self._fns: dict[Hashable, Step] = {}
        self._graphs: dict[Hashable, Any] = {}
        self.capture_seconds = self.compile_seconds = 0.0

    def run(self, key: Hashable, build: Callable[[], Step], dependent: bool = False) -> None:
        """Run the step `key`, building it with `build()` the first time it is asked for; with `dependent`
        its kernels are launched (and captured) dependent (`runtime.dependent_launches`)."""
        with dependent_launches(dependent):
            self._run(key, build)

    def _run(self, key: Hashable, build: Callable[[], Step]) -> None:
        if key not in self._fns:
            self._fns[key] = self._prepare(build())
        if not self.graphs:
            self._fns[key]()
            return
        if key not in self._graphs:
            self._graphs[key] = self._capture(self._fns[key])
        self._graphs[key].replay()

    def _prepare(self, fn: Step) -> Step:
        if self.compile_options is None:
            return fn
        compiled = torch.compile(fn, options=self.compile_options, fullgraph=False, dynamic=False)
        self._warm(compiled)  # the first call compiles: timed on its own, not as a step
        return compiled

    def _rewind(self) -> Callable[[], None]:
        """A function that puts the state tensors and the generator back as they are now."""
        saved = [t.clone() for t in self.state]
        rng = self.gen.get_state()

        def rewind() -> None:
            for t, s in zip(self.state, saved, strict=True):
                t.copy_(s)
            self.gen.set_state(rng)

        return rewind

    def _warm(self, fn: Step) -> None:
        t0 = time.perf_counter()
        rewind = self._rewind()
        fn()
        rewind()
        if self.state[0].device.type == "cuda":
            torch.cuda.synchronize()
        self.compile_seconds += time.perf_counter() - t0

    def _capture(self, fn: Step) -> Any:
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
        # a private generator must be registered so each replay draws fresh numbers from its current state
        register = getattr(graph, "register_generator_state", None)
        if register is not None and self.gen.device.type == "cuda":
            register(self.gen)
        with no_collection(), torch.cuda.graph(graph):
            fn()
        rewind()
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - t0
        return graph
