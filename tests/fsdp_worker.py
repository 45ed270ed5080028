"""One rank of tests/test_train_distributed.py (launched by `python -m torch.distributed.run`, gloo on CPU).

Loads a saved tiny target sharded over the ranks (`--fsdp-target`'s loader: rank 0 reads, the others build on
meta and receive the weights), then checks that its tapped features, early stop or not, equal those of the
whole model loaded alone, and that a few training steps run with it (DDP drafter, identical across ranks).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from dflash_zoo.adapters import get_adapter

from dflash_zoo.loading import load_target
from dflash_zoo.training.data import Example
from dflash_zoo.training.distributed import dist_info, load_sharded_target
from dflash_zoo.training.features import target_features
from dflash_zoo.training.train import TrainConfig, build_draft_config, new_drafter
from dflash_zoo.training.trainer import Trainer
from tests.tiny import VOCAB


def main(target_dir: str, out: Path) -> None:
    rank, world, _ = dist_info()
    sharded, tok = load_sharded_target(target_dir, "cpu", torch.float32, rank)
    whole, _ = load_target(target_dir, "cpu", torch.float32, None)
    seqs = [list(range(3, 40)), list(range(7, 20))]
    taps = [1, 2]
    got = target_features(sharded, get_adapter("qwen3")(sharded), taps, seqs, "cpu")
    full = target_features(sharded, get_adapter("qwen3")(sharded), taps, seqs, "cpu", stop=False)
    want = target_features(whole, get_adapter("qwen3")(whole), taps, seqs, "cpu")
    gen = torch.Generator().manual_seed(0)
    exs = [Example(tuple(torch.randint(0, VOCAB - 1, (24,), generator=gen).tolist()), 4) for _ in range(8)]
    cfg = TrainConfig(out=str(out / "d"), draft_layers=1, block_size=4, steps=3, batch_size=2, anchors_per_seq=8,
                      lr=1e-2, mask_token_id=VOCAB - 1)  # fmt: skip
    tr = Trainer(
        cfg, sharded, new_drafter(build_draft_config(sharded, tok, cfg), cfg, None, "cpu"), exs, "cpu"
    )
    for step in range(3):
        tr.step(step, step / 3)
    weights = torch.cat([p.detach().flatten() for p in tr.raw.parameters()])
    gathered = [torch.zeros_like(weights) for _ in range(world)]
    torch.distributed.all_gather(gathered, weights)
    report = {
        "world": world,
        "sharded_layers": type(sharded.model.layers[0]).__name__,
        "features_equal": bool(torch.equal(got, want)),
        "features_equal_without_stop": bool(torch.equal(full, want)),
        "drafters_identical": all(torch.equal(g, gathered[0]) for g in gathered),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
