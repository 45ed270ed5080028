"""`bench`: the what-if schedule, the JSON record schema and the CLI, on a tiny random shape (CPU)."""

from __future__ import annotations

import json
import os
from fractions import Fraction

import pytest
import torch
from click.testing import CliRunner

from dflash_zoo import demo
from dflash_zoo.bench import runner as B
from dflash_zoo.cli import cli
from dflash_zoo.engine.options import FastOptions

needs_demo = pytest.mark.skipif(not demo.available(), reason="no demo pair (scripts/build_demo_pair.py)")


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
    from dflash_zoo.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="must lie in \\[1, block size 16\\]"):
        B.whatif_schedule(17, 16)
    with pytest.raises(InvalidArgumentError):
        B.whatif_schedule(0.5, 16)


def _tiny_record(**kw):
    opts = B.BenchOptions(prompt_tokens=8, new_tokens=12, warmup=0, repeats=1, paths=("eager", "fast"), **kw)
    sub = B.random_subject("tiny-llama", "cpu", __import__("torch").float32, opts)
    return B.run_bench(sub, opts, ["test"])


def test_bench_record_schema_and_projection(monkeypatch):
    monkeypatch.setenv("DFLASH_ZOO_MOE_ROWS", "4")  # an engine switch: named in the record
    monkeypatch.setenv("DFLASH_ZOO_HOME", "/nowhere")  # where records go: not a switch
    monkeypatch.delenv("DFLASH_ZOO_TUNE", raising=False)  # the tests' own switch (conftest)
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
        assert r["first_divergence"] is None  # a projection's drafts are not checked: no divergence to tell
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
        "moe_rows": 0,  # the switch in the environment applies only where the GEMV kernels run
        "dependent_launch": False,  # CPU: the Triton kernels are not the default
        "expert_configs": None,
    }
    prov = rec["provenance"]
    assert prov["argv"] == ["test"] and {"torch", "transformers"} <= set(prov["versions"])
    assert "commit" in prov["git"] and "gpu" in prov and "environment" not in prov
    assert rec["fast_options"]["auto_moe_rows"] == 4  # the fast engine's options, whole, with the switch
    assert B.benchmeta.record_fast_options(json.loads(json.dumps(rec))) == FastOptions(
        graphs=None, auto_moe_rows=4
    )
    json.dumps(rec)  # serialisable as is


def test_fast_options_round_trip_through_a_bench_record(tmp_path):
    """Environment -> `FastOptions` -> the JSON record on disk -> `FastOptions` again, the same; a record written
    before the options were recorded whole (its provenance's copy of the switches) reads back the same way."""
    env = {"DFLASH_ZOO_KERNELS": "0", "DFLASH_ZOO_TUNE": "0", "DFLASH_ZOO_MOE_ROWS": "8",
           "DFLASH_ZOO_GEMV_ROWS": "4", "DFLASH_ZOO_GDN_VERIFY": "chunk", "DFLASH_ZOO_FLA": "0"}  # fmt: skip
    options = FastOptions.from_env(env, graphs=False, compile=True, compile_options={"max_autotune": True})
    path = tmp_path / "record.json"
    path.write_text(json.dumps({"fast_options": options.to_dict()}))
    back = B.benchmeta.record_fast_options(json.loads(path.read_text()))
    assert back == options and back.compile_options == {"max_autotune": True}
    assert back != FastOptions.from_env({}, graphs=False, compile=True)  # the switches made a difference
    old = {"options": {"graphs": False, "compile": True}, "provenance": {"environment": env}}
    assert B.benchmeta.record_fast_options(old) == options.with_choices(compile_options=None)
    future = {"fast_options": {**options.to_dict(), "a_later_field": 1}}  # written by a newer release
    assert B.benchmeta.record_fast_options(future) == options


def test_bench_record_tells_where_real_drafts_leave_the_greedy_output():
    """Greedy with real drafts (no projection): fp32 on CPU, the DFlash output is the autoregressive one on both
    engines (`first_divergence` None); the index is that of the first differing token otherwise."""
    rec = _tiny_record()
    assert rec["kind"] == "measurement"
    for r in rec["results"].values():
        assert r["autoregressive"]["output_ids"] == r["dflash"]["output_ids"]
        assert r["first_divergence"] is None
    assert B.first_difference([4, 5, 6], [4, 7, 6]) == 1


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
        "--path",
        "fast",
        "--json",
    ]
    old = os.umask(0o022)
    try:
        result = CliRunner().invoke(cli, args)
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    files = list((tmp_path / "bench").glob("*.json"))
    assert len(files) == 1
    assert files[0].stat().st_mode & 0o777 == 0o644  # as readable as any file under the umask, not private
    rec = json.loads(files[0].read_text())
    assert rec["kind"] == "measurement" and list(rec["results"]) == ["fast"]
    assert rec["options"]["compile"] is False and rec["options"]["graphs"] is False
    assert rec["provenance"]["argv"][0] == "dflash-zoo"


