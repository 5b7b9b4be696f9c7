"""Every process that loads the target to measure tau loads the weights the features were captured
from (target/weights_check.py): the evaluator and its live workers refuse weight files whose hash
is not the run's recorded target_hash, and the hash is computed once per process, not per worker."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from data_pipeline import provenance
from dflash_dist.evaluator import Evaluator
from dflash_dist.target.loading import target_identity
from dflash_dist.target.weights_check import (
    TargetWeightsMismatch,
    check_unchanged,
    hashed_weights,
    verify_weights,
)
from tests.helpers.config import config_from
from tests.helpers.eval_target import publish

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_eval):
    return tiny_eval


def perturb(target_dir: Path) -> None:
    """Rewrite the target's weights with one tensor changed slightly (another model, same shapes)."""
    path = target_dir / "model.safetensors"
    tensors = load_file(path)
    name = sorted(k for k in tensors if k.endswith("mlp.down_proj.weight"))[0]
    tensors[name] = tensors[name] + 1e-3
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)


def other_target(tiny: dict, where: Path) -> Path:
    """A copy of the tiny target whose weights differ from the recorded ones."""
    shutil.copytree(tiny["target_dir"], where)
    perturb(where)
    return where


def mismatch_named(err: TargetWeightsMismatch, target_dir: Path, recorded: str) -> None:
    text = str(err)
    assert err.recorded == recorded and err.found == provenance.hash_weight_files(target_dir) != recorded
    assert recorded in text and err.found in text and str(target_dir) in text and "target.path" in text


def test_the_evaluator_refuses_weights_other_than_the_recorded_ones(tiny, tmp_path):
    """The run plan's identity (hashed where the plan was made) names the features' target; an
    evaluator whose target_dir holds other weights is refused before it measures anything."""
    recorded = target_identity(tiny["cfg"], tiny["target_dir"])
    other = other_target(tiny, tmp_path / "other")
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
    other = other_target(tiny, tmp_path / "other")
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
