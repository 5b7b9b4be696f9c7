"""bench/bench_quality.py's data cache (<out>/data.safetensors + data.json): a run reuses it only when
data.json was written for the same settings and the data file holds the bytes data.json was written
with. A crash in the middle of writing (here: the kernel kills the writer at a file-size limit, half
way through its bytes) leaves the earlier file whole and no record that vouches for partial bytes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_quality  # noqa: E402

WANT_A, WANT_B = {"train": 3, "seed": 0}, {"train": 3, "seed": 1}

CRASHING_WRITER = """
import resource, signal, sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[1])
import bench_quality
tensors = {"train.features": torch.randn(4096, 64, generator=torch.Generator().manual_seed(1))}
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it (write would raise); the default kills
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), resource.RLIM_INFINITY))
bench_quality.store_data(Path(sys.argv[2]), tensors, {"want": {"train": 3, "seed": 1}})
"""


def _tensors(seed: int, rows: int) -> dict[str, torch.Tensor]:
    return {"train.features": torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed))}


def test_a_crash_mid_write_leaves_no_half_file_a_later_run_reads(tmp_path):
    data = tmp_path / "data.safetensors"
    a = _tensors(0, 1024)
    bench_quality.store_data(data, a, {"want": WANT_A})
    assert bench_quality.cached_meta(data, WANT_A) is not None

    limit = 512 << 10  # the crashing run's data is 1 MiB: it dies half way through
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-c", CRASHING_WRITER, str(ROOT / "bench"), str(data), str(limit)],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == -signal.SIGXFSZ, proc.stderr[-2000:]
    assert bench_quality.cached_meta(data, WANT_B) is None  # nothing vouches for the crashed run's data
    assert torch.equal(load_file(data)["train.features"], a["train.features"])  # the earlier data is whole
    assert bench_quality.cached_meta(data, WANT_A) is not None  # and still reused
    (partial,) = tmp_path.glob(".data.safetensors.tmp-*")  # the torn bytes, under the temporary name only
    assert 0 < partial.stat().st_size <= limit

    b = _tensors(1, 4096)
    bench_quality.store_data(data, b, {"want": WANT_B})  # the next write clears the dead writer's bytes
    assert not list(tmp_path.glob(".data.safetensors.tmp-*"))
    assert bench_quality.cached_meta(data, WANT_A) is None
    assert bench_quality.cached_meta(data, WANT_B) is not None
    assert torch.equal(load_file(data)["train.features"], b["train.features"])


def test_data_that_is_not_what_its_record_was_written_with_is_captured_again(tmp_path):
    """What the old non-atomic write could leave: a torn data file, or another setting's data (a
    crash between the data and its record) beside a record that matches the settings asked for."""
    data = tmp_path / "data.safetensors"
    bench_quality.store_data(data, _tensors(0, 1024), {"want": WANT_A})
    whole = data.read_bytes()
    data.write_bytes(whole[: len(whole) // 2])
    assert bench_quality.cached_meta(data, WANT_A) is None
    other = tmp_path / "other.safetensors"
    bench_quality.store_data(other, _tensors(1, 1024), {"want": WANT_B})  # same size, other bytes
    data.write_bytes(other.read_bytes())
    assert bench_quality.cached_meta(data, WANT_A) is None
    data.write_bytes(whole)
    assert bench_quality.cached_meta(data, WANT_A) is not None
