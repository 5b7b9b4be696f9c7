"""Every process that loads the target loads the weights the run plan hashed, the features' target
(target/weights_check.py): a capture actor, the evaluator and its live workers refuse weight files
whose hash is not the run's recorded target_hash (a capture actor before it writes anything), and
the hash is computed once per process, not per worker."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from data_pipeline import provenance
from dflash_dist.evaluator import Evaluator
from dflash_dist.target import weights_check
from dflash_dist.target.loading import target_identity
from dflash_dist.target.weights_check import (
    TargetWeightsMismatch,
    check_unchanged,
    hashed_weights,
    verify_weights,
)
from tests.helpers.capture import capture_config, make_capture_target, write_conversations
from tests.helpers.config import config_from
from tests.helpers.eval_target import publish
from tests.helpers.weights import other_target, perturb

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_eval):
    return tiny_eval


def mismatch_named(err: TargetWeightsMismatch, target_dir: Path, recorded: str) -> None:
    text = str(err)
    assert err.recorded == recorded and err.found == provenance.hash_weight_files(target_dir) != recorded
    assert recorded in text and err.found in text and str(target_dir) in text and "target.path" in text


def test_the_evaluator_refuses_weights_other_than_the_recorded_ones(tiny, tmp_path):
    """The run plan's identity (hashed where the plan was made) names the features' target; an
    evaluator whose target_dir holds other weights is refused before it measures anything."""
    recorded = target_identity(tiny["cfg"], tiny["target_dir"])
    other = other_target(tiny["target_dir"], tmp_path / "other")
    with pytest.raises(TargetWeightsMismatch) as info:
        Evaluator(tiny["cfg"], tmp_path / "run", other, tiny["prompts"], expected=None, identity=recorded)
    mismatch_named(info.value, other, recorded.target_hash)
    assert "the evaluator's target" in str(info.value)


def test_a_live_worker_refuses_weights_other_than_the_evaluators(tiny, tmp_path):
    """A live worker handed a check of another target_dir than the one whose files were hashed
    (the hash and stamp of the evaluator's own): refused with the mismatch (kept, and raised by its
    prompt calls); given the evaluator's own check, it loads."""
    from dflash_dist.evaluator.measure import _WORKER, live_worker_init, live_worker_prompt

    ev = Evaluator(tiny["cfg"], tmp_path / "run", tiny["target_dir"], tiny["prompts"], expected=None)
    other = other_target(tiny["target_dir"], tmp_path / "other")
    elsewhere = dataclasses.replace(ev.weights, target_dir=str(other))
    args = (tiny["cfg"].to_dict(), str(tiny["root"] / "trained"), ev.provenance.kernel_path, 1)
    try:
        live_worker_init(*args, elsewhere)
        assert isinstance(_WORKER["error"], TargetWeightsMismatch) and "model" not in _WORKER
        mismatch_named(_WORKER["error"], other, ev.identity.target_hash)
        with pytest.raises(TargetWeightsMismatch):
            live_worker_prompt(tiny["prompts"][0], (4,), "capped", (), 4)
        live_worker_init(*args, ev.weights)
        assert _WORKER["error"] is None and "model" in _WORKER
    finally:
        _WORKER.clear()
        ev.close()


def test_a_live_worker_requires_the_checksum_record_of_the_runs_own_export(tiny, tmp_path):
    """The evaluator loads its run's exports only with their dflash_export.json verified; its live
    workers (eval.live_workers > 1) load the export again from disk, and loaded one without a record
    unverified (its record removed, its weights replaced). A worker now requires it of the run's own
    exports, as the evaluator does; a drafter from elsewhere (the reference drafter) loads as before."""
    from dflash_dist.evaluator.measure import _WORKER, live_worker_init
    from dflash_dist.model.export import EXPORT_RECORD

    ev = Evaluator(tiny["cfg"], tmp_path / "run", tiny["target_dir"], tiny["prompts"], expected=None)
    export = tmp_path / "run" / "export" / "step_5"
    shutil.copytree(tiny["root"] / "trained", export)
    (export / EXPORT_RECORD).unlink()
    args = (tiny["cfg"].to_dict(), str(export), ev.provenance.kernel_path, 1, ev.weights)
    try:
        live_worker_init(*args)
        assert isinstance(_WORKER.get("error"), ValueError) and "model" not in _WORKER, _WORKER
        assert f"{export / EXPORT_RECORD}: missing" in str(_WORKER["error"])
        live_worker_init(*args, own=False)  # the reference drafter: no record of ours
        assert _WORKER["error"] is None and "drafter" in _WORKER
    finally:
        _WORKER.clear()
        ev.close()


