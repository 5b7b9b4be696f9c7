"""What produced a shard's features, and the refusal to mix features of different origins.

Features captured on a different target, layer set, dtype, kernel path (fla vs the torch
reference: up to 8% relative L2 apart, SPEC section 1) or chat template are different data.
A drafter trained on one and evaluated on another produced garbage in the seed run, so every
shard carries a `Provenance` and readers refuse shards whose compared fields differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data_pipeline.feature_codec import FEATURE_ENCODINGS, RAW

# Bump when the on-disk layout of a shard sample or a manifest line changes.
# 2: manifest lines carry every tar member's checksum (records.MemberChecksums); provenance
#    names the feature encoding (raw or fp8: feature_codec.py).
SHARD_SCHEMA_VERSION = 2

FEATURE_DTYPES = ("bfloat16", "float16", "float32")
# capture.kernels -> the kernel path its features carry (capture/fused_target.py, capture/fused_layers.py);
# eager keeps the GDN layers' own path, fla or torch
CAPTURE_KERNEL_PATHS = {"fused": "fla_fused", "fused2": "fla_fused2"}
KERNEL_PATHS = ("fla", "torch", *CAPTURE_KERNEL_PATHS.values())
WEIGHT_FILE_PATTERNS = ("*.safetensors", "*.bin")

# Fields that must match for two shards to be mixed; the version strings are informational.
COMPARED_FIELDS = (
    "schema_version",
    "target_id",
    "target_hash",
    "layer_ids",
    "hidden_size",
    "dtype",
    "kernel_path",
    "template_hash",
    "feature_encoding",
)


@dataclass(frozen=True)
class Provenance:
    """Origin of the features in a shard. Equality (==) compares only COMPARED_FIELDS."""

    schema_version: int
    target_id: str
    target_hash: str
    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str
    kernel_path: str
    template_hash: str
    # how the shards store the features (capture.feature_dtype): raw, or fp8 decoded on read;
    # a trainer refuses an encoding its config does not name (fp8 rounding is a change of data)
    feature_encoding: str = RAW
    torch_version: str = field(default="", compare=False)
    transformers_version: str = field(default="", compare=False)
    fla_version: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.layer_ids, list):
            object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        if not isinstance(self.schema_version, int) or self.schema_version < 1:
            raise ValueError(f"Provenance.schema_version must be an int >= 1, got {self.schema_version!r}")
        if not self.layer_ids or not all(isinstance(i, int) and i >= 0 for i in self.layer_ids):
            raise ValueError(f"Provenance.layer_ids must be non-negative ints, got {self.layer_ids!r}")
        if not isinstance(self.hidden_size, int) or self.hidden_size <= 0:
            raise ValueError(f"Provenance.hidden_size must be a positive int, got {self.hidden_size!r}")
        if self.dtype not in FEATURE_DTYPES:
            raise ValueError(f"Provenance.dtype must be one of {FEATURE_DTYPES}, got {self.dtype!r}")
        if self.feature_encoding not in FEATURE_ENCODINGS:
            raise ValueError(
                f"Provenance.feature_encoding must be one of {FEATURE_ENCODINGS}, got {self.feature_encoding!r}"
            )
        if self.kernel_path not in KERNEL_PATHS:
            raise ValueError(f"Provenance.kernel_path must be one of {KERNEL_PATHS}, got {self.kernel_path!r}")
        for name in ("target_id", "target_hash", "template_hash"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"Provenance.{name} must be a non-empty string")

    @property
    def feature_width(self) -> int:
        """k*H: the width of the concatenated per-token feature vector."""
        return len(self.layer_ids) * self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_ids"] = list(self.layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "<dict>") -> Provenance:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: provenance must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        unknown = sorted(set(d) - names)
        missing = sorted(required - set(d))
        if unknown or missing:
            raise ValueError(
                f"{where}: provenance has unknown fields {unknown} / is missing fields {missing}; "
                f"it was written by an incompatible schema (this code writes version "
                f"{SHARD_SCHEMA_VERSION}): re-extract the shards with this version"
            )
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = "<json>") -> Provenance:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: provenance is not valid JSON: {e}") from e
        return cls.from_dict(d, where)


class ProvenanceMismatch(ValueError):
    """Raised when shards of a different origin would be mixed with the expected data."""

    def __init__(self, where: str, diffs: tuple[tuple[str, Any, Any], ...]):
        self.where = where
        self.diffs = diffs
        lines = [f"shard provenance mismatch in {where}:"]
        lines += [f"  {name}: expected {exp!r}, found {got!r}" for name, exp, got in diffs]
        lines.append(
            "Features of a different target, layer set, dtype, kernel path, template or storage "
            "encoding (capture.feature_dtype) cannot be mixed. Either re-extract this data with the "
            "expected configuration (into a fresh shard directory), or change the config to match the "
            "shards' provenance."
        )
        super().__init__("\n".join(lines))

    def __reduce__(self):  # travels through Ray (an actor's error reaches the driver intact)
        return (type(self), (self.where, self.diffs))

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.diffs)


def check_compatible(expected: Provenance, found: Provenance, where: str) -> None:
    """Raise ProvenanceMismatch naming every compared field that differs (and `where`)."""
    diffs = tuple(
        (name, getattr(expected, name), getattr(found, name))
        for name in COMPARED_FIELDS
        if getattr(expected, name) != getattr(found, name)
    )
    if diffs:
        raise ProvenanceMismatch(where, diffs)


def weight_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """The target's weight files (*.safetensors, *.bin) in `model_dir`, sorted by name: what
    `hash_weight_files` hashes (and target/weights_check.py stamps)."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ValueError(f"hash_weight_files: {root} is not a directory")
    files = sorted({p for pat in WEIGHT_FILE_PATTERNS for p in root.glob(pat) if p.is_file()})
    if not files:
        raise ValueError(
            f"hash_weight_files: no {' / '.join(WEIGHT_FILE_PATTERNS)} files in {root}; "
            "point it at the HF model directory holding the target's weights"
        )
    return files


def hash_weight_files(model_dir: str | os.PathLike[str], chunk_bytes: int = 8 << 20) -> str:
    """sha256 over the target's weight files (*.safetensors, *.bin), sorted by name, streamed.

    Each file's name and size are hashed before its bytes, so a different split of the same
    bytes into files gives a different hash. Reads every byte: ~1-2 min for a 27B target.
    """
    h = hashlib.sha256()
    for path in weight_files(model_dir):
        h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(chunk_bytes):
                h.update(chunk)
    return h.hexdigest()


def installed_versions() -> dict[str, str]:
    """torch / transformers / fla versions for the informational Provenance fields ("" if absent)."""

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return ""

    return {
        "torch_version": version("torch"),
        "transformers_version": version("transformers"),
        "fla_version": version("flash-linear-attention") or version("fla-core"),
    }
