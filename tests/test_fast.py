"""The static / graphed fast path (cuda/static/) against the eager reference loop (decode.py), fp32 on CPU.

Engines default to fused q/k/v + gate/up weights and `F.rms_norm`; `UNFUSED` is the plain-module baseline.
The fast-vs-eager comparisons run for every adapter that declares a `static_layout` (tests/static_matrix.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from dflash_zoo.adapters import get_adapter
from dflash_zoo.adapters.base import GatedMLP, SparseMoE, StaticAttention, StaticLayout

from dflash_zoo.bench.runner import whatif_schedule
from dflash_zoo.cuda.static.fast import COMPILE_OPTIONS, FastEngine
from dflash_zoo.cuda.static.kernel_choice import COMPILED_DECODE_ATTENTION
from dflash_zoo.engine.decode import SpeculativeDecoder, autoregressive_generate
from dflash_zoo.engine.options import EngineOptions, FastOptions
from dflash_zoo.engine.results import GenerationConfig
from dflash_zoo.engine.static_support import unsupported_reason
from dflash_zoo.errors import UnsupportedModelError
from tests.oracles import greedy_reference
from tests.static_matrix import REQUIRED, STATIC_MODEL_TYPES, fast_engine, static_pair
from tests.tiny import VOCAB, tiny_drafter, tiny_target

MASK = VOCAB - 1
BLOCK = 8
UNFUSED = {"fuse": False, "fast_norm": False}


_pair = static_pair  # (adapter, drafter) of a tiny fp32 pair


def _eager(adapter, drafter, prompt, cfg, override=None):
    dec = SpeculativeDecoder(adapter, drafter, prompt, cfg, MASK, override)
    for _ in dec:
        pass
    return dec.result


def _prompts(n: int = 2, length: int = 10) -> list[list[int]]:
    return [
        torch.randint(0, MASK, (length,), generator=torch.Generator().manual_seed(s)).tolist()
        for s in range(n)
    ]


def _assert_both_paths_equal_ar(eng: FastEngine, adapter, cfg: GenerationConfig, device: str = "cpu") -> None:
    """The engine's speculative and autoregressive outputs equal the eager autoregressive reference."""
    for prompt in _prompts():
        ref = autoregressive_generate(adapter, prompt, cfg, device).output_ids
        assert eng.speculative(prompt, cfg).output_ids == ref
        assert eng.autoregressive(prompt, cfg).output_ids == ref


def _full_block_steps(res, max_new: int) -> int:
    """Steps the eager loop ran with a full block (near the end it verifies fewer slots)."""
    done, n = 1, 0
    for step in res.steps:
        if max_new - done < BLOCK:
            break
        done, n = done + step.acceptance_length, n + 1
    return n


@pytest.mark.parametrize(
    "variant",
    [{}, UNFUSED, {"decode_attention": "sums"}, {"decode_attention": "chunks"}],
    ids=["fused", "unfused", "sums", "chunks"],
)
@pytest.mark.parametrize("model_type", STATIC_MODEL_TYPES)
def test_fast_path_equals_eager_token_for_token(model_type, variant):
    """Static engine == eager loop == eager AR == transformers' greedy `generate`, token for token (fp32)."""
    adapter, drafter = _pair(model_type)
    cfg = GenerationConfig(max_new_tokens=20)
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False, **variant)
    for prompt in _prompts():
        ref = autoregressive_generate(adapter, prompt, cfg).output_ids
        eager, fast = _eager(adapter, drafter, prompt, cfg), eng.speculative(prompt, cfg)
        assert fast.output_ids == eager.output_ids == ref == greedy_reference(adapter.model, prompt, 20)
        assert eng.autoregressive(prompt, cfg).output_ids == ref
        n = _full_block_steps(eager, cfg.max_new_tokens)
        assert [s.proposed for s in fast.steps[:n]] == [s.proposed for s in eager.steps[:n]]


