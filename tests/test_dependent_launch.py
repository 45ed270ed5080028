"""Programmatic dependent launch (`runtime.dependent_launches`, `FastOptions.dependent_launch`): where it is on,
that the engine's steps run under it, and on a Hopper GPU that kernels launched dependent, eagerly and in a CUDA
graph, give the plain launches' results bit for bit and the graphed engine the same tokens."""

from __future__ import annotations

import pytest
import torch

from dflash_zoo.cuda.ops import attention, fp8, fused, gemv, runtime
from dflash_zoo.cuda.static.graphs import Steps
from dflash_zoo.cuda.static.kernel_choice import choose_kernels
from dflash_zoo.engine.options import FastOptions
from dflash_zoo.engine.results import GenerationConfig
from tests.static_matrix import fast_engine, static_pair

HOPPER = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs a Hopper GPU"
)


def test_launches_are_plain_off_cuda_and_outside_the_context():
    """Dependent only inside `dependent_launches(True)` and on CUDA: a CPU tensor (the interpreter) never is,
    and the context puts the setting back as it was, nested or not."""
    cpu = torch.zeros(1)
    assert runtime.launch_mode(cpu) == {"PDL": 0}
    with runtime.dependent_launches(True):
        assert runtime.launch_mode(cpu) == {"PDL": 0}
        assert runtime._DEPENDENT.get() is True
        with runtime.dependent_launches(False):
            assert runtime._DEPENDENT.get() is False
        assert runtime._DEPENDENT.get() is True
    assert runtime._DEPENDENT.get() is False


def test_dependent_launch_is_on_where_the_kernels_are_the_default():
    pytest.importorskip("triton")
    cuda = torch.device("cuda")
    assert choose_kernels(cuda, FastOptions()).dependent_launch is True
    assert choose_kernels(cuda, FastOptions(dependent_launch=False)).dependent_launch is False
    assert choose_kernels(cuda, FastOptions.from_env({"DFLASH_ZOO_PDL": "0"})).dependent_launch is False
    assert choose_kernels(cuda, FastOptions.from_env({"DFLASH_ZOO_KERNELS": "0"})).dependent_launch is False
    assert choose_kernels(torch.device("cpu"), FastOptions()).dependent_launch is False


def test_steps_run_under_their_setting():
    """A step runs (and would be captured) inside `dependent_launches(dependent)`; the setting ends with it."""
    seen = []
    steps = Steps([torch.zeros(1)], torch.Generator(), graphs=False, compile_options=None)
    for dependent in (True, False, True):
        steps.run("a", lambda: lambda: seen.append(runtime._DEPENDENT.get()), dependent=dependent)
    assert seen == [True, False, True] and runtime._DEPENDENT.get() is False


@pytest.mark.parametrize("dependent", [True, False])
def test_the_engine_launches_only_one_row_steps_dependent(dependent, monkeypatch):
    """Autoregressive steps under the engine's setting; spec, draft and drafter steps never."""
    adapter, drafter = static_pair("qwen3")
    eng = fast_engine(adapter, drafter, 0, max_len=64, dependent_launch=dependent)  # explicit: stands on CPU
    seen, run = [], eng.steps.run

    def recording(key, build, dependent=False):
        seen.append((key[0], dependent))
        run(key, build, dependent)

    monkeypatch.setattr(eng.steps, "run", recording)
    cfg = GenerationConfig(max_new_tokens=4)
    eng.autoregressive([3, 14, 15], cfg), eng.speculative([3, 14, 15], cfg)
    assert {("ar", dependent), ("spec", False)} == set(seen)


def _chain(x16: torch.Tensor, w: dict) -> list[torch.Tensor]:
    """Every kernel that launches dependent, each reading what the one before wrote: FP8 GEMM (+ its sum) and
    GEMV, the bf16 GEMV's partial sums and their residual add, the fused q/k/v rope, split attention, SiLU."""
    out = []
    y = fp8.linear(x16, w["q8"], w["s8"], None, tune=False)  # [16, 512]
    total, normed = fused.add_rms_norm(x16, y, w["norm"], 1e-6)
    parts = gemv.gemv_parts(normed[:1], w["qkv"], None, tune=False)  # [S, 1, 512]
    q = fused.rope_store(parts, None, None, w["cos"], w["sin"], w["pos"], w["k"], w["v"], 4, 1e-6, parts=True)
    o = attention.split_kv_attention(q.view(2, 2, 64), w["k"], w["v"], w["bias"], 0.125)  # [2, 2, 64]
    h = fused.silu_mul(o.reshape(1, 256), o.reshape(1, 256).flip(-1))
    z = fp8.linear(torch.cat([h, h], -1), w["q8"], w["s8"], None, tune=False)  # one row: the FP8 GEMV
    out += [y, total, normed, parts, q, o, h, z, fused.rms_norm(z, w["norm"], 1e-6)]
    return out


@pytest.mark.gpu
@HOPPER
def test_dependent_kernels_equal_plain_launches_eager_and_graphed():
    gen = torch.Generator("cuda").manual_seed(0)
    dev, bf = "cuda", torch.bfloat16

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(bf)

    q8, s8 = fp8.quantize(torch.randn(512, 512, generator=gen, device=dev) * 0.05)
    # q/k/v of 4 query heads and 2 KV heads of 64
    w = dict(q8=q8, s8=s8, norm=rand(512), qkv=rand(512, 512, scale=0.05), pos=torch.tensor([7], device=dev))
    w.update(cos=rand(1, 64), sin=rand(1, 64), k=rand(2, 32, 64), v=rand(2, 32, 64))
    w["bias"] = torch.zeros(2, 32, device=dev, dtype=bf)
    x16, x1 = rand(16, 512), rand(1, 512)
    caches = (w["k"].clone(), w["v"].clone())
    assert runtime.launch_mode(x1) == {"PDL": 0}
    plain = _chain(x16, w)
    for run in ("eager", "graph"):
        w["k"].copy_(caches[0]), w["v"].copy_(caches[1])
        with runtime.dependent_launches(True):
            assert runtime.launch_mode(x1) == {"PDL": 1, "launch_pdl": True}
            if run == "eager":
                got = _chain(x16, w)
            else:
                graph = torch.cuda.CUDAGraph()
                with runtime.no_collection(), torch.cuda.graph(graph):
                    got = _chain(x16, w)
                graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(plain, got, strict=True):
            assert torch.equal(a, b), run


@pytest.mark.gpu
@HOPPER
def test_graphed_engine_gives_the_same_tokens_launched_dependent():
    """A bf16 tiny pair, graphed, with the kernels' first configs: dependent launches change no token."""
    adapter, drafter = static_pair("qwen3", device="cuda")
    adapter.model.to(torch.bfloat16), drafter.to(torch.bfloat16)
    cfg, prompt = GenerationConfig(max_new_tokens=24), [3, 14, 15, 92, 65, 35, 89, 79]
    runs = {}
    for on in (False, True):
        eng = fast_engine(adapter, drafter, 0, max_len=64, graphs=True, tune=False, dependent_launch=on)
        assert eng.kernels.dependent_launch is on
        runs[on] = (eng.speculative(prompt, cfg).output_ids, eng.autoregressive(prompt, cfg).output_ids)
    assert runs[True] == runs[False]
