"""The one-call device scripts (bench/gpu_speed.sh and the gpu_env.sh they source) keep their
deadline, run here with stand-ins for python3 and nvidia-smi that do nothing or hang: a device call
that runs past its limit is cut off by the device tool, and the steps after the cut never run."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HANG = 60  # seconds a stand-in bench sleeps: well past the deadlines below


def stand_ins(tmp_path: Path) -> dict[str, str]:
    """PATH with a python3 whose benches hang (pip, pytest: done at once) and a silent nvidia-smi."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(
        f'#!/bin/sh\ncase "$*" in *bench_train_step.py*|*cost_model.py*) exec sleep {HANG} ;; esac\nexit 0\n'
    )
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("COST", "TRAIN_STEP_LIMIT_S", "FLEX_TESTS")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


def test_gpu_speed_steps_stop_at_the_deadline(tmp_path):
    """The trainer step (its own limit 300 s) and the cost model (150 s) are cut at the call's
    deadline, not at their own limits: before, `gpu_speed.sh 8` ran its hanging benches for their
    full sleep (the call's deadline ignored)."""
    env = stand_ins(tmp_path)
    env.update(OUT=str(tmp_path / "out"), TRAIN_STEP_SETTINGS="direct+lean", COST="1")
    t0 = time.monotonic()
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_speed.sh"), "8"],
        env=env, capture_output=True, text=True, timeout=HANG - 10, cwd=tmp_path,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert took < 15, (took, done.stdout, done.stderr)
    assert "train_step rc=124" in done.stdout and "cost rc=124" in done.stdout, done.stdout
    assert "gpu_tests rc=" not in done.stdout  # nothing else starts with under 60 s left


def test_a_call_that_writes_more_than_eight_files_sends_its_logs_as_one_archive(tmp_path):
    """The device tool returns at most 8 files of $OUT a call: gpu_kernels.sh writes 9 here (gpu.txt, install.log,
    its benches' logs and one log per gpu test group), so at its exit gpu_env.sh packs every .log into logs.tgz
    (the thirteenth lease lost loss.log and the train step's files to the limit)."""
    import tarfile

    env = stand_ins(tmp_path)
    out = tmp_path / "out"
    env.update(OUT=str(out))
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_kernels.sh"), "60"], env=env, capture_output=True,
                          text=True, timeout=HANG - 10, cwd=tmp_path)  # fmt: skip
    assert "every .log is in logs.tgz" in done.stdout, done.stdout + done.stderr
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and "logs.tgz" in files and not [f for f in files if f.endswith(".log")], files
    with tarfile.open(out / "logs.tgz") as tar:
        names = sorted(Path(n).name for n in tar.getnames())
    assert {"install.log", "flex.log", "loss.log", "train_step.log", "gpu_tests_4.log"} <= set(names), names
