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