@pytest.mark.parametrize("model_type", STATIC_MODEL_TYPES)
def test_forced_acceptance_rollback_agrees(model_type):
    """A forced schedule commits drafts (na varies 1..3): both paths roll back and extend context alike."""
    adapter, drafter = _pair(model_type)
    cfg = GenerationConfig(max_new_tokens=27)
    override = whatif_schedule(3.25, BLOCK)
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False)
    prompt = _prompts(1)[0]
    eager, fast = (
        _eager(adapter, drafter, prompt, cfg, override),
        eng.speculative(prompt, cfg, accept_override=override),
    )
    n = _full_block_steps(eager, cfg.max_new_tokens)
    assert n >= 5
    assert fast.acceptance_lengths == eager.acceptance_lengths
    upto = 1 + sum(eager.acceptance_lengths[:n])
    assert fast.output_ids[:upto] == eager.output_ids[:upto]
    assert len(fast.output_ids) == len(eager.output_ids) == cfg.max_new_tokens


def test_profiling_replays_run_the_real_steps_and_leave_the_engine_as_it_was():
    """`replays` (bench --profile): the draft step is the spec step's drafter part, spec and AR replays
    commit one position each, and a generation afterwards equals one before."""
    from dflash_zoo.bench.profile import profile_steps

    adapter, drafter = _pair("qwen3")
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False)
    prompt, cfg = _prompts(1)[0], GenerationConfig(max_new_tokens=12)
    before = eng.speculative(prompt, cfg)
    eng.replays(prompt, cfg, "draft")(2)
    assert eng.out[1:BLOCK].tolist() == before.steps[0].proposed  # the first step's full-block draft
    run = eng.replays(
        prompt, cfg, "spec"
    )  # prefill, then one step captured (here: run) with nothing accepted
    run(3)
    assert int(eng.pos) == len(prompt) + 4 and int(eng.force) == -1
    with pytest.raises(ValueError, match="do not fit"):
        run(eng.size)
    prof = profile_steps(eng, prompt, cfg, replays=5)
    assert prof["replays"] == 5 and set(prof) >= {
        "ar",
        "spec",
        "draft",
        "drafter",
        "drafter_share",
        "draft_share",
    }
    assert all(prof[k]["ms_per_step"] > 0 for k in ("ar", "spec", "draft", "drafter"))
    after = eng.speculative(prompt, cfg)
    assert after.output_ids == before.output_ids
    assert [s.proposed for s in after.steps] == [s.proposed for s in before.steps]


def test_engine_is_reusable_and_stops():
    adapter, drafter = _pair("qwen3")
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False)
    prompt = _prompts(1)[0]
    first = eng.speculative(prompt, GenerationConfig(max_new_tokens=12)).output_ids
    stop = first[5]
    res = eng.speculative(prompt, GenerationConfig(max_new_tokens=12, stop_token_ids=(stop,)))
    assert res.output_ids == first[: first.index(stop) + 1] and res.stop_reason == "stop_token"


@pytest.mark.parametrize("mode", ["autoregressive", "speculative"])
def test_each_step_is_launched_before_the_host_reads_the_one_before(mode, monkeypatch):
    """A step's successor is queued before the host waits for the step, unless the run could end with it by
    length (so a generation that ends by length runs no step it does not read); a stop token leaves at most
    one step unread. The tokens are those of a generation with no successor queued ahead."""
    adapter, drafter = _pair("qwen3")
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False)
    prompt, cfg = _prompts(1)[0], GenerationConfig(max_new_tokens=12)
    want = eng.speculative(prompt, cfg).output_ids
    assert eng.autoregressive(prompt, cfg).output_ids == want
    log, step, pipelined = [], eng._run_step, eng._pipelined

    def launch(name, sampler):
        log.append("launch")
        step(name, sampler)

    def reads(*args):
        for row in pipelined(*args):
            log.append("read")
            yield row

    monkeypatch.setattr(eng, "_run_step", launch)
    monkeypatch.setattr(eng, "_pipelined", reads)
    res = getattr(eng, mode)(prompt, cfg)
    assert res.output_ids == want and res.stop_reason == "max_new_tokens"
    assert log.count("launch") == log.count("read")  # ended by length: every step read
    if mode == "autoregressive":  # 11 steps: each but the last launched ahead of the read before it
        assert log == ["launch"] + ["launch", "read"] * 10 + ["read"]
    else:
        assert log[:3] == ["launch", "launch", "read"]
    log.clear()
    res = getattr(eng, mode)(prompt, replace(cfg, stop_token_ids=(want[5],)))
    assert res.output_ids == want[: want.index(want[5]) + 1] and res.stop_reason == "stop_token"
    assert log.count("launch") - log.count("read") in (0, 1)


