"""A run whose trainers stopped at a preemption notice (SIGTERM/SIGUSR1) saved but did not finish:
it must not end as a finished run does (exit 0, "done"). run_pipeline raises Preempted, the CLI
exits 75 (EX_TEMPFAIL), on which slurm/*.sbatch requeue the job. And what the end of a run says:
records skipped at ingest, exports not evaluated, prompts the tau is over, and a failed evaluator
(its summary first, then its error and exit 1)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time
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
    over 2 of 12 read as tau over 12), nor, without training, the samples the capture skipped. All are
    now in the final summary, with files and settings."""
    from data_pipeline.ledger import record_skipped
    from dflash_dist.config import load_config
    from dflash_dist.evaluator.policy import EvalResult
    from dflash_dist.orchestration.pipeline import _layout, _print_summary

    cfg = load_config(REPO / "configs" / "tiny.yaml", ["data.on_bad_record=skip"], out_dir=str(tmp_path / "run"))
    paths = _layout(cfg)
    counts = {
        "source": "/data/train.jsonl",
        "kind": "jsonl",
        "read": 104,
        "kept": 100,
        "truncated": 0,
        "tokens": 0,
        "skipped": {"malformed": 1, "unparsable": 3},
        "first_skip": {"unparsable": "/data/train.jsonl:12: bad"},
    }
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
    record_skipped(paths["shards"], "k-nonfinite", "nonfinite_features", 0)
    record_skipped(paths["shards"], "k-nonfinite-2", "nonfinite_features", 0)
    _print_summary(cfg, paths, run, captured=[paths["shards"]])
    out = capsys.readouterr().out
    assert (f"[capture] {paths['shards']}: 0 samples in 0 shards, 2 skipped (nonfinite_features 2; see "
            f"{paths['shards'] / 'skipped.jsonl'}; data.max_lost_fraction=0.0)") in out, out  # fmt: skip
    assert (f"[data] train: 4 of 104 record(s) of /data/train.jsonl skipped (malformed 1, unparsable 3; first: "
            f"/data/train.jsonl:12: bad), 0 truncated, under data.on_bad_record=skip, data.on_overlong=truncate: see "
            f"{cfg.out / 'data' / 'train.ingest.json'}") in out, out  # fmt: skip
    assert "[data] eval" not in out  # nothing skipped there
    assert ("[eval] tau per checkpoint (2 held-out prompts of the eval.num_prompts=12 asked: the others are not in "
            "data.eval_path or have no greedy continuation of 2+ tokens;") in out, out  # fmt: skip
    assert "[eval] 2 export(s) not evaluated: steps [100, 150]" in out, out
    _print_summary(cfg, paths, dataclasses.replace(run, stages=("extract", "train")))  # no evaluation asked
    assert "not evaluated" not in capsys.readouterr().out


def test_the_last_line_names_tensorboard_only_where_the_run_wrote_to_it(tmp_path, capsys):
    """`dflash-dist extract` ended with a TensorBoard command though a capture writes nothing there
    (tb/ stayed empty); it now names what it wrote, the shards, and how to train on them. A run that
    trains or evaluates still ends with the TensorBoard command."""
    from dflash_dist.config import load_config
    from dflash_dist.orchestration.pipeline import _layout, _print_summary

    cfg = load_config(REPO / "configs" / "tiny.yaml", [], out_dir=str(tmp_path / "run"))
    paths = _layout(cfg)
    extract = PipelineResult(str(cfg.out), ("extract",), (), (), (), 0, None, 1.0)
    _print_summary(cfg, paths, extract, captured=[paths["shards"]])
    out = capsys.readouterr().out
    assert "TensorBoard" not in out and "tensorboard --logdir" not in out, out
    assert out.splitlines()[-1] == (
        f"Shards: {paths['shards']} (manifest.jsonl, DONE) from the conversations ingested under {cfg.out / 'data'}; "
        f"train on them: dflash-dist train CONFIG --out {cfg.out}"
    )
    for stages in (("extract", "train", "eval"), ("train",), ("eval",)):
        _print_summary(cfg, paths, dataclasses.replace(extract, stages=stages))
        last = capsys.readouterr().out.splitlines()[-1]
        assert last == f"TensorBoard: tensorboard --logdir {paths['tb']} --host 127.0.0.1", (stages, last)


