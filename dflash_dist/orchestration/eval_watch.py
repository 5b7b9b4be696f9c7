"""The evaluator watched while the trainers run: its failure is said when it happens, not when training ends.

The evaluator actor runs beside a training that may take days; its failure (an export it cannot
load, a provenance or weights mismatch, its process lost more often than eval.max_restarts) used
to surface only as the run's final error. The driver now asks the actor for its status every
WATCH_INTERVAL_S and, the first time it has failed, logs one ERROR line: what failed, the steps it
had measured, where its log is (the actor's own stderr file, on its node), and what happens next.

Training goes on: its checkpoints and exports are the run's product, and `dflash-dist eval` measures
them afterwards; stopping the trainers would throw away the compute a failed measurement never
needed. The run still ends with the evaluator's error and exit 1 (pipeline.wait_evaluator).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)
WATCH_INTERVAL_S = 5.0  # how often the driver asks; a status call is answered at once (a threaded actor)
STATUS_TIMEOUT_S = 60.0  # an answer later than this counts as none (the actor's node busy), asked again


@dataclass(frozen=True)
class EvalFailure:
    """Why the evaluator stopped for good, and where to read more."""

    what: str  # `Type: message` of its error, or how its process was lost
    evaluated: tuple[int, ...]  # the checkpoint steps it had measured
    log: str | None  # its stderr file (Ray's worker-*.err on its node); None: not known
    host: str | None  # the host that file is on

    def line(self, out: str) -> str:
        """The one line the driver logs (and `dflash-dist status` shows)."""
        steps = f"after measuring steps {list(self.evaluated)}" if self.evaluated else "before measuring any checkpoint"
        where = f"its log: {self.log} on {self.host}" if self.log else "its log: the Ray worker logs of its node"
        return (f"the evaluator FAILED {steps}: {self.what}. Training continues (checkpoints and exports are kept; "
                f"`dflash-dist eval CONFIG --out {out}` measures them later) and the run will end with exit 1; "
                f"{where}")  # fmt: skip


def failure_of(status: dict | None, lost: int, max_restarts: int, last: dict | None) -> EvalFailure | None:
    """The evaluator's failure from its latest `status()` (None: no answer, the actor lost), counting
    `lost` calls that found its process gone, or None while it still works. A failed evaluation
    loop is final (the actor lives on, so Ray restarts nothing); a lost process is final once Ray
    has used its eval.max_restarts. `last`: the latest status it answered (its log and steps)."""
    known = status or last or {}
    where = (known.get("log"), known.get("host"))
    evaluated = tuple(known.get("evaluated") or ())
    if status is not None and status.get("error"):
        return EvalFailure(" ".join(str(status["error"]).split()), evaluated, *where)
    if status is None and lost > max_restarts:
        what = f"its process was lost {lost} time(s), more than eval.max_restarts={max_restarts}"
        return EvalFailure(what, evaluated, *where)
    return None


class EvaluatorWatch:
    """A daemon thread asking `evaluator.status()` until `stop()` or the first failure, which it logs
    once and keeps in `failure`."""

    def __init__(self, ray, evaluator, max_restarts: int, out: str, interval_s: float = WATCH_INTERVAL_S) -> None:
        self.failure: EvalFailure | None = None
        self.line: str | None = None
        self._ray, self._evaluator, self._max_restarts, self._out = ray, evaluator, max_restarts, out
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="evaluator-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        lost, last = 0, None
        while not self._stop.wait(self._interval_s):
            try:
                status = self._ray.get(self._evaluator.status.remote(), timeout=STATUS_TIMEOUT_S)
            except (ActorUnavailableError, GetTimeoutError):  # Ray is restarting it, or it is slow: ask again
                continue
            except RayActorError:
                status, lost = None, lost + 1
            except Exception as e:  # the session is ending (ray.shutdown): nothing left to watch
                log.debug("evaluator watch stopped: %s", e)
                return
            failure = failure_of(status, lost, self._max_restarts, last)
            last = status or last
            if failure is not None and not self._stop.is_set():  # stopped: the run's end reports it
                self.failure, self.line = failure, failure.line(self._out)
                log.error("%s", self.line)
                return