def test_live_workers_measure_a_reference_drafter_that_has_no_checksum_record(tiny, tmp_path):
    """eval.live_workers=2 in live mode against a reference drafter from elsewhere (z-lab's export has
    no dflash_export.json): the evaluator passes it to its workers as not the run's own, so they load
    it as the evaluator does instead of requiring the record of the run's own exports. (The worker
    side: the test above; this one covers the evaluator's reference path, which nothing else runs.)"""
    from dflash_dist.model.export import EXPORT_RECORD

    ref = tmp_path / "zlab_drafter"
    shutil.copytree(tiny["root"] / "trained", ref)
    (ref / EXPORT_RECORD).unlink()
    tree = tiny["cfg"].to_dict()
    # one prompt: the spawn pool starts its workers as prompts arrive, so one worker process (its
    # imports, its loads) measures it, on the same workers' path (live_workers > 1) the evaluator takes
    tree["eval"].update(mode="live", live_workers=2, reference_drafter=str(ref), num_prompts=1)
    out = tmp_path / "run"
    (out / "export").mkdir(parents=True)
    ev = Evaluator(config_from(tree), out, tiny["target_dir"], tiny["prompts"], expected=None)
    try:
        record = ev.reference_tau()
    finally:
        ev.close()
    assert record["live_tau_chain"] == pytest.approx(record["tau_chain"], rel=0.02)


def test_live_workers_refuse_a_target_changed_on_disk_after_the_evaluator_loaded_it(tiny, tmp_path):
    """eval.live_workers=2: the target's weights are rewritten after the evaluator verified and
    loaded them; the spawned workers, which load the target again for live decoding, refuse it,
    and the evaluator raises their error (not a broken pool)."""
    target = tmp_path / "target"
    shutil.copytree(tiny["target_dir"], target)
    tree = tiny["cfg"].to_dict()
    tree["target"]["path"] = str(target)
    tree["eval"].update(mode="live", live_workers=2, num_prompts=1)  # one prompt: one worker process starts
    out = tmp_path / "run"
    (out / "export").mkdir(parents=True)
    ev = Evaluator(config_from(tree), out, target, tiny["prompts"], expected=None)
    recorded = ev.identity.target_hash
    perturb(target)
    publish(tiny, out, "trained", 10)
    with pytest.raises(TargetWeightsMismatch) as info:
        ev.run_until(lambda: (True, 10), poll_s=0.05)
    ev.close()
    mismatch_named(info.value, target, recorded)
    assert "live worker" in str(info.value)


def test_weights_are_hashed_once_per_process_and_not_again_by_a_worker_given_the_check(tiny, tmp_path, monkeypatch):
    """hashed_weights keeps the hash per file stamp; verify_weights with the evaluator's check
    only stats the files while they are unchanged; a rewritten file (new ctime) is hashed again,
    and check_unchanged refuses files changed since the check."""
    target = tmp_path / "target"
    shutil.copytree(tiny["target_dir"], target)
    calls = []
    real = provenance.hash_weight_files
    monkeypatch.setattr(provenance, "hash_weight_files", lambda d, *a: calls.append(d) or real(d, *a))
    first = hashed_weights(target)
    assert hashed_weights(target) == first and len(calls) == 1
    assert first.target_hash == real(target)
    assert verify_weights(target, first.target_hash, "w", first) == first and len(calls) == 1
    os.utime(target / "model.safetensors")  # same bytes, new stamp: hashed again, and accepted
    again = verify_weights(target, first.target_hash, "w", first)
    assert len(calls) == 2 and again.target_hash == first.target_hash and again.stamp != first.stamp
    with pytest.raises(ValueError, match="changed while they were loaded"):
        check_unchanged(first, "w")
    perturb(target)
    with pytest.raises(TargetWeightsMismatch):
        verify_weights(target, first.target_hash, "w", again)
    assert len(calls) == 3


