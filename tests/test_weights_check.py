"""Every process that loads the target loads the weights the run plan hashed, the features' target
(target/weights_check.py): a capture actor, the evaluator and its live workers refuse weight files
whose hash is not the run's recorded target_hash (a capture actor before it writes anything), and
the hash is computed once per process, not per worker."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest

from data_pipeline import provenance
from dflash_dist.evaluator import Evaluator
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


def test_live_workers_refuse_a_target_changed_on_disk_after_the_evaluator_loaded_it(tiny, tmp_path):
    """eval.live_workers=2: the target's weights are rewritten after the evaluator verified and
    loaded them; the spawned workers, which load the target again for live decoding, refuse it,
    and the evaluator raises their error (not a broken pool)."""
    target = tmp_path / "target"
    shutil.copytree(tiny["target_dir"], target)
    tree = tiny["cfg"].to_dict()
    tree["target"]["path"] = str(target)
    tree["eval"].update(mode="live", live_workers=2)
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
