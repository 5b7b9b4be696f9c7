"""One logging set-up for every process of a run, and progress bars only where a person watches.

Each entry point (the CLI, a Ray actor, a Slurm rank or slice) calls `setup_logging(role, rank)`
once: one handler on the root logger, to stderr, in one format that names the process,

    2026-12-03 13:05:01,123 INFO [trainer 1] dflash_dist.trainer.loop: step 10 ...

the project's own loggers (dflash_dist, data_pipeline, launcher) at INFO, everything else at
WARNING. Calling it again (a restarted actor, a test) replaces the handler instead of adding one.
`progress` is tqdm drawn on stderr only when stderr is a terminal: inside Ray actors, Slurm jobs
and log files it draws nothing.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable

from tqdm import tqdm

PROJECT_LOGGERS = ("dflash_dist", "data_pipeline", "launcher")
FORMAT = "%(asctime)s %(levelname)s [{who}] %(name)s: %(message)s"
LEVEL_ENV = "DFLASH_LOG_LEVEL"  # e.g. DEBUG: the project's loggers at that level


class _Handler(logging.StreamHandler):
    """Ours (a later setup_logging call replaces it); writes to whatever sys.stderr is at the time."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(role: str, rank: int | str | None = None, level: str | int | None = None) -> None:
    """Log records of this process as `[role rank]` (see the module docstring)."""
    who = role if rank is None else f"{role} {rank}"
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(h)
    handler = _Handler()
    handler.setFormatter(logging.Formatter(FORMAT.format(who=who)))
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > logging.WARNING:
        root.setLevel(logging.WARNING)
    level = level or os.environ.get(LEVEL_ENV, "INFO")
    for name in PROJECT_LOGGERS:
        logging.getLogger(name).setLevel(level)


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it"):
    """A tqdm bar on stderr when it is a terminal; otherwise a pass-through that draws nothing."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not _interactive(), leave=False,
                dynamic_ncols=True)


def _interactive() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False