@pytest.mark.slow
def test_a_failed_evaluator_ends_the_run_with_its_summary_then_its_error(tmp_path, capsys):
    """The evaluator stops at a damaged export (its checksum record differs): the run exits 1 naming
    the export and the fix, as before, but it used to print nothing else: not the tau it had
    measured, nor which exports it never reached, nor (in `run`) the training's lost samples. Real
    `dflash-dist eval` on configs/tiny.yaml's target, Ray and the evaluator actor; two exports of a
    random drafter, the second damaged."""
    import torch
    from transformers import AutoTokenizer

    from dflash_dist.config import load_config
    from dflash_dist.model.drafter import DFlashDrafter
    from dflash_dist.model.export import export_drafter
    from dflash_dist.target.loading import drafter_config_for, resolve_target_dir, tokenizer_mask_id
    from launcher import cli

    out, config = tmp_path / "run", str(REPO / "configs" / "tiny.yaml")
    overrides = ["eval.num_prompts=2", "eval.max_new_tokens=8", "eval.poll_s=0.1"]
    cfg = load_config(config, overrides, out_dir=str(out))
    target_dir = resolve_target_dir(cfg)
    drafter_cfg = drafter_config_for(cfg, target_dir, tokenizer_mask_id(AutoTokenizer.from_pretrained(target_dir)))
    torch.manual_seed(0)
    for step in (10, 20):
        export_drafter(DFlashDrafter(drafter_cfg), out / "export" / f"step_{step}")
    weights = out / "export" / "step_20" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    assert cli.main(["eval", config, "--out", str(out), *overrides]) == 1
    captured = capsys.readouterr()
    assert "[eval] tau per checkpoint (2 held-out prompts;" in captured.out and "step     10: tau chain" in captured.out
    assert "[eval] 1 export(s) not evaluated: steps [20] (the evaluator failed before them)" in captured.out
    assert "the evaluator FAILED (its error follows" in captured.out, captured.out
    assert f"error: ChecksumMismatch: {out / 'export' / 'step_20'}: model.safetensors differ" in captured.err
    kept = re.search(r"Ray's logs of this run are kept in (\S+)/session_\*/logs", captured.err)  # the run failed
    assert kept, captured.err
    shutil.rmtree(Path(kept.group(1)).parent)


