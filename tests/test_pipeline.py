"""The whole pipeline on real components: the README's main command on the tiny config (a local
Ray head, 1 target actor, 2 DeepSpeed CPU ranks over gloo, the evaluator), then its outputs checked.
The run is the session's one `readme_run` (tests/conftest.py, tests/readme_run.py)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from data_pipeline.chat_data import read_chat_jsonl
from data_pipeline.ingest import sample_keys
from data_pipeline.records import DONE_NAME, MANIFEST_NAME, TMP_PREFIX
from data_pipeline.shard_reader import iter_shard_samples, read_manifest
from dflash_dist.model.export import load_drafter


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for events in logdir.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return {k: sorted(set(v)) for k, v in out.items()}


@pytest.fixture(scope="module")
def tiny_run(readme_run) -> tuple[Path, subprocess.CompletedProcess]:
    """The README's main command on the tiny config, run once for the session (tests/readme_run.py:
    through `ray job submit`, whose output is the job's own, stdout and stderr together)."""
    return readme_run.out, readme_run.proc


@pytest.mark.slow
def test_every_prompt_captured_exactly_once_in_complete_shards(tiny_run):
    out, _ = tiny_run
    shards = out / "shards"
    records = read_manifest(shards)
    assert (shards / DONE_NAME).exists() and (shards / MANIFEST_NAME).exists()
    assert not list(shards.glob(f"{TMP_PREFIX}*"))
    assert len(records) >= 2  # streamed in several shards
    keys = [k for r in records for k in r.keys]
    want = sample_keys(read_chat_jsonl(out / "data" / "train.ingested.jsonl"))
    assert len(want) == len(read_chat_jsonl(out / "data" / "train.jsonl"))
    assert sorted(keys) == sorted(want)  # each prompt exactly once, keyed by its content
    on_disk = sorted(p.name for p in shards.glob("*.tar"))
    assert on_disk == sorted(r.name for r in records)
    for r in records:
        p = r.provenance
        assert p.kernel_path == "torch" and p.dtype == "float32" and len(p.target_hash) == 64
        assert p.layer_ids == (1, 3, 5) and p.template_hash and p.schema_version >= 1
        samples = list(iter_shard_samples(shards / r.name))
        assert [s.key for s in samples] == list(r.keys)
        assert all(s.features.shape == (s.num_tokens, 3 * p.hidden_size) for s in samples)


@pytest.mark.slow
def test_checkpoints_exports_and_tensorboard(tiny_run):
    out, proc = tiny_run
    ckpt = out / "checkpoints"
    latest = (ckpt / "latest").read_text().strip()
    assert (ckpt / latest).is_dir()
    exports = sorted((out / "export").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    assert len(exports) >= 2
    drafter = load_drafter(exports[-1])
    assert drafter.fc.in_features == 3 * drafter.config.hidden_size  # all k layers feed fc
    evals = sorted((out / "eval").glob("step_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    assert {p.stem for p in evals} == {p.name for p in exports}

    scalars = _scalars(out / "tb")
    for tag in ("train/loss", "train/acc_slot_1", "train/grad_norm", "train/lr", "train/tokens_per_s",
                "data/wait_frac"):
        assert scalars.get(tag), f"missing {tag}"
    steps = [int(p.name.split("_")[1]) for p in exports]
    for tag in ("eval/tau_chain", "eval/tau_ddtree_4", "eval/tau_ddtree_8"):
        assert [s for s, _ in scalars[tag]] == steps, tag
    tau = [v for _, v in scalars["eval/tau_chain"]]
    assert tau[-1] > tau[0] and tau[-1] > 1.5
    assert json.loads(evals[0].read_text())["tau_chain"] == pytest.approx(tau[0], rel=1e-6)
    loss = [v for _, v in scalars["train/loss"]]
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3
    assert "tau chain" in proc.stdout and "tensorboard --logdir" in proc.stdout
    # the printed summary itself (a log record would carry its `[role rank]` prefix)
    assert re.search(r"^  step +\d+: tau chain \d", proc.stdout, re.M), proc.stdout[-3000:]
    assert re.search(r"^TensorBoard: tensorboard --logdir ", proc.stdout, re.M), proc.stdout[-3000:]


def test_run_plan_is_computed_once_and_read_back_by_the_other_tasks(tmp_path):
    """One task makes the plan (ingested data with its content hash, the target's weight hash,
    provenance, drafter shape, the resume decision); the others read it from JSON without touching
    the weights, and get an equal frozen record."""
    from data_pipeline.ingest import content_hash, sample_keys
    from data_pipeline.provenance import hash_weight_files
    from dflash_dist.orchestration.run_plan import PipelineError, RunPlan, plan_path, share_plan
    from tests.helpers.capture import capture_config, make_capture_target, write_conversations

    write_conversations(tmp_path / "train.jsonl", 6)
    target = make_capture_target(tmp_path / "target")
    cfg = capture_config(tmp_path / "run", target, tmp_path / "train.jsonl", "eval.enabled=false")
    weights_hash = hash_weight_files(target)
    lead = share_plan(cfg, ("extract", "train"), "auto", key="job-1", leader=True)
    assert lead.stages == ("extract", "train") and lead.resume_from is None and lead.num_samples == 6
    assert lead.identity.target_hash == lead.expected.target_hash == weights_hash
    assert lead.drafter.target_layer_ids == (1, 2) and lead.expected.layer_ids == (1, 2)
    records = read_chat_jsonl(lead.data.train_jsonl)
    assert lead.data.capture.records == 6 and lead.data.capture.content_sha256 == content_hash(sample_keys(records))
    assert RunPlan.from_json(lead.to_json(), "x") == lead
    for weights in target.glob("*.safetensors"):  # the other tasks never read the weights
        weights.rename(weights.with_suffix(".moved"))
    assert share_plan(cfg, ("extract", "train"), "auto", key="job-1", leader=False) == lead
    assert share_plan(cfg, ("extract", "train"), "auto", key="job-1") == lead  # no rank: the file is there
    with pytest.raises(PipelineError, match="job-2.json did not appear within 1s"):
        share_plan(cfg, ("extract",), "auto", key="job-2", leader=False, wait_s=1.0)
    plan_path(cfg.out, "job-3").parent.joinpath("job-3.json").write_text("{}")
    with pytest.raises(PipelineError, match="job-3.json: not a run plan"):
        share_plan(cfg, ("extract",), "auto", key="job-3")
