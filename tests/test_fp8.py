"""FP8 targets on the fast engine (cuda/ops/fp8.py, cuda/static/fp8.py, quantization.fp8_reason, bench/fp8.py).

- the format: `quantize` writes transformers' fine-grained FP8 blocks bit for bit; `dequantize` inverts it;
- the kernels (Triton's interpreter on CPU: fp32 and fp16, its bf16 dot is garbage) against the torch
  reference (dequantize, then matmul in fp32), for shapes that are and are not multiples of 128, one row
  (split-K GEMV, its partial sums, gated and partial-sum inputs) and 2..16 and more rows (tensor-core kernel),
  every config; `w8a8` on inputs its quantization keeps exact (the interpreter's fp32 -> e4m3 cast rounds
  some values across a power of two wrongly; the GPU test covers random inputs);
- a tiny Qwen3 quantized by `bench.fp8.to_fp8` runs on the static engine (graphs off) with the FP8 kernels and
  gives the tokens of the same engine with the torch reference projection, and of transformers' own greedy
  decoding of the dequantized weights, token for token (fp32 activations), fused and not;
- where the FP8 path cannot run, engine selection says why (`last_choice`), and the engine refuses the same;
- `bench --shape ... --fp8` writes the FP8 record with its bf16 comparison (no timing asserted).
GPU tests (`gpu`): bf16 kernels against the reference, w8a8 on random inputs, the graphed FP8 engine.
"""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
from click.testing import CliRunner
from dflash_zoo.adapters import get_adapter
from torch import nn

from dflash_zoo import quantization
from dflash_zoo.bench.fp8 import divergence, to_fp8
from dflash_zoo.cli import cli
from dflash_zoo.cuda.ops import fp8 as fp8_ops
from dflash_zoo.cuda.ops import gemv
from dflash_zoo.cuda.static import fp8 as static_fp8
from dflash_zoo.cuda.static.linear import FusedLinear, Gemv
from dflash_zoo.engine.decode import autoregressive_generate
from dflash_zoo.engine.options import EngineOptions, FastOptions
from dflash_zoo.engine.results import GenerationConfig
from dflash_zoo.engine.select import choose_engine
from dflash_zoo.errors import ConfigError, UnsupportedModelError
from dflash_zoo.quantization import FP8_CUDA_VERIFIED
from tests.static_matrix import fast_engine
from tests.tiny import VOCAB, tiny_drafter, tiny_target

