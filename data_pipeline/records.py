"""Frozen records shared by the shard writer and reader: one captured sample, one shard ref.

Shard directory layout (schema version SHARD_SCHEMA_VERSION):
  <prefix>-<NNNNNN>.tar   complete shards, renamed into place only once fully written
  .tmp-*.tar              shards being written; never read
  manifest.jsonl          one ShardRecord per line, appended after the shard's rename, with a
                          checksum of every tar member (MemberChecksums; checksums.py)
  .manifest.lock          fcntl lock serialising renames and manifest appends
  DONE                    written by mark_done() once every producer has closed
  skipped.jsonl           keys settled but not written, each with its reason (non-finite features;
                          an empty regenerated response, never captured): with the manifest's
                          keys, the capture ledger a restarted capture resumes from (ledger.py)
  released.json           shards trained and covered by a published checkpoint (disk_budget.py)
  buffer.json             disk buffer: cap and unconsumed bytes, for `dflash-dist status`
Inside a shard, sample i is stored as tar members `<i:08d>.<field>`:
  input_ids.npy int32 [T], loss_mask.npy uint8 [T], target_argmax.npy int32 [T],
  features.npy [T, k*H] (bf16 as the raw uint16 bit pattern; fp16/fp32 natively),
  meta.json {schema_version, key, T, dtype, features_shape, features_encoding, extra} (+ feature_layers
  when fp8: features.npy is then uint8 [T, k*(H+1)], feature_codec.py).
The sample's own key lives in meta.json, so keys may contain any characters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from data_pipeline.checksums import MEMBER_ALGORITHM, ChecksumMismatch, check_algorithm, digest_bytes, is_digest
from data_pipeline.provenance import SHARD_SCHEMA_VERSION, Provenance

MANIFEST_NAME = "manifest.jsonl"
MANIFEST_LOCK_NAME = ".manifest.lock"
DONE_NAME = "DONE"
TMP_PREFIX = ".tmp-"
SKIPPED_NAME = "skipped.jsonl"
# skipped.jsonl's reason for a sample whose regenerated response was empty (generation.is_empty_response),
# beside shard_reader.NONFINITE; the `regenerate` stage's .rejected.jsonl gives the same reason
EMPTY_RESPONSE = "empty_response"
RELEASED_NAME = "released.json"
BUFFER_NAME = "buffer.json"
# a complete shard's name: a plain file name `<prefix>-<NNNNNN>.tar` (no directory part, no
# "..", no NUL); the prefix as ShardWriter accepts it
SHARD_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*-[0-9]{6,}\.tar")

TORCH_FEATURE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
DTYPE_NAMES = {v: k for k, v in TORCH_FEATURE_DTYPES.items()}


# what a damaged manifest line's error says to do (the capture appends whole lines only)
DAMAGED_LINE_FIX = (
    "the capture writes whole lines only, so this one was damaged or edited: restore the file from a copy, or "
    "delete that line and the directory's DONE and continue the capture with --resume auto (the shard it listed "
    "is removed and its samples captured again)"
)


@dataclass(frozen=True, eq=False)
class Sample:
    """One captured sequence. `meta` holds caller-defined JSON-serialisable extras."""

    key: str
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T], 1 on response tokens
    features: torch.Tensor  # [T, k*H] in the target dtype
    target_argmax: torch.Tensor  # int32 [T], the target's next-token argmax per position
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(f"Sample.key must be a non-empty string, got {self.key!r}")
        t = _check_tensor(self.key, "input_ids", self.input_ids, torch.int32, 1)
        _check_tensor(self.key, "loss_mask", self.loss_mask, torch.uint8, 1)
        _check_tensor(self.key, "target_argmax", self.target_argmax, torch.int32, 1)
        if not isinstance(self.features, torch.Tensor) or self.features.dim() != 2:
            raise ValueError(f"sample {self.key!r}: features must be a 2-D tensor [T, k*H]")
        if self.features.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"sample {self.key!r}: features dtype {self.features.dtype} is not one of {list(TORCH_FEATURE_DTYPES)}"
            )
        for name in ("loss_mask", "target_argmax"):
            if getattr(self, name).shape[0] != t:
                raise ValueError(
                    f"sample {self.key!r}: {name} has {getattr(self, name).shape[0]} tokens, input_ids has {t}"
                )
        if self.features.shape[0] != t:
            raise ValueError(f"sample {self.key!r}: features has {self.features.shape[0]} rows, input_ids has {t}")
        if not isinstance(self.meta, Mapping):
            raise ValueError(f"sample {self.key!r}: meta must be a mapping, got {type(self.meta)}")

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.features.dtype]


def check_shard_name(name: Any, where: str) -> str:
    """`name` if it is a shard file name (SHARD_NAME_RE), else a ValueError naming `where`: names
    come from files on shared storage, and the reader opens and the disk budget deletes them."""
    if not isinstance(name, str) or not SHARD_NAME_RE.fullmatch(name):
        raise ValueError(
            f"{where}: shard name {name!r} is not a plain shard file name <prefix>-<NNNNNN>.tar (no directory part): "
            "this file was not written by dflash-dist's shard writer; remove that entry or use a fresh shard directory"
        )
    return name


def _check_tensor(key: str, name: str, t: Any, dtype: torch.dtype, dim: int) -> int:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != dim:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"sample {key!r}: {name} must be a {dim}-D {dtype} tensor, got {got}")
    return int(t.shape[0])


@dataclass(frozen=True)
class MemberChecksums:
    """The digest of every tar member of one shard, recorded when the shard was written: per
    sample (storage order), one digest per member suffix (`members`, e.g. "features.npy")."""

    algorithm: str
    members: tuple[str, ...]
    digests: tuple[tuple[str, ...], ...]

    @classmethod
    def of(cls, rows: list[dict[str, str]], algorithm: str = MEMBER_ALGORITHM) -> MemberChecksums:
        """From each sample's member_digests (one member set per shard)."""
        members = tuple(rows[0]) if rows else ()
        assert all(tuple(r) == members for r in rows), "every sample of a shard has the same members"
        return cls(algorithm, members, tuple(tuple(r.values()) for r in rows))

    def verify(self, index: int, raw: dict[str, Any], where: str, key: str) -> None:
        """Raise ChecksumMismatch naming the member of sample `index` whose bytes (as read, `raw`:
        suffix -> bytes, webdataset's grouping) differ from the recorded digest, or ValueError when
        the sample's member set differs (an unlisted member would go unchecked)."""
        got = sorted(k for k in raw if not k.startswith("_"))
        if got != list(self.members):
            raise ValueError(f"{where}: sample {index} ({key!r}) has members {got}, the manifest {list(self.members)}")
        for member, want in zip(self.members, self.digests[index]):
            found = digest_bytes(raw[member], self.algorithm)
            if found != want:
                raise ChecksumMismatch(
                    f"{where}: member {raw.get('__key__', f'{index:08d}')}.{member} (sample {index}, key {key!r}) "
                    f"has {self.algorithm} {found}, the manifest recorded {want} when it was written: the shard was "
                    "damaged since; re-extract the data (into a fresh shard directory)"
                )

    def to_dict(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "members": list(self.members), "digests": [list(d) for d in self.digests]}

    @classmethod
    def from_dict(cls, d: Any, n_samples: int, where: str) -> MemberChecksums:
        if not isinstance(d, dict) or set(d) != {"algorithm", "members", "digests"}:
            raise ValueError(f"{where}: checksums must be an object with algorithm, members and digests")
        algorithm = check_algorithm(d["algorithm"], where)
        members, digests = d["members"], d["digests"]
        if not isinstance(members, list) or not members or not all(isinstance(m, str) and m for m in members):
            raise ValueError(f"{where}: checksums.members must be a non-empty list of member suffixes")
        if not isinstance(digests, list) or len(digests) != n_samples:
            raise ValueError(f"{where}: checksums.digests must list one entry per sample ({n_samples})")
        for i, row in enumerate(digests):
            if not isinstance(row, list) or len(row) != len(members) or not all(is_digest(x, algorithm) for x in row):
                raise ValueError(f"{where}: checksums.digests[{i}] must hold {len(members)} {algorithm} hex digests")
        return cls(algorithm, tuple(members), tuple(tuple(row) for row in digests))


