"""The evaluator actor: a thin Ray wrapper that runs `Evaluator.run_until` in a background thread.

It is built from one frozen EvaluatorTask (as a target actor from its CaptureTask), and `wait`
returns the frozen EvalResults; the poll interval and backlog policy are the task's cfg.eval,
the run directory its run.out_dir. The target is loaded inside the thread, so
`start()` returns at once and the (slow) target load and reference continuations overlap the
trainer's first steps; an error there is reported by `status()` and raised by `wait()`.
The actor is threaded (max_concurrency), so `status()` and `trainer_finished()` are answered
while `wait()` blocks.

Ray restarts a lost evaluator (eval.max_restarts): the restarted actor starts itself, reads the
results it already wrote under <out>/eval and continues after the newest (none measured twice);
the driver tells it `trainer_finished` again (pipeline.wait_evaluator).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
import traceback
from dataclasses import dataclass

import ray
import torch

from data_pipeline.provenance import Provenance
from dflash_dist.compile_cache import actor_runtime_env, use_private_cache_dirs
from dflash_dist.config import Config
from dflash_dist.evaluator.policy import EvalResult
from dflash_dist.target.loading import TargetIdentity
from dflash_dist.target.weights_check import VerifiedWeights, hashes_made

log = logging.getLogger(__name__)
MAX_CONCURRENCY = 4  # wait() blocks one slot; status()/trainer_finished() need others


def evaluator_actor_options(cfg: Config) -> dict:
    """The evaluator actor's Ray options, every key written out (STYLE 4)."""
    return {"num_cpus": cfg.eval.num_cpus, "num_gpus": cfg.eval.num_gpus, "max_concurrency": MAX_CONCURRENCY,
            "max_restarts": cfg.eval.max_restarts, "max_task_retries": 0,
            "runtime_env": actor_runtime_env()}  # the driver's private compile cache directories


@dataclass(frozen=True)
class EvaluatorTask:
    """What the evaluator actor measures: every export under the config's run directory, against
    one target, on the held-out prompts (token ids)."""

    cfg: dict  # Config.to_dict(): run.out_dir is the run directory; eval.* the modes, poll and backlog policy
    target_dir: str
    eval_prompts: tuple[tuple[int, ...], ...]
    identity: TargetIdentity | None = None  # the run plan's: the target's files must hash to it; None: hashed here
    expected: Provenance | None = None  # the training shards' provenance the target must reproduce; None: unchecked
    shard_dir: str | None = None  # shards re-checked before every evaluation; None: none
    weights: VerifiedWeights | None = None  # the run plan's check: files carrying its stamp are not hashed here


@ray.remote(max_concurrency=MAX_CONCURRENCY)
class EvaluatorActor:
    def __init__(self, task: EvaluatorTask) -> None:
        from dflash_dist.config import load_config_dict
        from dflash_dist.logging_setup import setup_logging

        setup_logging("evaluator", 0)  # the evaluator's INFO lines (references, tau per step) reach the driver
        use_private_cache_dirs()  # on this node, before anything compiles (its live workers inherit it)
        self.task = task
        self.cfg = load_config_dict(task.cfg)
        if self.cfg.eval.num_gpus == 0:
            torch.set_num_threads(max(1, int(self.cfg.eval.num_cpus)))  # no more threads than reserved CPUs
        self._lock = threading.Lock()
        self._finished: bool = False
        self._final_step: int | None = None
        self._wake = threading.Event()  # set with _finished: the evaluator stops waiting out its poll
        self._evaluator = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()  # calls of a threaded actor may run out of order
        self._error: BaseException | None = None
        self._error_text: str | None = None
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if self.restarted:  # by Ray, after the process was lost: nobody calls start() again
            log.warning("evaluator restarted (pid %d): continuing after its last result", os.getpid())
            self.start()

    def start(self) -> None:
        """Load the target and follow the exports in a background thread."""
        if self._thread is not None:
            raise RuntimeError("EvaluatorActor.start() was already called")
        self._thread = threading.Thread(target=self._run, name="evaluator", daemon=True)
        self._thread.start()
        self._started.set()

    def trainer_finished(self, final_step: int | None) -> None:
        """The trainer is done; `final_step` is its last export (None if it wrote none)."""
        with self._lock:
            self._finished, self._final_step = True, final_step
        self._wake.set()

    def status(self) -> dict:
        ev = self._evaluator
        results = ev.results if ev is not None else {}
        last = results[max(results)] if results else None
        return {
            "alive": self._thread is not None and self._thread.is_alive(),
            "ready": ev is not None,
            "evaluated": sorted(ev.done) if ev is not None else [],
            "last_step": last.step if last else None,
            "last_tau_chain": last.tau_chain if last else None,
            "last_tau_vs_reference": last.tau_chain_vs_reference if last else None,
            "last_tau_live_chain": last.live["tau_chain"] if last and last.live else None,
            "trainer_finished": self._finished,
            "error": self._error_text,
            "restarted": self.restarted,
            "weights_hashed": len(hashes_made()),  # by this process (0: the files carried the plan's stamp)
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": socket.gethostname(),
            "log": own_log_file(),
        }

    def wait(self, timeout_s: float | None = None) -> list[EvalResult]:
        """Block until the evaluator stops; every evaluated step's EvalResult, by step (also
        those of a run this one resumed)."""
        t0 = time.monotonic()
        if not self._started.wait(timeout_s):
            raise TimeoutError(f"EvaluatorActor.start() was not called within {timeout_s}s")
        self._thread.join(None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - t0)))
        if self._thread.is_alive():
            raise TimeoutError(f"the evaluator is still running after {timeout_s}s: {self.status()}")
        if self._error is not None:
            raise _portable(self._error)
        return [r for _, r in sorted(self._evaluator.results.items())]

    def _progress(self) -> dict:
        ev = self._evaluator
        return {"evaluated": len(ev.done) if ev is not None else 0, "log": own_log_file()}

    def _stop(self) -> tuple[bool, int | None]:
        with self._lock:
            return self._finished, self._final_step

    def _run(self) -> None:
        from dflash_dist.actors.heartbeat import Heartbeat
        from dflash_dist.evaluator.evaluator import Evaluator

        task, e = self.task, self.cfg.eval
        try:
            with Heartbeat(self.cfg.out, "evaluator", 0, info=self._progress):
                self._evaluator = Evaluator(self.cfg, self.cfg.out, task.target_dir,
                                            [list(p) for p in task.eval_prompts], task.expected,
                                            shard_dir=task.shard_dir, identity=task.identity, weights=task.weights)
                self._evaluator.run_until(self._stop, e.poll_s, e.max_backlog, e.backlog_stride, wake=self._wake)
        except BaseException as e:  # kept for wait(); the thread itself has no caller to raise to
            self._error, self._error_text = e, "".join(traceback.format_exception_only(type(e), e)).strip()
            # its traceback in its own log, the file the driver's line (eval_watch.py) and `status` name
            log.error("evaluator failed: %s", self._error_text, exc_info=e)
        finally:
            if self._evaluator is not None:
                self._evaluator.close()


def own_log_file() -> str | None:
    """This process's stderr file (Ray's `session_*/logs/worker-*.err` on its node), None if its
    stderr is no file (a terminal, a pipe)."""
    try:
        path = os.readlink("/proc/self/fd/2")
    except OSError:
        return None
    return path if path.startswith("/") and os.path.isfile(path) else None


def _portable(error: BaseException) -> BaseException:
    """The error itself when Ray can ship it to the caller; else a RuntimeError carrying its type
    and message (an exception whose __init__ differs from its args does not unpickle)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__module__}.{type(error).__name__}: {error}")