# ---------------------------------------------------------------------------- capture actors
@pytest.fixture(scope="module")
def capture_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    write_conversations(root / "train.jsonl", 8)
    return {"dir": make_capture_target(root / "target"), "jsonl": root / "train.jsonl"}


def test_a_capture_actor_refuses_other_weights_at_the_plans_path_before_writing_anything(
    capture_target, tmp_path, monkeypatch
):
    """Another node of a multi-node run: the plan hashed target.path on the driver's node, this
    node's files at that path hold other weights. CaptureJob.load is refused with the mismatch
    (both hashes, the directory, the actor and its node, the fix) and the shard tree stays empty:
    no shard, no ledger. With the plan's weights back it captures as before, every shard recording
    the plan's hash; loaded again it hashes nothing (this process's stamp cache); files rewritten
    during the load are refused."""
    from data_pipeline.shard_reader import read_manifest
    from dflash_dist.capture.capture_job import CaptureJob
    from dflash_dist.capture.data_prep import capture_data
    from dflash_dist.target import loading

    here = tmp_path / "target"
    shutil.copytree(capture_target["dir"], here)
    cfg = capture_config(tmp_path / "run", here, capture_target["jsonl"])
    ident = target_identity(cfg, here)  # the run plan's, made on the driver's node
    perturb(here)  # this node: other weights at the same path
    shards = cfg.out / "shards"
    with pytest.raises(TargetWeightsMismatch) as info:
        CaptureJob.load(cfg, here, ident, shards, 0, 1)
    mismatch_named(info.value, here, ident.target_hash)
    assert "target actor 0 on " in str(info.value) and "shards captured here would record" in str(info.value)
    assert not shards.exists() and not any(cfg.out.rglob("*"))  # no shard, no ledger, nothing at all

    shutil.copy(capture_target["dir"] / "model.safetensors", here / "model.safetensors")  # the plan's weights
    calls = []
    real = provenance.hash_weight_files
    monkeypatch.setattr(provenance, "hash_weight_files", lambda d, *a: calls.append(d) or real(d, *a))
    result = CaptureJob.load(cfg, here, ident, shards, 0, 1).run(
        capture_target["jsonl"], capture_data(cfg, capture_target["jsonl"])
    )
    records = read_manifest(shards)
    assert result.samples == 8 and records and {r.provenance.target_hash for r in records} == {ident.target_hash}
    assert len(calls) == 1  # the restored files' new stamp: hashed once
    CaptureJob.load(cfg, here, ident, shards, 0, 1)
    assert len(calls) == 1  # same files: the stamp cache (the plan's hash, in single-process runs)

    real_load = loading.load_target

    def rewritten_while_loading(cfg, target_dir, device=None):
        loaded = real_load(cfg, target_dir, device)
        os.utime(Path(target_dir) / "model.safetensors")  # the same bytes, written again: a new stamp
        return loaded

    monkeypatch.setattr(loading, "load_target", rewritten_while_loading)
    with pytest.raises(ValueError, match="changed while they were"):
        CaptureJob.load(cfg, here, ident, tmp_path / "other_shards", 0, 1)
    assert not (tmp_path / "other_shards").exists()


def test_a_capture_actor_given_another_models_shapes_says_the_hashes_differ(capture_target, tmp_path):
    """This node's target.path holds another model whose weights do not fit the config (another
    hidden size): its load fails, and the actor raises the mismatch, which says what is wrong,
    from that failure."""
    from dflash_dist.capture.capture_job import CaptureJob

    here = make_capture_target(tmp_path / "target", hidden=32)
    shutil.copy(capture_target["dir"] / "config.json", here / "config.json")  # the plan's model's config
    cfg = capture_config(tmp_path / "run", capture_target["dir"], capture_target["jsonl"])
    ident = target_identity(cfg, capture_target["dir"])
    with pytest.raises(TargetWeightsMismatch) as info:
        CaptureJob.load(cfg, here, ident, cfg.out / "shards", 0, 1)
    mismatch_named(info.value, here, ident.target_hash)
    assert info.value.__context__ is not None  # the load's own error, kept
    assert not any(cfg.out.rglob("*"))


