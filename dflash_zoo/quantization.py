"""Quantized targets: what a `quantization_config` says, what runs it here, and how to load it (torch-free).

A pre-quantized target (FP8, MXFP4, bitsandbytes, GPTQ, AWQ, compressed-tensors, ...) runs on the eager engine
through transformers' own quantizer, which needs its packages and, for its fast kernels, a recent enough GPU
(below it, transformers dequantizes FP8 and MXFP4 to bf16 itself, or refuses). `report` says which, naming what
is missing, from the config alone (packages by `importlib.util.find_spec`, the GPU by `nvidia-smi`), for `check`
and `info`. The fast engine runs block-wise (128x128) FP8 targets through its FP8 kernels on a Hopper GPU with
triton (cuda/ops/fp8.py); for any other quantized target, or elsewhere, `quantized_reason` is why engine
selection (engine/select.py) falls back to eager (`fp8_reason` for FP8). `load_kwargs` is how
`TargetAdapter.from_pretrained` loads one: placed by its quantizer at load (`device_map`; bitsandbytes models
cannot be moved afterwards) in a dtype its kernels take.

Field evidence (docs/quantization.md): FP8, NVFP4 and MXFP4 targets keep a mean acceptance of about 4 to 5.5
with a bf16 drafter; quantizing the drafter is what fails (formats/quantized.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from dflash_zoo.errors import ConfigError, UnsupportedModelError

# why a quantized drafter is refused by default (formats/quantized.py; docs/quantization.md has the details)
EVIDENCE = (
    "SGLang ran a W4A16 DFlash 2 drafter at ~0% acceptance without a warning (sgl-project/sglang#39087); "
    "vLLM failed to load quantized drafters (vllm-project/vllm#53116, #53107, #51581)"
)


REFUSES = "transformers refuses it"


@dataclass(frozen=True)
class Method:
    """One `quant_method` as transformers loads it: the packages its quantizer needs, and its GPU floor."""

    label: str
    packages: tuple[str, ...]  # import names transformers' quantizer requires to load it at all
    kernels: tuple[str, ...] = ()  # import names its fast GPU kernels need on top
    capability: tuple[int, int] | None = None  # minimum CUDA compute capability of those kernels
    below: str = REFUSES  # what happens below that capability, or without the kernels
    loadable: bool = True  # transformers loads a pre-quantized checkpoint of it
    hub_kernel: str | None = None  # the Hub repo its kernel is fetched from (once, into the HF cache)


# transformers 5.17 to 5.25 `quantizers/quantizer_*.py` `validate_environment`
METHODS: dict[str, Method] = {
    "fp8": Method(
        "FP8",
        ("accelerate",),
        ("kernels",),
        (8, 9),
        "transformers dequantizes it to bf16",
        hub_kernel="kernels-community/finegrained-fp8",
    ),
    "fbgemm_fp8": Method("FP8 (fbgemm)", ("accelerate", "fbgemm_gpu"), (), (9, 0)),
    "mxfp4": Method(
        "MXFP4",
        ("accelerate",),
        ("triton", "kernels"),
        (7, 5),
        "transformers dequantizes it to bf16",
        hub_kernel="kernels-community/gpt-oss-triton-kernels",
    ),
    "bitsandbytes_4bit": Method("bitsandbytes 4-bit", ("accelerate", "bitsandbytes")),
    "bitsandbytes_8bit": Method("bitsandbytes 8-bit", ("accelerate", "bitsandbytes")),
    "gptq": Method("GPTQ", ("optimum", "gptqmodel")),
    "awq": Method("AWQ", ("accelerate", "gptqmodel")),
    "compressed-tensors": Method("compressed-tensors", ("compressed_tensors",)),
    "nvfp4": Method("NVFP4", (), loadable=False),
    "modelopt": Method("NVIDIA ModelOpt", (), loadable=False),
}
FAST_METHODS: frozenset[str] = frozenset({"fp8"})  # what the fast engine runs: block-wise FP8 (`fp8_reason`)
FP8_BLOCK = [128, 128]  # the weight blocks its FP8 kernels read (cuda/ops/fp8.py)
FP8_CAPABILITY = (9, 0)  # the GPU they run on: Hopper
_HALF_ONLY = ("gptq", "awq")  # their CUDA kernels take fp16


@dataclass(frozen=True)
class QuantReport:
    """What a target's quantization is and what will run it here."""

    method: str | None  # transformers' quant_method; None: not quantized
    details: str  # e.g. "block-wise 128x128, dynamic activations"
    eager: str  # how the eager engine runs it, or why it cannot
    fast: str  # the fast engine's answer
    missing: tuple[str, ...]  # packages transformers needs that are not installed
    status: str  # PASS (runs), WARN (runs degraded, or after installing `missing`), FAIL (cannot run here)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "detail": self.detail}

    @property
    def detail(self) -> str:
        """One line for `check` and `info`."""
        if self.method is None:
            return "not quantized"
        what = f"{self.method} ({self.details})" if self.details else self.method
        return f"{what}; eager: {self.eager}; fast engine: {self.fast}"