@dataclass(frozen=True)
class ShardRecord:
    """One complete shard as listed in manifest.jsonl (the unit passed between components)."""

    name: str  # file name inside the shard directory, e.g. "actor0-000003.tar"
    n_samples: int
    n_tokens: int
    n_bytes: int
    keys: tuple[str, ...]  # sample keys in storage order
    provenance: Provenance
    checksums: MemberChecksums  # every tar member's digest at write time, verified as it is read

    def to_json(self) -> str:
        """One manifest line, without the trailing newline."""
        d = {
            "name": self.name,
            "n_samples": self.n_samples,
            "n_tokens": self.n_tokens,
            "n_bytes": self.n_bytes,
            "keys": list(self.keys),
            "provenance": self.provenance.to_dict(),
            "checksums": self.checksums.to_dict(),
        }
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, line: str, where: str = "<manifest line>") -> ShardRecord:
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not a valid manifest line ({e}); {DAMAGED_LINE_FIX}") from e
        fields = {"name", "n_samples", "n_tokens", "n_bytes", "keys", "provenance", "checksums"}
        if isinstance(d, dict) and set(d) == fields - {"checksums"}:
            raise ValueError(
                f"{where}: manifest line has no checksums: it was written before shard schema version "
                f"{SHARD_SCHEMA_VERSION}, which this code reads; re-extract the shards with this version"
            )
        if not isinstance(d, dict) or set(d) != fields:
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(
                f"{where}: manifest line must have exactly {sorted(fields)}, got {got}; {DAMAGED_LINE_FIX}"
            )
        prov = Provenance.from_dict(d["provenance"], where)
        return cls(
            name=check_shard_name(d["name"], where),
            n_samples=int(d["n_samples"]),
            n_tokens=int(d["n_tokens"]),
            n_bytes=int(d["n_bytes"]),
            keys=tuple(d["keys"]),
            provenance=prov,
            checksums=MemberChecksums.from_dict(d["checksums"], int(d["n_samples"]), where),
        )
