"""data_pipeline/npy_bytes.py: a .npy member back to the array numpy's own reader gives, for every
header version and layout a shard can hold, from many threads at once; object arrays refused."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest

from data_pipeline.npy_bytes import npy_from_bytes


def npy(array: np.ndarray, version=None, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, version=version, allow_pickle=allow_pickle)
    return buf.getvalue()


CASES = [
    np.arange(24, dtype=np.uint16).reshape(4, 6),  # bf16 features are stored as their 16 bits
    np.arange(7, dtype=np.int32),
    np.ones((3, 2, 5), dtype=np.uint8),
    np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
    np.zeros((0, 8), dtype=np.float16),
    np.array(3.5, dtype=np.float64),  # 0-d
    np.arange(6, dtype=">i4"),  # big-endian
]


@pytest.mark.parametrize("array", CASES, ids=[f"{a.dtype}{a.shape}" for a in CASES])
@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
def test_equal_to_numpys_reader_and_writable(array, version):
    data = npy(array, version)
    want = np.lib.format.read_array(io.BytesIO(data))
    got = npy_from_bytes(data)
    assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    assert got.flags.writeable  # a copy, not a view of the (read-only) bytes


def test_object_arrays_and_unknown_versions_are_refused():
    with pytest.raises(ValueError, match="Python objects: refused"):
        npy_from_bytes(npy(np.array([{"a": 1}], dtype=object), allow_pickle=True))
    data = bytearray(npy(np.arange(3)))
    data[6] = 9  # major version 9
    with pytest.raises(ValueError, match=r"version \(9, 0\)"):
        npy_from_bytes(bytes(data))


def test_many_threads_decode_at_once():
    arrays = [np.arange(n * 3, dtype=np.int32).reshape(n, 3) for n in range(1, 33)]
    blobs = [npy(a) for a in arrays]
    errors, barrier = [], threading.Barrier(8)

    def work() -> None:
        barrier.wait()
        try:
            for _ in range(200):
                for a, b in zip(arrays, blobs):
                    assert np.array_equal(npy_from_bytes(b), a)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:1]
