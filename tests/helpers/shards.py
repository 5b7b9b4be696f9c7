"""Shard contents for the shard and reader tests: a provenance, samples of random bits (NaN/Inf
included) or finite numbers, the keys a stream hands out, and a bit flipped inside a written shard."""

from __future__ import annotations

import tarfile
from pathlib import Path

import torch

from data_pipeline.provenance import SHARD_SCHEMA_VERSION, Provenance
from data_pipeline.records import Sample
from data_pipeline.shard_reader import ShardStream

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def make_prov(**overrides) -> Provenance:
    fields = dict(
        schema_version=SHARD_SCHEMA_VERSION,
        target_id="tiny-qwen3_5",
        target_hash="ab" * 32,
        layer_ids=(1, 2),
        hidden_size=16,
        dtype="bfloat16",
        kernel_path="torch",
        template_hash="tmpl-1",
        torch_version="2.13.0",
    )
    fields.update(overrides)
    return Provenance(**fields)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, -0, subnormals included) viewed as `dtype`."""
    int_dtype = {2: torch.int16, 4: torch.int32}[torch.empty(0, dtype=dtype).element_size()]
    info = torch.iinfo(int_dtype)
    raw = torch.randint(info.min, info.max + 1, shape, dtype=torch.int64, generator=g)
    return raw.to(int_dtype).view(dtype)


def make_sample(key: str, prov: Provenance, T: int = 12, seed: int = 0, finite: bool = False, **meta) -> Sample:
    """Random bits as features (NaN/Inf included: round trips), or with `finite` numbers the
    stream hands out (it skips samples with NaN/Inf features)."""
    g = torch.Generator().manual_seed(seed)
    width = prov.feature_width
    if finite:
        features = torch.randn(T, width, generator=g).to(DTYPES[prov.dtype])
    else:
        features = random_bits((T, width), DTYPES[prov.dtype], g)
    return Sample(
        key=key,
        input_ids=torch.randint(0, 250_000, (T,), dtype=torch.int32, generator=g),
        loss_mask=torch.randint(0, 2, (T,), dtype=torch.uint8, generator=g),
        features=features,
        target_argmax=torch.randint(0, 250_000, (T,), dtype=torch.int32, generator=g),
        meta=meta,
    )


def stream_keys(stream: ShardStream, limit: int | None = None) -> list[str]:
    out = []
    for sample in stream:
        out.append(sample.key)
        if limit is not None and len(out) == limit:
            break
    return out


def flip_member_byte(shard: Path, member: str) -> None:
    """XOR the lowest bit of a member's last array element (little-endian: its low byte), in
    place: the size stays, the value stays finite, only the checksum can tell."""
    with tarfile.open(shard) as tar:
        info = tar.getmember(member)
    data = bytearray(shard.read_bytes())
    itemsize = 2 if member.endswith("features.npy") else 4
    data[info.offset_data + info.size - itemsize] ^= 0x01
    shard.write_bytes(bytes(data))