MASK = VOCAB - 1
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# q/k/v and gate/up in whole 128-row blocks (fused); and a ragged one: nothing a multiple of 128 (unfused,
# partial edge blocks everywhere)
SHAPES = {
    "aligned": dict(hidden_size=256, intermediate_size=384, head_dim=64, num_hidden_layers=2),
    "ragged": dict(hidden_size=192, intermediate_size=320, head_dim=48, num_hidden_layers=2),
}
FP8_128 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.fixture
def interpret():
    """Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1 without CUDA, before triton is imported)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CUDA present: the GPU tests run the compiled kernels")
    pytest.importorskip("triton")


def fp8_pair(shape: str = "aligned", model_type: str = "qwen3", device: str = "cpu", dtype=torch.float32):
    """(adapter, drafter) of a tiny pair whose target's decoder projections are FP8 (`to_fp8`), activations in
    `dtype` (set before quantizing: `.to(dtype)` would cast the FP8 weights too)."""
    dims = SHAPES[shape]
    target = tiny_target(model_type, seed=0, **dims).to(device, dtype)
    # one tap: the last layer's down projection folds into the final norm (a tapped layer's does not)
    drafter = tiny_drafter(target, seed=1, taps=[0], hidden_size=dims["hidden_size"]).to(device, dtype)
    adapter = get_adapter(model_type)(target)
    to_fp8(target, adapter.layers())
    return adapter, drafter


def dequantized_twin(model: nn.Module) -> nn.Module:
    """A copy of `model` whose FP8 projections are plain `nn.Linear` modules of the dequantized weights."""
    twin = copy.deepcopy(model)
    for name, m in list(twin.named_modules()):
        if isinstance(m, nn.Linear) and m.weight.dtype == fp8_ops.FP8:
            plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            plain.weight = nn.Parameter(fp8_ops.dequantize(m.weight, m.weight_scale_inv))
            plain.bias = m.bias
            twin.set_submodule(name, plain)
    del twin.hf_quantizer
    twin.config.quantization_config = None
    return twin


def _prompt(seed: int = 0, length: int = 10) -> list[int]:
    return torch.randint(0, MASK, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- the format --------------------------------------------------------------------------------------------
def test_quantize_writes_transformers_blocks_bit_for_bit():
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w[:128, 128:256] = 0  # an all-zero block keeps scale 1
    quantizer = FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=[128, 128]))
    theirs = Fp8Quantize(quantizer).convert({"p.weight": w})
    q, s = fp8_ops.quantize(w)
    assert q.dtype == fp8_ops.FP8 and s.dtype == torch.float32 and s.shape == (2, 3)
    assert torch.equal(q.view(torch.uint8), theirs["p.weight"].view(torch.uint8))
    assert torch.equal(s, theirs["p.weight_scale_inv"]) and s[0, 1] == 1


@pytest.mark.parametrize("n,k", [(256, 384), (200, 300), (130, 64)])
def test_dequantize_inverts_quantize_within_e4m3_precision(n, k):
    """Every block's weights come back within e4m3's half-ulp (2^-4 relative, 448 the block's amax); an edge
    block of a ragged shape is scaled by the amax of what it covers (its largest weight maps to +-448)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    q, s = fp8_ops.quantize(w)
    assert s.shape == (fp8_ops.blocks(n), fp8_ops.blocks(k))
    back = fp8_ops.dequantize(q, s)
    full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    assert ((back - w).abs() <= full * 448 / 16 + 1e-7).all()
    edge = w[128 * (s.shape[0] - 1) :, 128 * (s.shape[1] - 1) :]
    assert q.float()[-1, -1] != 0 and s[-1, -1] == pytest.approx(edge.abs().max().item() / 448, rel=1e-6)


def test_layout_reason_names_the_layout_the_kernels_read():
    q, s = fp8_ops.quantize(torch.randn(200, 300))
    assert fp8_ops.layout_reason(q, s) is None
    assert "not fp32 [2, 3]" in fp8_ops.layout_reason(q, s[:1])
    assert "not fp32 [2, 3]" in fp8_ops.layout_reason(q, s.double())
    assert "no weight_scale_inv" in fp8_ops.layout_reason(q, None)
    assert "float8_e5m2" in fp8_ops.layout_reason(q.to(torch.float8_e5m2), s)


# ---- the kernels -------------------------------------------------------------------------------------------
def _case(n, k, rows, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, s = fp8_ops.quantize(torch.randn(n, k, generator=gen))
    x, gate = (torch.randn(rows, k, generator=gen).to(dtype) for _ in range(2))
    return x, q, s, torch.randn(n, generator=gen).to(dtype), gate


CLOSE = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float16: dict(atol=3e-2, rtol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 40])
@pytest.mark.parametrize("n,k", [(256, 384), (200, 300), (130, 64)])
def test_fp8_linear_equals_the_reference(interpret, n, k, rows, dtype):
    """Any rows (GEMV, few-row kernel, prefill tiles), shapes in whole and partial blocks, with bias and a
    gated input (SiLU, GELU), against dequantize-then-matmul in fp32."""
    x, q, s, bias, gate = _case(n, k, rows, dtype)
    torch.testing.assert_close(
        fp8_ops.linear(x, q, s, bias), fp8_ops.reference(x, q, s, bias), **CLOSE[dtype]
    )
    for act in sorted(gemv.ACTS.values()):
        want = fp8_ops.reference(x, q, s, None, gate, act)
        torch.testing.assert_close(fp8_ops.linear(x, q, s, None, gate, act), want, **CLOSE[dtype])


def test_every_config_divides_the_scale_blocks():
    """A tensor-core tile never straddles two scale blocks (one scale per tile); a GEMV tile's rows share one
    row of blocks (its columns load their own scales)."""
    for bn, *_ in fp8_ops.GEMV_CONFIGS:
        assert fp8_ops.BLOCK % bn == 0
    for _, bn, bk, *_ in fp8_ops.GEMM_CONFIGS + fp8_ops.PREFILL_CONFIGS:
        assert fp8_ops.BLOCK % bn == 0 and bk == fp8_ops.BLOCK


@pytest.mark.parametrize(
    "rows,config",
    [(1, c) for c in fp8_ops.GEMV_CONFIGS]
    + [(9, c) for c in fp8_ops.GEMM_CONFIGS]
    + [(33, c) for c in fp8_ops.PREFILL_CONFIGS],
    ids=str,
)
def test_every_config_equals_the_reference(interpret, rows, config):
    x, q, s, bias, gate = _case(200, 300, rows, torch.float32, seed=rows)
    got = fp8_ops._launch(x, q, s, bias, None, config, 1, False, torch.float32)
    torch.testing.assert_close(got, fp8_ops.reference(x, q, s, bias), **CLOSE[torch.float32])
    got = fp8_ops._launch(x, q, s, None, gate, config, 1, False, torch.float32)
    torch.testing.assert_close(got, fp8_ops.reference(x, q, s, None, gate, 1), **CLOSE[torch.float32])


@pytest.mark.parametrize("rows", [1, 5])
def test_partial_sums_add_up_to_the_output(interpret, rows):
    """`linear_parts`: fp32 slices whose in-order sum, plus bias, rounded, is `linear`'s output."""
    x, q, s, bias, _ = _case(256, 384, rows, torch.float16)
    parts = fp8_ops.linear_parts(x, q, s)
    assert parts.dtype == torch.float32 and parts.shape[1:] == (rows, 256)
    want = fp8_ops.linear(x, q, s, bias)
    torch.testing.assert_close((parts.sum(0) + bias.float()).half(), want, atol=2e-2, rtol=2e-3)
    with pytest.raises(ValueError, match="at most 16 rows"):
        fp8_ops.linear_parts(torch.randn(17, 384), q, s)


@pytest.mark.parametrize("config", [fp8_ops.GEMV_CONFIGS[0], fp8_ops.GEMV_CONFIGS[-1]], ids=str)
def test_fp8_gemv_reads_a_gate_up_gemv_s_partial_sums(interpret, config):
    """One row given as a gate/up GEMV's fp32 partial sums [S, 1, 2F]: the same output and partial sums as from
    their in-order sums rounded to the activations' dtype (what that GEMV returns), prefetching or in row sums."""
    gen = torch.Generator().manual_seed(3)
    sums = torch.randn(3, 1, 2 * 300, generator=gen)  # [S, 1, 2F]
    gate, up = sums[..., :300], sums[..., 300:]
    g16, u16 = (t.sum(0).half() for t in (gate, up))  # [1, F] each
    q, s = fp8_ops.quantize(torch.randn(200, 300, generator=gen))
    want = fp8_ops._launch(u16, q, s, None, g16, config, 1, False, torch.float16)
    got = fp8_ops._launch(up, q, s, None, gate, config, 1, True, torch.float16)
    assert got.dtype == torch.float16 and torch.equal(got, want)
    assert torch.equal(
        fp8_ops._parts(up, q, s, gate, config, 1, True, torch.float16),
        fp8_ops._parts(u16, q, s, g16, config, 1, False, torch.float16),
    )
    torch.testing.assert_close(
        fp8_ops.linear(up, q, s, None, gate, 1, True, torch.float16),
        fp8_ops.reference(u16, q, s, None, g16, 1),
        atol=2e-2,
        rtol=2e-3,
    )
    with pytest.raises(ValueError, match="partial sums as input"):
        fp8_ops.linear(up, q, s, None, gate, 1, True)  # the activations' dtype is needed


@pytest.mark.parametrize(
    "rows,config",
    [(4, c) for c in fp8_ops._configs(4, True)] + [(20, c) for c in fp8_ops._configs(20, True)],
    ids=str,
)
def test_w8a8_multiplies_quantized_rows_on_the_fp8_path(interpret, rows, config):
    """`w8a8` (every config): rows quantized per 128 columns (amax / 448) and multiplied in FP8, as
    `reference(w8a8=True)`.
    Inputs are e4m3 values times a power of two per group, each group holding +-448 times it, so the
    quantization is exact in any rounding (the interpreter's cast is not RNE everywhere)."""
    gen = torch.Generator().manual_seed(5)
    k = 300
    groups = torch.randn(rows, 3, 128, generator=gen).mul(100).clamp(-448, 448).to(fp8_ops.FP8).float()
    groups[:, :, 0] = 448.0
    powers = 2.0 ** torch.randint(-6, 3, (rows, 3, 1), generator=gen).float()
    x = (groups * powers).flatten(1)[:, :k]  # [rows, 300]: the last group ragged
    q, s = fp8_ops.quantize(torch.randn(200, k, generator=gen))
    xq, xs = fp8_ops.quantize_rows(x)
    assert torch.equal(xq.float() * xs.repeat_interleave(128, -1)[:, :k], x)  # exact by construction
    got = fp8_ops._launch(x, q, s, None, None, config, 1, False, torch.float32)
    torch.testing.assert_close(got, fp8_ops.reference(x, q, s, w8a8=True), atol=1e-3, rtol=1e-5)
    assert fp8_ops.w8a8_of(config) and not fp8_ops.w8a8_of(config[:6])
    # wgmma's left operand spans 64 rows or more: up to 16 rows the weight's (swapped), else x's
    if rows <= fp8_ops.ROWS:
        assert config[6] == fp8_ops.W8A8_SWAP and config[1] >= 64
    else:
        assert config[6] == fp8_ops.W8A8 and config[0] >= 64


def test_inputs_are_checked(interpret):
    q, s = fp8_ops.quantize(torch.randn(200, 300))
    with pytest.raises(ValueError, match="block scales of a \\[200, 300\\] weight are fp32 \\[2, 3\\]"):
        fp8_ops.linear(torch.randn(1, 300), q, s[:, :2], None)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_ops.linear(torch.randn(1, 300), q.float(), s, None)


def test_fp8_linear_traces_under_torch_compile(interpret):
    """The op's fake function gives the real shape and dtype: one graph under `torch.compile` (aot_eager)."""
    x, q, s, bias, gate = _case(200, 300, 3, torch.float32)

    def step(x, q, s, bias, gate):
        return fp8_ops.linear(x, q, s, bias, gate, 1) * 2

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, q, s, bias, gate), step(x, q, s, bias, gate))


