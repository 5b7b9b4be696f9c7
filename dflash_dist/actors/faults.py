"""What to do when the trainer group fails, as pure functions of its failure history (STYLE 8).

A DeepSpeed group cannot take back a restarted rank (its collective state is gone with the
process), so one lost rank ends the whole group, and the pipeline starts a new group that
resumes from the latest complete checkpoint. Whether to start it, when, and from where is
decided here; pipeline.py only carries the decision out. Nothing here touches Ray or files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DIED = "died"  # a rank's process (or its node) was lost: Ray's actor/worker/node errors
ERROR = "error"  # the trainer code itself raised in a rank
KINDS = (DIED, ERROR)
# errors that replaying the same checkpoint and data raises again (bad input, a refused resume, a
# non-finite loss, unreadable data, a bug): the run stops at once instead of spending a restart.
# Matched against every class name of the error's MRO, so subclasses (ResumeError, DataLost,
# ProvenanceMismatch, ConfigError) count too. Anything else (a collective's RuntimeError, OSError,
# a timeout) may be transient and is retried.
DETERMINISTIC = frozenset({
    "ValueError", "TypeError", "KeyError", "IndexError", "AttributeError", "AssertionError", "FloatingPointError",
    "NotImplementedError", "ZeroDivisionError", "ImportError", "DataLost",
})  # fmt: skip


@dataclass(frozen=True)
class Failure:
    """One failed trainer group."""

    kind: str  # DIED or ERROR
    rank: int  # the rank whose failure ended the group (-1: unknown)
    message: str
    resumed_from: str | None  # the checkpoint this group started from (None: step 0)
    error_types: tuple[str, ...] = ()  # ERROR: the class names of the error's MRO

    @property
    def deterministic(self) -> bool:
        return self.kind == ERROR and any(t in DETERMINISTIC for t in self.error_types)

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind


@dataclass(frozen=True)
class RestartPolicy:
    """train.max_restarts new groups at most per run; the n-th waits backoff_s * 2**(n-1),
    capped at max_backoff_s (a lost node needs a moment to be replaced or declared dead)."""

    max_restarts: int
    backoff_s: float = 2.0
    max_backoff_s: float = 60.0

    @classmethod
    def of_train(cls, train) -> RestartPolicy:
        """The policy of a config's train section (max_restarts, restart_backoff_s, max_restart_backoff_s)."""
        return cls(train.max_restarts, train.restart_backoff_s, train.max_restart_backoff_s)


@dataclass(frozen=True)
class Decision:
    restart: bool
    delay_s: float  # before starting the new group
    message: str  # for the log (restart) or the error (give up)


def decide_restart(policy: RestartPolicy, failures: Sequence[Failure]) -> Decision:
    """Restart after the latest of `failures` (oldest first), or give up saying why.

    Gives up once the restarts are spent, at once on an error replaying cannot change
    (DETERMINISTIC), and when the trainer code raised the same error twice in a row from the same
    checkpoint: replaying that cannot end differently (a lost process can).
    """
    assert failures, "decide_restart needs at least one failure"
    last, n = failures[-1], len(failures)
    where = f"rank {last.rank}" if last.rank >= 0 else "a rank"
    what = f"{where} {'was lost' if last.kind == DIED else 'failed'}: {last.message}"
    if n > policy.max_restarts:
        return Decision(False, 0.0, (
            f"trainer group failed {n} time(s), more than train.max_restarts={policy.max_restarts}; last: {what}. "
            "Fix the cause, then continue from the latest checkpoint with --resume auto"))
    if last.deterministic:
        return Decision(False, 0.0, (
            f"{what}. Restarting from the same checkpoint and data would fail the same way: fix the cause, then "
            "continue with --resume auto"))
    if n >= 2 and all(f.kind == ERROR for f in failures[-2:]) and failures[-2].message == last.message \
            and failures[-2].resumed_from == last.resumed_from:
        start = last.resumed_from or "step 0"
        return Decision(False, 0.0, (
            f"trainer group failed twice from {start} with the same error, so restarting cannot help: {what}. "
            "Fix the cause, then continue with --resume auto"))
    delay = min(policy.max_backoff_s, policy.backoff_s * 2.0 ** min(n - 1, 62))  # no float overflow at any n
    return Decision(True, delay, (
        f"{what}; restart {n} of {policy.max_restarts} in {delay:g}s from the latest complete checkpoint"))


def restart_resume(original: str, has_checkpoint: bool) -> str:
    """The `--resume` of a restarted group: `auto` (this run's latest complete checkpoint) once
    the run has one; until then what the run started with (`never`: from step 0, a PATH: that
    checkpoint again)."""
    return "auto" if has_checkpoint else original
