"""Quantized targets and drafters (dflash_zoo/quantization.py, dflash_zoo/formats/quantized.py).

- `report` says what a `quantization_config` is and what runs it here, naming the missing package or the GPU's
  compute capability (probes injected: no package or GPU is faked in the code under test); `check` shows it as
  a row, and a quantized drafter as a FAIL row with the evidence.
- the fast engine falls back to eager for a quantized target and `last_choice` says why.
- a pre-quantized FP8 checkpoint (block-wise e4m3 weights + `weight_scale_inv`, as transformers' `fp8` method
  stores them) loads through transformers' own quantizer with the dtype asked for: on CPU transformers
  dequantizes it, and speculative greedy output equals the target's own greedy output; without accelerate the
  load is refused naming it. On a GPU (`gpu`) the FP8 modules themselves run: taps, logits and rollback too.
- a quantized drafter is refused by default with the published evidence; with the flag an FP8 block-scaled one
  loads dequantized exactly (weight * scale in fp32), and packed integer weights are refused even then.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from dflash_zoo.adapters import get_adapter
from safetensors.torch import load_file, save_file

from dflash_zoo import quantization
from dflash_zoo.engine.checkpoint import load_drafter, save_drafter
from dflash_zoo.engine.options import EngineOptions
from dflash_zoo.engine.select import choose_engine
from dflash_zoo.errors import UnsupportedModelError
from dflash_zoo.formats.quantized import QuantizedDrafterError
from tests.cli_runner import run_cli
from tests.tiny import save_tiny_pair, tiny_drafter, tiny_target

BLOCK = 16
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (float8_e4m3fn weight [N, K], fp32 scale per BLOCK x BLOCK block [N/B, K/B]) with w ~ q * s."""
    n, k = w.shape
    blocks = w.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # 448: e4m3's largest finite value
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(n, k)
    return q, scale.float()