# ---- the static engine -------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", ["aligned", pytest.param("ragged", marks=pytest.mark.slow)])
def test_fp8_engine_equals_the_reference_projection_and_the_dequantized_target(interpret, shape, monkeypatch):
    """The FP8 kernels in every place the engine runs them (fused q/k/v and gate/up GEMVs and their partial
    sums into the rope and norm kernels, the gated down GEMV reading gate/up's sums, verify and prefill
    blocks), or the projections unfused where the parts are ragged: the same tokens as the same engine with
    the torch reference projection, and as transformers' greedy decoding of the dequantized weights (fp32)."""
    adapter, drafter = fp8_pair(shape)
    cfg, prompt = GenerationConfig(max_new_tokens=8), _prompt()
    ref = fast_engine(adapter, drafter, MASK, max_len=48, graphs=False, fp8="torch")
    want = ref.speculative(prompt, cfg).output_ids
    assert ref.autoregressive(prompt, cfg).output_ids == want
    twin = get_adapter("qwen3")(dequantized_twin(adapter.model))
    assert autoregressive_generate(twin, prompt, cfg).output_ids == want
    flags = dict(gemv=True, fused_ops=True, fp8="weight_only")
    eng = fast_engine(adapter, drafter, MASK, max_len=48, graphs=False, **flags)
    assert eng.kernels.fp8 == "weight_only" and eng.target.fp8_weights
    fused = shape == "aligned"
    assert all((q.linears is None) == fused for q in eng.target.qkv)
    calls = []

    def spy(name, real):  # records (op, rows, in_parts)
        at = 6 if name == "linear" else 5
        return lambda *a, **k: calls.append((name, a[0].shape[-2], a[at])) or real(*a, **k)

    for name in ("linear", "linear_parts"):
        monkeypatch.setattr(fp8_ops, name, spy(name, getattr(fp8_ops, name)))
    assert eng.speculative(prompt, cfg).output_ids == want
    assert eng.autoregressive(prompt, cfg).output_ids == want
    # one-row steps: q/k/v and gate/up as partial sums where fused, the down GEMV reading gate/up's (in_parts)
    # and leaving its own to the next norm where it folds (layer 1); prefill rows through the kernel; verify
    # blocks' q/k/v (fused) and folded o / down as the block kernel's partial sums
    ops = set(calls)
    assert {("linear", 10, False), ("linear_parts", 8, False)} <= ops
    if fused:
        assert {("linear_parts", 1, False), ("linear", 1, True), ("linear_parts", 1, True)} <= ops
        assert ("linear", 8, False) in ops  # gate/up: silu_mul reads its output
    else:  # unfused: one row each through the GEMV (o's partial sums to the norm), no partial-sum inputs
        assert {("linear", 1, False), ("linear_parts", 1, False)} <= ops and not any(i for *_, i in ops)


