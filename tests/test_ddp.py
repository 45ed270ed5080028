"""Multi-process training through torch.distributed (torchrun, gloo on CPU, two ranks on loopback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_two_ranks_train_different_shards_into_identical_weights(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "ddp_worker.py"), str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    reports = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    for _attempt in range(2):  # one relaunch, only for a rank killed by SIGABRT (seen once in CI, see below)
        for p in reports:
            p.unlink(missing_ok=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        # a gloo rank once died with "terminate called without an active exception" (SIGABRT) on the loaded
        # 2-core CI host and did not reproduce in 30 local runs: relaunch once for that, fail on anything else
        if proc.returncode == 0 or "Signal 6 (SIGABRT)" not in proc.stderr:
            break
    written = [p.name for p in reports if p.is_file()]
    assert proc.returncode == 0, f"reports written: {written}\n{proc.stderr[-3000:]}"
    ranks = [json.loads(p.read_text()) for p in reports]
    assert all(r["world"] == 2 for r in ranks)
    assert ranks[0]["shard"] != ranks[1]["shard"]  # each rank saw its own examples ...
    assert all(r["identical_across_ranks"] and r["moved"] > 0 for r in ranks)  # ... yet DDP kept one model
