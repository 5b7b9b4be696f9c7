"""On CUDA: the parity checker in fp32 (drafter, loss, DDTree judged; target via fla reported)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.gpu
def test_parity_on_cuda(golden_dir):
    proc = subprocess.run([sys.executable, "-m", "dflash_dist.parity", str(golden_dir), "--device", "cuda"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kernel=fla" in proc.stdout