def test_fused_fp8_projections_are_views_of_fused_weights_and_scales():
    """q/k/v in whole 128-row blocks fuse: the modules' FP8 weights and scales become row views of the fused
    tensors (no copy kept); ragged parts are not fused."""
    adapter, _ = fp8_pair("aligned")
    attn = adapter.layers()[0].self_attn
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    want = [(p.weight.clone(), p.weight_scale_inv.clone()) for p in parts]
    fused = FusedLinear(parts, gemv=Gemv(fp8="torch"))
    assert fused.weight.shape == (512, 256) and fused.scales.shape == (4, 2)
    assert fused.weight.dtype == fp8_ops.FP8
    for p, (w, s) in zip(parts, want, strict=True):
        assert p.weight.data_ptr() != w.data_ptr() and torch.equal(
            p.weight.view(torch.uint8), w.view(torch.uint8)
        )
        assert torch.equal(p.weight_scale_inv, s)
    assert parts[1].weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
    x = torch.randn(1, 3, 256)
    cat = torch.cat([w for w, _ in want]), torch.cat([s for _, s in want])
    torch.testing.assert_close(torch.cat(fused(x), -1), fp8_ops.reference(x, *cat))
    ragged, _ = fp8_pair("ragged")
    a = ragged.layers()[0].self_attn
    assert FusedLinear([a.q_proj, a.k_proj, a.v_proj]).linears is not None
    assert not static_fp8.fusable([a.q_proj, nn.Linear(192, 128)])  # FP8 beside plain: never fused


