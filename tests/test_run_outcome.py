"""A run whose trainers stopped at a preemption notice (SIGTERM/SIGUSR1) saved but did not finish:
it must not end as a finished run does (exit 0, "done"). run_pipeline raises Preempted, the CLI
exits 75 (EX_TEMPFAIL), on which slurm/*.sbatch requeue the job."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_dist.orchestration import pipeline
from dflash_dist.orchestration.pipeline import EXIT_PREEMPTED, PipelineResult, Preempted, check_finished
from dflash_dist.trainer.loop import TrainResult
from tests.conftest import REPO


def result(preempted: str | None) -> PipelineResult:
    ranks = tuple(TrainResult(r, 8, 0, 4.2, ("step_4", "step_8"), (), 16, 0, None, preempted) for r in range(2))
    return PipelineResult("/runs/x", ("extract", "train"), (), ranks, (), 0, preempted, 12.0)


def test_a_preempted_run_is_not_finished():
    check_finished(result(None))  # finished: nothing raised
    with pytest.raises(Preempted, match=r"stopped at SIGTERM after saving step_8 \(step 8\).*--resume auto"):
        check_finished(result("SIGTERM"))


def test_the_cli_exits_75_on_preemption_and_the_sbatch_scripts_requeue_on_it(monkeypatch, capsys):
    from launcher import cli

    def preempted(*_a, **_kw):
        raise Preempted("the trainers stopped at SIGTERM after saving step_8 (step 8)")

    monkeypatch.setattr(pipeline, "run_pipeline", preempted)
    assert cli.main(["run", str(REPO / "configs" / "tiny.yaml"), "--out", "/tmp/dflash-outcome-test"]) == EXIT_PREEMPTED
    assert "stopped at SIGTERM" in capsys.readouterr().err
    for script in ("pipeline.sbatch", "train.sbatch"):
        text = Path(REPO / "slurm" / script).read_text()
        assert f'[ "$rc" = {EXIT_PREEMPTED} ]' in text and "scontrol requeue" in text, script


def test_resume_defaults_to_never_and_a_slice_refuses_what_it_cannot_do(monkeypatch, capsys, tmp_path):
    """--resume is `never` unless given; `extract --slice` always continues from the ledger (an array's
    tasks share --out), so an explicit --resume never or PATH there is refused instead of ignored."""
    from launcher import cli

    seen = {}
    monkeypatch.setattr(pipeline, "run_pipeline", lambda cfg, stages, resume: seen.setdefault("resume", resume))
    assert cli.main(["run", str(REPO / "configs" / "tiny.yaml"), "--out", str(tmp_path / "run")]) == 0
    assert seen == {"resume": "never"}
    for resume in ("never", "checkpoints/step_4"):
        out = tmp_path / f"slice-{resume.replace('/', '-')}"
        code = cli.main(["extract", str(REPO / "configs" / "tiny.yaml"), "--out", str(out), "--slice", "0/2",
                         "--resume", resume])
        assert code == 2 and f"--resume {resume} does not apply" in capsys.readouterr().err
        assert not out.exists()  # refused before anything was written