def test_a_check_skips_hashing_only_for_files_that_still_carry_its_exact_stamp(tiny, tmp_path):
    """The run plan's check handed to another process (here: to verify_weights) is reused for the
    files it stamped; files rewritten in place with other bytes, their size and mtime set back as
    they were, differ in ctime alone (no user call sets it back): hashed, and refused."""
    target = tmp_path / "target"
    shutil.copytree(tiny["target_dir"], target)
    check = hashed_weights(target)
    made = len(weights_check.hashes_made())
    assert verify_weights(target, check.target_hash, "w", check) == check and len(weights_check.hashes_made()) == made
    path = target / "model.safetensors"
    before = os.stat(path)
    other = tmp_path / "other"
    other_target(target, other)
    data = (other / "model.safetensors").read_bytes()
    assert len(data) == before.st_size and data != path.read_bytes()
    with open(path, "r+b") as f:  # the same inode, the same size
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # the same mtime
    stamp = weights_check.weights_stamp(target)
    assert [s[:3] + s[4:] for s in stamp] == [s[:3] + s[4:] for s in check.stamp] and stamp != check.stamp
    with pytest.raises(TargetWeightsMismatch):
        verify_weights(target, check.target_hash, "w", check)
    assert len(weights_check.hashes_made()) == made + 1


# ---------------------------------------------------------------------------- the plan's check, through Ray
def _plan(capture_target, target: Path, out: Path):
    """The run plan of an extract over `target`, made in this process (the driver)."""
    from dflash_dist.orchestration.run_plan import make_plan

    cfg = capture_config(
        out,
        target,
        capture_target["jsonl"],
        "eval.enabled=false",
        "eval.max_new_tokens=4",
        "eval.poll_s=0.1",
        cpus_per_actor=0.5,
        max_restarts=0,
    )
    return cfg, make_plan(cfg, ("extract",), "never")


def _start(cfg, plan):
    """The pipeline's capture of `plan` started (_start_capture, one target actor): its actors and calls."""
    from dflash_dist.orchestration.pipeline import _start_capture

    shards = cfg.out / "shards"
    shards.mkdir(parents=True, exist_ok=True)  # as the pipeline's _layout leaves it
    return _start_capture(cfg, plan, {"shards": shards}, lambda role, i: {})


def _finish(ray, cfg, started):
    """The results of a capture _start started (_finish_capture)."""
    from dflash_dist.orchestration.pipeline import _finish_capture

    return _finish_capture(ray, started[1], [cfg.out / "shards"])