@pytest.mark.slow
def test_a_failed_evaluator_is_said_when_it_fails_and_training_goes_on(tmp_path, caplog, monkeypatch):
    """The evaluator fails at the first export (its eval.reference_drafter has a damaged weights
    file) while the trainers have most of their steps ahead. One ERROR line says so at that time
    (what failed, where the evaluator's log is, that training continues), `dflash-dist status`
    shows it, the training runs to its last step, and the run still ends with exit 1 naming the
    error; the evaluator's log, with its traceback, is kept (the run failed). Before: nothing was
    said until training had finished, and the log was removed with the run's Ray directory.
    Real `dflash-dist run` on configs/tiny.yaml's target (smaller), Ray, DeepSpeed, the evaluator.
    The watch asks every 0.2 s (not every 5 s): the failure is said ~3 s after the step-10 export (the
    evaluator is ready near then too), near step 13 of 80 (10 epochs), with most steps still ahead."""
    import functools
    import logging

    from transformers import AutoTokenizer

    from dflash_dist.config import load_config
    from dflash_dist.model.drafter import DFlashDrafter
    from dflash_dist.model.export import export_drafter
    from dflash_dist.orchestration.eval_watch import EvaluatorWatch
    from dflash_dist.target.loading import drafter_config_for, resolve_target_dir, tokenizer_mask_id
    from launcher import cli
    from launcher.status import collect, render

    monkeypatch.setattr(pipeline, "EvaluatorWatch", functools.partial(EvaluatorWatch, interval_s=0.2))
    epochs = 10
    out, config, reference = tmp_path / "run", str(REPO / "configs" / "tiny.yaml"), tmp_path / "reference"
    overrides = ["data.max_train_samples=32", "capture.regenerate=false", "train.world_size=1",
                 f"train.epochs={epochs}", "train.checkpoint_every=10", "train.keep_checkpoints=1",
                 "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.poll_s=0.1",
                 f"eval.reference_drafter={reference}"]  # fmt: skip
    cfg = load_config(config, overrides[:-1], out_dir=str(out))
    target_dir = resolve_target_dir(cfg)
    drafter_cfg = drafter_config_for(cfg, target_dir, tokenizer_mask_id(AutoTokenizer.from_pretrained(target_dir)))
    export_drafter(DFlashDrafter(drafter_cfg), reference)
    (reference / "model.safetensors").write_bytes(b"\x00" * 64)  # config.json (checked at load) stays valid
    caplog.set_level(logging.INFO)
    kept = None
    try:
        assert cli.main(["run", config, "--out", str(out), *overrides]) == 1
        said = [r for r in caplog.records if "the evaluator FAILED" in r.getMessage()]
        finished = [r for r in caplog.records if r.getMessage().startswith("training finished at step")]
        assert len(said) == 1 and said[0].levelno == logging.ERROR, [r.getMessage() for r in said]
        assert finished and said[0].created < finished[0].created, "said only after the training had finished"
        print(f"\nthe failure was said {finished[0].created - said[0].created:.1f}s before training finished")
        line = said[0].getMessage()
        assert "\n" not in line and "Training continues" in line and "exit 1" in line, line
        log_file = Path(line.split("its log: ")[1].split(" on ")[0])
        kept = next(p for p in log_file.parents if p.name.startswith("dfray-"))
        assert "evaluator failed:" in log_file.read_text() and "Traceback" in log_file.read_text()
        steps = json.loads((out / "train_log.jsonl").read_text().splitlines()[-1])["step"]
        assert steps == epochs * 32 // 4  # every epoch trained after the evaluator failed
        status = collect(out)
        assert status["eval"]["failed"] == line
        assert ("evaluator", f"FAILED: {line}") in render(status)[0]
    finally:
        if kept is not None:
            shutil.rmtree(kept, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("max_restarts", [0, 100_000])
def test_a_run_that_fails_stops_watching_the_evaluator_before_its_ray_session_ends(
    tmp_path, monkeypatch, capsys, caplog, max_restarts
):
    """A run that fails (or is interrupted) while the evaluator is watched: the watch must stop before
    the run's placement group and Ray session end. Before, it was stopped after both: the placement
    group's release kills the evaluator, so a status call then found it gone and, once more often than
    eval.max_restarts (at once at 0), the watch logged that the evaluator had FAILED, a false line in a
    run that failed for another reason; and a call while `ray.shutdown` ran (2.6 s measured here; it
    asks every 5 s) found Ray gone, and Ray's auto-init started a second local cluster from the watch's
    thread (Ray's default /tmp/ray, not the run's private directory; a dashboard on :8265) that lived on
    after the run, or its call died of Ray's SystemExit with a traceback on stderr. Here the watch asks
    every 10 ms and the driver fails once the evaluator runs. Real `dflash-dist eval`, Ray, the evaluator
    actor."""
    import functools
    import logging
    import threading

    import ray

    from dflash_dist.orchestration.eval_watch import EvaluatorWatch
    from launcher import cli

    def fails(*_a, **_kw):  # the driver's next step after the watch started fails, once the evaluator runs
        deadline = time.monotonic() + 120
        while not (out / "heartbeat" / "evaluator-0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # the watch has had its answers by now
        raise pipeline.PipelineError("injected: the driver failed while the evaluator was watched")

    monkeypatch.setattr(pipeline, "EvaluatorWatch", functools.partial(EvaluatorWatch, interval_s=0.01))
    monkeypatch.setattr(pipeline, "_capture_dirs", fails)
    died: list[str] = []  # a thread's uncaught exception (the watch's ray.get as Ray shut down: SystemExit)
    monkeypatch.setattr(threading, "excepthook", lambda a: died.append(f"{a.thread.name}: {a.exc_type.__name__}"))
    caplog.set_level(logging.INFO)
    out, config, err = tmp_path / "run", str(REPO / "configs" / "tiny.yaml"), ""
    overrides = ["eval.num_prompts=2", "eval.max_new_tokens=8", f"eval.max_restarts={max_restarts}"]
    try:
        assert cli.main(["eval", config, "--out", str(out), *overrides]) == 1
        err = capsys.readouterr().err
        assert "injected: the driver failed" in err, err
        said = [r.getMessage() for r in caplog.records if "the evaluator FAILED" in r.getMessage()]
        assert not said, said
        assert not died, died
        assert not ray.is_initialized(), "the watch started a Ray cluster after the run's session ended"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        kept = re.search(r"Ray's logs of this run are kept in (\S+)/session_\*/logs", err)
        if kept:
            shutil.rmtree(Path(kept.group(1)).parent, ignore_errors=True)
