"""Load and save z-lab-format drafters: `config.json` + `model.safetensors` (or a sharded index).

Never executes checkpoint code and never unpickles: weights come from safetensors only, configs from JSON.
Saving writes into a temporary folder next to the destination and swaps it into place (`outdir.py`), so an
interrupted save never leaves a half-written drafter, and a directory dflash-zoo did not write is never
replaced without `overwrite`.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_zoo import drafters
from dflash_zoo.engine import outdir
from dflash_zoo.engine.config import SLIDING, DraftConfig, load_draft_config
from dflash_zoo.engine.drafter import DFlashDrafter
from dflash_zoo.engine.outdir import OWNER, OWNER_KEY
from dflash_zoo.errors import CheckpointError, DrafterFormatError, missing_directory
from dflash_zoo.formats import draft_vocab, quantized, verifier, weights


def _directory(source: str | os.PathLike) -> Path:
    """A drafter's local directory (a Hub id is resolved to one first: `dflash_zoo.sources.resolve_dir`)."""
    path = Path(source).expanduser()
    if not path.is_dir():
        raise missing_directory(str(source))
    return path


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({directory / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"sharded checkpoint in {directory} is missing shard(s): {', '.join(missing)}"
            )
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise CheckpointError(
            f"no .safetensors weights in {directory}", hint="drafters load from safetensors only"
        )
    return found


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint; a `model.` prefix is stripped. A name
    stored twice (in two shards, or with and without the prefix) is refused: one copy would be ignored."""
    stored: list[tuple[str, str, torch.Tensor]] = []  # (file:key, name, tensor)
    for file in _weight_files(directory):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    stored.append((f"{file.name}:{key}", key.removeprefix("model."), f.get_tensor(key)))
        except Exception as exc:  # safetensors raises several types for truncated/corrupted headers
            raise CheckpointError(
                f"cannot read {file.name} in {file.parent}: {exc}",
                hint="the file is damaged or incomplete: fetch or copy it again",
            ) from exc
    return weights.unique(stored, str(directory))


def load_drafter(
    source: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = torch.float32,
    allow_quantized: bool = False,
) -> DFlashDrafter:
    """Build the drafter its config declares (dflash_zoo/drafters) from a local directory, and load every weight
    strictly: a missing, unconsumed, mis-shaped or non-finite tensor refuses the checkpoint. (A Hub id:
    `dflash_zoo.load_drafter`, which fetches it first.)

    A drafter in another layout loads under its own tensor names, the verifier copies a speculators checkpoint
    carries recorded for the pair check (dflash_zoo/formats); a quantized one is refused unless
    `allow_quantized` (formats/quantized.py). `dtype` None keeps every tensor as stored (`convert`)."""
    directory = _directory(source)
    cfg = load_draft_config(directory)
    tensors = quantized.admit(cfg.raw, read_state_dict(directory), allow_quantized)
    split = weights.from_layout(cfg, tensors)
    with torch.device("meta"):
        model = draft_vocab.build(cfg)
    state = _checked_state(model, type(model).state_from_checkpoint(cfg, split.state), directory, cfg)
    model.load_state_dict(state, assign=True)
    model.rotary_emb = type(model.rotary_emb)(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    model.verifier_copies = verifier.record(split.copies, state.get("d2t"))
    return model.to(device=device, dtype=dtype).eval()


def _checked_state(
    model: DFlashDrafter, state: dict[str, torch.Tensor], directory: Path, cfg: DraftConfig
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's names, or `DrafterFormatError` naming every problem."""
    state = weights.renamed(state, _ALIASES)
    expected = model.state_dict()
    where = f"drafter {directory} ({cfg.arch})"
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        parts = ([f"missing {_names(missing)}"] if missing else []) + (
            [f"not used by {cfg.arch}: {_names(extra)}"] if extra else []
        )
        raise DrafterFormatError(f"{where}: " + "; ".join(parts), hint=_fix_hint(cfg, extra))
    for name, param in expected.items():
        if tuple(state[name].shape) != tuple(param.shape):
            raise DrafterFormatError(
                f"{where}: tensor {name!r} has shape {tuple(state[name].shape)}, config expects "
                f"{tuple(param.shape)}",
                hint="the config.json and the weights come from different drafters",
            )
        if state[name].is_floating_point() and not bool(torch.isfinite(state[name]).all()):
            raise CheckpointError(
                f"{where}: tensor {name!r} holds NaN or infinite values",
                hint="the file is damaged or the training diverged: fetch it again or use an earlier checkpoint",
            )
    return state


# spellings of the same tensor: z-lab stores the selector's codebooks bare, a transformers save adds `.weight`
_ALIASES = {
    f"candidate_selector.{n}_codebook.weight": f"candidate_selector.{n}_codebook"
    for n in ("predecessor", "successor")
}


def _names(keys: list[str], shown: int = 4) -> str:
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return ", ".join(keys[:shown]) + more


def _fix_hint(cfg: DraftConfig, extra: list[str]) -> str:
    if cfg.arch == "dflash" and any("_conv." in k or k.startswith("candidate_selector.") for k in extra):
        return 'these are DFlash 2 tensors: set "architectures": ["DFlash2DraftModel"] and its dflash_config keys'
    return "the config.json and the weights come from different drafters, or the drafter is in another layout"


def draft_config_dict(cfg: DraftConfig) -> dict[str, Any]:
    """The z-lab `config.json` for a drafter (transformers-5 generation: `dflash_config` + `rope_parameters`)."""
    raw = dict(cfg.raw)
    rope = {"rope_type": cfg.rope.type, "rope_theta": cfg.rope.theta}
    if cfg.rope.type != "default":
        rope.update(
            factor=cfg.rope.factor, original_max_position_embeddings=cfg.rope.original_max_position_embeddings
        )
    spec = drafters.ARCHS[cfg.arch]
    raw.update(
        architectures=list(spec.architectures),
        model_type=spec.model_type,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.rms_norm_eps,
        attention_bias=cfg.attention_bias,
        hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings,
        layer_types=list(cfg.layer_types),
        block_size=cfg.block_size,
        num_target_layers=cfg.num_target_layers,
        tie_word_embeddings=False,
    )
    raw.setdefault("rope_parameters", rope)
    raw.setdefault("rope_theta", cfg.rope.theta)  # older readers (and the upstream loader) read it top-level
    if cfg.sliding_window:  # Qwen3Config (z-lab's loader) drops the window unless use_sliding_window is set
        raw.update(sliding_window=cfg.sliding_window, use_sliding_window=True)
    dcfg = dict(raw.get("dflash_config") or {})
    dcfg.update(
        block_size=cfg.block_size,
        target_layer_ids=list(cfg.target_layer_ids),
        mask_token_id=cfg.mask_token_id,
    )
    if cfg.dflash2 is not None:  # DFlash 2's shapes and logit transforms, where z-lab's loader reads them
        dcfg.update(asdict(cfg.dflash2), output_multiplier=cfg.output_multiplier)
        for key in ("final_logit_softcapping", "input_embedding_scale"):
            if getattr(cfg, key) is not None:
                dcfg[key] = getattr(cfg, key)
    raw["dflash_config"] = dcfg
    _write_causality(raw, dcfg, cfg)
    if spec is drafters.LAGUNA:
        raw["gating"] = cfg.attention_gate or False
    raw.pop("auto_map", None)  # never point loaders at remote code
    return raw


def _write_causality(raw: dict[str, Any], dcfg: dict[str, Any], cfg: DraftConfig) -> None:
    """In-block causality where z-lab's loader reads it: a top-level `is_causal` when every layer agrees (what
    z-lab's attention reads), else nothing for the default rule (sliding layers causal, full ones not), else
    the per-layer list in `dflash_config` (ours and vLLM's reading; z-lab's loader cannot express it)."""
    for d in (raw, dcfg):  # a converted config may say it elsewhere (`dflash_config.causal`)
        d.pop("is_causal", None)
        d.pop("causal", None)
    if len(set(cfg.causal)) == 1:
        raw["is_causal"] = cfg.causal[0]
    elif cfg.causal != tuple(t == SLIDING for t in cfg.layer_types):
        dcfg["causal"] = list(cfg.causal)


def write_drafter_files(
    model: DFlashDrafter, directory: Path, extra_files: dict[str, str] | None = None
) -> None:
    """`config.json`, the extra files, then `model.safetensors` (tagged as ours) into an existing directory."""
    (directory / "config.json").write_text(json.dumps(draft_config_dict(model.cfg), indent=2) + "\n")
    for name, text in (extra_files or {}).items():
        (directory / name).write_text(text)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.checkpoint_state().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt", OWNER_KEY: OWNER})
    outdir.normal_mode(directory / "model.safetensors")  # safetensors writes 0600


def save_drafter(
    model: DFlashDrafter,
    out_dir: str | os.PathLike,
    extra_files: dict[str, str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `config.json` + `model.safetensors` into a temporary sibling, fsync, then swap it into place.

    An existing `out_dir` is replaced only when it is empty, was written by dflash-zoo (`outdir.is_ours`),
    or `overwrite` is set; otherwise `InvalidArgumentError` and nothing is touched.
    """
    out = outdir.norm(out_dir)
    outdir.check_output(out, overwrite, flag="overwrite=True")
    outdir.recover(out)
    tmp = outdir.new_temp_dir(out)
    try:
        write_drafter_files(model, tmp, extra_files)
        outdir.fsync_tree(tmp)
        outdir.swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
