"""A resume from an earlier checkpoint tag branches the run: the tags after it were removed, but their
exports and the evaluator's results of them stayed, so the evaluator counted step M as measured and
never measured the new export/step_M, and the summary (eval/*.json), `status` and TensorBoard showed
the discarded future's tau. Now rank 0's rewind moves them into <out>/discarded/ (with a record and
a warning), and the evaluator trusts a result only while its file is there and export/step_M holds
what it measured, and purges TensorBoard's points past its newest trusted result.

A real one-rank Trainer (DeepSpeed on CPU over gloo) trains the tiny target to step 4 (tags and
exports at 2 and 4); a real Evaluator measures both; the run resumes from step_2 and trains to 4
again. An exact resume would write step 4's weights again bit for bit; an elastic resume or a
permitted config change would not: the old future's export/step_4 is made to differ by replacing
it, before it is measured, with a copy of export/step_2 (a complete export with its own record)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from dflash_dist.trainer import checkpoint
from dflash_dist.trainer.discard import DISCARDED, RECORD
from dflash_dist.trainer.resume import decide
from dflash_dist.trainer.state import STATE_VERSION
from tests.helpers.eval_target import SPECIALS, word_tokenizer
from tests.helpers.tb import scalars
from tests.helpers.tiny import DEMO, make_cfg, write_shards

PROMPTS = [[5, 9, 17, 33, 2, 8], [40, 41, 7, 3, 90, 12]]


def _record(export_dir: Path) -> dict:
    return json.loads((export_dir / "dflash_export.json").read_text())["checksums"]["files"]


def _setup(tiny, tmp_path: Path):
    """Train to step 4 (exports 2 and 4; the old future's step 4 replaced by step 2's weights), then
    measure both. Returns (cfg, shards, the evaluator's target, the measuring Evaluator)."""
    from dflash_dist.actors.trainer_group import train_job
    from dflash_dist.evaluator.evaluator import Evaluator
    from dflash_dist.trainer.loop import Trainer

    shards, out = tmp_path / "shards", tmp_path / "run"
    write_shards(shards, tiny["prov"], tiny["samples"], done=True)
    target = tmp_path / "target"  # the trainer's tiny target with a tokenizer, for the evaluator
    shutil.copytree(tiny["target_dir"], target)
    words = [f"t{i}" for i in range(DEMO.vocab_size - len(SPECIALS))] + list(SPECIALS)
    word_tokenizer(words, eos_token="<|endoftext|>", mask_token="<|mask|>").save_pretrained(target)
    cfg = make_cfg(out, tiny["target_dir"], "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.budgets=[4]",
                   world_size=1, max_steps=4, checkpoint_every=2, keep_checkpoints=4)  # fmt: skip
    job = train_job(cfg, tiny["target_dir"], shards, tiny["prov"], tiny["drafter"], total_steps=4)
    assert Trainer(cfg, job).run().steps == 4
    export = out / "export"
    shutil.rmtree(export / "step_4")
    shutil.copytree(export / "step_2", export / "step_4")  # the discarded future's (other) weights

    ev = Evaluator(cfg, out, target, PROMPTS, expected=None)
    assert [r.step for r in ev.run_until(lambda: (True, 4), poll_s=0.05)] == [2, 4]
    ev.close()
    assert [st for st, _ in scalars(out / "tb" / "eval")["eval/tau_chain"]] == [2, 4]
    return cfg, shards, target, ev


def _resume_from_step_2(cfg, tiny, shards: Path) -> None:
    from dflash_dist.actors.trainer_group import train_job
    from dflash_dist.trainer.loop import Trainer

    tag = cfg.out / "checkpoints" / "step_2"
    decision = decide(str(tag), cfg, shards, (4, "step"), STATE_VERSION)
    job = train_job(cfg, tiny["target_dir"], shards, tiny["prov"], tiny["drafter"], total_steps=4, resume=decision)
    result = Trainer(cfg, job).run()
    assert result.resumed_from == str(tag) and result.steps == 4


def test_a_resume_from_an_earlier_tag_moves_the_later_exports_and_results_aside(tiny, tmp_path, single_rank_gloo,
                                                                                 caplog, capsys):  # fmt: skip
    """Before: eval/step_4.json and export/step_4 of the discarded future stayed; a fresh evaluator
    measured nothing (`[]`) and the old result stood for the new export."""
    from dflash_dist.evaluator.evaluator import Evaluator

    cfg, shards, target, _ = _setup(tiny, tmp_path)
    out = cfg.out
    old_result = (out / "eval" / "step_4.json").read_text()
    old_export = _record(out / "export" / "step_4")
    caplog.set_level(logging.WARNING, logger="dflash_dist.trainer.discard")
    _resume_from_step_2(cfg, tiny, shards)

    # what was discarded: moved under <out>/discarded/, said in a record and a warning
    (moved,) = (out / DISCARDED).iterdir()
    record = json.loads((moved / RECORD).read_text())
    assert record["moved"] == ["eval/step_4.json", "eval/rounds/step_4.json", "export/step_4"]
    assert "resumed from step_2" in record["why"]
    assert (moved / "eval" / "step_4.json").read_text() == old_result
    assert (moved / "eval" / "rounds" / "step_4.json").is_file() and _record(moved / "export" / "step_4") == old_export
    assert any(str(moved) in r.getMessage() and "export/step_4" in r.getMessage() for r in caplog.records)
    assert (out / "eval" / "step_2.json").is_file() and not (out / "eval" / "step_4.json").exists()
    new_export = _record(out / "export" / "step_4")
    assert new_export != old_export  # the branched run's own step 4

    ev = Evaluator(cfg, out, target, PROMPTS, expected=None)
    measured = ev.run_until(lambda: (True, 4), poll_s=0.05)
    ev.close()
    assert [r.step for r in measured] == [4] and measured[0].export == new_export
    assert json.loads((out / "eval" / "step_4.json").read_text())["export"] == new_export
    # TensorBoard: the discarded future's point at step 4 is gone, the new one shown once
    taus = scalars(out / "tb" / "eval")["eval/tau_chain"]
    assert [st for st, _ in taus] == [2, 4] and taus[1][1] == pytest.approx(measured[0].tau_chain)
    assert checkpoint.read_latest(out / "checkpoints") == "step_4"
    # the run's summary: the new tau at step 4, and what was moved aside
    from dflash_dist.orchestration.pipeline import PipelineResult, _layout, _print_summary

    capsys.readouterr()
    _print_summary(cfg, _layout(cfg), PipelineResult(str(out), ("train", "eval"), (), (), (), 0, None, 600.0))
    summary = capsys.readouterr().out
    assert "  " + measured[0].table_row() + "\n" in summary and summary.count("step      4:") == 1, summary
    assert (f"[discarded] {moved}: eval/step_4.json, eval/rounds/step_4.json, export/step_4 (resumed from step_2 "
            "(step 2)") in summary, summary  # fmt: skip


def test_an_evaluator_holding_the_discarded_results_measures_the_new_export(tiny, tmp_path, single_rank_gloo,
                                                                            caplog):  # fmt: skip
    """The pipeline starts the evaluator beside the trainers: it may read eval/ before rank 0 moves
    the old results, and saved progress (state_dict) may claim step 4. Before: both treated step 4
    as measured (next_request None, run_until `[]`), and TensorBoard kept the old point beside none."""
    from dflash_dist.evaluator.evaluator import Evaluator

    cfg, shards, target, ev = _setup(tiny, tmp_path)
    out = cfg.out
    saved = ev.state_dict()
    _resume_from_step_2(cfg, tiny, shards)
    new_export = _record(out / "export" / "step_4")

    # progress saved before the rewind no longer claims step 4: its export holds other files now
    other = Evaluator(cfg, out, target, PROMPTS, expected=None)
    other.load_state_dict(saved)
    request = other.next_request()
    assert request is not None and request.step == 4 and 4 not in other.done and 2 in other.done

    # the evaluator that read the old results before the rewind measures the new export/step_4
    caplog.set_level(logging.WARNING, logger="dflash_dist.evaluator.evaluator")
    assert 4 in ev.done
    measured = ev.run_until(lambda: (True, 4), poll_s=0.05)
    ev.close()
    assert [r.step for r in measured] == [4] and measured[0].export == new_export
    assert ev.results[4] == measured[0] and sorted(ev.done) == [2, 4]
    assert any("step 4 is measured again" in r.getMessage() for r in caplog.records)
    taus = scalars(out / "tb" / "eval")["eval/tau_chain"]
    assert [st for st, _ in taus] == [2, 4] and taus[1][1] == pytest.approx(measured[0].tau_chain)
    # the saved progress names the export each step measured (the old future's step 4: step 2's files)
    assert saved["evaluated"] == [2, 4] and saved["exports"]["4"] == _record(out / "export" / "step_2") != new_export


def test_an_old_export_measured_after_the_rewind_is_moved_aside_when_the_new_one_comes(tiny_eval, tmp_path):
    """The evaluator measured the old export/step_4 while rank 0 moved it (its result written after the
    move): the result's file is there, but export/step_4 holds other files once the branched run writes
    it. Before: that result stood for the new export. Files only: the exports are published as the
    trainer does (tests/helpers/eval_target.py's tiny evaluator setting)."""
    from dflash_dist.evaluator.evaluator import Evaluator
    from tests.helpers.eval_target import publish

    out = tmp_path / "run"
    (out / "export").mkdir(parents=True)
    publish(tiny_eval, out, "random", 4)
    ev = Evaluator(tiny_eval["cfg"], out, tiny_eval["target_dir"], tiny_eval["prompts"], expected=None)
    (old,) = ev.run_until(lambda: (True, 4), poll_s=0.05)
    assert ev.next_request() is None
    shutil.rmtree(out / "export" / "step_4")  # the branched run writes step 4 again, other weights
    publish(tiny_eval, out, "trained", 4)
    request = ev.next_request()
    assert request is not None and request.step == 4 and 4 not in ev.done
    (moved,) = (out / DISCARDED).iterdir()
    assert json.loads((moved / "eval" / "step_4.json").read_text()) == old.to_json()
    assert json.loads((moved / RECORD).read_text())["moved"] == ["eval/step_4.json", "eval/rounds/step_4.json"]
    (new,) = ev.run_until(lambda: (True, 4), poll_s=0.05)
    ev.close()
    assert new.export == _record(out / "export" / "step_4") != old.export
    assert new.tau_chain > old.tau_chain + 0.5  # the trained drafter's, not the random one's
    taus = scalars(out / "tb" / "eval")["eval/tau_chain"]
    assert taus == [(4, pytest.approx(new.tau_chain))]


def test_a_result_of_an_export_moved_while_it_was_measured_is_not_kept(tiny_eval, tmp_path, monkeypatch):
    """The evaluator loaded the old future's export/step_6 (a 27B drafter: minutes of measuring) when
    rank 0's rewind to step_2 moved it; its result was written after the move, so rank 0 never saw it.
    Before: eval/step_6.json stayed, trusted (export/step_6 absent: nothing to compare), and as the
    newest done step it made pending_steps pass over the branched run's new exports 4 (next_request
    None) until step 6 was written again, and the summary showed the discarded future's tau at 6."""
    from dflash_dist.evaluator.evaluator import Evaluator
    from dflash_dist.trainer import discard
    from tests.helpers.eval_target import publish

    out = tmp_path / "run"
    (out / "export").mkdir(parents=True)
    for step in (2, 6):
        publish(tiny_eval, out, "random", step)
    ev = Evaluator(tiny_eval["cfg"], out, tiny_eval["target_dir"], tiny_eval["prompts"], expected=None)
    ev.evaluate(2, out / "export" / "step_2")
    load = ev._load_drafter

    def load_then_rewind(export_dir, own=True):  # the drafter is in memory when rank 0 moves its files
        drafter = load(export_dir, own)
        discard.discard_after(out, 2, "step_2")
        return drafter

    monkeypatch.setattr(ev, "_load_drafter", load_then_rewind)
    ev.evaluate(6, out / "export" / "step_6")
    monkeypatch.undo()
    assert not (out / "export" / "step_6").exists()
    assert not (out / "eval" / "step_6.json").exists() and not (out / "eval" / "rounds" / "step_6.json").exists()
    assert 6 not in ev.done and 6 not in ev.results
    kept = [d / "eval" / "step_6.json" for d in (out / DISCARDED).iterdir() if (d / "eval" / "step_6.json").is_file()]
    assert len(kept) == 1  # moved aside (kept), not deleted
    publish(tiny_eval, out, "trained", 4)  # the branched run's step 4
    request = ev.next_request()
    assert request is not None and request.step == 4
    (new,) = ev.run_until(lambda: (True, 4), poll_s=0.05)
    ev.close()
    assert [st for st, _ in scalars(out / "tb" / "eval")["eval/tau_chain"]] == [2, 4]  # step 6's point purged


def test_a_result_written_while_rank_0_moves_the_exports_is_moved_too(tmp_path, monkeypatch):
    """The evaluator wrote eval/step_6.json after rank 0 listed eval/ but before it moved export/step_6
    (its check after writing still found the export): before, rank 0 listed once, so that result stayed."""
    from dflash_dist.trainer import discard

    out = tmp_path / "run"
    for d in ("eval", "export/step_6"):
        (out / d).mkdir(parents=True)
    (out / "export" / "step_6" / "config.json").write_text("{}")
    move = shutil.move

    def evaluator_writes_meanwhile(src, dst):
        if src.endswith("step_6") and not (out / "eval" / "step_6.json").exists():
            (out / "eval" / "step_6.json").write_text("{}")  # the evaluator's result, written meanwhile
        return move(src, dst)

    monkeypatch.setattr(discard.shutil, "move", evaluator_writes_meanwhile)
    discard.discard_after(out, 2, "step_2")
    monkeypatch.undo()
    assert not (out / "eval" / "step_6.json").exists() and not (out / "export" / "step_6").exists()
    moved = {m for d in (out / DISCARDED).iterdir() for m in json.loads((d / RECORD).read_text())["moved"]}
    assert moved == {"export/step_6", "eval/step_6.json"}


def test_a_planted_discarded_link_is_refused(tmp_path):
    """<out>/discarded planted as a link to a directory elsewhere: before, the exports and results were
    moved through it out of the run directory."""
    from dflash_dist.trainer import discard

    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (out / "export" / "step_6").mkdir(parents=True)
    elsewhere.mkdir()
    (out / DISCARDED).symlink_to(elsewhere)
    with pytest.raises(ValueError, match="discarded.*link"):
        discard.discard_after(out, 2, "step_2")
    assert (out / "export" / "step_6").is_dir() and list(elsewhere.iterdir()) == []


def test_a_replaced_export_below_the_newest_measured_is_measured_again(tiny_eval, tmp_path):
    """export/step_4 written again after steps 4 and 6 were measured (`dflash-dist export --force` of
    step_4, e.g. in another dtype): its result is moved aside, and the step must be measured again and
    its old point leave TensorBoard. Before: pending_steps passed over step 4 (below the newest measured),
    so it stayed unmeasured, and TensorBoard kept the old point (purge_step was 7)."""
    from dflash_dist.evaluator.evaluator import Evaluator
    from tests.helpers.eval_target import publish

    out = tmp_path / "run"
    (out / "export").mkdir(parents=True)
    for step in (2, 4, 6):
        publish(tiny_eval, out, "random", step)
    ev = Evaluator(tiny_eval["cfg"], out, tiny_eval["target_dir"], tiny_eval["prompts"], expected=None)
    old = {r.step: r for r in ev.run_until(lambda: (True, 6), poll_s=0.05)}
    shutil.rmtree(out / "export" / "step_4")
    publish(tiny_eval, out, "trained", 4)
    request = ev.next_request()
    assert request is not None and request.step == 4
    (new,) = ev.run_until(lambda: (True, 6), poll_s=0.05)
    ev.close()
    assert new.step == 4 and new.export == _record(out / "export" / "step_4") and new.tau_chain > old[4].tau_chain + 0.5
    assert sorted(ev.done) == [2, 4, 6] and json.loads((out / "eval" / "step_4.json").read_text()) == new.to_json()
    tb = scalars(out / "tb" / "eval")
    want = {2: old[2].tau_chain, 4: new.tau_chain, 6: old[6].tau_chain}
    assert tb["eval/tau_chain"] == [(s, pytest.approx(t)) for s, t in want.items()]  # each step once
    assert [s for s, _ in tb["eval/tau_ddtree_4"]] == [2, 4, 6]
