"""A trainer rank at the slot where data is lost, as a Ray task of test_trainer's group-report test.
Its own module: a Ray worker imports the module of the function it runs, and tests/test_trainer.py
(torch, DeepSpeed, the trainer, the test's helpers) cost each of the two workers twice the CPU that
step_source's DataLost alone does."""

from __future__ import annotations

import time


def rank_raises_data_lost(delay_s: float, own: str) -> None:
    """Raise DataLost after `delay_s`, naming `own` (the samples this rank could not read) or nothing."""
    from dflash_dist.trainer.step_source import DataLost

    time.sleep(delay_s)
    err = DataLost(f"2 sample(s) could not be read. Rank could not read: {own or 'none here'}")
    err.names_nothing = not own
    raise err
