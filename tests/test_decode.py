"""Decode-loop edge cases: exact max_new_tokens, stop tokens mid-block, short prompts, bad input, streaming."""

from __future__ import annotations

import pytest

from dflash_zoo.api import Pipeline, check_pair
from dflash_zoo.engine.results import GenerationConfig
from dflash_zoo.engine.select import EngineOptions
from dflash_zoo.errors import IncompatiblePairError, InvalidArgumentError
from tests.oracles import OracleDecoder, greedy_reference
from tests.tiny import VOCAB, tiny_drafter, tiny_target

PROMPT = [5, 17, 42, 9, 100, 7]


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("qwen3", seed=0)
    return target, tiny_drafter(target, seed=1, block_size=8)


@pytest.fixture(scope="module")
def pipe(pair):
    return Pipeline(model=pair[0], drafter=pair[1], mask_token_id=VOCAB - 1)


def _oracle(pipe, prompt, ref, n, stops=(), block=8):
    cfg = GenerationConfig(max_new_tokens=n, block_size=block, stop_token_ids=tuple(stops))
    dec = OracleDecoder(pipe.adapter, pipe.drafter, prompt, cfg, VOCAB - 1, reference=ref)
    for _ in dec:
        pass
    return dec.result


@pytest.mark.parametrize("n", [1, 2, 8, 9, 16, 17, 30])
def test_max_new_tokens_is_exact_even_with_full_acceptance(pipe, pair, n):
    ref = greedy_reference(pair[0], PROMPT, 40)
    res = _oracle(pipe, PROMPT, ref, n)
    assert res.output_ids == ref[:n] and res.stop_reason == "max_new_tokens"
    assert sum(res.acceptance_lengths) == n - 1  # the first token comes from prefill


def test_stop_token_mid_block_is_kept_and_ends_generation(pipe, pair):
    ref = greedy_reference(pair[0], PROMPT, 40)
    j = next(i for i in range(3, 40) if ref[i] not in ref[:i])  # a first occurrence inside a later block
    res = _oracle(pipe, PROMPT, ref, 40, stops=[ref[j]])
    assert res.output_ids == ref[: j + 1] and res.stop_reason == "stop_token"
    assert res.steps[-1].acceptance_length <= res.steps[-1].accepted + 1


def test_stop_token_as_first_token(pipe, pair):
    ref = greedy_reference(pair[0], PROMPT, 4)
    res = pipe.generate(PROMPT, max_new_tokens=10, stop_token_ids=[ref[0]])
    assert res.output_ids == ref[:1] and res.steps == []


def test_prompt_of_one_token(pipe, pair):
    ref = greedy_reference(pair[0], [7], 20)
    assert pipe.generate([7], max_new_tokens=20).output_ids == ref


def test_result_schema_and_statistics(pipe, pair):
    res = _oracle(pipe, PROMPT, greedy_reference(pair[0], PROMPT, 20), 20)
    d = res.to_dict()
    for key in (
        "output_ids",
        "text",
        "acceptance_lengths",
        "steps",
        "mean_acceptance_length",
        "tokens_per_second",
    ):
        assert key in d
    assert all(len(s["proposed"]) == 7 for s in d["steps"][:-1])  # block_size - 1 proposals per step
    assert d["mean_acceptance_length"] == pytest.approx(sum(d["acceptance_lengths"]) / len(d["steps"]))
    assert sum(res.histogram.values()) == len(res.steps)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"block_size": 1}, "block_size must be >= 2"),
        ({"block_size": 9}, "exceeds the drafter's trained block size 8"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_p": 1e-46, "temperature": 1.0}, "top_p must be in"),
        ({"temperature": 1e-38}, "too small to sample with"),
        ({"seed": 2**64, "temperature": 0.7}, "seed must be an integer in"),
        ({"seed": "a"}, "seed must be an integer"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
        ({"stop_token_ids": ["x"]}, "stop_token_ids must be token ids"),
        ({"stop_token_ids": 5.0}, "stop_token_ids must be token ids"),
    ],
)
def test_bad_generation_arguments(pipe, kw, message):
    with pytest.raises(InvalidArgumentError, match=message):
        pipe.generate(PROMPT, **kw)


