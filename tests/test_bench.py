"""`bench`: the what-if schedule, the JSON record schema and the CLI, on a tiny random shape (CPU)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from click.testing import CliRunner

from dflash_zoo.bench import runner as B
from dflash_zoo.cli import cli


@pytest.mark.parametrize("tau", [1.0, 2.5, 3.25, 6.5, 7.3, 16.0])
def test_whatif_schedule_has_exactly_the_mean(tau):
    block = 16
    override = B.whatif_schedule(tau, block)
    total = B.whatif_new_tokens(tau, 512) - 1  # tokens after the first (prefill) token
    commits, done = [], 0
    while done < total:
        commits.append(override(len(commits), block - 1) + 1)
        done += commits[-1]
    assert done == total
    assert Fraction(sum(commits), len(commits)) == Fraction(str(tau))
    assert all(1 <= c <= block for c in commits)
    if tau == 6.5:
        assert set(commits) == {6, 7} and total + 1 == 508


def test_whatif_rejects_impossible_means():
    with pytest.raises(ValueError):
        B.whatif_schedule(17, 16)
    with pytest.raises(ValueError):
        B.whatif_schedule(0.5, 16)


def _tiny_record(**kw):
    opts = B.BenchOptions(prompt_tokens=8, new_tokens=12, warmup=0, repeats=1, paths=("eager", "fast"), **kw)
    sub = B.random_subject("tiny-llama", "cpu", __import__("torch").float32, opts)
    return B.run_bench(sub, opts, ["test"])


def test_bench_record_schema_and_projection():
    rec = _tiny_record(what_if_acceptance=2.5)
    assert rec["schema"] == B.SCHEMA and rec["kind"] == "projection"
    assert rec["projection"]["what_if_acceptance"] == 2.5
    assert rec["options"]["new_tokens_effective"] == 11
    assert rec["subject"]["kind"] == "shape" and rec["subject"]["weights"] == "random"
    assert set(rec["results"]) == {"eager", "fast"}
    for r in rec["results"].values():
        ar, spec = r["autoregressive"], r["dflash"]
        assert spec["mean_acceptance_length"] == 2.5 and spec["histogram"] == {"2": 2, "3": 2}
        assert ar["new_tokens"] == spec["new_tokens"] == 11
        for key in ("tokens_per_second", "ttft_seconds", "peak_memory_bytes", "roofline_fraction"):
            assert key in ar and key in spec
        assert r["speedup"] > 0
    assert rec["options"]["compile"] is False
    assert rec["results"]["eager"]["compile_seconds"] is None
    assert (
        rec["results"]["fast"]["compile_seconds"] == 0.0 and rec["results"]["fast"]["capture_seconds"] == 0.0
    )
    assert rec["results"]["eager"]["engine"] is None
    assert rec["results"]["fast"]["engine"] == {
        "graphs": False,
        "compile": False,
        "compile_options": None,
        "decode_attention": "sdpa",
        "block_attention": "sdpa",
        "gemv": False,
        "gemv_configs": None,
        "fused_ops": False,
    }
    prov = rec["provenance"]
    assert prov["argv"] == ["test"] and {"torch", "transformers"} <= set(prov["versions"])
    assert "commit" in prov["git"] and "gpu" in prov
    json.dumps(rec)  # serialisable as is


def test_bench_cli_writes_the_record(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path))
    args = [
        "bench",
        "--shape",
        "tiny-qwen3",
        "--prompt-tokens",
        "6",
        "--new-tokens",
        "8",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--device",
        "cpu",
        "--no-graphs",
        "--no-compile",
        "--json",
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    files = list((tmp_path / "bench").glob("*.json"))
    assert len(files) == 1
    rec = json.loads(files[0].read_text())
    assert rec["kind"] == "measurement" and list(rec["results"]) == ["fast"]
    assert rec["options"]["compile"] is False and rec["options"]["graphs"] is False
    assert rec["provenance"]["argv"][0] == "dflash-zoo"


def test_bench_cli_table_names_the_kernels(tmp_path, monkeypatch):
    """Without --json: the table on stdout; one-off costs and the fast path's kernels on stderr."""
    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path))
    args = ["bench", "--shape", "tiny-qwen3", "--prompt-tokens", "6", "--new-tokens", "8", "--warmup", "0"]
    args += ["--repeats", "1", "--device", "cpu", "--no-graphs", "--no-compile"]
    result = CliRunner().invoke(cli, args, env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert "autoregressive" in result.stdout and "dflash" in result.stdout
    assert "fast: compile 0.0 s, graph capture 0.0 s" in result.stderr
    assert "fast: attention sdpa (one row) / sdpa (blocks), split-K GEMV off" in result.stderr


def test_bench_cli_usage_errors():
    result = CliRunner().invoke(cli, ["bench", "--shape", "nope"])
    assert result.exit_code == 2 and "unknown shape" in result.output


def test_bench_split_target_runs_eager_and_records_the_placement(tmp_path, monkeypatch):
    """--devices places the pair's target (here over two CPU slots: every hook runs) and benches it eagerly."""
    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["bench", "--devices", "cpu,cpu", "--prompt-tokens", "8", "--new-tokens", "8", "--warmup", "0",
            "--repeats", "1", "--json"]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    rec = json.loads(next((tmp_path / "bench").glob("*.json")).read_text())
    assert list(rec["results"]) == ["eager"]  # no fast path for a split target
    placement = rec["subject"]["placement"]
    assert placement["devices"] == ["cpu", "cpu"] and placement["head"] == "cpu"
    bad = CliRunner().invoke(cli, ["bench", "--devices", "cpu,cpu", "--path", "fast"])
    assert bad.exit_code == 2 and "eager path only" in bad.output


def test_bench_random_shape_split_over_devices(tmp_path, monkeypatch):
    """--shape with --devices: a random target built on meta and materialised slot by slot, benched eagerly."""
    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path))
    args = ["bench", "--shape", "tiny-qwen3", "--devices", "cpu,cpu", "--prompt-tokens", "8", "--new-tokens",
            "12", "--warmup", "0", "--repeats", "1", "--what-if-acceptance", "2.5", "--json"]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    rec = json.loads(next((tmp_path / "bench").glob("*.json")).read_text())
    assert list(rec["results"]) == ["eager"]
    assert rec["subject"]["kind"] == "shape" and rec["subject"]["placement"]["devices"] == ["cpu", "cpu"]
    assert rec["results"]["eager"]["dflash"]["mean_acceptance_length"] == 2.5
    bad = CliRunner().invoke(
        cli, ["bench", "--shape", "tiny-qwen3", "--devices", "cpu,cpu", "--device", "cpu"]
    )
    assert bad.exit_code == 2 and "--devices" in bad.output