def method_of(qcfg: Any) -> str:
    """transformers' quant_method of a `quantization_config` (dict or config object); bitsandbytes by its bits."""
    data = _config_dict(qcfg)
    method = data.get("quant_method", "unknown")
    method = str(getattr(method, "value", method)).lower()  # a loaded config holds transformers' enum
    if method == "bitsandbytes":
        return "bitsandbytes_8bit" if data.get("load_in_8bit") else "bitsandbytes_4bit"
    return method


def _config_dict(qcfg: Any) -> dict[str, Any]:
    """A `quantization_config` as a dict: the JSON object itself, or a loaded config object's fields."""
    if isinstance(qcfg, dict):
        return qcfg
    if hasattr(qcfg, "to_dict") or hasattr(qcfg, "__dict__"):
        return getattr(qcfg, "to_dict", lambda: vars(qcfg))()
    raise ConfigError(f"the target's quantization_config must be a JSON object, got {qcfg!r}")


def details(qcfg: dict[str, Any]) -> str:
    """The scheme in a few words: block size, bits, groups, activation scheme, compressed-tensors formats."""
    parts = []
    block = qcfg.get("weight_block_size")
    if isinstance(block, list) and block:
        parts.append(f"block-wise {'x'.join(str(b) for b in block)}")
    if qcfg.get("bits"):
        parts.append(f"{qcfg['bits']}-bit")
    if qcfg.get("group_size"):
        parts.append(f"group {qcfg['group_size']}")
    if qcfg.get("bnb_4bit_quant_type"):
        parts.append(qcfg["bnb_4bit_quant_type"])
    if qcfg.get("activation_scheme"):
        parts.append(f"{qcfg['activation_scheme']} activations")
    if qcfg.get("format"):
        parts.append(str(qcfg["format"]))
    if qcfg.get("quant_algo"):
        parts.append(str(qcfg["quant_algo"]))
    return ", ".join(parts)