def test_one_stop_token_id_needs_no_list(pipe):
    full = pipe.generate(PROMPT, max_new_tokens=12, stop_token_ids=[])
    stop = full.output_ids[3]
    cut = pipe.generate(PROMPT, max_new_tokens=12, stop_token_ids=stop)
    assert cut.output_ids == full.output_ids[: full.output_ids.index(stop) + 1]


@pytest.mark.parametrize(
    "prompt,message",
    [(None, "a prompt is text, token ids or a list of chat messages"), (5, "got int"),
     ([], "the prompt is empty"), ([1, 10**9], "outside the target's vocabulary")],
)  # fmt: skip
def test_bad_prompts(pipe, prompt, message):
    with pytest.raises(InvalidArgumentError, match=message):
        pipe.generate(prompt, max_new_tokens=4)


@pytest.mark.parametrize(
    "draft_kw,message",
    [
        ({"taps": [0, 4]}, "tap id 4 >= target layers"),
        ({"extra_cfg": {"hidden_size": 32}}, "hidden size 32 != target 64"),
        ({"extra_cfg": {"mask_token_id": VOCAB}}, "outside the embedding table"),
    ],
)
def test_incompatible_pairs_are_refused(pair, draft_kw, message):
    from dflash_zoo.engine.config import normalize_draft_config
    from tests.tiny import draft_config_dict

    raw = draft_config_dict(pair[0], taps=draft_kw.get("taps"))
    extra = draft_kw.get("extra_cfg", {})
    if "mask_token_id" in extra:
        raw["dflash_config"]["mask_token_id"] = extra["mask_token_id"]
    raw.update({k: v for k, v in extra.items() if k != "mask_token_id"})
    drafter = type(pair[1])(normalize_draft_config(raw))
    with pytest.raises(IncompatiblePairError, match=message):
        check_pair(pair[0], drafter)


def test_stream_yields_text_as_committed():
    from tests.tiny import tiny_tokenizer

    target = tiny_target("qwen3", seed=0)
    pipe = Pipeline(
        model=target, drafter=tiny_drafter(target), tokenizer=tiny_tokenizer(), mask_token_id=VOCAB - 1
    )
    pieces = list(pipe.stream("hello world", raw=True, max_new_tokens=12))
    res = pipe.generate("hello world", raw=True, max_new_tokens=12)
    assert "".join(pieces) == res.text
    assert res.output_ids == greedy_reference(target, pipe.encode("hello world", raw=True), 12)


def test_chat_template_is_used_unless_raw():
    from tests.tiny import tiny_tokenizer

    target = tiny_target("qwen3", seed=0)
    pipe = Pipeline(
        model=target, drafter=tiny_drafter(target), tokenizer=tiny_tokenizer(), mask_token_id=VOCAB - 1
    )
    assert pipe.tokenizer.decode(pipe.encode("hi")) == "[user] hi\n[assistant] "
    assert pipe.tokenizer.decode(pipe.encode("hi", raw=True)) == "hi"


def test_sampling_is_reproducible_with_a_seed(pipe):
    a = pipe.generate(PROMPT, max_new_tokens=12, temperature=0.8, seed=3).output_ids
    b = pipe.generate(PROMPT, max_new_tokens=12, temperature=0.8, seed=3).output_ids
    assert a == b and len(a) == 12


def test_stateful_cache_with_a_crop_only_adapter_is_refused():
    """A hybrid (recurrent-state) target behind the plain crop adapter must be refused, never run silently."""
    from dflash_zoo.adapters.base import TargetAdapter

    from dflash_zoo.engine.decode import SpeculativeDecoder
    from dflash_zoo.errors import UnsupportedModelError

    target = tiny_target("qwen3_5_text", seed=0)
    dec = SpeculativeDecoder(
        TargetAdapter(target), tiny_drafter(target), PROMPT, GenerationConfig(8), VOCAB - 1
    )
    with pytest.raises(UnsupportedModelError, match="cannot be cropped exactly"):
        list(dec)


def test_fast_path_through_the_pipeline_equals_greedy(pair):
    """`fast=True` takes the static engine (CPU here, no graphs) with the CLI's keyword set."""
    pipe = Pipeline(model=pair[0], drafter=pair[1], mask_token_id=VOCAB - 1, options=EngineOptions(fast=True))
    res = pipe.generate(PROMPT, images=None, max_new_tokens=20)
    assert pipe.last_choice.name == "fast"
    assert res.output_ids == greedy_reference(pair[0], PROMPT, 20)