def test_weight_bytes_of_a_moe_target_count_only_the_routed_experts():
    """One token streams k of E experts; a B-token verify, under uniform routing, 1 - (1 - k/E)^B of them."""
    import torch
    from dflash_zoo.adapters import get_adapter

    from dflash_zoo.bench import meta as benchmeta
    from tests.tiny import tiny_drafter, tiny_target

    model = tiny_target("qwen3_moe")
    text = model.config
    adapter, drafter = get_adapter("qwen3_moe")(model), tiny_drafter(model)
    wb = benchmeta.weight_bytes(adapter, drafter, block=8)
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    # the tiny configs are untied: the input embedding is not streamed
    everything = wb["target_total"] - model.get_input_embeddings().weight.numel() * 4
    miss = 1 - text.num_experts_per_tok / text.num_experts  # 1 - 2/4 in the tiny config
    assert experts > 0 and miss == 0.5
    assert wb["target_streamed"] == everything - round(experts * miss)
    assert wb["target_streamed_verify"] == everything - round(experts * miss**8)
    dense = tiny_target("qwen3")
    wd = benchmeta.weight_bytes(get_adapter("qwen3")(dense), tiny_drafter(dense), block=8)
    assert (
        wd["target_streamed"]
        == wd["target_streamed_verify"]
        == wd["target_total"] - 4 * torch.numel(dense.get_input_embeddings().weight)
    )