def has_package(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@lru_cache(maxsize=1)
def gpu_capability() -> tuple[int, int] | None:
    """The first visible NVIDIA GPU's compute capability from `nvidia-smi` (no torch); None without one."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if (visible is not None and visible.strip() in ("", "-1")) or shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True).stdout
        major, _, minor = out.strip().splitlines()[0].strip().partition(".")
        return int(major), int(minor or 0)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def report(config: dict[str, Any], have: Any = has_package, gpu: Any = gpu_capability) -> QuantReport:
    """What the target config's `quantization_config` is and what runs it here (`have(name)`, `gpu()` probe)."""
    qcfg = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not qcfg:
        return QuantReport(None, "", "transformers' own modules", "as for any target", (), "PASS")
    method = method_of(qcfg)
    spec = METHODS.get(method)
    fast = _fast_answer(method, qcfg, have, gpu)
    if spec is None:
        return QuantReport(method, details(qcfg), f"transformers' {method} quantizer (requirements not known "
                           "to dflash-zoo)", fast, (), "WARN")  # fmt: skip
    if not spec.loadable:
        why = "transformers loads no pre-quantized checkpoint of it; vLLM / SGLang serve it (`dflash-zoo serve`)"
        return QuantReport(method, details(qcfg), why, fast, (), "FAIL")
    missing = tuple(p for p in spec.packages if not have(p))
    eager, status = _eager_answer(spec, have, gpu())
    if missing:
        eager, status = (
            f"needs {', '.join(missing)} installed (pip install {' '.join(_dist(p) for p in missing)})",
            "WARN",
        )
    return QuantReport(method, details(qcfg), eager, fast, missing, status)


def _eager_answer(spec: Method, have: Any, capability: tuple[int, int] | None) -> tuple[str, str]:
    if not spec.kernels and spec.capability is None:
        return f"transformers' {spec.label} quantizer", "PASS"
    absent = [k for k in spec.kernels if not have(k)]
    floor = ".".join(str(v) for v in spec.capability) if spec.capability else None
    short = "FAIL" if spec.below == REFUSES else "WARN"  # refused, or run another, slower way
    if capability is None:
        return f"no GPU seen: {spec.below} (its kernels need CUDA compute capability >= {floor})", short
    if spec.capability and capability < spec.capability:
        have_cc = ".".join(str(v) for v in capability)
        return f"GPU compute capability {have_cc} < {floor}: {spec.below}", short
    if absent:
        return f"without {', '.join(absent)} {spec.below}", "WARN"
    fetched = f", kernel {spec.hub_kernel} from the Hub or the HF cache" if spec.hub_kernel else ""
    return (
        f"transformers' {spec.label} kernels (compute capability {'.'.join(map(str, capability))}{fetched})",
        "PASS",
    )


def _fast_answer(method: str, qcfg: dict[str, Any], have: Any, gpu: Any) -> str:
    if method not in FAST_METHODS:
        return "falls back to eager (it runs block-wise FP8 targets only)"
    why = fp8_config_reason(qcfg) or _fp8_gpu_reason(gpu(), have)
    return f"falls back to eager: {why}" if why else "runs it (FP8 kernels reading the 8-bit weights)"


def _fp8_gpu_reason(capability: tuple[int, int] | None, have: Any) -> str | None:
    """Why the FP8 kernels would not run here, from `nvidia-smi`'s GPU and the installed packages."""
    if capability is None:
        return "no GPU seen (its FP8 kernels need a Hopper GPU)"
    if capability < FP8_CAPABILITY:
        return f"GPU compute capability {'.'.join(map(str, capability))} < 9.0 (its FP8 kernels need Hopper)"
    return None if have("triton") else "its FP8 kernels need triton (pip install triton)"


def fp8_config_reason(qcfg: Any) -> str | None:
    """Why the fast engine's FP8 kernels do not read this FP8 `quantization_config`'s weights (None: they do):
    blocks other than 128x128, static activation scales, or scales not stored as fp32 (`scale_fmt`)."""
    data = _config_dict(qcfg)
    block = data.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and all(isinstance(b, int) for b in block)):
        raise ConfigError(
            f"the target's quantization_config: weight_block_size must be a list of integers, got {block!r}"
        )
    if block is None or list(block) != FP8_BLOCK:
        blocks = "per tensor" if block is None else "x".join(str(b) for b in block)
        return f"its FP8 weights are scaled {blocks}; the fast engine's FP8 kernels read 128x128 blocks"
    if str(data.get("activation_scheme") or "dynamic").lower() != "dynamic":
        return "it has static activation scales; the fast engine's FP8 kernels take 16-bit activations"
    if (data.get("scale_fmt") or "float") != "float":
        return f"its block scales are {data['scale_fmt']}; the fast engine's FP8 kernels read fp32 scales"
    return None


