"""Train a DFlash drafter for a Hugging Face target (recipe: docs/method.md §6, paper v1 §4.2 + app. A.1).

Per sequence: the frozen target runs once with taps on (features [1, T, K*H]); `anchors_per_seq` anchors are
drawn among response positions whose next token is also supervised (SpecForge rule), resampled every pass.
Each anchor starts a block `[token at anchor] + mask x (B-1)`, embedded by the target's embedding. All blocks
are appended after the clean sequence in one drafter call: a block sees target context strictly before its
anchor plus its own block (bidirectional; causal for sliding layers) and never another block (`Span`).
Slot k's label is the token at anchor + k; cross-entropy on slots 1..B-1 weighted w_k = exp(-(k-1)/gamma).
Embedding and LM head are the target's and stay frozen. AdamW, cosine with linear warmup, clip 1.0.

Ablation switches (docs/training.md): `no_target_features` freezes `fc` at zero, so every context key and
value is exactly zero and the drafter sees only its block (it still loads and runs in the normal engine);
`uniform_blocks` tiles the response with consecutive blocks instead of random anchors;
`uniform_loss_weights` sets w_k = 1.

The step itself (features, drafter forward and backward, optimizer) is `trainer.Trainer`; this module builds
the drafter, runs the loop, and writes checkpoints and the output.

Multi-GPU: launched under `torchrun`, each rank takes every world-th sequence and the drafter is wrapped in
DDP (`distributed.py`: a target sharded with FSDP too); rank 0 writes checkpoints and the output.

A little over the ~300 lines we aim for: the config, the drafter's construction, the loop and its outputs.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress, TextColumn

from dflash_zoo import drafters
from dflash_zoo.drafters import DFlash2Params, build
from dflash_zoo.engine import outdir
from dflash_zoo.engine.checkpoint import load_drafter, save_drafter, write_drafter_files
from dflash_zoo.engine.config import DraftConfig, default_target_layer_ids, normalize_draft_config
from dflash_zoo.engine.drafter import DFlashDrafter
from dflash_zoo.errors import CheckpointError, ConfigError, InvalidArgumentError
from dflash_zoo.training import checkpoints
from dflash_zoo.training.checkpoints import STATE_FILE
from dflash_zoo.training.data import Example
from dflash_zoo.training.distributed import dist_info
from dflash_zoo.training.trainer import MAX_SLOTS, StepStats, Trainer

log = logging.getLogger("dflash_zoo")
__all__ = ["MAX_SLOTS", "STATE_FILE", "TrainConfig", "TrainResult", "dist_info", "train"]
_Trainer = Trainer  # the name tests/ddp_worker.py imports


@dataclass(frozen=True)
class TrainConfig:
    """Trainer settings; the CLI maps its flags one to one onto these fields."""

    out: str
    draft_layers: int = 5
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    steps: int | None = None
    epochs: float = 6.0
    batch_size: int = 8
    anchors_per_seq: int = 512
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    clip: float = 1.0
    loss_decay_gamma: float | None = None
    seed: int = 0
    save_every: int = 0
    time_budget: float | None = None  # seconds; the cosine runs on max(step, time) progress
    cache_features: bool = False  # keep features in device memory after their first use
    cache_dir: str | None = None  # the on-disk feature cache (`feature_cache.py`), written once, reused
    cache_dtype: str = "bf16"  # its storage dtype: bf16, fp16 or fp32
    cache_shard_bytes: int = 10**9  # features per file of the disk cache
    max_length: int = 3072  # of the tokenised examples (part of the feature cache's key)
    data: str | None = None  # the data file (its hash is part of the feature cache's key)
    attention: str = "auto"  # drafter attention: auto (flex on CUDA), dense (the reference) or flex
    compile: str = "auto"  # regional torch.compile of the step (`regions.py`): auto, on or off
    no_target_features: bool = False
    uniform_blocks: bool = False
    uniform_loss_weights: bool = False
    overwrite: bool = False  # replace an `out` that dflash-zoo did not write
    keep_checkpoints: bool = False  # keep `<out>-checkpoint` after success (else it is removed)
    arch: str | None = None  # drafter architecture: "dflash" or "dflash2" (None: dflash, or the --init one's)
    dflash2: DFlash2Params = DFlash2Params(2, 16, 256, 16)  # DFlash 2's shapes (published drafters' values)
    selector_loss_weight: float = 1.0  # DFlash 2: the selector loss's weight beside the DFlash loss


@dataclass(frozen=True)
class TrainResult:
    """What `train` returns; `history` holds (step, loss, tau) at each log point.

    `loss` / `tau` are those of the last step run by this call: None when it ran none (a finished run resumed).
    """

    out_dir: str
    steps: int
    loss: float | None
    tau: float | None
    seconds: float
    tokens_per_second: float
    history: tuple[tuple[int, float, float], ...] = ()


def build_draft_config(target: Any, tokenizer: Any, cfg: TrainConfig) -> DraftConfig:
    """A z-lab draft config for `target`: Qwen3 layers of the target's width, taps by the upstream rule."""
    tc = target.config.get_text_config()
    n_layers = tc.num_hidden_layers
    if cfg.target_layer_ids:
        check_layer_ids(cfg.target_layer_ids, n_layers)
    taps = (
        list(cfg.target_layer_ids)
        if cfg.target_layer_ids
        else default_target_layer_ids(n_layers, cfg.draft_layers)
    )
    rope = getattr(tc, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(tc, "rope_theta", 1e6))
    heads = tc.num_attention_heads
    arch = drafters.ARCHS[cfg.arch or "dflash"]
    raw = {
        "architectures": list(arch.architectures),
        "model_type": "qwen3",
        "hidden_size": tc.hidden_size,
        "intermediate_size": tc.intermediate_size,
        "num_hidden_layers": cfg.draft_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(tc, "num_key_value_heads", None) or heads,
        "head_dim": getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        "vocab_size": tc.vocab_size,
        "rms_norm_eps": getattr(tc, "rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "max_position_embeddings": getattr(tc, "max_position_embeddings", 40960),
        "num_target_layers": n_layers,
        "dflash_config": {
            "block_size": cfg.block_size,
            "target_layer_ids": taps,
            "mask_token_id": pick_mask_id(target, tokenizer, cfg),
            **(asdict(cfg.dflash2) if arch is drafters.DFLASH2 else {}),
        },
    }
    return normalize_draft_config(raw)


def check_layer_ids(ids: tuple[int, ...] | list[int], n_layers: int) -> None:
    """Tap ids must be distinct layers of the target: 0 .. n_layers - 1."""
    bad = [i for i in ids if not 0 <= i < n_layers]
    if bad or len(set(ids)) != len(ids):
        what = f"{', '.join(map(str, bad))} outside" if bad else "repeats an id; ids must be distinct in"
        raise InvalidArgumentError(
            f"--target-layer-ids {what} the target's layers 0..{n_layers - 1}",
            hint=f"pass distinct ids between 0 and {n_layers - 1}, or leave the option out for the default",
        )


def pick_mask_id(target: Any, tokenizer: Any, cfg: TrainConfig) -> int:
    """--mask-token-id, else the tokenizer's declared mask token, else `<|MASK|>`, else the last embedding row
    when the tokenizer stops short of the table (the Qwen3 situation)."""
    rows = target.get_input_embeddings().weight.shape[0]
    declared = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
    if cfg.mask_token_id is not None:
        mask = cfg.mask_token_id
    elif isinstance(declared, int):
        mask = declared
    elif tokenizer is not None and "<|MASK|>" in tokenizer.get_vocab():
        mask = tokenizer.convert_tokens_to_ids("<|MASK|>")
    elif tokenizer is not None and len(tokenizer) < rows:
        mask = rows - 1
    else:
        raise ConfigError(
            "no mask token: the tokenizer declares none, has no <|MASK|> and fills the embedding table",
            hint="pass --mask-token-id ID (a reserved id below the embedding rows)",
        )
    if not 0 <= mask < rows:
        raise InvalidArgumentError(
            f"mask token id {mask} outside the target's embedding rows 0..{rows - 1}",
            hint="pass --mask-token-id with a reserved id inside the table",
        )
    return int(mask)


def new_drafter(draft_cfg: DraftConfig, cfg: TrainConfig, init: str | None, device: Any) -> DFlashDrafter:
    """A fresh (seeded) drafter, or one loaded from `init`; fp32 master weights."""
    torch.manual_seed(cfg.seed)
    model = load_drafter(init, device, torch.float32) if init else build(draft_cfg).to(device)
    model = _as_arch(model, cfg, init)
    if (
        cfg.no_target_features
    ):  # zero fc => zero context K/V: no information from the target reaches the drafter
        torch.nn.init.zeros_(model.fc.weight)
        model.fc.weight.requires_grad_(False)
    return model.train()


def _as_arch(model: DFlashDrafter, cfg: TrainConfig, init: str | None) -> DFlashDrafter:
    """The --init drafter in the asked architecture: DFlash upgrades to DFlash 2 (its new parts neutral);
    any other change is refused."""
    if init is None or cfg.arch in (None, model.arch):
        return model
    if (model.arch, cfg.arch) == ("dflash", "dflash2"):
        from dflash_zoo.drafters.dflash2 import DFlash2Drafter

        return DFlash2Drafter.from_dflash(model, cfg.dflash2)
    raise InvalidArgumentError(
        f"--init {init} is a {model.arch} drafter; it cannot become {cfg.arch}",
        hint=f"drop --arch (it keeps {model.arch}), or start from a {cfg.arch} or dflash drafter",
    )


def save_checkpoint(model: DFlashDrafter, opt: Any, step: int, gen: torch.Generator, root: Path) -> Path:
    """fp32 drafter + optimizer, step and anchor RNG, for `--resume` (one crash-safe `step-N/` under `root`)."""

    def write(directory: Path) -> None:
        write_drafter_files(model, directory)
        torch.save(
            {"step": step, "optimizer": opt.state_dict(), "rng": gen.get_state()}, directory / STATE_FILE
        )

    return checkpoints.save(root, step, write)


def save_output(
    model: DFlashDrafter, directory: Path, dtype: torch.dtype, meta: dict, overwrite: bool
) -> None:
    """The final z-lab drafter in `dtype`, plus the training settings as `training_args.json`."""
    import json

    clone = copy.deepcopy(model).to(dtype)
    text = json.dumps(meta, indent=2, default=str) + "\n"
    save_drafter(clone, directory, {"training_args.json": text}, overwrite=overwrite)


def check_locations(cfg: TrainConfig, resume: bool) -> Path | None:
    """Every output location checked (and our leftovers recovered) before any model is loaded.

    Returns the checkpoint `--resume` will use (None without `resume`).
    """
    out, root = outdir.norm(cfg.out), checkpoints.root_for(cfg.out)
    outdir.check_name(out)  # before any path under it is looked at
    outdir.check_not_package(out)  # before `recover` touches anything beside it
    outdir.check_writable(out.parent if out.exists() else out, "output directory")
    outdir.recover(out)
    outdir.check_output(out, cfg.overwrite)
    writes = bool(cfg.save_every or cfg.keep_checkpoints)
    checkpoints.check_root(root, writes=writes, resume=resume, overwrite=cfg.overwrite)
    return checkpoints.latest(root) if resume else None


def _announce_checkpoints(cfg: TrainConfig, drafter: DFlashDrafter, root: Path) -> None:
    from dflash_zoo.output import human_size, stderr

    if not (cfg.save_every or cfg.keep_checkpoints):
        return  # no checkpoint is ever written
    size = 3 * 4 * sum(p.numel() for p in drafter.parameters())  # fp32 weights + two AdamW moments
    fate = "kept (--keep-checkpoints)" if cfg.keep_checkpoints else "removed after a successful run"
    stderr().print(f"checkpoints: {root} (about {human_size(size)}; {fate})", highlight=False, markup=False)


def train(
    cfg: TrainConfig,
    model: Any,
    tokenizer: Any,
    examples: list[Example],
    device: Any = "cpu",
    init: str | None = None,
    resume: bool = False,
    meta: dict | None = None,
) -> TrainResult:
    """Train a drafter for `model` (a loaded, frozen target) on `examples`; writes `cfg.out`.

    Args:
        init: an existing drafter directory to start from (its shape wins over `cfg`).
        resume: continue from the newest complete checkpoint in `<out>-checkpoint` (weights, optimizer,
            step counter, anchor RNG).
        meta: extra provenance written into `training_args.json`.
    Returns:
        A `TrainResult` (steps, last loss / tau estimate, wall time, tokens/s, history).
    """
    model.requires_grad_(False)
    rank, _, _ = dist_info()
    out, root = Path(cfg.out), checkpoints.root_for(cfg.out)
    found = check_locations(cfg, resume) if rank == 0 else (checkpoints.latest(root) if resume else None)
    state = None
    if found is not None:
        init, state = str(found), checkpoints.load_state(found)
        log.info("resuming from %s (step %d)", found, int(state["step"]))
    drafter = new_drafter(None if init else build_draft_config(model, tokenizer, cfg), cfg, init, device)
    tr = Trainer(cfg, model, drafter, examples, device)
    step = 0
    if state is not None:
        _load_optimizer(tr.opt, state["optimizer"], found)
        tr.gen.set_state(state["rng"])
        step = int(state["step"])
    if tr.rank == 0:
        _announce_checkpoints(cfg, drafter, root)
    if cfg.cache_dir and not cfg.no_target_features and step < tr.total:
        tr.use_disk_cache(Path(cfg.cache_dir), cfg.cache_shard_bytes)
    try:
        run = _run(cfg, tr, step, root)
    finally:
        tr.release()
    if tr.rank == 0:
        unsaved = run.last_saved != run.steps and (state is None or run.steps != int(state["step"]))
        if cfg.keep_checkpoints and unsaved:
            save_checkpoint(tr.raw, tr.opt, run.steps, tr.gen, root)
        info = {**asdict(cfg), **(meta or {}), **drafter_shape(tr.raw), "steps_done": run.steps,
                "final_loss": run.loss, "seconds": run.seconds}  # fmt: skip
        save_output(tr.raw, out, model.dtype, info, cfg.overwrite)
        if not cfg.keep_checkpoints:
            checkpoints.remove(root)  # only after the output is in place
    if tr.world > 1:
        torch.distributed.barrier()
    return TrainResult(
        str(out), run.steps, run.loss, run.tau, run.seconds, run.tokens_per_second, run.history
    )


def drafter_shape(drafter: DFlashDrafter) -> dict[str, Any]:
    """The shape fields of `training_args.json` as the drafter has them (--init / --resume shapes win over
    the options)."""
    dcfg = drafter.cfg
    return {"arch": drafter.arch, "draft_layers": dcfg.num_hidden_layers, "block_size": dcfg.block_size,
            "target_layer_ids": list(dcfg.target_layer_ids), "mask_token_id": dcfg.mask_token_id}  # fmt: skip


def _load_optimizer(opt: Any, state: dict, found: Path | None) -> None:
    """The checkpoint's optimizer state; one for other parameters (another --arch or --no-target-features
    than the run had) is named, not PyTorch's internal error."""
    try:
        opt.load_state_dict(state)
    except ValueError as exc:
        raise CheckpointError(
            f"the optimizer state in {found} does not fit this drafter's parameters ({exc})",
            hint="resume with the --arch and --no-target-features the run was started with",
        ) from exc


DISPLAY_SECONDS = 2.0  # how often the progress bar reads loss and tau from the device


@dataclass(frozen=True)
class _Run:
    steps: int
    loss: float | None
    tau: float | None
    seconds: float
    tokens_per_second: float
    history: tuple[tuple[int, float, float], ...]
    last_saved: int | None  # step of the last checkpoint written during the loop


def _run(cfg: TrainConfig, tr: Trainer, step: int, root: Path) -> _Run:
    """The optimizer loop from `step` to the end (or the time budget), with progress and checkpoints.

    Loss and tau are read from the device (a sync) only at log points and, for the progress bar, every
    `DISPLAY_SECONDS`: the host queues the next step while the GPU runs this one.
    """
    from dflash_zoo.output import stderr

    stats: StepStats | None = None
    history: list[tuple[int, float, float]] = []
    last_saved, shown = None, 0.0
    t0, tokens, every = time.perf_counter(), 0, max(1, tr.total // 20)
    bar = Progress(
        *Progress.get_default_columns(),
        TextColumn("{task.fields[info]}"),
        console=stderr(),
        disable=tr.rank != 0 or not stderr().is_terminal,
    )
    with bar:
        task = bar.add_task("training", total=tr.total, completed=step, info="")
        while step < tr.total:
            elapsed = time.perf_counter() - t0
            progress = max(step / tr.total, elapsed / cfg.time_budget if cfg.time_budget else 0.0)
            if progress >= 1.0:
                break
            stats = tr.step(step, progress)
            step, tokens = step + 1, tokens + stats.tokens
            now = time.perf_counter()
            tps = tokens * tr.world / max(1e-9, now - t0)
            logged = step % every == 0 or step == tr.total
            if logged or (not bar.disable and now - shown >= DISPLAY_SECONDS):
                loss, tau, shown = float(stats.loss), float(stats.tau), now
                bar.update(task, info=f"loss {loss:.3f} tau~{tau:.2f} {tps:,.0f} tok/s")
            bar.update(task, completed=step)
            if logged:
                history.append((step, loss, tau))
                if tr.rank == 0 and not stderr().is_terminal:
                    stderr().print(
                        f"step {step}/{tr.total} loss {loss:.4f} tau~{tau:.2f} {tps:,.0f} tok/s",
                        highlight=False,
                    )
            if tr.rank == 0 and cfg.save_every and step % cfg.save_every == 0:
                save_checkpoint(tr.raw, tr.opt, step, tr.gen, root)
                last_saved = step
    seconds = time.perf_counter() - t0
    tps = tokens * tr.world / max(1e-9, seconds)
    loss, tau = (None, None) if stats is None else (float(stats.loss), float(stats.tau))
    return _Run(step, loss, tau, seconds, tps, tuple(history), last_saved)
