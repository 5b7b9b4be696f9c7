"""A run whose trainers stopped at a preemption notice (SIGTERM/SIGUSR1) saved but did not finish:
it must not end as a finished run does (exit 0, "done"). run_pipeline raises Preempted, the CLI
exits 75 (EX_TEMPFAIL), on which slurm/*.sbatch requeue the job."""

from __future__ import annotations

import dataclasses
import json
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


def test_the_summary_names_records_skipped_at_ingest_and_exports_never_evaluated(tmp_path, capsys):
    """What a run dropped before any shard and the checkpoints it never measured: configs/tiny.yaml
    with 4 bad lines in 104 under data.on_bad_record=skip printed '0 sample(s) lost' and 'done',
    the skips only in one log line among the roles' thousands; exports the evaluator passed over
    (behind the trainer) had no word at all, nor held-out prompts the evaluator could not use (tau
    over 2 of 12 read as tau over 12). All are now in the final summary, with files and settings."""
    from dflash_dist.config import load_config
    from dflash_dist.evaluator.policy import EvalResult
    from dflash_dist.orchestration.pipeline import _layout, _print_summary

    cfg = load_config(REPO / "configs" / "tiny.yaml", ["data.on_bad_record=skip"], out_dir=str(tmp_path / "run"))
    paths = _layout(cfg)
    counts = {"source": "/data/train.jsonl", "kind": "jsonl", "read": 104, "kept": 100, "truncated": 0, "tokens": 0,
              "skipped": {"malformed": 1, "unparsable": 3}, "first_skip": {"unparsable": "/data/train.jsonl:12: bad"}}
    (cfg.out / "data").mkdir()
    (cfg.out / "data" / "train.ingest.json").write_text(json.dumps(counts))
    (cfg.out / "data" / "eval.ingest.json").write_text(json.dumps({**counts, "skipped": {}, "read": 12}))
    for step in (50, 100, 150, 200):
        (paths["export"] / f"step_{step}").mkdir()
    for step in (50, 200):
        done = EvalResult(step=step, tau_chain=2.0, tau_ddtree={4: 2.5}, accept_hist=(1,), slot_acceptance=(0.5,),
                          prompts=2, rounds=3, kernel_path="torch", seconds=0.5)  # fmt: skip
        (paths["eval"] / f"step_{step}.json").write_text(json.dumps(done.to_json()))
    run = PipelineResult(str(cfg.out), ("extract", "train", "eval"), (), result(None).train, (), 0, None, 1.0)
    _print_summary(cfg, paths, run)
    out = capsys.readouterr().out
    assert (f"[data] train: 4 of 104 record(s) of /data/train.jsonl skipped (malformed 1, unparsable 3; first: "
            f"/data/train.jsonl:12: bad), 0 truncated, under data.on_bad_record=skip, data.on_overlong=truncate: see "
            f"{cfg.out / 'data' / 'train.ingest.json'}") in out, out  # fmt: skip
    assert "[data] eval" not in out  # nothing skipped there
    assert ("[eval] tau per checkpoint (2 held-out prompts of the eval.num_prompts=12 asked: the others are not in "
            "data.eval_path or have no greedy continuation of 2+ tokens;") in out, out  # fmt: skip
    assert "[eval] 2 export(s) not evaluated: steps [100, 150]" in out, out
    _print_summary(cfg, paths, dataclasses.replace(run, stages=("extract", "train")))  # no evaluation asked
    assert "not evaluated" not in capsys.readouterr().out