def test_the_matrix_holds_the_fast_path_families():
    """An empty or shrunken matrix would let every parametrised comparison pass by running nothing."""
    assert set(REQUIRED) <= set(STATIC_MODEL_TYPES)
    assert all(isinstance(get_adapter(t).static_layout, StaticLayout) for t in STATIC_MODEL_TYPES)


def test_mixed_dense_and_sparse_moe_layers_equal_eager():
    """`decoder_sparse_step=2`: dense and sparse MoE layers alternate; each runs by the kind the layout finds."""
    adapter, drafter = _pair("qwen3_moe", decoder_sparse_step=2)
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False)
    assert [g is None for g in eng.target.gate_up] == [False, True, False, True]
    prompt, cfg = _prompts(1)[0], GenerationConfig(max_new_tokens=12)
    ref = autoregressive_generate(adapter, prompt, cfg).output_ids
    assert eng.speculative(prompt, cfg).output_ids == eng.autoregressive(prompt, cfg).output_ids == ref


_QWEN3 = get_adapter("qwen3").static_layout
BROKEN_LAYOUTS = {  # each names something the tiny Qwen3 target does not have, or not as a projection
    "q_norm": (replace(_QWEN3, attention=StaticAttention(q_norm="q_ln", k_norm="k_ln")), "self_attn.q_ln"),
    "attention": (replace(_QWEN3, attention=StaticAttention(path="attn")), "layer 0.attn"),
    "gate": (replace(_QWEN3, mlp=GatedMLP(gate_proj="w1")), "layer 0.mlp.w1"),
    "rotary": (replace(_QWEN3, rotary_emb="model.rope"), "model.rope"),
    "not_linear": (replace(_QWEN3, attention=StaticAttention(q_proj="q_norm", q_norm="q_norm", k_norm="k_norm")),
                   "not an nn.Linear"),
    "dense_only": (replace(_QWEN3, mlp=None, moe=SparseMoE()), "no 'experts' child"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BROKEN_LAYOUTS))
def test_a_layout_naming_a_missing_module_fails_clearly(case):
    layout, named = BROKEN_LAYOUTS[case]
    broken = type("BrokenAdapter", (get_adapter("qwen3"),), {"static_layout": layout})  # not registered
    adapter, drafter = _pair("qwen3")
    with pytest.raises(UnsupportedModelError, match="static layout of the 'qwen3' adapter") as exc:
        fast_engine(broken(adapter.model), drafter, MASK, max_len=64, graphs=False)
    assert named in str(exc.value) and "static_layout" in exc.value.hint


def test_layout_declarations_are_checked():
    with pytest.raises(ValueError, match="q_norm and k_norm together"):
        StaticAttention(q_norm="q_norm")
    with pytest.raises(ValueError, match="mlp, moe or both"):
        StaticLayout(mlp=None)
    with pytest.raises(ValueError, match="go together"):
        StaticLayout(layer_types=("linear_attention", "full_attention"))  # GDN layers without a declaration