def test_bench_cli_table_names_the_kernels(tmp_path, monkeypatch):
    """Without --json: the table on stdout; one-off costs and the fast path's kernels on stderr."""
    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path))
    args = ["bench", "--shape", "tiny-qwen3", "--prompt-tokens", "6", "--new-tokens", "8", "--warmup", "0"]
    args += ["--repeats", "1", "--device", "cpu", "--no-graphs", "--no-compile", "--path", "fast"]
    result = CliRunner().invoke(cli, args, env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert "autoregressive" in result.stdout and "dflash" in result.stdout
    assert "fast: compile 0.0 s, graph capture 0.0 s" in result.stderr
    assert "fast: attention sdpa (one row) / sdpa (blocks), split-K GEMV off" in result.stderr


def test_bench_cli_profile_times_each_step(tmp_path, monkeypatch):
    """--profile: the record holds each fast step's device time and the drafter's share; stderr says them."""
    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path))
    args = ["bench", "--shape", "tiny-qwen3", "--prompt-tokens", "6", "--new-tokens", "8", "--warmup", "0"]
    args += [
        "--repeats",
        "1",
        "--device",
        "cpu",
        "--path",
        "fast",
        "--profile",
        "--out",
        str(tmp_path / "r.json"),
    ]
    result = CliRunner().invoke(cli, args, env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    prof = json.loads((tmp_path / "r.json").read_text())["results"]["fast"]["profile"]
    assert prof["replays"] >= 1 and 0 < prof["drafter_share"]
    assert prof["drafter_share"] == prof["drafter"]["ms_per_step"] / prof["spec"]["ms_per_step"]
    assert prof["draft_share"] == prof["draft"]["ms_per_step"] / prof["spec"]["ms_per_step"]
    assert (
        "device time a step: ar " in result.stderr and "of a DFlash step the drafter takes" in result.stderr
    )


def test_bench_cli_usage_errors():
    result = CliRunner().invoke(cli, ["bench", "--shape", "nope"])
    assert result.exit_code == 2 and "unknown shape" in result.output
    result = CliRunner().invoke(cli, ["bench", "--path", "eager", "--profile", "--compile"])
    assert result.exit_code == 2 and "--profile and --compile concern only the fast engine" in result.output
    result = CliRunner().invoke(cli, ["bench", "--path", "fast", "--graphs", "--device", "cpu"])
    assert result.exit_code == 2 and "--graphs captures CUDA graphs; this bench runs on cpu" in result.output


@needs_demo
def test_bench_says_when_fast_engine_options_go_unused(tmp_path):
    """The engine picked here is the eager one (CPU): --profile is said to be unused, not silently dropped."""
    args = ["bench", "--device", "cpu", "--dtype", "fp32", "--warmup", "0", "--limit", "1", "--repeats", "1"]
    env = {"DFLASH_ZOO_HOME": str(tmp_path)}
    result = CliRunner().invoke(cli, [*args, "--max-new-tokens", "3", "--json", "--profile"], env=env)
    assert result.exit_code == 0, result.output
    assert "--profile concerns only the fast engine, not measured here" in result.stderr
    assert list(json.loads(result.stdout)["results"]) == ["eager"]


def test_bench_split_target_runs_eager_and_records_the_placement(tmp_path, monkeypatch):
    """--devices places the pair's target (here over two CPU slots: every hook runs) and benches it eagerly."""
    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["bench", "--devices", "cpu,cpu", "--prompt-tokens", "8", "--new-tokens", "8", "--warmup", "0",
            "--repeats", "1", "--limit", "2", "--json"]  # fmt: skip
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


# ---- prompt sets, lengths, the record location, the spread ---------------------------------------------


def _bench(tmp_path, *args, env=None):
    """`bench` on the embedded demo pair, eager, CPU, short: its record (or None) and the click result."""
    base = ["bench", "--device", "cpu", "--dtype", "fp32", "--path", "eager", "--warmup", "0"]
    result = CliRunner().invoke(cli, [*base, *args], env={"DFLASH_ZOO_HOME": str(tmp_path), **(env or {})})
    files = sorted((tmp_path / "bench").glob("*.json"))
    return (json.loads(files[-1].read_text()) if files else None), result


@needs_demo
def test_bench_demo_pair_runs_on_its_held_out_stdlib_files(tmp_path):
    """No prompt given: the demo pair is measured on the held-out stdlib chunks, eval's lengths (32 / N)."""
    from dflash_zoo.bench import prompts

    rec, result = _bench(tmp_path, "--limit", "3", "--max-new-tokens", "5", "--repeats", "2", "--json")
    assert result.exit_code == 0, result.output
    assert "prompts: held-out stdlib files (3," in result.stderr
    subject = rec["subject"]
    assert subject["kind"] == "demo" and subject["prompts"]["count"] == 3
    assert rec["options"]["prompt_tokens"] == prompts.PROMPT_TOKENS and rec["options"]["new_tokens"] == 5
    for mode in ("autoregressive", "dflash"):
        m = rec["results"]["eager"][mode]
        assert m["new_tokens"] == 3 * 5 and len(m["tokens_per_second_runs"]) == 2
    # greedy in fp32: DFlash reproduces the target's own tokens, prompt by prompt
    eager = rec["results"]["eager"]
    assert eager["dflash"]["output_ids"] == eager["autoregressive"]["output_ids"]


def test_held_out_set_reads_the_listed_stdlib_files(tmp_path):
    """One chunk per held-out file present (long enough); an unrelated or short file gives none."""
    from dflash_zoo.bench import prompts
    from dflash_zoo.errors import NotFoundError

    (tmp_path / "base64.py").write_text("x = 1\n" * 200)
    (tmp_path / "copy.py").write_text("short\n")
    (tmp_path / "json.py").write_text("y = 2\n" * 200)  # trained on, not held out
    ps = prompts.held_out_stdlib(tmp_path)
    assert len(ps.records) == 1 and set(ps.records[0].text) <= set("x = 1\n")
    assert {"base64.py", "copy.py", "enum.py"} <= set(prompts.HELD_OUT) and "json.py" not in prompts.HELD_OUT
    with pytest.raises(NotFoundError, match="held-out"):
        prompts.held_out_stdlib(tmp_path / "empty")
    assert len(prompts.held_out_stdlib().records) >= 10  # this Python's own stdlib


@needs_demo
def test_bench_prompts_file_takes_evals_line_formats(tmp_path):
    """--prompts FILE.jsonl: text, prompt and messages lines, as `eval --data` reads them."""
    from dflash_zoo.training.data import DataError

    data = tmp_path / "p.jsonl"
    lines = [
        {"text": "import os\n\ndef walk(path):\n    for name in os.listdir(path):\n"},
        {"prompt": "def add(a, b):"},
        {"messages": [{"role": "user", "content": "class Stack:"}]},
    ]
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rec, result = _bench(tmp_path, "--prompts", str(data), "--raw", "-n", "4", "--repeats", "1", "--json")
    assert result.exit_code == 0, result.output
    assert rec["subject"]["prompts"] == {"set": str(data), "count": 3}
    assert rec["results"]["eager"]["autoregressive"]["new_tokens"] == 12
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"nope": 1}\n')
    _, result = _bench(tmp_path / "b", "--prompts", str(bad))
    assert isinstance(result.exception, DataError) and f"{bad}:2" in str(result.exception)
    assert "building" not in result.output  # read before any model is loaded
    _, result = _bench(tmp_path / "c", "--shape", "tiny-qwen3", "--prompts", str(data))
    assert result.exit_code == 2 and "--prompts" in result.output