def test_w8a8_mode_takes_multi_row_projections_to_the_fp8_path(interpret, monkeypatch):
    """fp8="w8a8": verify and prefill rows go through the kernels with quantized activations; one-row steps
    through the weight-only GEMV (no tensor cores for one row)."""
    adapter, drafter = fp8_pair("aligned")
    calls, real = [], fp8_ops.linear
    monkeypatch.setattr(fp8_ops, "linear", lambda *a, **k: calls.append((a[0].shape, a[8])) or real(*a, **k))
    eng = fast_engine(adapter, drafter, MASK, max_len=48, graphs=False, fp8="w8a8")
    res = eng.speculative(_prompt(), GenerationConfig(max_new_tokens=4))
    assert len(res.output_ids) == 4
    assert {w8a8 for shape, w8a8 in calls if shape[-2] > 1} == {True}  # 10 prompt rows, 8 verify rows


# ---- where the FP8 path runs, and why not ------------------------------------------------------------------
def test_fp8_target_takes_the_fast_engine_where_its_kernels_run(interpret):
    adapter, drafter = fp8_pair("aligned")
    assert (
        adapter.model.hf_quantizer is not None
    )  # as transformers marks a pre-quantized checkpoint it loaded
    assert quantization.method_of(adapter.model.config.quantization_config) == "fp8"
    assert quantization.quantized_reason(adapter) is None
    assert choose_engine(adapter, "cpu", EngineOptions(fast=True), drafter=drafter).name == "fast"