def fp8_modules_reason(adapter: Any) -> str | None:
    """Where the target holds FP8 tensors the static engine does not read (None: nowhere). It reads FP8
    weights (with `weight_scale_inv`, `ops.fp8.layout_reason`) in the decoder layers' projections its static
    layout names: attention q/k/v/o, a dense MLP's gate/up/down, Gated-DeltaNet's input and output projections;
    the embedding, the LM head, MoE experts, routers and the rest stay in 16 bits."""
    from dflash_zoo.cuda.ops import fp8 as fp8_ops  # torch: the target is loaded

    layout = type(adapter).static_layout
    if layout is None:
        return None
    at, mlp, gdn = layout.attention, layout.mlp, layout.linear
    read = {f"{at.path}.{n}" for n in (at.q_proj, at.k_proj, at.v_proj, at.o_proj)}
    read |= {f"{layout.mlp_path}.{n}" for n in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)} if mlp else set()
    read |= {f"{gdn.path}.{n}" for n in (*gdn.in_proj, gdn.out_proj)} if gdn else set()
    inside = set()
    for i, layer in enumerate(adapter.layers()):
        for name, mod in layer.named_modules():
            inside.add(id(mod))
            if not _holds_fp8(mod):
                continue
            why = "it is not a projection the fast engine reads in 8 bits" if name not in read else None
            why = why or fp8_ops.layout_reason(mod.weight, getattr(mod, "weight_scale_inv", None))
            if why:
                return f"layer {i}'s {name} holds FP8 weights: {why}"
    outside = [n for n, m in adapter.model.named_modules() if id(m) not in inside and _holds_fp8(m)]
    return f"{outside[0]} holds FP8 weights outside the decoder layers" if outside else None


def _fp8(t: Any) -> bool:
    """An 8-bit float tensor (e4m3 or e5m2)."""
    return t.is_floating_point() and t.element_size() == 1


def _holds_fp8(module: Any) -> bool:
    return any(_fp8(t) for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))


def fp8_reason(adapter: Any, qcfg: Any) -> str | None:
    """Why the fast engine's FP8 path cannot run this FP8 target here (None: it can, or transformers dequantized
    its weights on load): its config (`fp8_config_reason`), FP8 tensors where the engine does not read them
    (`fp8_modules_reason`), or a device its kernels do not run on (`ops.fp8.device_reason`: a CUDA GPU of
    compute capability >= 9.0 with triton, or Triton's interpreter)."""
    from dflash_zoo.cuda.ops import fp8 as fp8_ops  # torch: the target is loaded

    model = adapter.model
    if not any(_fp8(p) for p in model.parameters()):  # dequantized on load: plain weights
        return None
    why = fp8_config_reason(qcfg) or fp8_modules_reason(adapter)
    return why or fp8_ops.device_reason(next(model.parameters()).device)


# the FP8 fast path (weight-only, the default mode) has passed its GPU tests (`pytest -m gpu tests/test_fp8.py`:
# the kernels at 1-100 rows, the engine in CUDA graphs for each FP8 shape, `bench --fp8`); False would give CUDA
# users the fast engine only when asked, as a static layout not yet verified on CUDA (`StaticLayout.cuda_verified`)
FP8_CUDA_VERIFIED = True


def fp8_unverified_reason(adapter: Any) -> str | None:
    """Why the fast engine should not be an FP8 target's default on CUDA although it can run it (None: no reason)."""
    if FP8_CUDA_VERIFIED or not any(_fp8(p) for p in adapter.model.parameters()):
        return None
    return "the FP8 fast path is verified on CPU only, not yet on CUDA"


def _dist(module: str) -> str:
    """The pip distribution of an import name."""
    return {"compressed_tensors": "compressed-tensors", "fbgemm_gpu": "fbgemm-gpu"}.get(module, module)


def quantized_reason(adapter: Any) -> str | None:
    """Why the fast engine does not run this target (None: it is not quantized, or the fast engine runs it).

    A checkpoint transformers dequantized on load (FP8 / MXFP4 without their kernels) has plain weights: no
    reason. Called from engine/select.py for `pipe.last_choice`.
    """
    model = adapter.model
    qcfg = getattr(model.config, "quantization_config", None)
    if qcfg is None or not (getattr(model, "is_quantized", False) or getattr(model, "hf_quantizer", None)):
        return None
    method = method_of(qcfg)
    if method == "fp8":
        why = fp8_reason(adapter, qcfg)
        return None if why is None else f"the target is FP8-quantized: {why}"
    label = METHODS[method].label if method in METHODS else method
    return f"the target is {label}-quantized; the fast engine runs no {label} targets"


