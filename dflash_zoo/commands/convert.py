"""`convert`: a drafter from any layout dflash-zoo reads into another (dflash_zoo/formats).

Reads SRC strictly (every tensor consumed, as for a run), refuses what the requested layout cannot express
before touching weights (torch is imported only then), and writes OUT through a temporary sibling renamed into
place; a directory dflash-zoo did not write is replaced only with --overwrite. The tensors are copied as stored,
so a conversion and its way back are bit-exact. `--target` names the target: a speculators output needs it
(its verifier name, embedding, LM head and final norm come from it), and a speculators input's copies of those
are checked against it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import click

from dflash_zoo import formats, output

EPILOG = """\b
Layouts:
  zlab          z-lab/dflash: DFlashDraftModel / DFlash2DraftModel config.json (what `generate` and `train` use)
  speculators   vllm-project/speculators: speculators_model_type dflash / dflash2 (vLLM loads it)
  hf-native     transformers' MuseGlimmerAssistantModel (DFlash drafters with bidirectional layers only)
\b
Examples:
  dflash-zoo convert ./zlab-drafter --to speculators ./spec-drafter --target Qwen/Qwen3-8B
  dflash-zoo convert ./spec-drafter --to zlab ./zlab-drafter --target ./Qwen3-8B   # checks its verifier copies
  dflash-zoo convert ./zlab-drafter --to hf-native ./assistant
  dflash-zoo convert ./assistant --to zlab ./zlab-drafter --overwrite --json
\b
Refused, with the reason: DFlash 2 or causal layers in hf-native, a reduced draft vocabulary in zlab or
hf-native, logit transforms in speculators or hf-native, a quantized drafter (unless
--allow-quantized-drafter: FP8 block-scaled weights are written dequantized).
\b
Environment: HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE=1, HF_TOKEN, DFLASH_ZOO_DEBUG=1.
"""


@click.command(epilog=EPILOG)
@click.argument("source")
@click.argument("out", type=click.Path(file_okay=False))
@click.option(
    "--to", "layout", type=click.Choice(formats.LAYOUTS), required=True, help="The layout to write."
)
@click.option("--target", "-t", default=None, help="The drafter's target: local dir or Hub id.")
@click.option("--revision", default=None, help="SOURCE revision (a Hub id).")
@click.option("--overwrite", is_flag=True, help="Replace OUT even if dflash-zoo did not write it.")
@click.option(
    "--allow-quantized-drafter", is_flag=True, help="Convert a quantized drafter (FP8: dequantized)."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def convert(
    source: str,
    out: str,
    layout: str,
    target: str | None,
    revision: str | None,
    overwrite: bool,
    allow_quantized_drafter: bool,
    as_json: bool,
) -> None:
    """Write the drafter SOURCE (local dir or Hub id, any layout) as a LAYOUT checkpoint in OUT."""
    from dflash_zoo.engine import outdir
    from dflash_zoo.engine.config import load_draft_config
    from dflash_zoo.sources import DRAFT_FILES, resolve_dir

    src = resolve_dir(source, revision, DRAFT_FILES)
    cfg = load_draft_config(src)
    formats.check_expressible(layout, cfg, has_target=target is not None)  # before any weights
    outdir.check_output(outdir.norm(out), overwrite)
    outdir.check_holds_no_input(outdir.norm(out), {"SOURCE": src, "--target": target})
    tgt = _target(target) if target else None
    written, dropped = _write(src, layout, out, tgt, overwrite, allow_quantized_drafter)
    result = {
        "source": str(src),
        "source_layout": cfg.layout,
        "layout": layout,
        "out": str(written),
        "architecture": cfg.variant,
        "verifier_copies_checked": bool(tgt) and bool(dropped),
        "verifier_copies_dropped": dropped if layout != formats.SPECULATORS else [],
    }
    if as_json:
        output.emit_json(result)
        return
    click.echo(str(written))
    output.hint(f"{cfg.layout} -> {layout}: {cfg.variant} drafter written to {written}")
    if dropped and layout != formats.SPECULATORS:
        checked = "equal to the target's" if tgt else "not checked: --target checks them"
        output.hint(
            f"left out the verifier copies {', '.join(dropped)} ({checked}); {layout} uses the target's own"
        )


def _target(name: str) -> dict[str, Any]:
    """The target's directory, config and adapter class (config files and weights only: no tokenizer needed)."""
    from dflash_zoo.adapters import find_adapter
    from dflash_zoo.errors import UnsupportedModelError
    from dflash_zoo.quantization import read_config
    from dflash_zoo.sources import resolve_dir

    directory = resolve_dir(name, None, ["config.json", "*.safetensors", "*.safetensors.index.json"])
    config = read_config(directory)
    cls = find_adapter(str(config.get("model_type", "")))
    if cls is None:
        raise UnsupportedModelError(f"target {name}: no adapter for model_type {config.get('model_type')!r}")
    return {"name": name, "dir": Path(directory), "config": config, "adapter": cls}


def _write(
    src: Path, layout: str, out: str, tgt: dict | None, overwrite: bool, allow_q: bool
) -> tuple[Path, list]:
    """Load SOURCE as stored, check it against the target, write it; returns (OUT, verifier copies it carried)."""
    from dflash_zoo.engine.checkpoint import load_drafter
    from dflash_zoo.errors import IncompatiblePairError
    from dflash_zoo.formats import verifier, write

    model = load_drafter(src, "cpu", None, allow_quantized=allow_q)  # dtype None: every tensor as stored
    copies = model.verifier_copies
    ver = None
    if tgt is not None:
        problems = [p for p in tgt["adapter"].validate(tgt["config"], model.cfg) if p.severity == "FAIL"]
        if problems:
            raise IncompatiblePairError(f"the drafter does not fit {tgt['name']}: {problems[0].message}")
        parts = verifier.target_tensors(tgt["dir"], tgt["adapter"])
        verifier.check(copies, parts, target=tgt["name"])
        archs = tuple(tgt["config"].get("architectures") or ())
        ver = write.Verifier(tgt["name"], archs, parts)
        if model.cfg.num_target_layers is None:  # speculators does not hold it; z-lab's loader needs it
            layers = tgt["adapter"].text_config_dict(tgt["config"]).get("num_hidden_layers")
            model.cfg = dataclasses.replace(model.cfg, num_target_layers=layers)
    return write.save_layout(model, layout, out, ver, overwrite), [c.name for c in copies]
