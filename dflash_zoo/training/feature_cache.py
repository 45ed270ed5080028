"""On-disk cache of tapped target features (`train --cache-features DIR`), written once, reused by later
epochs and runs.

Layout: `DIR/rank-RRRRR-of-WWWWW/` per rank of the writing run (each rank caches the examples it trains on):
- `shard-NNNNNN.safetensors`: one tensor per example, named by its index in the rank's shard, [T_i, K*H];
- `manifest.json`: the cache key, the feature width and the complete shards with their examples.

Crash safety: a shard is written to `.shard-NNNNNN.tmp-XXXXXXXX`, fsynced, renamed and the directory fsynced;
only then is the manifest replaced the same way. A kill at any instant leaves the last manifest valid; on the
next open, temporary files and a shard the manifest does not list (renamed, manifest not yet replaced) are
removed, each only when it is ours by name (and, for a shard, by its metadata tag), and the missing examples
are computed again. Anything else in DIR is the user's: the cache refuses it instead of touching it. A listed
shard that is missing, of another size than the manifest records or with an unreadable header is damage no
kill leaves: the cache is refused naming the shard (delete the rank directory to rebuild it).

Key (`CacheKey`): the target's config and weights fingerprints and dtype, the tap set, `--max-length`, the
data file's hash, a digest of the token ids this rank trains on, the storage dtype, rank and world size. A
cache written under another key is refused, naming the fields that differ.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from array import array
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from dflash_zoo.engine import outdir
from dflash_zoo.errors import ZooError

FORMAT = "dflash-zoo.feature-cache/1"
MANIFEST = "manifest.json"
SHARD_BYTES = 10**9  # features per shard file
_RANK_DIR = re.compile(r"rank-\d{5}-of-\d{5}")
_PROBE = re.compile(r"\.dflash-zoo-probe-[0-9a-f]{8}")  # `outdir.check_writable`'s
_SHARD = re.compile(r"shard-(\d{6})\.safetensors")
_TEMP = re.compile(r"\.(shard-\d{6}\.safetensors|manifest\.json)\.tmp-[0-9a-f]{8}|\.tmp[A-Za-z0-9]{6}")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class FeatureCacheError(ZooError):
    """A feature cache directory cannot be used (another run's cache, foreign files, no space)."""


@dataclass(frozen=True)
class CacheKey:
    """What the cached features depend on; two runs share a cache only when every field is equal."""

    target_config: str
    target_weights: str
    target_dtype: str
    taps: tuple[int, ...]
    max_length: int
    data: str
    examples: str
    dtype: str
    rank: int
    world: int

    def differences(self, other: dict[str, Any]) -> list[str]:
        """Names (with both values where short) of the fields in which `other` differs from this key."""
        out = []
        for f in fields(self):
            mine, theirs = _jsonable(getattr(self, f.name)), other.get(f.name)
            if mine != theirs:
                short = len(str(mine)) + len(str(theirs)) < 60
                out.append(f"{f.name} ({theirs} in the cache, {mine} now)" if short else f.name)
        return out


def _jsonable(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _sha(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little") + p)
    return h.hexdigest()[:32]


def config_fingerprint(model: Any) -> str:
    """A hash of the target's config, without the fields that name where or by which version it was saved."""
    cfg = model.config.to_dict()
    for k in ("_name_or_path", "transformers_version", "_commit_hash", "dtype", "torch_dtype"):
        cfg.pop(k, None)
    return _sha([json.dumps(cfg, sort_keys=True, default=str).encode()])


def weights_fingerprint(model: Any, samples: int = 64) -> str:
    """A hash of every parameter's name, shape, dtype and `samples` values spread over it (one host copy).

    A parameter sharded over ranks (FSDP) contributes its local shard: `combine` the ranks' fingerprints.
    """
    from torch.distributed.tensor import DTensor

    names, picks = [], []
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        flat = local.detach().reshape(-1)
        picks.append(flat[:: max(1, flat.numel() // samples)][:samples].float())
        names.append(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
    values = torch.cat(picks).cpu().numpy().tobytes() if picks else b""
    return _sha([*names, values])


def combine(fingerprints: list[str]) -> str:
    """One fingerprint from several (e.g. every rank's, in rank order)."""
    return _sha([f.encode() for f in fingerprints])


def examples_digest(examples: list[Any]) -> str:
    """A hash of the token ids (and supervised starts) of `examples`, in order."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(array("q", [ex.start, len(ex.ids), *ex.ids]).tobytes())
    return h.hexdigest()[:32]


def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()[:32]


def estimate_bytes(lengths: list[int], width: int, dtype: str) -> int:
    """Bytes of the shards holding features of sequences of `lengths` tokens (headers included, roughly)."""
    item = torch.empty((), dtype=DTYPES[dtype]).element_size()
    return sum(n * width * item + 64 for n in lengths)


def _write_atomic(directory: Path, name: str, write) -> None:
    """`write(tmp_path)`, fsync, rename to `name`, fsync the directory."""
    tmp = directory / f".{name}.tmp-{secrets.token_hex(4)}"
    try:
        write(tmp)
        outdir.fsync_path(tmp)
        os.replace(tmp, directory / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    outdir.fsync_path(directory)


def rank_dir(root: Path, rank: int, world: int) -> Path:
    return root / f"rank-{rank:05d}-of-{world:05d}"


def check_root(root: Path) -> None:
    """Refuse a DIR that is not a directory or holds anything but rank directories (before any work)."""
    if root.exists() and (root.is_symlink() or not root.is_dir()):
        raise FeatureCacheError(f"feature cache location {root} exists and is not a directory")
    outdir.check_writable(root, "feature cache directory")
    names = [p.name for p in root.iterdir() if not _ours(p)] if root.is_dir() else []
    if names:
        shown = ", ".join(sorted(names)[:3])
        raise FeatureCacheError(
            f"feature cache directory {root} holds files dflash-zoo did not write ({shown})",
            hint="pass an empty or new directory to --cache-features",
        )


def _ours(p: Path) -> bool:
    """A rank directory, or another rank's writability probe (there only for an instant: maybe gone now)."""
    return _PROBE.fullmatch(p.name) is not None or (p.is_dir() and _RANK_DIR.fullmatch(p.name) is not None)


class FeatureCache:
    """One rank's cache: `open` checks and cleans it, `add` buffers features, `flush` writes a shard."""

    def __init__(self, directory: Path, key: CacheKey, width: int, shard_bytes: int = SHARD_BYTES):
        self.dir, self.key, self.width, self.shard_bytes = directory, key, width, shard_bytes
        self.shards: list[dict[str, Any]] = []
        self.where: dict[int, str] = {}  # example index -> shard file
        self._buffer: dict[int, torch.Tensor] = {}
        self._open: dict[str, Any] = {}

    @classmethod
    def open(cls, root: Path, key: CacheKey, width: int, shard_bytes: int = SHARD_BYTES) -> FeatureCache:
        """The rank's cache under `root`: created, or resumed after its leftovers are cleaned; a cache of
        another key (or width) is refused naming the difference."""
        check_root(root)
        cache = cls(rank_dir(root, key.rank, key.world), key, width, shard_bytes)
        cache.dir.mkdir(parents=True, exist_ok=True)
        cache._load_manifest()
        cache._clean()
        return cache

    def _load_manifest(self) -> None:
        path = self.dir / MANIFEST
        if not path.is_file():
            return
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise FeatureCacheError(
                f"cannot read {path}: {exc}", hint=f"delete {self.dir} to rebuild it"
            ) from exc
        if raw.get("format") != FORMAT:
            raise FeatureCacheError(
                f"{path} is not a dflash-zoo feature cache manifest ({raw.get('format')!r})"
            )
        diff = self.key.differences(raw.get("key", {}))
        if raw.get("width") != self.width:
            diff.append(f"width ({raw.get('width')} in the cache, {self.width} now)")
        if diff:
            raise FeatureCacheError(
                f"feature cache {self.dir} was written for another run: {'; '.join(diff)} differ",
                hint="pass another --cache-features DIR, or delete this one to rebuild it",
            )
        self.shards = raw["shards"]
        for shard in self.shards:
            self._check_shard(shard)
        self.where = {i: s["file"] for s in self.shards for i in s["examples"]}

    def _check_shard(self, shard: dict[str, Any]) -> None:
        """A listed shard must be there whole (its recorded size, a readable header): a damaged one is named,
        never announced as cached (its features would fail mid-training)."""
        path = self.dir / shard["file"]
        size = path.stat().st_size if path.is_file() else None
        if size is None:
            why = "is missing"
        elif shard.get("bytes") not in (None, size):  # manifests list each shard's size when it was written
            why = f"has {size} bytes where the manifest records {shard['bytes']}"
        elif not _tagged(path):
            why = "has an unreadable header"
        else:
            return
        raise FeatureCacheError(
            f"feature cache shard {path} {why}: the cache is damaged",
            hint=f"delete {self.dir} (this rank's cache; its features are computed again on the next run)",
        )

    def _clean(self) -> None:
        """Remove temporary files and shards the manifest does not list (ours only); refuse anything else."""
        listed = {s["file"] for s in self.shards}
        for p in self.dir.iterdir():
            if p.name == MANIFEST or p.name in listed:
                continue
            if p.is_file() and _TEMP.fullmatch(p.name):
                p.unlink()
            elif p.is_file() and _SHARD.fullmatch(p.name) and _tagged(p):
                p.unlink()  # renamed, but the kill came before the manifest listed it
            else:
                raise FeatureCacheError(
                    f"feature cache directory {self.dir} holds {p.name}, which dflash-zoo did not write",
                    hint="move it away, or pass another --cache-features DIR",
                )
        outdir.fsync_path(self.dir)

    def missing(self, count: int) -> list[int]:
        """Indices among 0..count-1 with no cached features."""
        return [i for i in range(count) if i not in self.where]

    def add(self, index: int, feats: torch.Tensor) -> None:
        """Buffer [T, K*H] features of example `index`; a full buffer becomes a shard."""
        self._buffer[index] = feats.to(DTYPES[self.key.dtype]).cpu()
        if sum(t.numel() * t.element_size() for t in self._buffer.values()) >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        """Write the buffered features as one shard, then list it in the manifest (both crash-safe)."""
        from safetensors.torch import save_file

        if not self._buffer:
            return
        number = 1 + max((int(_SHARD.fullmatch(s["file"]).group(1)) for s in self.shards), default=-1)
        name = f"shard-{number:06d}.safetensors"
        tensors = {str(i): t.contiguous() for i, t in self._buffer.items()}
        meta = {outdir.OWNER_KEY: outdir.OWNER, "format": FORMAT}

        def write(tmp: Path) -> None:
            save_file(tensors, str(tmp), metadata=meta)
            # safetensors writes a private file; the cache may be shared, as the manifest is
            outdir.normal_mode(tmp)

        _write_atomic(self.dir, name, write)
        size = (self.dir / name).stat().st_size
        self.shards.append({"file": name, "examples": sorted(self._buffer), "bytes": size})
        self._write_manifest()
        self.where.update(dict.fromkeys(self._buffer, name))
        self._buffer = {}

    def _write_manifest(self) -> None:
        body = {"format": FORMAT, "key": asdict(self.key), "width": self.width, "shards": self.shards}
        text = json.dumps(body, indent=1) + "\n"
        _write_atomic(self.dir, MANIFEST, lambda tmp: tmp.write_text(text))

    def get(self, index: int) -> torch.Tensor:
        """[T, K*H] features of example `index` (on the host, in the storage dtype)."""
        from safetensors import safe_open

        name = self.where[index]
        if name not in self._open:
            self._open[name] = safe_open(str(self.dir / name), framework="pt", device="cpu")
        return self._open[name].get_tensor(str(index))

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.dir).free


def _tagged(path: Path) -> bool:
    """True when a shard file carries our metadata tag (a complete safetensors file written by us)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get(outdir.OWNER_KEY) == outdir.OWNER
    except Exception:  # truncated or not safetensors: not provably ours
        return False