def cached_report(repo: str, revision: str | None, cache_dir: str | Path) -> QuantReport | None:
    """The report for a Hub repo's `config.json` as the HF cache at `cache_dir` holds it (no network); None: not
    cached."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo, "config.json", cache_dir=str(cache_dir), revision=revision)
    except ValueError:  # not a valid repo id
        return None
    return report(read_config(Path(found).parent)) if isinstance(found, str) else None


def read_config(directory: str | Path) -> dict[str, Any]:
    """A model directory's `config.json` as a dict ({} when there is none: transformers reports that)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}", hint="fix the file or fetch it again") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object", hint="fix the file or fetch it again")
    return raw


def check_loadable(config: dict[str, Any]) -> None:
    """Refuse a quantized target transformers cannot load here, naming the package to install or the reason."""
    r = report(config)
    if r.method is None:
        return
    if r.missing:
        raise UnsupportedModelError(
            f"the target is {r.method}-quantized and transformers needs {', '.join(r.missing)} to load it",
            hint=f"pip install {' '.join(_dist(p) for p in r.missing)}",
        )
    if r.status == "FAIL":
        raise UnsupportedModelError(f"the target is {r.method}-quantized: {r.eager}")


def load_kwargs(directory: str | Path, dtype: Any, device: Any) -> dict[str, Any]:
    """`from_pretrained` keywords for a pre-quantized checkpoint ({} for any other): placed on `device` by its
    quantizer at load, in the dtype its CUDA kernels take (fp16 for GPTQ / AWQ, bf16 for an fp32 request)."""
    config = read_config(directory)
    qcfg = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not qcfg:
        return {}
    check_loadable(config)
    out: dict[str, Any] = {"device_map": {"": str(device)}}
    if str(device).startswith("cuda"):
        import torch  # only here: the caller is loading weights

        if method_of(qcfg) in _HALF_ONLY:
            out["dtype"] = torch.float16
        elif dtype == torch.float32:  # quantized kernels take 16-bit activations
            out["dtype"] = torch.bfloat16
    return out


def check_rows(
    target_config: dict[str, Any], draft_raw: dict[str, Any], draft_dir: Path | None = None
) -> list[tuple[str, str, str]]:
    """`check`'s rows (name, status, detail): the target's quantization, and a quantized drafter if it is one
    (by its config, or by the tensors of a local `draft_dir`, as the loader decides)."""
    r = report(target_config)
    rows = [("quantization", r.status, r.detail)]
    qcfg = draft_raw.get("quantization_config")
    what = f"{method_of(qcfg)}-quantized" if qcfg else tensor_quantization(draft_dir) if draft_dir else None
    if what:
        why = (
            f"the drafter is {what}: refused by default because {EVIDENCE}; "
            "--allow-quantized-drafter tries it (FP8 block-scaled weights only, dequantized)"
        )
        rows.append(("drafter quantization", "FAIL", why))
    return rows


# safetensors dtypes of unquantized weights; a vocabulary map may be integer or bool, not quantized weights
_FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
VOCAB_MAPS = ("d2t", "t2d")


def tensor_quantization(folder: Path) -> str | None:
    """Whether a drafter folder's safetensors hold quantized tensors (FP8, or integer weights other than a
    vocabulary map), read from the files' JSON headers (no torch); e.g. "quantized (tensor X is F8_E4M3)"."""
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
        except (OSError, ValueError):
            return None  # unreadable here: the loader names it
        for name, info in header.items():
            if name != "__metadata__" and name.removeprefix("model.") not in VOCAB_MAPS:
                dtype = info.get("dtype") if isinstance(info, dict) else None
                if dtype not in _FLOAT_DTYPES:
                    return f"quantized (tensor {name} is {dtype})"
    return None
