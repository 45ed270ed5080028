"""One rank of tests/test_ddp.py (launched by `python -m torch.distributed.run`, gloo on CPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from dflash_zoo.training.data import Example
from dflash_zoo.training.train import TrainConfig, _Trainer, build_draft_config, dist_info, new_drafter
from tests.tiny import VOCAB, tiny_target, tiny_tokenizer


def main(out: Path) -> None:
    rank, world, _ = dist_info()  # initialises the gloo process group from torchrun's environment
    target, tok = tiny_target("qwen3", seed=0), tiny_tokenizer()
    gen = torch.Generator().manual_seed(0)
    examples = [
        Example(tuple(torch.randint(0, VOCAB - 1, (24,), generator=gen).tolist()), 4) for _ in range(8)
    ]
    cfg = TrainConfig(out=str(out / "d"), draft_layers=1, block_size=4, steps=3, batch_size=2, anchors_per_seq=8,
                      lr=1e-2, mask_token_id=VOCAB - 1)  # fmt: skip
    drafter = new_drafter(build_draft_config(target, tok, cfg), cfg, None, "cpu")
    before = torch.cat([p.detach().flatten() for p in drafter.parameters()]).clone()
    tr = _Trainer(cfg, target, drafter, examples, "cpu")
    for step in range(cfg.steps):
        tr.step(step, step / cfg.steps)
    after = torch.cat([p.detach().flatten() for p in drafter.parameters()])
    gathered = [torch.zeros_like(after) for _ in range(world)]
    torch.distributed.all_gather(gathered, after)
    report = {
        "world": world,
        "identical_across_ranks": all(torch.equal(g, gathered[0]) for g in gathered),
        "moved": float((after - before).abs().max()),
        "shard": [list(ex.ids[:4]) for ex in tr.shard],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.barrier()  # nobody tears gloo down while a peer still talks to it (as `train` ends)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