def test_unsupported_pairs_are_named():
    hybrid = get_adapter("deepseek_v3")(tiny_target("deepseek_v3"))  # multi-head latent attention
    assert unsupported_reason(hybrid) == "no static layout declared by the 'deepseek_v3' adapter"
    windowed = get_adapter("qwen3")(
        tiny_target("qwen3", layer_types=["full_attention", "sliding_attention"] * 2)
    )
    assert "sliding_attention layers" in unsupported_reason(windowed)
    adapter, drafter = _pair("qwen3")
    assert unsupported_reason(adapter) is None
    assert unsupported_reason(adapter, graphs=True) is None  # sampling or not: never a reason
    with pytest.raises(ValueError):
        fast_engine(hybrid, drafter, MASK, max_len=64)

    moe, _ = _pair("qwen3_moe")  # fp32, transformers' default experts implementation: grouped_mm
    assert unsupported_reason(moe) is None  # uncaptured steps may sync with the host
    # captured, fp32 grouped_mm would loop on offsets.tolist()
    assert "'grouped_mm' in float32 syncs" in unsupported_reason(moe, graphs=True)
    moe.model.to(torch.bfloat16)
    assert unsupported_reason(moe, graphs=True) is None  # torch's grouped GEMM, no sync
    moe.model.set_experts_implementation("eager")  # a Python loop over the hit experts
    assert "'eager' in bfloat16 syncs" in unsupported_reason(moe, graphs=True)
    moe.model.set_experts_implementation("batched_mm")  # gathers each token's experts
    assert unsupported_reason(moe, graphs=True) is None
    with pytest.raises(ValueError, match="experts implementation"):
        fast_engine(
            get_adapter("qwen3_moe")(tiny_target("qwen3_moe")), drafter, MASK, max_len=64, graphs=True
        )


def _capturable(adapter):
    """fp32 sparse MoE steps are captured with `batched_mm` (fp32 `grouped_mm` loops over host offsets)."""
    if adapter.static_layout.moe is not None:
        adapter.model.set_experts_implementation("batched_mm")
    return adapter


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", STATIC_MODEL_TYPES)
def test_cuda_graph_path_equals_eager_fp32(model_type):
    adapter, drafter = _pair(model_type, "cuda")
    _capturable(adapter)
    cfg = GenerationConfig(max_new_tokens=24)
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=True)
    _assert_both_paths_equal_ar(eng, adapter, cfg, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_cuda_graphs_equal_eager_fp32_and_capture_in_bf16():
    """A sparse MoE target in CUDA graphs: fp32 with batched_mm (gathers; grouped_mm would sync in fp32) equals
    eager AR; bf16 with transformers' default grouped_mm captures and decodes (equality is not expected there)."""
    adapter, drafter = _pair("qwen3_moe", "cuda")
    adapter.model.set_experts_implementation("batched_mm")
    cfg = GenerationConfig(max_new_tokens=24)
    _assert_both_paths_equal_ar(
        fast_engine(adapter, drafter, MASK, max_len=64, graphs=True), adapter, cfg, "cuda"
    )
    adapter.model.set_experts_implementation("grouped_mm")
    adapter.model.to(torch.bfloat16), drafter.to(torch.bfloat16)
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=True)
    res = eng.speculative(_prompts(1)[0], cfg)
    assert len(res.output_ids) == 24 and eng.capture_seconds > 0


def test_smaller_block_than_trained():
    adapter, drafter = _pair("llama")
    cfg = GenerationConfig(max_new_tokens=16, block_size=4)
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False, block_size=4)
    prompt = _prompts(1)[0]
    res = eng.speculative(prompt, cfg)
    assert res.output_ids == autoregressive_generate(adapter, prompt, cfg).output_ids
    # block 4: 3 proposals a step; near max_new_tokens the record lists only the slots that can still commit
    assert len(res.steps[0].proposed) == 3 and all(len(s.proposed) <= 3 for s in res.steps)


def _storage_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind a module's parameters (views of one storage count once)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()}
    return sum(storages.values())


