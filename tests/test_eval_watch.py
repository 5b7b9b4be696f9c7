"""The driver's watch over the evaluator (dflash_dist/orchestration/eval_watch.py): from the actor's
status answers to the one failure it reports while the trainers go on. The real actor failing
inside a run is tests/test_run_outcome.py's."""

from __future__ import annotations

from dflash_dist.orchestration.eval_watch import failure_of

WORKING = {"error": None, "evaluated": [10, 20], "log": "/tmp/r/session_x/logs/worker-1.err", "host": "node7"}


def test_a_failed_evaluation_loop_is_reported_at_once_with_its_log():
    assert failure_of(WORKING, 0, 3, None) is None
    failed = {**WORKING, "error": "ChecksumMismatch: /runs/x/export/step_30: model.safetensors differ\n  (again)"}
    failure = failure_of(failed, 0, 3, WORKING)
    assert failure is not None and failure.evaluated == (10, 20)
    line = failure.line("/runs/x")
    assert "\n" not in line and "after measuring steps [10, 20]: ChecksumMismatch: " in line and "(again)" in line
    assert "its log: /tmp/r/session_x/logs/worker-1.err on node7" in line
    assert "Training continues" in line and "dflash-dist eval CONFIG --out /runs/x" in line and "exit 1" in line


def test_a_lost_process_is_a_failure_only_once_ray_has_used_its_restarts():
    """A lost process is restarted by Ray (eval.max_restarts); each call finding it gone counts, and
    only past the restarts is it reported, with the log the last answer named."""
    assert failure_of(None, 3, 3, WORKING) is None
    failure = failure_of(None, 4, 3, WORKING)
    assert failure is not None and "lost 4 time(s), more than eval.max_restarts=3" in failure.what
    assert failure.log == WORKING["log"] and failure.evaluated == (10, 20)
    never = failure_of(None, 1, 0, None)  # lost before it ever answered
    assert never is not None and "its log: the Ray worker logs of its node" in never.line("/runs/x")
    assert "before measuring any checkpoint" in never.line("/runs/x")
