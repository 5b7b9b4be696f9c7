"""A trainer rank at the slot where data is lost, as a Ray task of test_trainer's group-report test.
Its own module: a Ray worker imports the module of the function it runs, and tests/test_trainer.py
(torch, DeepSpeed, the trainer, the test's helpers) cost each of the two workers twice the CPU that
step_source's DataLost alone does."""

from __future__ import annotations

import time
from pathlib import Path

AFTER_S = 1.0  # how long the later rank raises after the earlier one said it is raising


def rank_raises_data_lost(own: str, flag: str) -> None:
    """Raise DataLost naming `own` (the samples this rank could not read), or nothing: the rank that
    names nothing raises first (it writes `flag`, then raises), the other AFTER_S after `flag`
    appears. The order does not depend on when Ray started either worker (a fixed sleep did: on a
    loaded host the second worker could start more than the sleep later)."""
    from dflash_dist.trainer.step_source import DataLost

    if own:
        deadline = time.monotonic() + 120
        while not Path(flag).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(AFTER_S)
    else:
        Path(flag).write_text("raising\n")
    err = DataLost(f"2 sample(s) could not be read. Rank could not read: {own or 'none here'}")
    err.names_nothing = not own
    raise err
