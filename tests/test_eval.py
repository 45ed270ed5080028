"""`eval --json` schema and per-position acceptance bookkeeping (tiny random pair, CPU)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dflash_zoo.cli import cli
from dflash_zoo.engine.results import GenerationResult, StepRecord
from dflash_zoo.training.evaluate import per_position_acceptance
from tests.tiny import save_tiny_pair


def test_per_position_acceptance_counts_proposed_slots():
    res = GenerationResult(output_ids=[], text="", prompt_tokens=1)
    res.steps = [StepRecord([1, 2, 3], 2, 3), StepRecord([1, 2, 3], 0, 1), StepRecord([1], 1, 2)]
    # slot 1: accepted in steps 0 and 2 of 3; slot 2: step 0 of 2; slot 3: none of 2
    assert per_position_acceptance([res], 4) == [2 / 3, 1 / 2, 0.0]


def test_eval_json_schema(tmp_path):
    target, draft = save_tiny_pair(tmp_path, block_size=4)
    data = tmp_path / "p.jsonl"
    data.write_text('{"text": "def add(a, b):\\n    return a + b\\n"}\n{"prompt": "hello"}\n')
    args = [
        "eval",
        "-t",
        str(target),
        "-d",
        str(draft),
        "--data",
        str(data),
        "-n",
        "12",
        "--device",
        "cpu",
        "--json",
    ]
    out = CliRunner().invoke(cli, args)
    assert out.exit_code == 0, out.output
    obj = json.loads(out.stdout)
    for key in ("mean_acceptance_length", "histogram", "per_position_acceptance", "spec_tokens_per_second",
                "ar_tokens_per_second", "speedup", "outputs_match_autoregressive"):  # fmt: skip
        assert key in obj
    assert obj["prompts"] == 2 and obj["block_size"] == 4
    assert len(obj["per_position_acceptance"]) == 3
    assert all(isinstance(k, str) for k in obj["histogram"])
    assert sum(obj["histogram"].values()) == obj["steps"]
    assert obj["outputs_match_autoregressive"] == 2  # greedy speculative decoding is lossless
    assert obj["first_divergence"] == [None, None]


def test_eval_defaults_to_the_embedded_demo_pair(tmp_path):
    """eval shares generate's model options: no --target/--draft means the offline demo pair."""
    data = tmp_path / "p.jsonl"
    data.write_text('{"text": "import os\\nimport sys\\n\\n\\ndef main():\\n    pass\\n"}\n')
    args = ["eval", "--data", str(data), "-n", "8", "--device", "cpu", "--json", "--no-baseline"]
    out = CliRunner().invoke(cli, args, env={"HF_HUB_OFFLINE": "1"})
    assert out.exit_code == 0, out.output
    obj = json.loads(out.stdout)
    assert obj["prompts"] == 1 and obj["block_size"] == 16  # the demo drafter's block
    assert obj["ar_tokens_per_second"] is None and obj["generated_tokens"] == 8


def test_one_time_costs_land_on_no_measured_prompt():
    """The longest prompt runs first both ways, so the fast engine is built (and captured) before timing."""
    from dflash_zoo.api import Pipeline
    from dflash_zoo.engine.select import EngineOptions
    from dflash_zoo.training.evaluate import evaluate
    from tests.test_fast import MASK, _pair

    adapter, drafter = _pair("qwen3")
    pipe = Pipeline(adapter.model, drafter, None, mask_token_id=MASK, options=EngineOptions(fast=True))
    calls = []

    class Recorder:  # forwards to the real pipeline, noting which engine each call found
        drafter = pipe.drafter

        def generate(self, ids, **kw):
            calls.append(("spec", len(ids), kw["max_new_tokens"], pipe._engines.get("fast-b8")))
            return pipe.generate(ids, **kw)

        def generate_autoregressive(self, ids, **kw):
            calls.append(("ar", len(ids), kw["max_new_tokens"], pipe._engines.get("fast-b8")))
            return pipe.generate_autoregressive(ids, **kw)

    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [13, 14]]
    res = evaluate(Recorder(), prompts, max_new_tokens=10)
    assert [c[:3] for c in calls[:2]] == [
        ("spec", 7, 10),
        ("ar", 7, 10),
    ]  # warm-up: longest prompt, full length
    measured = calls[2:]
    assert len(measured) == 6 and all(c[3] is not None and c[3] is measured[0][3] for c in measured)
    assert res.prompts == 3 and res.outputs_match_autoregressive == 3


@pytest.mark.parametrize(
    ("matched", "dtype", "expected"),
    [(3, "bfloat16", None), (1, "bfloat16", "expected in bfloat16"), (2, "float32", "must not")],
)
def test_eval_explains_outputs_that_differ(capsys, matched, dtype, expected):
    """Fewer identical outputs than prompts: a rounding note in bf16, a bug report request in fp32."""
    from dflash_zoo.commands.train import _mismatch_hint
    from dflash_zoo.training.evaluate import EvalResult

    where = [None] * matched + [7, 2][: 3 - matched]
    res = EvalResult(
        3,
        16,
        0.0,
        30,
        9,
        3.3,
        {3: 9},
        [0.5] * 15,
        10.0,
        outputs_match_autoregressive=matched,
        first_divergence=where,
    )
    _mismatch_hint(res, dtype)
    err = capsys.readouterr().err
    assert (expected in err) if expected else err == ""
    if expected:
        first = ", ".join(str(i) for i in sorted(i for i in where if i is not None))
        assert (
            f"{3 - matched} of 3 outputs differ from autoregressive decoding (first differing token: {first})"
            in err
        )


def test_first_difference():
    from dflash_zoo.engine.results import first_difference

    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one stopped earlier
