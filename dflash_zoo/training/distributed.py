"""Multi-process training through `torchrun`: process group, collectives the trainer needs, and a frozen target
sharded with FSDP when it does not fit one GPU.

Data parallelism: each rank trains on every world-th example; the drafter is replicated and wrapped in DDP.
`--fsdp-target`: the frozen target's decoder layers are sharded over the ranks with FSDP2 (`fully_shard` on
each layer), so each GPU holds 1/world of them and gathers one layer at a time in the forward. The embedding,
final norm and LM head stay whole on every rank: the trainer calls them outside the target's forward (block
embeddings, the drafter's logits), a different number of times per rank, which collectives would not allow.
Only rank 0 reads the checkpoint (into host memory); the others build the model on the meta device, and the
weights reach them by a broadcast from rank 0 (`set_model_state_dict(..., broadcast_from_rank0=True)`);
buffers outside the state dict (rotary tables) are broadcast the same way.

A sharded layer's forward is a collective, so every rank runs the target the same number of times
(`agree_max` pads a rank's feature-cache pass with one-token forwards). Stopping the forward after the last
tapped layer stays safe: FSDP's post-forward hook, registered when the layer was sharded, runs (and frees the
gathered weights) before the trainer's hooks, and every rank stops at the same layer.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

import torch

# regeneration or a feature-cache pass on rank 0 can keep the others waiting at a barrier for hours
_TIMEOUT = timedelta(hours=12)


def dist_info() -> tuple[int, int, int]:
    """(rank, world size, local rank); initialises torch.distributed when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend, timeout=_TIMEOUT)
        # torn down before the interpreter exits: gloo's threads alive at exit abort the process (SIGABRT)
        atexit.register(_destroy)
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


def _destroy() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def active() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def barrier() -> None:
    if active():
        torch.distributed.barrier()


def agree_max(value: int, device: Any) -> int:
    """The largest `value` over all ranks (itself when not distributed)."""
    if not active():
        return value
    t = torch.tensor([value], device=_comm_device(device))
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def local_world() -> int:
    """How many ranks run on this host (torchrun's LOCAL_WORLD_SIZE; 1 outside torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (`[obj]` when not distributed)."""
    if not active():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not active():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _comm_device(device: Any) -> torch.device:
    """Where collectives run: the rank's GPU under NCCL, the host under gloo."""
    return torch.device(device) if torch.distributed.get_backend() == "nccl" else torch.device("cpu")


def is_sharded(model: Any) -> bool:
    """True when `model` was sharded by `shard_target`."""
    return bool(getattr(model, "_dflash_zoo_sharded", False))


def shard_target(model: Any, adapter: Any, device: Any, rank: int) -> Any:
    """Shard a frozen target's decoder layers over the ranks (FSDP2). Rank 0's model holds the weights (on
    the host); the others' are on the meta device. Returns the model on `device`, in eval mode."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = torch.device(device)
    full = model.state_dict() if rank == 0 else {}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()} if rank == 0 else {}
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for layer in adapter.layers():
        fully_shard(layer, mesh=mesh)
    model.to_empty(device=device)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=opts)
    for name, buf in model.named_buffers():  # not in the state dict (e.g. rotary inv_freq): rank 0's values
        if rank == 0:
            buf.copy_(buffers[name])
        torch.distributed.broadcast(buf, src=0)
    model.requires_grad_(False)
    model._dflash_zoo_sharded = True
    return model.eval()


def load_sharded_target(source: str, device: Any, dtype: torch.dtype, rank: int) -> tuple[Any, Any]:
    """(sharded target, tokenizer) for `--fsdp-target`: rank 0 reads the checkpoint, the rest build on meta."""
    import transformers

    from dflash_zoo.adapters import get_adapter
    from dflash_zoo.loading import load_target
    from dflash_zoo.sources import TARGET_FILES, resolve_dir

    if rank == 0:
        model, tok = load_target(source, "cpu", dtype, None)
    else:
        directory = resolve_dir(source, None, TARGET_FILES)
        config = transformers.AutoConfig.from_pretrained(directory)
        auto = getattr(transformers, get_adapter(config.model_type).auto_class)
        with torch.device("meta"):
            model = auto.from_config(config, dtype=dtype)
        tok = transformers.AutoTokenizer.from_pretrained(directory)
    adapter = get_adapter(model.config.model_type)(model)
    return shard_target(model, adapter, device, rank), tok