@pytest.mark.parametrize("model_type", STATIC_MODEL_TYPES)
def test_fused_weights_are_views_and_eager_outputs_are_unchanged(model_type, tmp_path):
    from dflash_zoo.engine.checkpoint import load_drafter, save_drafter

    adapter, drafter = _pair(model_type)
    prompt, cfg = _prompts(1)[0], GenerationConfig(max_new_tokens=12)
    logits = adapter.model(torch.tensor([prompt])).logits
    eager = _eager(adapter, drafter, prompt, cfg)
    sizes = _storage_bytes(adapter.model), _storage_bytes(drafter)
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False)
    assert (_storage_bytes(adapter.model), _storage_bytes(drafter)) == sizes  # no second copy
    i = next(i for i, m in enumerate(eng.target.layers) if m.q is not None)  # the first attention layer
    for attn, fused in (
        (adapter.layers()[i].self_attn, eng.target.qkv[i]),
        (drafter.layers[0].self_attn, eng.sdraft.qkv[0]),
    ):
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            assert isinstance(proj.weight, torch.nn.Parameter)
            assert proj.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
    assert torch.equal(adapter.model(torch.tensor([prompt])).logits, logits)  # the HF forward over the views
    assert _eager(adapter, drafter, prompt, cfg).output_ids == eager.output_ids
    again = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False)  # views the fused tensors, no copy
    pairs = [(again.sdraft.gate_up[0], eng.sdraft.gate_up[0])]
    pairs += [(a, b) for a, b in zip(again.target.gate_up, eng.target.gate_up, strict=True) if b][
        :1
    ]  # None: MoE
    assert all(a.weight.data_ptr() == b.weight.data_ptr() for a, b in pairs)
    save_drafter(drafter, tmp_path / "d")  # z-lab names, shared storage is fine for safetensors
    state = load_drafter(tmp_path / "d").state_dict()
    assert all(torch.equal(v, state[k]) for k, v in drafter.state_dict().items())


def test_fused_projections_with_bias_equal_eager():
    """Llama's attention_bias / mlp_bias: the biases are fused along with the weights."""
    target = tiny_target("llama", seed=0, attention_bias=True, mlp_bias=True)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # HF initialises biases to zero, which would test nothing
    adapter = get_adapter("llama")(target)
    drafter = tiny_drafter(target, seed=1, taps=[0, 2])
    cfg = GenerationConfig(max_new_tokens=16)
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False)
    assert eng.target.qkv[0].bias is not None and eng.target.gate_up[0].bias is not None
    _assert_both_paths_equal_ar(eng, adapter, cfg)


@pytest.mark.parametrize("name", ["sums", "chunks"])
@pytest.mark.parametrize("t", [1, 5])
def test_decode_attention_equals_masked_sdpa(name, t):
    """Every decode attention computes the masked grouped SDPA (fp32, GQA 4:2); hidden keys do not count."""
    from dflash_zoo.cuda.ops.attention import DECODE_ATTENTION, group_mask, grouped_sdpa

    gen = torch.Generator().manual_seed(0)
    # 32 keys: "chunks" splits them into 16 chunks of 2, and those past key 6 + t are wholly hidden
    q, k, v = (torch.randn(1, n, r, 8, generator=gen) for n, r in ((4, t), (2, 32), (2, 32)))
    positions = torch.arange(6, 6 + t)
    gmask = group_mask(torch.arange(32)[None, :] <= positions[:, None], 2, torch.float32)  # [1, 1, 2T, 32]
    ref = grouped_sdpa(q, k, v, gmask, 0.3)
    attend = DECODE_ATTENTION[name]
    torch.testing.assert_close(attend(q, k, v, gmask, 0.3), ref)
    k2 = k.clone()
    k2[:, :, 6 + t :] = 1e4  # keys past every row's position
    torch.testing.assert_close(attend(q, k2, v, gmask, 0.3), ref)