def test_fp8_fallback_off_the_kernels_device(monkeypatch):
    """Without a device the FP8 kernels run on (here: CPU, no interpreter), `last_choice` says why and the
    static engine refuses the FP8 kernels with the same words (the torch reference still runs there)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    adapter, drafter = fp8_pair("aligned")
    choice = choose_engine(adapter, "cpu", EngineOptions(fast=True), drafter=drafter)
    assert choice.name == "eager"
    assert choice.reason == (
        "fast engine unavailable: the target is FP8-quantized: the Triton kernels need a CUDA device (got cpu)"
    )
    with pytest.raises(ValueError, match="fp8='weight_only': the Triton kernels need a CUDA device"):
        fast_engine(adapter, drafter, MASK, max_len=48, graphs=False, fp8="weight_only")
    assert fast_engine(adapter, drafter, MASK, max_len=48, graphs=False).kernels.fp8 == "torch"


def test_fp8_device_reasons_off_hopper_and_without_triton(monkeypatch):
    """The GPU's compute capability (given, so no device is touched) and triton's presence."""
    pytest.importorskip("triton")
    cuda = torch.device("cuda")
    assert fp8_ops.device_reason(cuda, capability=(9, 0)) is None
    assert fp8_ops.device_reason(cuda, capability=(10, 0)) is None
    assert fp8_ops.device_reason(cuda, capability=(8, 9)) == (
        "the FP8 kernels need a Hopper GPU (compute capability >= 9.0), not 8.9"
    )
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    assert fp8_ops.device_reason(cuda, capability=(9, 0)) == "the Triton kernels need the `triton` package"


@pytest.mark.parametrize(
    "change,words",
    [
        ({"weight_block_size": [16, 16]}, "FP8 weights are scaled 16x16; the fast engine's FP8 kernels read 128x128"),
        ({"weight_block_size": None}, "its FP8 weights are scaled per tensor"),
        ({"activation_scheme": "static"}, "static activation scales"),
        ({"scale_fmt": "ue8m0"}, "its block scales are ue8m0"),
    ],
)  # fmt: skip
def test_fp8_fallback_for_other_schemes(interpret, change, words):
    adapter, drafter = fp8_pair("aligned")
    adapter.model.config.quantization_config = {**FP8_128, **change}
    choice = choose_engine(adapter, "cpu", EngineOptions(fast=True), drafter=drafter)
    assert choice.name == "eager" and choice.reason.startswith("fast engine unavailable: the target is FP8-")
    assert words in choice.reason


def test_fp8_weights_the_engine_does_not_read_are_named(interpret):
    """FP8 in a MoE block's experts (`FP8Experts` hold 3-d FP8 tensors), outside the decoder layers, or with
    scales of another layout: selection says where, and the static engine refuses it with the same reason. A
    MoE target whose attention alone is FP8 runs (its routers and experts are not `nn.Linear`)."""
    target = tiny_target("qwen3_moe", seed=0, hidden_size=256, head_dim=64, num_hidden_layers=2)
    moe = get_adapter("qwen3_moe")(target)
    assert to_fp8(target, moe.layers())[:4] == [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
    ]
    assert quantization.quantized_reason(moe) is None
    experts = moe.layers()[0].mlp.experts
    experts.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach().to(fp8_ops.FP8), requires_grad=False)
    assert quantization.quantized_reason(moe) == (
        "the target is FP8-quantized: layer 0's mlp.experts holds FP8 weights: it is not a projection the fast "
        "engine reads in 8 bits"
    )
    drafter = tiny_drafter(target, seed=1, taps=[0, 1], hidden_size=256)
    with pytest.raises(UnsupportedModelError, match="layer 0's mlp.experts holds FP8 weights"):
        fast_engine(moe, drafter, MASK, max_len=48, graphs=False, fp8="torch")

    adapter, _ = fp8_pair("aligned")
    head = adapter.model.lm_head
    head.weight = nn.Parameter(fp8_ops.quantize(head.weight.detach())[0], requires_grad=False)
    assert quantization.quantized_reason(adapter).endswith(
        "lm_head holds FP8 weights outside the decoder layers"
    )

    adapter, _ = fp8_pair("aligned")
    o = adapter.layers()[1].self_attn.o_proj
    o.weight_scale_inv = nn.Parameter(o.weight_scale_inv[:1].clone(), requires_grad=False)
    assert quantization.quantized_reason(adapter) == (
        "the target is FP8-quantized: layer 1's self_attn.o_proj holds FP8 weights: its weight_scale_inv is "
        "float32 [1, 2], not fp32 [2, 2] (one scale per 128 x 128 block)"
    )


def test_report_says_where_the_fast_engine_runs_an_fp8_target():
    cfg = {"quantization_config": FP8_128}

    def fast(capability, present=("accelerate", "kernels", "triton")):
        report = quantization.report(cfg, have=lambda name: name in present, gpu=lambda: capability)
        return report.detail.partition("fast engine: ")[2]

    assert fast((9, 0)) == "runs it (FP8 kernels reading the 8-bit weights)"
    assert (
        fast((8, 9)) == "falls back to eager: GPU compute capability 8.9 < 9.0 (its FP8 kernels need Hopper)"
    )
    assert fast(None) == "falls back to eager: no GPU seen (its FP8 kernels need a Hopper GPU)"
    assert fast((9, 0), ("accelerate", "kernels")).endswith(
        "its FP8 kernels need triton (pip install triton)"
    )
    mx = quantization.report({"quantization_config": {"quant_method": "mxfp4"}}, gpu=lambda: (9, 0))
    assert mx.fast == "falls back to eager (it runs block-wise FP8 targets only)"


def test_a_loaded_configs_method_is_its_name():
    """transformers' config objects hold their method as an enum: read as its value."""
    from transformers import FineGrainedFP8Config

    assert quantization.method_of(FineGrainedFP8Config(weight_block_size=[128, 128])) == "fp8"


# ---- options -----------------------------------------------------------------------------------------------
def test_fp8_option_and_its_environment_variable(monkeypatch):
    assert FastOptions().fp8 is None and FastOptions.from_env({"DFLASH_ZOO_FP8": "w8a8"}).fp8 == "w8a8"
    with pytest.raises(ConfigError, match="fp8 must be one of weight_only, w8a8, torch"):
        FastOptions(fp8="int8")
    with pytest.raises(ConfigError, match="DFLASH_ZOO_FP8='fp4' is not one of"):
        FastOptions.from_env({"DFLASH_ZOO_FP8": "fp4"})
    pytest.importorskip("triton")
    from dflash_zoo.cuda.static.kernel_choice import choose_kernels

    cuda = torch.device("cuda")  # no device is touched
    assert choose_kernels(cuda, FastOptions()).fp8 == "weight_only"
    assert choose_kernels(cuda, FastOptions(fp8="w8a8")).fp8 == "w8a8"
    assert choose_kernels(cuda, FastOptions.from_env({"DFLASH_ZOO_KERNELS": "0"})).fp8 == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert choose_kernels(torch.device("cpu"), FastOptions()).fp8 == "torch"


