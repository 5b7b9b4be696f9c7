"""data_pipeline/plain_tar.py against webdataset's own reader (`group_by_keys(tar_file_expander)`,
which it replaced for shards and token-store tars): the same samples from every plain tar a writer
can make (webdataset's ShardWriter, the project's ShardWriter, pax and GNU long names, directories,
links and `__meta__` members skipped), and a tar cut short inside a member is an error naming the
file, as webdataset's was."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
import webdataset as wds
from webdataset.tariterators import group_by_keys, tar_file_expander

from data_pipeline.plain_tar import tar_samples
from data_pipeline.records import MANIFEST_NAME
from data_pipeline.shard_reader import iter_shard_samples, read_manifest
from data_pipeline.shard_writer import ShardWriter, mark_done
from tests.helpers.shards import make_prov, make_sample


def _webdataset(path) -> list[dict]:
    with open(path, "rb") as f:
        return list(group_by_keys(tar_file_expander([{"url": str(path), "stream": f}])))


def _plain(path) -> list[dict]:
    with open(path, "rb") as f:
        return list(tar_samples(f, str(path)))


def _tar(path, fmt: int, members: list[tuple[str, bytes | str | None]]) -> None:
    with tarfile.open(path, "w|", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif isinstance(data, str):
                info.type, info.linkname = tarfile.SYMTYPE, data
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_webdataset_shardwriter_tars_read_the_same(tmp_path):
    rng = np.random.default_rng(0)
    with wds.ShardWriter(str(tmp_path / "s-%06d.tar"), maxcount=3, verbose=0) as w:
        for i in range(7):
            w.write({"__key__": f"{'k' * 120}/{i:08d}", "features.npy": rng.standard_normal((5, 3)).astype(np.float32),
                     "meta.json": {"i": i}, "txt": "x" * (i * 300)})  # fmt: skip
    tars = sorted(tmp_path.glob("s-*.tar"))
    assert len(tars) == 3
    for path in tars:
        got, want = _plain(path), _webdataset(path)
        assert got == want and len(got) in (1, 3), path


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_long_names_links_directories_and_meta_members_read_the_same(tmp_path, fmt):
    long = "n" * (90 if fmt == tarfile.USTAR_FORMAT else 200)  # ustar: a 155-byte prefix + 100-byte name
    members = [(f"{long}/00000000.a.npy", b"a" * 513), (f"{long}/00000000.B.JSON", b"{}"), ("dir", None),
               ("__meta__", b"m"), ("00000001.link", "/etc/passwd"), ("00000001.a.npy", b"b" * 1024),
               ("00000001.empty", b""), ("sub/00000002.a.npy", b"c")]  # fmt: skip
    if fmt != tarfile.USTAR_FORMAT:
        members.append(("ü名.a", b"u"))
    path = tmp_path / "t.tar"
    _tar(path, fmt, members)
    got = _plain(path)
    assert got == _webdataset(path)
    assert [s["__key__"] for s in got][:3] == [f"{long}/00000000", "00000001", "sub/00000002"]
    assert got[0]["b.json"] == b"{}" and got[1] == {"__key__": "00000001", "__url__": str(path),
                                                     "a.npy": b"b" * 1024, "empty": b""}  # fmt: skip


def test_a_tar_cut_inside_a_member_is_an_error_naming_the_file(tmp_path):
    """webdataset's reader added the file to a truncated tar's ReadError; tarfile's own message is
    only 'unexpected end of data', which named no shard of hundreds (iter_shard_samples, bench)."""
    path = tmp_path / "t.tar"
    _tar(path, tarfile.PAX_FORMAT, [("00000000.a", b"a" * 5000), ("00000001.a", b"b" * 5000)])
    data = path.read_bytes()
    for cut in (512 + 100, 512 + 5120 + 512 + 100):  # inside the first member; inside the second
        path.write_bytes(data[:cut])
        with pytest.raises(tarfile.ReadError, match=rf"{path}: cut short"):
            _plain(path)
    path.write_bytes(data[: 512 + 5120])  # cut at a member boundary: the tar ends there, as for webdataset
    assert [s["__key__"] for s in _plain(path)] == ["00000000"] == [s["__key__"] for s in _webdataset(path)]


def test_iter_shard_samples_of_a_truncated_shard_names_it(tmp_path):
    prov = make_prov()
    with ShardWriter(tmp_path, prov, prefix="cap") as w:
        w.write(make_sample("a", prov, finite=True))
    mark_done(tmp_path)
    (record,) = read_manifest(tmp_path)
    path = tmp_path / record.name
    assert (tmp_path / MANIFEST_NAME).exists()
    with tarfile.open(path) as tar:
        last = tar.getmembers()[-1]  # cut in the middle of the last member's data
    assert last.size > 1
    path.write_bytes(path.read_bytes()[: last.offset_data + last.size // 2])
    with pytest.raises(tarfile.ReadError, match=rf"{path}: cut short"):
        list(iter_shard_samples(path))