def test_unknown_decode_attention_is_refused():
    adapter, drafter = _pair("qwen3")
    with pytest.raises(ValueError, match="decode_attention must be one of"):
        fast_engine(adapter, drafter, MASK, max_len=64, graphs=False, decode_attention="fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_norm_is_bitwise_hf_rmsnorm(dtype):
    from dflash_zoo.cuda.static.norms import Norms

    norm = tiny_target("qwen3").model.layers[0].input_layernorm.to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1, 0.2)
    x = torch.randn(1, 5, norm.weight.shape[0]).to(dtype)
    assert torch.equal(Norms(norm.variance_epsilon, fast=True)(norm, x), norm(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (inductor on CPU takes ~45 s here)")
@pytest.mark.parametrize("decode_attention", [None, "sums"])  # None: the compiled default
@pytest.mark.parametrize("model_type", STATIC_MODEL_TYPES)
def test_compiled_graphed_steps_equal_eager_fp32(model_type, decode_attention):
    adapter, drafter = _pair(model_type, "cuda")
    _capturable(adapter)
    cfg = GenerationConfig(max_new_tokens=24)
    eng = fast_engine(
        adapter, drafter, MASK, max_len=64, graphs=True, compile=True, decode_attention=decode_attention
    )
    _assert_both_paths_equal_ar(eng, adapter, cfg, "cuda")
    assert eng.compile_seconds > 0 and eng.capture_seconds > 0


class _Box:
    def __init__(self, t: torch.Tensor):
        self.t = t

    def bump(self) -> None:
        self.t.add_(1)


def test_compiled_steps_get_a_dynamo_cache_of_their_own():
    """A compiling engine runs its steps over its own copy of their code (`graphs.private_code`): dynamo keeps
    compiled code per code object, and a cache shared by the engines of two targets made dynamo's recompile
    check raise (`KeyError: 'language_model'`, a Gemma 4 VLM engine then a Gemma 4 text one). The copy runs
    the same method; each compiled copy holds its own cache entry and the shared code none."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list as entries

    from dflash_zoo.cuda.static.graphs import private_code

    boxes = [_Box(torch.zeros(2)) for _ in range(2)]
    steps = [private_code(b.bump) for b in boxes]
    codes = [s.__func__.__code__ for s in steps]
    assert codes[0] is not codes[1] and all(c is not _Box.bump.__code__ for c in codes)
    assert all(
        s.__self__ is b and s.__func__.__qualname__ == "_Box.bump" for s, b in zip(steps, boxes, strict=True)
    )
    for step in steps:
        torch.compile(step, backend="eager", fullgraph=True)()
    assert [b.t.tolist() for b in boxes] == [[1.0, 1.0], [1.0, 1.0]]
    assert [len(entries(c)) for c in codes] == [1, 1] and not entries(_Box.bump.__code__)
    adapter, drafter = _pair("qwen3")
    eng = fast_engine(adapter, drafter, MASK, 64, graphs=False)
    assert private_code(eng._ar_step).__func__.__code__ is not FastEngine._ar_step.__code__


def test_pipeline_baseline_runs_on_the_same_path_as_generate():
    """With the fast path on, `generate_autoregressive` uses the static target too (like-for-like speedups)."""
    from dflash_zoo.api import Pipeline

    adapter, drafter = _pair("qwen3")
    fast = Pipeline(adapter.model, drafter, None, mask_token_id=MASK, options=EngineOptions(fast=True))
    eager = Pipeline(adapter.model, drafter, None, mask_token_id=MASK, options=EngineOptions(fast=False))
    prompt = _prompts(1)[0]
    res = fast.generate_autoregressive(prompt, max_new_tokens=12)
    assert fast.last_choice.name == "fast"  # the static engine ran the baseline
    assert res.output_ids == eager.generate_autoregressive(prompt, max_new_tokens=12).output_ids


def test_pipeline_compile_flag_reaches_the_engine():
    """`compile=True` builds a compiling engine; other options rebuild it (no step runs here)."""
    from dflash_zoo.api import Pipeline

    adapter, drafter = _pair("qwen3")
    pipe = Pipeline(
        adapter.model, drafter, mask_token_id=MASK, options=EngineOptions(True, FastOptions(compile=True))
    )
    cfg = pipe.config(max_new_tokens=8)
    eng = pipe.engine(cfg, 8)
    assert eng.compile and eng.compile_seconds == 0.0  # compiled lazily, on the first step
    assert (
        eng.compile_options == COMPILE_OPTIONS and eng.kernels.decode_attention == COMPILED_DECODE_ATTENTION
    )
    pipe.options = EngineOptions(fast=True)
    plain = pipe.engine(cfg, 8)
    assert plain is not eng and not plain.compile and plain.kernels.decode_attention == "sdpa"
    assert pipe.engine(cfg, 8) is plain  # reused while nothing changes


def test_captures_run_with_the_garbage_collector_off_and_restore_it():
    """A collection inside a CUDA graph capture can free another engine's graph, which CUDA refuses mid-capture:
    `Steps._capture` and the tuner's `graph_ms` capture under `no_collection`, which leaves the collector as it
    found it."""
    import gc

    from dflash_zoo.cuda.ops.runtime import no_collection

    assert gc.isenabled()
    with no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection():
            pass
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), no_collection():
        raise RuntimeError("a failed capture")
    assert gc.isenabled()
