"""The pinned loss curve's run (tests/test_loss_curve.py, the numerics gate; test_zero_step runs it
with the lean optimizer step): the stored file, the run's size and the gate's tolerance."""

from __future__ import annotations

from pathlib import Path

PINNED = Path(__file__).resolve().parents[1] / "data" / "loss_curve_zero2.json"
NUM = 18  # the tiny fixture's 18 samples in 9 shards of 2: rank 0 reads 5 shards, rank 1 reads 4
# 5 steps (micro 1 x accumulation 2) per epoch: in the 5th rank 0 trains its last 2 samples while rank 1
# fills its slots with empty batches (trainer/step_source.py: nothing is dropped); 5 epochs
STEPS = 25
# Two identical runs agree bit for bit; fp32 noise from a reordered sum is ~1e-7 relative at step 1
# and grows with the steps, so 1e-6 relative catches it while a rebuild of the same math passes.
RTOL = 1e-6