# ---- bench -------------------------------------------------------------------------------------------------
def test_divergence_report():
    d = divergence([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert d["first_divergence"] == [2, None] and d["identical_share"] == 7 / 8 and d["prefix_share"] == 6 / 8


def test_bench_fp8_writes_the_fp8_record_with_its_bf16_comparison(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path))
    args = ["bench", "--shape", "tiny-qwen3", "--fp8", "--prompt-tokens", "6", "--new-tokens", "8"]
    args += [
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--device",
        "cpu",
        "--no-graphs",
        "--out",
        str(tmp_path / "r.json"),
    ]
    result = CliRunner().invoke(cli, args, env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    rec = json.loads((tmp_path / "r.json").read_text())
    assert list(rec["results"]) == ["fast"] and rec["results"]["fast"]["engine"]["fp8"] == "torch"
    quant = rec["subject"]["quantization"]
    assert quant["weight_block_size"] == [128, 128] and "self_attn.q_proj" in quant["converted_per_layer"]
    assert rec["subject"]["weight_bytes"]["target_total"] < quant["bf16_weight_bytes"]["target_total"]
    fp8 = rec["fp8"]
    assert set(fp8["bf16_results"]["fast"]) >= {"autoregressive", "dflash"}
    assert set(fp8["speedup_vs_bf16"]["fast"]) == {"autoregressive", "dflash"}
    d = fp8["divergence"]
    assert d["prompts"] == 4 and d["new_tokens"] == [8] * 4 and len(d["first_divergence"]) == 4
    assert 0 <= d["identical_share"] <= 1
    err = result.stderr
    assert "FP8 / bf16 tok/s: autoregressive" in err and "fast: FP8 projections torch" in err
    assert "greedy FP8 vs bf16 over 4 prompts: first divergence at" in err


def test_bench_fp8_usage_errors():
    runner = CliRunner()
    res = runner.invoke(cli, ["bench", "qwen3-8b", "--fp8"])
    assert res.exit_code == 2 and "--fp8 quantizes a --shape's random weights" in res.output
    res = runner.invoke(cli, ["bench", "--shape", "tiny-qwen3", "--fp8", "--path", "eager"])
    assert res.exit_code == 2 and "--fp8 measures the fast engine" in res.output


# ---- GPU ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("rows", [1, 5, 16, 100])
def test_fp8_kernels_bf16_on_cuda(rows):
    """bf16 activations on the GPU, every weight-only config of the row count and the tuned choice: within a
    bf16 rounding or two of the fp32 reference."""
    if torch.cuda.get_device_capability() < fp8_ops.CAPABILITY:
        pytest.skip("needs a Hopper GPU")
    gen = torch.Generator(device="cuda").manual_seed(rows)
    q, s = fp8_ops.quantize(torch.randn(4096, 4160, device="cuda", generator=gen))
    x = torch.randn(rows, 4160, device="cuda", generator=gen).bfloat16()
    want = fp8_ops.reference(x, q, s, dtype=torch.float32)
    configs = fp8_ops._configs(rows, False)
    for config in configs:
        got = fp8_ops._launch(x, q, s, None, None, config, 1, False, torch.bfloat16)
        torch.testing.assert_close(got.float(), want, atol=0.1, rtol=1.6e-2)
    tuned = fp8_ops.linear(x, q, s, None, tune=True)  # the tuner times every config, then runs the best
    torch.testing.assert_close(tuned.float(), want, atol=0.1, rtol=1.6e-2)


@pytest.mark.gpu
@CUDA
def test_bf16_tensor_core_kernel_reads_every_e4m3_value_exactly(monkeypatch):
    """The bit-operation e4m3 -> bf16 conversion of the tensor-core kernel (`fp8_kernels.e4m3_bf16`): one-hot
    rows pick the weight's columns, which hold every finite e4m3 byte (subnormals and both zeros included),
    so each output is one weight times 1: equal to torch's own cast, bit for bit, for every config. Passed on
    one H100, so `fp8.BITS_CUDA_VERIFIED` makes the conversion the kernel's default on CUDA."""
    if torch.cuda.get_device_capability() < fp8_ops.CAPABILITY:
        pytest.skip("needs a Hopper GPU")
    monkeypatch.setattr(fp8_ops, "BITS_CUDA_VERIFIED", True)
    n, c = torch.arange(128, device="cuda")[:, None], torch.arange(128, device="cuda")
    codes = (16 * n + c) % 256  # [N, K]: columns 0..15 of the 128 rows hold every byte
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3's NaNs
    q = codes.to(torch.uint8).view(fp8_ops.FP8)
    s = torch.ones(1, 1, device="cuda")
    assert set(codes[:, :16].flatten().tolist()) | {0x7F, 0xFF} == set(range(256))
    x = torch.eye(16, 128, device="cuda", dtype=torch.bfloat16)  # [16, K]: row r picks column r
    want = q[:, :16].T.to(torch.bfloat16)  # [16, N]
    for config in fp8_ops._configs(16, False):
        got = fp8_ops._launch(x, q, s, None, None, config, 1, False, torch.bfloat16)
        assert torch.equal(got, want), config


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("rows", [5, 16, 100])
def test_fp8_w8a8_kernels_on_cuda(rows):
    """w8a8 on random inputs against its own reference (the hardware cast rounds to nearest even; bf16 rows put
    many values on e4m3 ties, so the reference's scales must be the kernels' to the last bit)."""
    if torch.cuda.get_device_capability() < fp8_ops.CAPABILITY:
        pytest.skip("needs a Hopper GPU")
    gen = torch.Generator(device="cuda").manual_seed(rows)
    q, s = fp8_ops.quantize(torch.randn(4096, 4160, device="cuda", generator=gen))
    x = torch.randn(rows, 4160, device="cuda", generator=gen).bfloat16()
    w8 = fp8_ops.reference(x, q, s, w8a8=True, dtype=torch.float32)
    for config in fp8_ops._configs(rows, True):
        got = fp8_ops._launch(x, q, s, None, None, config, 1, False, torch.bfloat16)
        torch.testing.assert_close(got.float(), w8, atol=0.1, rtol=1.6e-2)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp8_engine_in_cuda_graphs(shape):
    """fp32 activations in CUDA graphs: the FP8 kernels give the torch reference projection's tokens, speculative
    and autoregressive; selection picks the fast engine on Hopper. bf16: the graphed FP8 engine captures and
    decodes (equality with another kernel's rounding is not expected there). Once this passes on a GPU,
    `quantization.FP8_CUDA_VERIFIED` makes the FP8 path the default there."""
    if torch.cuda.get_device_capability() < fp8_ops.CAPABILITY:
        pytest.skip("needs a Hopper GPU")
    adapter, drafter = fp8_pair(shape, device="cuda")
    auto = choose_engine(
        adapter, "cuda", EngineOptions(), drafter=drafter
    )  # opt-in until this test has passed
    assert (
        auto.name == "fast" if FP8_CUDA_VERIFIED else "FP8 fast path is verified on CPU only" in auto.reason
    )
    assert choose_engine(adapter, "cuda", EngineOptions(fast=True), drafter=drafter).name == "fast"
    cfg = GenerationConfig(max_new_tokens=24)
    ref = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False, fp8="torch")
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=True)
    assert eng.kernels.fp8 == "weight_only"
    for seed in range(2):
        want = ref.autoregressive(_prompt(seed), cfg).output_ids
        assert eng.speculative(_prompt(seed), cfg).output_ids == want
        assert eng.autoregressive(_prompt(seed), cfg).output_ids == want
    adapter, drafter = fp8_pair(shape, device="cuda", dtype=torch.bfloat16)
    for mode in ("weight_only", "w8a8"):
        eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=True, fp8=mode)
        res = eng.speculative(_prompt(), cfg)
        assert len(res.output_ids) == 24 and eng.capture_seconds > 0


@pytest.mark.gpu
@CUDA
def test_bench_fp8_on_cuda(tmp_path, monkeypatch):
    """`bench --shape tiny-qwen3 --fp8` on the GPU: graphs, the FP8 kernels, the record's comparison."""
    if torch.cuda.get_device_capability() < fp8_ops.CAPABILITY:
        pytest.skip("needs a Hopper GPU")
    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path))
    args = ["bench", "--shape", "tiny-qwen3", "--fp8", "--prompt-tokens", "32", "--new-tokens", "32"]
    args += ["--warmup", "0", "--repeats", "1", "--device", "cuda", "--what-if-acceptance", "4"]
    args += ["--out", str(tmp_path / "r.json")]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    rec = json.loads((tmp_path / "r.json").read_text())
    assert (
        rec["results"]["fast"]["engine"]["fp8"] == "weight_only" and rec["fp8"]["divergence"]["prompts"] == 4
    )
