"""`bench --train` on CPU with a tiny shape: the record's contents and the FLOP count (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from dflash_zoo.bench.shapes import SHAPES
from dflash_zoo.bench.train_step import PARTS, peak_for
from tests.cli_runner import run_captured

run = run_captured  # (exit code, stdout, stderr) of `dflash-zoo ARGS`


ARGS = ["bench", "--train", "--shape", "tiny-qwen3", "--seq-len", "96", "--anchors-per-seq", "12", "--batch-size",
        "2", "--device", "cpu", "--warmup", "1", "--repeats", "2"]  # fmt: skip


def test_train_step_record(capsys, tmp_path):
    code, out, err = run(capsys, *ARGS, "--json", "--out", tmp_path / "r.json")
    assert code == 0, err
    rec = json.loads(out)
    assert rec == json.loads((tmp_path / "r.json").read_text())
    assert rec["schema"] == "dflash-zoo.bench-train/1" and rec["shape"] == "tiny-qwen3"
    st = rec["step"]
    assert set(st["parts_seconds"]) == set(PARTS) and len(st["seconds_runs"]) == 2
    assert st["seconds"] > 0 and st["tokens_per_second"] == pytest.approx(2 * 96 / st["seconds"])
    assert st["mfu"] is None and st["peak_flops_per_second"] is None  # a CPU has no listed peak
    assert rec["options"]["attention"] == "dense"  # auto off CUDA
    assert rec["attention"]["mode"] == "forward" and rec["attention"]["flex_seconds"] > 0
    assert {"argv", "git", "versions", "gpu"} <= set(rec["provenance"])
    s = SHAPES["tiny-qwen3"]
    assert rec["drafter"]["layers"] == s.draft_layers and rec["drafter"]["block_size"] == s.block_size
    # the FLOP count, from the shape's sizes (module docstring of bench/train_step.py)
    h, hd, f, v = s.hidden, s.head_dim, s.ffn, s.vocab
    attn = h * s.heads * hd * 2 + 2 * h * s.kv_heads * hd + 2 * hd  # q, o, k, v, q/k norms
    layer = attn + 3 * h * f + 2 * h  # + MLP and the two layer norms
    taps, b, tokens = rec["drafter"]["taps"], s.block_size, 2 * 96
    want = {
        "target_forward": 2 * layer * (max(taps) + 1) * tokens,
        "drafter_layers": 6
        * layer
        * s.draft_layers
        * 2
        * 12
        * b,  # the drafter's layers are the target's shape
        "context_kv": 6 * (2 * h * s.kv_heads * hd) * s.draft_layers * tokens,
        "fc": 4 * (len(taps) * h * h) * tokens,
        "lm_head": 4 * v * h * 2 * 12 * (b - 1),
    }
    assert st["flops"] == {k: float(x) for k, x in want.items()} | {"total": float(sum(want.values()))}
    assert "training step, tiny-qwen3" not in err  # --json: no table


def test_table_and_usage_errors(capsys, tmp_path):
    code, out, err = run(capsys, *ARGS, "--out", tmp_path / "r.json")
    assert code == 0, err
    assert "target forward" in out and "drafter forward backward" in out and "optimizer" in out
    assert "tokens/s" in err and "drafter attention (forward)" in err
    assert run(capsys, "bench", "--train", "--device", "cpu")[0] == 2  # no shape
    code, _, err = run(capsys, *ARGS, "--what-if-acceptance", "3")
    assert code == 2 and "--train does not take" in err
    code, _, err = run(capsys, *ARGS[:-4], "--anchors-per-seq", "200")
    assert code == 2 and "exceeds" in err


def test_peak_rates_are_per_card():
    assert peak_for("NVIDIA H100 80GB HBM3") == peak_for("NVIDIA H200") == 989e12  # SXM: dense bf16
    assert peak_for("NVIDIA H100 PCIe") == 756e12 and peak_for("NVIDIA H100 NVL") == 835e12
    assert peak_for("NVIDIA A100-SXM4-80GB") is None  # not listed: no MFU rather than a wrong one


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_train_step_record_on_cuda(capsys, tmp_path):
    """The CUDA path: compiled flex, CUDA-event parts, peak memory; MFU where the card is listed."""
    # 16 anchors of block 16: the block queries fill whole flex tiles (256 rows), as every real recipe's do
    args = [{"cpu": "cuda", "12": "16"}.get(a, a) for a in ARGS]
    code, out, err = run(capsys, *args, "--attention", "flex", "--json", "--out", tmp_path / "r.json")
    assert code == 0, err
    rec = json.loads(out)
    assert rec["options"]["attention"] == "flex" and rec["options"]["dtype"] == "bfloat16"
    assert rec["attention"]["mode"] == "forward+backward" and rec["step"]["peak_memory_bytes"] > 0
    assert all(v > 0 for v in rec["step"]["parts_seconds"].values())