def test_capture_actors_given_the_plans_check_hash_only_files_without_its_stamp(capture_target, ray_cluster, tmp_path):
    """The driver's run plan records its check of the weights (hash + stamp) in memory only, and
    the pipeline hands it to its target actors (each a Ray process of its own): one loading the
    files the plan hashed hashes nothing; one loading a copy elsewhere (the same bytes, another
    path and inode: another node's files), with the check naming the original, hashes them in
    full and captures; one whose copy holds other weights is refused before writing anything."""
    from dflash_dist.orchestration.run_plan import PipelineError, RunPlan
    from dflash_dist.target.weights_check import VerifiedWeights

    here = tmp_path / "target"
    shutil.copytree(capture_target["dir"], here)
    cfg, plan = _plan(capture_target, here, tmp_path / "run")
    assert isinstance(plan.weights, VerifiedWeights) and plan.weights.target_hash == plan.identity.target_hash
    assert plan.weights.stamp == weights_check.weights_stamp(here)
    # never written, never read back: a stamp from a file does not spare a hash
    text = plan.to_json()
    assert "weights" not in json.loads(text) and str(plan.weights.stamp[0][4]) not in text
    assert RunPlan.from_json(text, "x").weights is None
    forged = {**json.loads(text), "weights": dataclasses.asdict(plan.weights)}
    assert RunPlan.from_json(json.dumps(forged), "x").weights is None

    copy = tmp_path / "node2" / "target"
    shutil.copytree(here, copy)  # the same bytes: another path, inode and ctime
    cfg2 = capture_config(tmp_path / "run2", copy, capture_target["jsonl"], cpus_per_actor=0.5, max_restarts=0)
    other = other_target(here, tmp_path / "node3" / "target")
    cfg3 = capture_config(tmp_path / "run3", other, capture_target["jsonl"], cpus_per_actor=0.5, max_restarts=0)
    # the three captures' actors (each a process of its own, 0.5 CPU) start at once: their imports overlap
    started = [_start(cfg, plan), _start(cfg2, dataclasses.replace(plan, target_dir=str(copy))),
               _start(cfg3, dataclasses.replace(plan, target_dir=str(other)))]  # fmt: skip
    assert [len(actors) for actors, _ in started] == [1, 1, 1]

    (result,) = _finish(ray_cluster, cfg, started[0])
    assert result.samples == 8 and result.weights_hashed == 0  # the driver's node: its stamp, no hash
    from data_pipeline.shard_reader import read_manifest

    assert {r.provenance.target_hash for r in read_manifest(cfg.out / "shards")} == {plan.identity.target_hash}

    (result,) = _finish(ray_cluster, cfg2, started[1])
    assert result.samples == 8 and result.weights_hashed == 1  # hashed there, and accepted

    with pytest.raises(PipelineError) as info:
        _finish(ray_cluster, cfg3, started[2])
    cause = info.value.__cause__
    assert isinstance(cause, TargetWeightsMismatch) and cause.recorded == plan.identity.target_hash
    assert cause.found == provenance.hash_weight_files(other)
    assert {p.name for p in (cfg3.out / "shards").iterdir()} <= {".manifest.lock"}  # the driver's: no shard, no ledger


def test_the_evaluator_actor_given_the_plans_check_does_not_hash(capture_target, ray_cluster, tmp_path):
    """The evaluator, a Ray process of its own started by the pipeline (_start_evaluator), loads the
    files the plan hashed (and checks them against the plan's provenance) without hashing them."""
    from dflash_dist.orchestration.pipeline import _start_evaluator

    here = tmp_path / "target"
    shutil.copytree(capture_target["dir"], here)
    cfg, plan = _plan(capture_target, here, tmp_path / "run")
    actor = _start_evaluator(cfg, plan, [[5, 6, 7, 8], [9, 10, 11]], cfg.out / "shards", {})
    try:
        deadline = time.monotonic() + 120
        while not (status := ray_cluster.get(actor.status.remote()))["ready"]:
            assert status["error"] is None and time.monotonic() < deadline, status
            time.sleep(0.2)
        assert status["error"] is None and status["weights_hashed"] == 0, status
    finally:
        ray_cluster.kill(actor)


def test_a_capture_slice_hashes_unless_it_made_the_plan_itself(capture_target, tmp_path, monkeypatch):
    """`extract --slice`: the slice that makes the array's run plan hands its own check to its load
    (nothing hashed again); another slice reads the plan from JSON, which carries no check (a stamp
    from a file never spares a hash), and hashes the files it loads in its own process. That slice
    runs here as another process would start: with no hash of its own yet (the process's stamp
    cache emptied), and the plan only on disk (share_plan reads it back)."""
    from launcher.slurm_capture import capture_slice, slice_marker

    here = tmp_path / "target"
    shutil.copytree(capture_target["dir"], here)
    cfg = capture_config(tmp_path / "run", here, capture_target["jsonl"], "eval.enabled=false")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # both slices: the same plan key (no Slurm job here)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    assert capture_slice(cfg, 0, 2)["weights_hashed"] == 0  # made the plan here: its check
    monkeypatch.setattr(weights_check, "_HASHES", {})  # another process: nothing hashed there yet
    assert capture_slice(cfg, 1, 2)["weights_hashed"] == 1
    assert json.loads(slice_marker(cfg.out, 1, 2).read_text())["weights_hashed"] == 1
