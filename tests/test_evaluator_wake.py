"""The trainer's end wakes the evaluator (Evaluator.run_until's `wake`, set by
EvaluatorActor.trainer_finished): the final export is evaluated at once, not after the rest of a
poll. Each run's end waited out `eval.poll_s` (5 s by default) before its last measurement."""

from __future__ import annotations

import threading
import time

from dflash_dist.evaluator import Evaluator
from tests.helpers.eval_target import publish

POLL_S = 3600.0  # far longer than the test waits: only the wake can end the evaluator's sleep


def test_the_trainers_end_wakes_the_evaluator_out_of_its_poll(tiny_eval, tmp_path):
    out = tmp_path / "run"
    (out / "export").mkdir(parents=True)
    ev = Evaluator(tiny_eval["cfg"], out, tiny_eval["target_dir"], tiny_eval["prompts"], expected=None)
    trainer = {"finished": False, "final": None}
    wake, results, errors = threading.Event(), [], []

    def follow():
        try:
            results.extend(ev.run_until(lambda: (trainer["finished"], trainer["final"]), poll_s=POLL_S, wake=wake))
        except BaseException as e:  # reported by the assertion below
            errors.append(e)

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while ev._refs is None and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)  # the references are made before the first wait between looks
        time.sleep(0.5)  # it is now inside that wait (no export yet, the trainer not finished)
        assert thread.is_alive() and not results, errors
        publish(tiny_eval, out, "trained", 10)  # the trainer's last export, then its end
        trainer["finished"], trainer["final"] = True, 10
        wake.set()
        thread.join(120)
        assert not thread.is_alive(), f"the evaluator slept on (poll {POLL_S:.0f} s) after the trainer's end"
        assert not errors, errors
        assert [r.step for r in results] == [10] and not wake.is_set()  # cleared after it woke
    finally:
        trainer["finished"], trainer["final"] = True, None
        wake.set()
        thread.join(5)
        ev.close()