def quantize_dir(directory, names: str = "proj.weight") -> None:
    """Rewrite a checkpoint's matching matrices as FP8 blocks + `weight_scale_inv`, and say so in its config."""
    state = load_file(str(directory / "model.safetensors"))
    out = {}
    for name, t in state.items():
        if name.endswith(names) and t.dim() == 2:
            out[name], out[name.removesuffix(".weight") + ".weight_scale_inv"] = fp8_blocks(t.float())
        else:
            out[name] = t
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {**FP8_CONFIG, "modules_to_not_convert": ["lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))


# ---- the report: torch-free, probes injected ----------------------------------------------------------------
CONFIGS = {
    "fp8": FP8_CONFIG,
    "mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]},
    "bnb": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128},
    "modelopt": {"quant_method": "modelopt", "quant_algo": "NVFP4"},
    "fbgemm": {"quant_method": "fbgemm_fp8"},
}


def probe(present=(), capability=None):
    return dict(have=lambda name: name in present, gpu=lambda: capability)


@pytest.mark.parametrize(
    "name,present,capability,status,words",
    [
        ("fp8", ("accelerate", "kernels"), (9, 0), "PASS", ["block-wise 16x16", "kernels-community/finegrained-fp8"]),
        ("fp8", ("accelerate", "kernels"), None, "WARN", ["no GPU seen", "dequantizes it to bf16"]),
        ("fp8", ("accelerate", "kernels"), (8, 0), "WARN", ["compute capability 8.0 < 8.9"]),
        ("fp8", ("kernels",), (9, 0), "WARN", ["needs accelerate installed", "pip install accelerate"]),
        ("fp8", ("accelerate",), (9, 0), "WARN", ["without kernels"]),
        ("mxfp4", ("accelerate", "triton", "kernels"), (9, 0), "PASS", ["MXFP4 kernels"]),
        ("bnb", ("accelerate",), (9, 0), "WARN", ["bitsandbytes_4bit", "pip install bitsandbytes", "nf4"]),
        ("gptq", ("optimum", "gptqmodel"), None, "PASS", ["4-bit, group 128", "GPTQ quantizer"]),
        ("modelopt", (), (10, 0), "FAIL", ["transformers loads no pre-quantized", "dflash-zoo serve"]),
        # transformers refuses fbgemm below Hopper: `check` must not call that pair compatible
        ("fbgemm", ("accelerate", "fbgemm_gpu"), (8, 0), "FAIL", ["8.0 < 9.0: transformers refuses it"]),
        ("fbgemm", ("accelerate", "fbgemm_gpu"), None, "FAIL", ["no GPU seen"]),
    ],
)  # fmt: skip
def test_report_names_what_runs_it_and_what_is_missing(name, present, capability, status, words):
    r = quantization.report({"quantization_config": CONFIGS[name]}, **probe(present, capability))
    assert r.status == status, r.detail
    assert all(w in r.detail for w in words), r.detail
    assert "fast engine: falls back to eager" in r.detail


def test_unquantized_and_unknown_methods():
    assert quantization.report({}).detail == "not quantized" and quantization.report({}).status == "PASS"
    r = quantization.report({"text_config": {"quantization_config": {"quant_method": "hqq2"}}})
    assert r.method == "hqq2" and r.status == "WARN" and "requirements not known" in r.detail


def test_check_shows_the_quantization_rows(tmp_path):
    target_dir, draft_dir = save_tiny_pair(tmp_path)
    config = json.loads((target_dir / "config.json").read_text())
    config["quantization_config"] = FP8_CONFIG
    (target_dir / "config.json").write_text(json.dumps(config))
    res = run_cli("check", "--target", str(target_dir), "--draft", str(draft_dir), "--offline", "--json")
    rows = {r["check"]: r for r in json.loads(res.stdout)["rows"]}
    assert rows["quantization"]["detail"].startswith("fp8 (block-wise 16x16, dynamic activations)")
    draft = json.loads((draft_dir / "config.json").read_text())
    draft["quantization_config"] = FP8_CONFIG
    (draft_dir / "config.json").write_text(json.dumps(draft))
    res = run_cli("check", "--target", str(target_dir), "--draft", str(draft_dir), "--offline", "--json")
    rows = {r["check"]: r for r in json.loads(res.stdout)["rows"]}
    assert res.code == 3 and rows["drafter quantization"]["status"] == "FAIL"
    assert "sgl-project/sglang#39087" in rows["drafter quantization"]["detail"]


def test_check_sees_a_drafter_quantized_in_its_tensors_only(tmp_path):
    """No quantization_config, FP8 weights: `generate` refuses it, so `check` does too (from the header)."""
    from safetensors.torch import load_file, save_file

    target_dir, draft_dir = save_tiny_pair(tmp_path)
    args = ("check", "--target", str(target_dir), "--draft", str(draft_dir), "--offline", "--json")
    assert "drafter quantization" not in {r["check"] for r in json.loads(run_cli(*args).stdout)["rows"]}
    weights = draft_dir / "model.safetensors"
    state = load_file(str(weights))
    name = next(k for k in state if k.endswith("down_proj.weight"))
    state[name] = state[name].to(torch.float8_e4m3fn)
    save_file(state, str(weights))
    res = run_cli(*args)
    rows = {r["check"]: r for r in json.loads(res.stdout)["rows"]}
    assert res.code == 3 and f"tensor {name} is F8_E4M3" in rows["drafter quantization"]["detail"]


# ---- engine selection ------------------------------------------------------------------------------------------
def test_fast_engine_falls_back_to_eager_for_a_quantized_target():
    model = tiny_target("qwen3")
    adapter = get_adapter("qwen3")(model)
    assert choose_engine(adapter, "cpu", EngineOptions(fast=True)).name == "fast"
    model.config.quantization_config = FP8_CONFIG
    assert (
        quantization.quantized_reason(adapter) is None
    )  # a config alone (dequantized weights): plain modules
    model.hf_quantizer = object()  # what transformers sets on a model its quantizer loaded
    # FP8 weights dequantized on load are plain: the fast engine runs them (FP8 ones: tests/test_fp8.py)
    assert choose_engine(adapter, "cpu", EngineOptions(fast=True)).name == "fast"
    model.config.quantization_config = CONFIGS["mxfp4"]
    assert "runs no MXFP4 targets" in choose_engine(adapter, "cpu", EngineOptions(fast=True)).reason


# ---- a pre-quantized FP8 target ---------------------------------------------------------------------------------
@pytest.fixture
def fp8_pair(tmp_path):
    target_dir, draft_dir = save_tiny_pair(tmp_path)
    quantize_dir(target_dir)
    return target_dir, draft_dir


@pytest.mark.skipif(HAS_ACCELERATE, reason="accelerate is installed: the refusal does not apply")
def test_fp8_target_without_accelerate_is_refused_naming_it(fp8_pair):
    from dflash_zoo.loading import load_target

    with pytest.raises(UnsupportedModelError, match="fp8-quantized and transformers needs accelerate") as err:
        load_target(str(fp8_pair[0]), "cpu", torch.float32, None)
    assert err.value.hint == "pip install accelerate"


def test_fp8_target_on_cpu_is_dequantized_and_lossless(fp8_pair):
    pytest.importorskip("accelerate", reason="transformers' FP8 quantizer needs accelerate")
    import dflash_zoo

    pipe = dflash_zoo.load(str(fp8_pair[0]), str(fp8_pair[1]), device="cpu", dtype="fp32")
    stored = load_file(str(fp8_pair[0] / "model.safetensors"))
    q, scale = (
        stored["model.layers.0.self_attn.q_proj.weight"],
        stored["model.layers.0.self_attn.q_proj.weight_scale_inv"],
    )
    layer = pipe.model.model.layers[0].self_attn.q_proj
    assert q.dtype == torch.float8_e4m3fn and layer.weight.dtype == torch.float32  # the dtype asked for
    expected = q.float() * scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    assert torch.equal(layer.weight, expected)  # transformers dequantized the blocks itself
    for prompt in ([5, 9, 3, 7], [40, 41, 42]):
        spec = pipe.generate(prompt, max_new_tokens=32)
        assert spec.output_ids == pipe.generate_autoregressive(prompt, max_new_tokens=32).output_ids


@pytest.mark.gpu
def test_fp8_target_runs_its_fp8_modules_on_gpu(fp8_pair):
    """On CUDA (compute capability >= 8.9) transformers keeps the FP8 modules: taps, logits, rollback and the
    lossless loop run through them, on the eager engine, and `last_choice` says why not the fast one."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU of compute capability >= 8.9")
    pytest.importorskip("accelerate")
    try:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

        load_finegrained_fp8_kernel()
    except (ImportError, ValueError, OSError) as exc:  # from the Hub: offline, none is cached
        pytest.skip(f"transformers' FP8 kernel is not available here: {exc}")
    import dflash_zoo

    pipe = dflash_zoo.load(str(fp8_pair[0]), str(fp8_pair[1]), device="cuda", dtype="bf16")
    assert "FP8" in type(pipe.model.model.layers[0].self_attn.q_proj).__name__
    adapter = pipe.adapter
    ids = torch.tensor([[5, 9, 3, 7, 11, 13]], device="cuda")
    with torch.no_grad():
        ref = pipe.model(ids, output_hidden_states=True)
        with adapter.tap([0, 2]) as taps:
            cache = adapter.new_cache()
            logits = adapter.forward(ids, cache)
        feats = taps.take()  # [1, T, 2H]
    torch.testing.assert_close(feats[..., :64], ref.hidden_states[1])
    torch.testing.assert_close(logits, ref.logits)
    for prompt in ([5, 9, 3, 7], [40, 41, 42]):
        spec = pipe.generate(prompt, max_new_tokens=32)
        assert spec.output_ids == pipe.generate_autoregressive(prompt, max_new_tokens=32).output_ids
    assert pipe.last_choice.name == "eager" and "FP8" in pipe.last_choice.reason


# ---- quantized drafters -------------------------------------------------------------------------------------------
@pytest.fixture
def fp8_drafter_dir(tmp_path):
    drafter = tiny_drafter(tiny_target("qwen3"), seed=2)
    save_drafter(drafter, tmp_path / "d")
    quantize_dir(tmp_path / "d", names=".weight")
    return tmp_path / "d"


def test_quantized_drafter_is_refused_with_the_evidence(fp8_drafter_dir):
    with pytest.raises(QuantizedDrafterError) as err:
        load_drafter(fp8_drafter_dir)
    msg = str(err.value)
    assert (
        "quant_method 'fp8'" in msg and "sgl-project/sglang#39087" in msg and "vllm-project/vllm#53116" in msg
    )
    assert err.value.exit_code == 2 and "--allow-quantized-drafter" in err.value.hint


def test_allowed_fp8_drafter_is_dequantized_exactly(fp8_drafter_dir):
    state = load_file(str(fp8_drafter_dir / "model.safetensors"))
    drafter = load_drafter(fp8_drafter_dir, allow_quantized=True)
    q, s = state["fc.weight"], state["fc.weight_scale_inv"]
    expected = q.float() * s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    assert torch.equal(drafter.fc.weight, expected)  # transformers' Fp8Dequantize arithmetic, in fp32


def test_packed_integer_drafter_weights_are_refused_even_when_allowed(fp8_drafter_dir):
    state = load_file(str(fp8_drafter_dir / "model.safetensors"))
    state["fc.weight"] = state["fc.weight"].view(torch.int8)
    save_file(state, str(fp8_drafter_dir / "model.safetensors"))
    with pytest.raises(QuantizedDrafterError, match=r"tensor fc\.weight is int8: packed integer weights"):
        load_drafter(fp8_drafter_dir, allow_quantized=True)


def test_cli_flag_lets_a_quantized_drafter_run(tmp_path):
    target_dir, draft_dir = save_tiny_pair(tmp_path)
    quantize_dir(draft_dir, names=".weight")
    args = ("generate", "ab", "--target", str(target_dir), "--draft", str(draft_dir), "--raw", "-n", "8")
    refused = run_cli(*args, "--device", "cpu")
    assert refused.code == 2 and "sglang#39087" in refused.stderr
    ran = run_cli(*args, "--device", "cpu", "--allow-quantized-drafter", "--json")
    assert ran.code == 0, ran.stderr
    assert len(json.loads(ran.stdout)["output_ids"]) == 8


def test_convert_writes_an_allowed_fp8_drafter_dequantized(fp8_drafter_dir, tmp_path):
    assert run_cli("convert", str(fp8_drafter_dir), "--to", "zlab", str(tmp_path / "z")).code == 2
    res = run_cli(
        "convert", str(fp8_drafter_dir), "--to", "zlab", str(tmp_path / "z"), "--allow-quantized-drafter"
    )
    assert res.code == 0, res.stderr
    assert "quantization_config" not in json.loads((tmp_path / "z" / "config.json").read_text())
    back = load_drafter(tmp_path / "z")  # plain float weights now: no flag needed
    assert torch.equal(back.fc.weight, load_drafter(fp8_drafter_dir, allow_quantized=True).fc.weight)