def test_bench_max_new_tokens_is_the_name_new_tokens_a_hidden_alias():
    out = CliRunner().invoke(cli, ["bench", "--help"], env={"COLUMNS": "120"}).stdout
    assert "--max-new-tokens" in out and "--new-tokens" not in out.replace("--max-new-tokens", "")


def test_bench_checks_the_record_location_before_measuring(tmp_path):
    """A DFLASH_ZOO_HOME that cannot be written fails at once (nothing built); an existing --out is kept."""
    import os
    import sys

    from tests.readonly import cli as zoo_cli
    from tests.readonly import run_readonly

    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "DFLASH_ZOO_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    args = ["bench", "--shape", "tiny-qwen3", "--device", "cpu", "--prompt-tokens", "4", "-n", "4"]
    proc = run_readonly(zoo_cli(*args), [home], env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert f"cannot write the bench record in {home / 'bench'}" in proc.stderr
    assert "building" not in proc.stderr and "Traceback" not in proc.stderr
    assert sys.executable  # the same interpreter ran it
    keep = tmp_path / "mine.json"
    keep.write_text("user data\n")
    result = CliRunner().invoke(cli, [*args, "--out", str(keep)])
    assert result.exit_code == 2 and "exists" in result.output and keep.read_text() == "user data\n"


def test_bench_prints_the_results_before_a_failing_record_write(tmp_path, monkeypatch):
    """The table is on stdout even when the record cannot be written at the end."""
    from dflash_zoo.commands import bench as bench_cmd
    from dflash_zoo.errors import ZooError

    def fail(path, record, explicit=True):
        raise ZooError(f"cannot write the bench record {path}: disk full")

    monkeypatch.setattr(bench_cmd, "_write_record", fail)
    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path))
    args = ["bench", "--shape", "tiny-qwen3", "--device", "cpu", "--prompt-tokens", "4", "-n", "6",
            "--warmup", "0", "--repeats", "1", "--no-graphs"]  # fmt: skip
    result = CliRunner().invoke(cli, args, env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert result.exit_code == 1 and "autoregressive" in result.stdout and "dflash" in result.stdout


def test_a_default_record_path_taken_meanwhile_gets_a_suffix(tmp_path):
    """Two benches started in the same second: the second record goes beside the first, nothing is lost;
    a path the user named is never replaced (the record stays in its temporary file, named)."""
    from dflash_zoo.commands import bench as bench_cmd
    from dflash_zoo.errors import ZooError

    path = tmp_path / "20261207T200217Z-demo.json"
    path.write_text("{}\n")
    went = bench_cmd._write_record(path, {"run": 2}, explicit=False)
    assert went == tmp_path / "20261207T200217Z-demo-2.json" and json.loads(went.read_text()) == {"run": 2}
    with pytest.raises(ZooError, match="appeared while measuring; the record is in"):
        bench_cmd._write_record(path, {"run": 3}, explicit=True)
    assert path.read_text() == "{}\n" and len(list(tmp_path.glob(".*.tmp"))) == 1


def test_bench_table_shows_the_spread_and_warns_when_wide(capsys):
    """min-max beside the median; repeats of 7 / 21 / 414 tok/s get a warning naming all three."""
    from dflash_zoo.bench.prompts import spread
    from dflash_zoo.commands import bench as bench_cmd

    def mode(runs):
        return {"tokens_per_second": spread(runs).median, "tokens_per_second_runs": runs,
                "mean_acceptance_length": 1.0, "ttft_seconds": 0.01, "peak_memory_bytes": None,
                "roofline_fraction": None}  # fmt: skip

    eager = {"autoregressive": mode([100.0, 101.0, 102.0]), "dflash": mode([7.0, 21.0, 414.0])}
    eager["speedup"] = 0.2
    record = {"kind": "measurement", "results": {"eager": eager}}
    bench_cmd._print_table(record)
    bench_cmd._warn_spread(record)
    out, err = capsys.readouterr()
    assert "100.0-102.0" in out and "7.0-414.0" in out
    assert "eager dflash: repeats gave 7.0 / 21.0 / 414.0 tok/s" in err
    assert "autoregressive" not in err  # 100-102 is a tight spread


def test_provenance_keeps_the_record_name_not_the_machine_folder():
    """`--out` is recorded as its file name (either spelling); every other argument as given."""
    argv = ["dflash-zoo", "bench", "--shape", "qwen3-8b", "--out", "/scratch/out/r.json", "--repeats", "3"]
    got = B.benchmeta.provenance(argv, torch.device("cpu"))["argv"]
    assert got == ["dflash-zoo", "bench", "--shape", "qwen3-8b", "--out", "r.json", "--repeats", "3"]
    assert B.benchmeta.provenance(["x", "--out=runs/a/b.json"], torch.device("cpu"))["argv"] == [
        "x",
        "--out=b.json",
    ]
    assert B.benchmeta.provenance(["x", "--shape", "/a/b"], torch.device("cpu"))["argv"] == [
        "x",
        "--shape",
        "/a/b",
    ]
