"""The evaluator: checkpoint-selection policy, replay tau of exports on a tiny Qwen3.5 target,
provenance refusal, restart, and the Ray actor following exports as they appear."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from data_pipeline.provenance import ProvenanceMismatch
from data_pipeline.records import Sample
from data_pipeline.shard_writer import ShardWriter
from dflash_dist.evaluator import (
    EvalRequest,
    EvalResult,
    Evaluator,
    list_exports,
    pending_steps,
    should_stop,
)
from dflash_dist.target.generation import stop_token_ids
from tests.helpers.authors_loop import authors_loop
from tests.helpers.config import config_from
from tests.helpers.eval_target import BUDGETS, DEMO, publish, word_tokenizer
from tests.helpers.fake_engine import PROMPTS, FakeEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- policy -------------------------------------------------------------------------------


def test_pending_steps_in_order_after_the_newest_done():
    assert pending_steps([30, 10, 20], set()) == [10, 20, 30]
    assert pending_steps([10, 20, 30], {10}) == [20, 30]
    assert pending_steps([10, 20, 30], {20}) == [30]  # 10 was skipped before: not revisited
    assert pending_steps([10, 20], {10, 20}) == []
    assert pending_steps([], {5}) == []


def test_pending_steps_thins_a_backlog_but_keeps_the_newest():
    steps = list(range(100, 1100, 100))  # 10 waiting
    assert pending_steps(steps, set(), max_backlog=4, stride=3) == [100, 400, 700, 1000]
    assert pending_steps(steps, set(), max_backlog=10, stride=3) == steps
    assert pending_steps(steps, set(), max_backlog=4, stride=1) == steps
    for n in range(1, 30):
        for done in (set(), {0}, {n // 2}):
            todo = pending_steps(list(range(n + 1)), done, max_backlog=3, stride=4)
            assert todo[-1] == n and todo == sorted(todo) and len(todo) <= max(3, n // 4 + 1)
    with pytest.raises(ValueError, match="stride"):
        pending_steps(steps, set(), stride=0)


def test_should_stop():
    assert not should_stop(False, None, {10})
    assert should_stop(True, None, set())  # finished without an export: nothing to wait for
    assert not should_stop(True, 20, {10})
    assert should_stop(True, 20, {10, 20})
    assert should_stop(True, 20, {30})


def test_records_round_trip():
    r = EvalResult(step=7, tau_chain=2.5, tau_ddtree={8: 3.25, 4: 3.0}, accept_hist=(1, 2, 0),
                   slot_acceptance=(0.5, 0.0), prompts=2, rounds=3, kernel_path="torch", seconds=0.5)
    d = json.loads(json.dumps(r.to_json()))
    assert EvalResult.from_json(d) == r and list(d["tau_ddtree"]) == ["4", "8"]
    looped = replace(r, loop_free={"definition": "d", "prompts": 1, "loops": 1, "tau_chain": 2.0,
                                   "tau_ddtree": {4: 2.5, 8: 2.75}})
    assert EvalResult.from_json(json.loads(json.dumps(looped.to_json()))) == looped
    assert "(loop-free prompts: chain 2.00)" in looped.table_row() and "loop-free" not in r.table_row()
    with pytest.raises(ValueError, match="version"):
        EvalResult.from_json({**d, "version": 99}, "x.json")
    with pytest.raises(ValueError, match="x.json"):
        EvalResult.from_json({k: v for k, v in d.items() if k != "rounds"}, "x.json")
    q = EvalRequest(step=3, export_dir="/o/export/step_3")
    assert EvalRequest.from_json(q.to_json()) == q and q.path == Path("/o/export/step_3")


def test_loop_free_tau_leaves_out_the_prompts_whose_continuation_loops():
    """measure.loop_free: the same rounds aggregated over the prompts whose reference continuation
    does not end in a loop (target/continuations.ends_in_loop): a loop is trivial to draft."""
    from dflash_dist.evaluator.measure import HeldOut, Measured, loop_free
    from dflash_dist.model.replay import aggregate_rounds

    loop = [5, 6, 7] * 15  # 45 tokens going round a 3-token segment
    prose = list(range(10, 60))  # 50 distinct tokens
    refs = [HeldOut(prompt_len=2, end=2 + len(c), sequence=tuple([1, 2] + c), features=torch.zeros(2 + len(c), 4))
            for c in (prose, loop, prose[:20], loop[:9])]  # the last one is too short to count as a loop
    chains = [[3, 2, 1], [8, 8, 8, 8], [2, 2], [1, 1, 1]]
    trees = {4: [[3, 3], [5, 5, 5], [2, 3], [1, 2]]}
    m = Measured(aggregate_rounds(8, chains, trees), chains, trees)
    got = loop_free(m, refs, (4,))
    want = aggregate_rounds(8, [chains[0], chains[2], chains[3]], {4: [trees[4][0], trees[4][2], trees[4][3]]})
    assert got["prompts"] == 3 and got["loops"] == 1
    assert got["tau_chain"] == want.tau_chain < m.result.tau_chain and got["tau_ddtree"] == {4: want.tau_ddtree(4)}


def test_loop_free_tau_of_prompts_that_all_loop_is_none_with_its_count_never_nan():
    """Every reference continuation loops: no loop-free prompt, so no loop-free tau. The record says
    so (prompts 0, taus None); the table, the log text, the result JSON and TensorBoard's scalars carry
    "n/a (0 loop-free prompts)", null or nothing, never NaN. A result written before (NaN) reads the same."""
    from dflash_dist.evaluator.measure import HeldOut, Measured, loop_free
    from dflash_dist.evaluator.policy import loop_free_text
    from dflash_dist.evaluator.tb_log import scalars_of
    from dflash_dist.model.replay import aggregate_rounds

    loop = [5, 6, 7] * 15
    refs = [HeldOut(prompt_len=2, end=2 + len(loop), sequence=tuple([1, 2] + loop), features=torch.zeros(47, 4))] * 2
    chains, trees = [[8, 8], [8, 7]], {4: [[5, 5], [5, 4]]}
    got = loop_free(Measured(aggregate_rounds(8, chains, trees), chains, trees), refs, (4,))
    assert got["prompts"] == 0 and got["loops"] == 2
    assert got["tau_chain"] is None and got["tau_ddtree"] == {4: None}
    assert loop_free_text(got) == "n/a (0 loop-free prompts)"

    r = EvalResult(step=7, tau_chain=7.75, tau_ddtree={4: 4.75}, accept_hist=(0,) * 7 + (3,),
                   slot_acceptance=(1.0,) * 7, prompts=2, rounds=4, kernel_path="torch", seconds=0.5, loop_free=got)
    text = json.dumps(r.to_json(), allow_nan=False)  # raises on a NaN anywhere in the record
    assert json.loads(text)["loop_free"]["tau_chain"] is None
    assert EvalResult.from_json(json.loads(text)) == r
    row = r.table_row()
    assert "(loop-free prompts: chain n/a (0 loop-free prompts))" in row and "nan" not in row.lower()
    scalars = scalars_of(r)
    assert not any("loop_free" in tag for tag in scalars) and all(v == v for v in scalars.values())
    # eval/step_N.json written before this change held NaN for these taus
    old = {**r.to_json(), "loop_free": {**got, "tau_chain": float("nan"), "tau_ddtree": {"4": float("nan")}}}
    assert EvalResult.from_json(json.loads(json.dumps(old))) == r


def test_list_exports_sees_only_complete_step_directories(tmp_path):
    for name, files in [("step_10", 2), ("step_20", 1), (".tmp-step_30-ab", 2), ("step_x", 2), ("step_40", 0)]:
        (tmp_path / name).mkdir()
        for f in ("config.json", "model.safetensors")[:files]:
            (tmp_path / name / f).write_text("{}")
    (tmp_path / "step_50").write_text("a file")
    assert list_exports(tmp_path) == {10: tmp_path / "step_10"}
    assert list_exports(tmp_path / "missing") == {}


def test_stop_token_ids_are_the_turn_end_and_the_eos():
    words = [f"t{i}" for i in range(8)]
    assert stop_token_ids(word_tokenizer(words + ["<|endoftext|>", "<|im_end|>"], eos_token="<|endoftext|>")) == (8, 9)
    assert stop_token_ids(word_tokenizer(words + ["<|endoftext|>", "<|im_end|>"])) == (9,)
    assert stop_token_ids(word_tokenizer(words + ["<|endoftext|>"], eos_token="<|endoftext|>")) == (8,)
    assert stop_token_ids(word_tokenizer(words)) == ()


@pytest.fixture(scope="module")
def tiny(tiny_eval):
    """This module's name for the evaluator's tiny setting (tests/conftest.py `tiny_eval`): a tiny
    target with a tokenizer, two exports of its drafter, the eval config."""
    return tiny_eval


def read_scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_evaluator_scores_exports_and_a_restart_continues(tiny, tmp_path):
    out = tmp_path / "run"
    (out / "export").mkdir(parents=True)
    publish(tiny, out, "random", 10)
    (out / "export" / ".tmp-step_15-y").mkdir()  # an export being written: ignored
    ev = Evaluator(tiny["cfg"], out, tiny["target_dir"], tiny["prompts"], expected=None)
    assert ev.provenance.kernel_path == "torch" and ev.stop_ids == (252, 254)  # <|endoftext|>, <|im_end|>
    first = ev.run_until(lambda: (True, 10), poll_s=0.05)
    ev.close()
    assert [r.step for r in first] == [10]
    assert EvalResult.from_json(json.loads((out / "eval" / "step_10.json").read_text())) == first[0]

    # restart: a fresh evaluator recovers step 10 from eval/step_10.json and does only step 20
    publish(tiny, out, "trained", 20)
    ev2 = Evaluator(tiny["cfg"], out, tiny["target_dir"], tiny["prompts"], expected=ev.provenance)
    measured = json.loads((out / "export" / "step_10" / "dflash_export.json").read_text())["checksums"]["files"]
    assert ev2.done == {10} and ev2.state_dict() == {"version": 2, "evaluated": [10], "exports": {"10": measured}}
    second = ev2.run_until(lambda: (True, 20), poll_s=0.05)
    ev2.close()
    assert [r.step for r in second] == [20]
    rand, trained = first[0], second[0]
    assert trained.tau_chain > rand.tau_chain + 0.5, (rand, trained)
    for r in (rand, trained):
        assert r.prompts == 3 and r.kernel_path == "torch" and sum(r.accept_hist) == r.rounds
        assert sorted(r.tau_ddtree) == BUDGETS and len(r.slot_acceptance) == DEMO.block_size - 1
        assert 1.0 <= r.tau_chain <= DEMO.block_size
        assert all(1.0 <= r.tau_ddtree[b] <= b + 1 for b in BUDGETS)  # a tree of b nodes + the bonus
        lf = r.loop_free
        assert lf["prompts"] + lf["loops"] == r.prompts and sorted(lf["tau_ddtree"]) == BUDGETS

    tb = read_scalars(out / "tb" / "eval")
    if trained.loop_free["prompts"]:
        assert tb["eval/tau_chain_loop_free"][20] == pytest.approx(trained.loop_free["tau_chain"])
    assert tb["eval/tau_chain"] == pytest.approx({10: rand.tau_chain, 20: trained.tau_chain})
    for b in BUDGETS:
        assert tb[f"eval/tau_ddtree_{b}"] == pytest.approx({10: rand.tau_ddtree[b], 20: trained.tau_ddtree[b]})
    assert tb["eval/slot_acceptance_1"] == pytest.approx({10: rand.slot_acceptance[0], 20: trained.slot_acceptance[0]})
    assert not any(p.name.startswith(".tmp-") for p in (out / "eval").iterdir())

    # saved progress also counts when the files are gone (another out dir, say)
    ev2.load_state_dict({"version": 1, "evaluated": [30]})
    assert ev2.next_request() is None and ev2.done == {10, 20, 30}


def test_a_damaged_export_is_named_not_measured(tiny, tmp_path):
    """An export's bytes changed since the trainer wrote it (same size: the safetensors file still
    loads) used to be measured and logged as that checkpoint's tau; the evaluator now verifies the
    checksums the export records and stops naming the file, and an export of the run without that
    record is refused as not written whole by the trainer."""
    from data_pipeline.checksums import ChecksumMismatch

    out = tmp_path / "run"
    (out / "export").mkdir(parents=True)
    publish(tiny, out, "trained", 10)
    weights = out / "export" / "step_10" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    ev = Evaluator(tiny["cfg"], out, tiny["target_dir"], tiny["prompts"], expected=None)
    with pytest.raises(ChecksumMismatch, match=r"step_10: model.safetensors differ\(s\) from the xxh3_128"):
        ev.run_until(lambda: (True, 10), poll_s=0.05)
    from dflash_dist.model.export import EXPORT_RECORD

    (out / "export" / "step_10" / EXPORT_RECORD).unlink()
    with pytest.raises(ValueError, match=f"step_10/{EXPORT_RECORD}: missing"):
        ev.run_until(lambda: (True, 10), poll_s=0.05)
    ev.close()
    assert not (out / "eval" / "step_10.json").exists()


def _write_shard(shard_dir: Path, prov) -> str:
    t = 5
    sample = Sample(key="s0", input_ids=torch.arange(t, dtype=torch.int32), loss_mask=torch.ones(t, dtype=torch.uint8),
                    features=torch.zeros(t, prov.feature_width), target_argmax=torch.zeros(t, dtype=torch.int32))
    with ShardWriter(shard_dir, prov) as w:
        w.write(sample)
    return w.records[0].name


def test_evaluator_refuses_features_of_another_origin(tiny, tmp_path):
    out = tmp_path / "run"
    ev = Evaluator(tiny["cfg"], out, tiny["target_dir"], tiny["prompts"], expected=None)
    prov = ev.provenance
    _write_shard(tmp_path / "good", prov)
    assert ev.check_shards(tmp_path / "good") == 1
    for field, value in [("kernel_path", "fla"), ("target_hash", "0" * 64)]:
        bad_dir = tmp_path / f"bad_{field}"
        name = _write_shard(bad_dir, replace(prov, **{field: value}))
        with pytest.raises(ProvenanceMismatch) as err:
            ev.check_shards(bad_dir)
        assert err.value.fields == (field,) and str(bad_dir / name) in str(err.value)

    # the loop checks the shards before it scores anything
    (out / "export").mkdir(parents=True)
    publish(tiny, out, "random", 5)
    ev.shard_dir = tmp_path / "bad_kernel_path"
    with pytest.raises(ProvenanceMismatch, match="kernel_path"):
        ev.run_until(lambda: (True, 5), poll_s=0.05)
    assert not (out / "eval").exists()

    with pytest.raises(ProvenanceMismatch, match="kernel_path") as err:
        Evaluator(tiny["cfg"], out, tiny["target_dir"], tiny["prompts"], expected=replace(prov, kernel_path="fla"))
    assert err.value.fields == ("kernel_path",)


def test_the_evaluator_refuses_fused_capture_kernels_where_capture_would(tiny, tmp_path):
    """capture.kernels applies to the evaluator's target as to capture's (non-negotiable 4): on this
    CPU target, whose Gated DeltaNet runs the torch reference, fused kernels are refused with the
    fix named, as CaptureJob refuses them (before, the evaluator started on "torch")."""
    cfg = tiny["cfg"].model_copy(deep=True)
    cfg.capture.kernels = "fused"
    refused = r"capture.kernels=fused needs fla's kernels on CUDA; this target runs 'torch'"
    with pytest.raises(ValueError, match=refused):
        Evaluator(cfg, tmp_path / "run", tiny["target_dir"], tiny["prompts"], expected=None)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["fused", "fused2"])
def test_cuda_evaluator_measures_on_the_fused_capture_kernels(tiny, tmp_path, monkeypatch, kernels):
    """capture.kernels fused / fused2 on the GPU: the evaluator's target runs the same kernels as
    capture's (load_target + apply_capture_kernels, what CaptureJob.load does), so it accepts the
    provenance the run plan expects of the shards ("fla_fused" / "fla_fused2"); its held-out
    features are bitwise those of that capture path on the same sequence; live decoding runs on the
    fused model (through the cache: fused2's rewritten forwards fall back to transformers' there, its
    norms and conv stay fused) and its tau is that of replay over live's own sequences within 10%
    (bf16 cached and full forwards round apart, so a round may flip; a broken cache path would not
    come near); a live worker accepts the path."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from data_pipeline.provenance import CAPTURE_KERNEL_PATHS
    from dflash_dist.capture.fused_target import apply_capture_kernels
    from dflash_dist.evaluator.measure import _WORKER, live_worker_init
    from dflash_dist.model.capture import capture_features, check_kernel_path
    from dflash_dist.target.loading import expected_provenance, load_target, target_identity

    # fuse_target swaps the module's conv for fla's: put the routed one back after the test
    monkeypatch.setattr(modeling_qwen3_5, "causal_conv1d_fn", modeling_qwen3_5.causal_conv1d_fn)
    tree = tiny["cfg"].to_dict()
    tree["target"].update(device="cuda", dtype="bfloat16")
    tree["capture"]["kernels"] = kernels
    tree["eval"]["mode"] = "live"
    cfg = config_from(tree)
    target_dir = tiny["target_dir"]
    out = tmp_path / "run"
    (out / "export").mkdir(parents=True)
    publish(tiny, out, "trained", 5)
    model, tokenizer = load_target(cfg, target_dir)
    expected = expected_provenance(cfg, target_dir, target_identity(cfg, target_dir), tokenizer)
    assert expected.kernel_path == CAPTURE_KERNEL_PATHS[kernels]
    ev = Evaluator(cfg, out, target_dir, tiny["prompts"], expected=expected)  # refused before: it ran "fla"
    assert ev.provenance.kernel_path == CAPTURE_KERNEL_PATHS[kernels]
    ref = ev.references()[0]
    assert apply_capture_kernels(kernels, model, check_kernel_path(model, False)) == CAPTURE_KERNEL_PATHS[kernels]
    ids = torch.tensor([list(ref.sequence[: ref.end])], device="cuda")
    cap = capture_features(model, ids, ev.identity.layer_ids, with_argmax=False)
    assert torch.equal(cap.features[0], ref.features)
    (result,) = ev.run_until(lambda: (True, 5), poll_s=0.05)
    ev.close()
    assert result.kernel_path == CAPTURE_KERNEL_PATHS[kernels] and result.tau_chain >= 1.0
    live = result.live
    print(f"{kernels}: replay tau {result.tau_chain:.3f}, live {live['tau_chain']:.3f}, "
          f"replay over live's own {live['replay_own']['tau_chain']:.3f}")
    assert live["tau_chain"] == pytest.approx(live["replay_own"]["tau_chain"], rel=0.1)
    live_worker_init(cfg.to_dict(), str(out / "export" / "step_5"), CAPTURE_KERNEL_PATHS[kernels], 1, ev.weights)
    assert _WORKER["error"] is None and "model" in _WORKER
    _WORKER.clear()


def test_an_fp8_run_is_evaluated_on_the_targets_own_features(tiny, tmp_path):
    """capture.feature_dtype=fp8: the evaluator accepts the run's fp8 shards (their provenance
    names the encoding its config expects) and measures tau on the features its own target
    computes, never on shards: the same tau as the bf16 run's evaluator, bit for bit."""
    from data_pipeline.feature_codec import FP8

    fp8_cfg = tiny["cfg"].model_copy(deep=True)
    fp8_cfg.capture.feature_dtype = "fp8"
    taus = {}
    for name, cfg in (("bf16", tiny["cfg"]), ("fp8", fp8_cfg)):
        out = tmp_path / name
        ev = Evaluator(cfg, out, tiny["target_dir"], tiny["prompts"], expected=None)
        assert ev.provenance.feature_encoding == (FP8 if name == "fp8" else "raw")
        _write_shard(tmp_path / f"shards_{name}", ev.provenance)
        assert ev.check_shards(tmp_path / f"shards_{name}") == 1
        (out / "export").mkdir(parents=True)
        publish(tiny, out, "trained", 5)
        ev.shard_dir = tmp_path / f"shards_{name}"
        taus[name] = [r.tau_chain for r in ev.run_until(lambda: (True, 5), poll_s=0.05)]
        ev.close()
    ev = Evaluator(fp8_cfg, tmp_path / "x", tiny["target_dir"], tiny["prompts"], expected=None)
    with pytest.raises(ProvenanceMismatch, match="feature_encoding"):  # bf16 shards under an fp8 config
        ev.check_shards(tmp_path / "shards_bf16")
    ev.close()
    assert taus["fp8"] == taus["bf16"] and len(taus["fp8"]) == 1


def test_evaluator_actor_follows_exports_as_they_appear(tiny, tmp_path):
    import ray
    from transformers import AutoTokenizer

    from dflash_dist.actors.evaluator_actor import EvaluatorActor, EvaluatorTask, evaluator_actor_options
    from dflash_dist.target.loading import expected_provenance, target_identity

    target_dir = tiny["target_dir"]
    out = tmp_path / "run"
    cfg = _cfg(tiny, poll_s=0.1)
    cfg.run.out_dir = str(out)
    # what the pipeline demands of shards, computed without loading the model
    expected = expected_provenance(cfg, target_dir, target_identity(cfg, target_dir),
                                   AutoTokenizer.from_pretrained(target_dir))
    prompts = tuple(tuple(p) for p in tiny["prompts"])
    (out / "export").mkdir(parents=True)
    assert not ray.is_initialized()
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        task = EvaluatorTask(cfg.to_dict(), str(target_dir), prompts, expected=expected)
        actor = EvaluatorActor.options(**evaluator_actor_options(cfg)).remote(task)
        # an actor whose target refuses the expected provenance, started now (its process's start overlaps the
        # first actor's work): a refusal inside the actor reaches the caller of wait(), checked at the end
        tree = cfg.to_dict()
        tree["run"]["out_dir"] = str(tmp_path / "run2")
        refusing = EvaluatorActor.options(**evaluator_actor_options(cfg)).remote(
            EvaluatorTask(tree, str(target_dir), prompts, expected=replace(expected, target_hash="0" * 64)))
        refused = refusing.start.remote()
        ray.get(actor.start.remote())
        publish(tiny, out, "random", 10)
        deadline = time.time() + 90
        while 10 not in (status := ray.get(actor.status.remote()))["evaluated"]:
            assert status["alive"] and status["error"] is None and time.time() < deadline, status
            time.sleep(0.2)
        assert not status["trainer_finished"]
        publish(tiny, out, "trained", 20)
        ray.get(actor.trainer_finished.remote(20))
        results = ray.get(actor.wait.remote(timeout_s=90))
        assert all(type(r) is EvalResult for r in results) and [r.step for r in results] == [10, 20]
        assert results == [EvalResult.from_json(json.loads((out / "eval" / f"step_{s}.json").read_text()))
                           for s in (10, 20)]
        assert results[1].tau_chain > results[0].tau_chain + 0.5
        status = ray.get(actor.status.remote())
        assert not status["alive"] and status["evaluated"] == [10, 20] and status["last_step"] == 20
        assert sorted(p.name for p in (out / "eval").iterdir()) == ["rounds", "step_10.json", "step_20.json"]
        assert sorted(p.name for p in (out / "eval" / "rounds").iterdir()) == ["step_10.json", "step_20.json"]
        ray.kill(actor)

        # a refusal inside the actor reaches the caller of wait() with its type name and message
        ray.get(refused)
        with pytest.raises(Exception, match=r"(?s)ProvenanceMismatch.*target_hash: expected '0+', found"):
            ray.get(refusing.wait.remote(timeout_s=90))
    finally:
        ray.shutdown()


def test_run_until_does_not_wait_forever_for_a_missing_final_export(tiny, tmp_path):
    ev = Evaluator(tiny["cfg"], tmp_path / "run", tiny["target_dir"], tiny["prompts"], expected=None)
    assert ev.run_until(lambda: (True, None), poll_s=0.01) == []  # finished, nothing exported
    with pytest.raises(FileNotFoundError, match="step_5"):
        ev.run_until(lambda: (True, 5), poll_s=0.01, final_export_timeout_s=0.05)


def test_run_until_computes_the_references_while_waiting_for_the_first_export(tiny, tmp_path):
    """The greedy continuations and features of the held-out prompts do not depend on a checkpoint:
    made while the trainer has exported nothing yet, they are off the first evaluation's path."""
    ev = Evaluator(tiny["cfg"], tmp_path / "run", tiny["target_dir"], tiny["prompts"], expected=None)
    calls = iter([(False, None), (False, None), (True, None)])
    assert ev.run_until(lambda: next(calls), poll_s=0.01) == []
    assert ev._refs and all(ref.prompt in [list(p) for p in tiny["prompts"]] for ref in ev._refs)
    finished_at_once = Evaluator(tiny["cfg"], tmp_path / "run2", tiny["target_dir"], tiny["prompts"], expected=None)
    assert finished_at_once.run_until(lambda: (True, None), poll_s=0.01) == [] and finished_at_once._refs is None


# ---- modes: live, server, the count convention, a reference drafter, images, status --------------


# the live-mode tests whose proof is about bookkeeping or side-by-side workers, not tau's size: 12 new tokens a
# prompt instead of the setting's 24 (live decoding is most of their time)
SHORT = 12


def _cfg(tiny, **eval_fields):
    tree = tiny["cfg"].to_dict()
    tree["eval"].update(eval_fields)
    return config_from(tree)


def read_images(tb_dir: Path) -> dict[str, dict[int, tuple[int, int]]]:
    """tag -> step -> (width, height) of the PNG TensorBoard holds."""
    import io

    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"images": 0})
    acc.Reload()
    return {tag: {e.step: Image.open(io.BytesIO(e.encoded_image_string)).size for e in acc.Images(tag)}
            for tag in acc.Tags()["images"]}


def test_live_mode_every_n_checkpoints_against_a_reference_drafter(tiny, tmp_path):
    out = tmp_path / "run"
    (out / "export").mkdir(parents=True)
    cfg = _cfg(tiny, mode="live", live_every=2, reference_drafter=str(tiny["root"] / "trained"))
    ev = Evaluator(cfg, out, tiny["target_dir"], tiny["prompts"], expected=None)
    for step, which in ((10, "random"), (20, "trained"), (30, "trained")):
        publish(tiny, out, which, step)
    results = {r.step: r for r in ev.run_until(lambda: (True, 30), poll_s=0.05)}
    ev.close()
    assert sorted(results) == [10, 20, 30]
    assert results[20].live is None  # live runs at the 1st and every 2nd evaluated checkpoint
    for step in (10, 30):
        r = results[step]
        live = r.live
        assert r.mode == "live" and r.count == "capped"
        assert live["tau_chain"] == pytest.approx(r.tau_chain, rel=0.02)
        for b in BUDGETS:
            assert live["tau_ddtree"][b] == pytest.approx(r.tau_ddtree[b], rel=0.02)
        assert live["rounds_equal"] >= 0.9 * live["rounds_compared"] and live["continuations_equal"] == 3
        # replay over live's own continuations: here they are the references', so its tau is replay's
        own = live["replay_own"]
        assert own["prompts"] == 3 and own["tau_chain"] == pytest.approx(r.tau_chain)
        assert own["tau_ddtree"] == pytest.approx(r.tau_ddtree)
        rounds = json.loads((out / "eval" / "rounds" / f"step_{step}.json").read_text())
        for replay_rounds, live_rounds in zip(rounds["replay"]["chain"], rounds["live"]["chain"]):
            assert len(replay_rounds) >= 1 and abs(len(replay_rounds) - len(live_rounds)) <= 1
    assert "live" not in json.loads((out / "eval" / "rounds" / "step_20.json").read_text())

    # the reference is the same drafter as step 20/30: ratio 1, measured once (eval/reference.json)
    ref = results[20].reference
    assert ref["tau_chain"] == pytest.approx(results[20].tau_chain)
    assert ref["live_tau_chain"] == pytest.approx(results[30].live["tau_chain"])
    assert results[20].tau_chain_vs_reference == pytest.approx(1.0)
    assert results[10].tau_chain_vs_reference < 0.9  # the random drafter, well below the reference
    assert EvalResult.from_json(json.loads((out / "eval" / "step_30.json").read_text())) == results[30]
    stamp = (out / "eval" / "reference.json").stat().st_mtime_ns
    ev2 = Evaluator(cfg, out, tiny["target_dir"], tiny["prompts"], expected=None)
    assert ev2.reference_tau() == ref and (out / "eval" / "reference.json").stat().st_mtime_ns == stamp

    tb = read_scalars(out / "tb" / "eval")
    assert sorted(tb["eval/tau_live_chain"]) == [10, 30]
    assert tb["eval/tau_chain_vs_reference"][20] == pytest.approx(1.0)
    assert set(tb["eval/reference_tau_ddtree_8"]) == {10, 20, 30}
    assert set(tb["eval/slot_acceptance_live_1"]) == {10, 30} and "eval/live_rounds_equal" in tb
    images = read_images(out / "tb" / "eval")
    assert set(images["eval/tau_vs_step"]) == {10, 20, 30} and set(images["eval/accept_hist"]) == {10, 20, 30}
    assert set(images["eval/accept_hist_live"]) == {10, 30}
    assert images["eval/tau_vs_step"][30] == (640, 400)

    # dflash-dist status shows the newest checkpoint's tau against the reference
    import yaml

    from launcher.status import collect, render

    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))  # what the pipeline saves
    s = collect(out)
    assert s["eval"]["tau_chain_vs_reference"] == pytest.approx(1.0)
    rows = dict(render(s)[0])
    assert rows["tau vs reference"].startswith("chain 1.00x")


def test_live_workers_decode_the_prompts_side_by_side_with_the_same_rounds(tiny, tmp_path):
    """eval.live_workers=2: the prompts are decoded live in two spawned processes, each with its own
    target and drafter; every prompt's rounds and tokens are the one-process run's. The references
    come from batched greedy generation: each is the prompt's one-at-a-time greedy continuation."""
    from dflash_dist.target.generation import greedy_continuation

    rounds = {}
    for workers in (1, 2):
        out = tmp_path / f"run{workers}"
        (out / "export").mkdir(parents=True)
        cfg = _cfg(tiny, mode="live", live_workers=workers, reference_batch=2, max_new_tokens=SHORT)
        ev = Evaluator(cfg, out, tiny["target_dir"], tiny["prompts"], expected=None)
        publish(tiny, out, "trained", 10)
        (result,) = ev.run_until(lambda: (True, 10), poll_s=0.05)
        assert result.live["continuations_equal"] == result.prompts == 3
        rounds[workers] = json.loads((out / "eval" / "rounds" / "step_10.json").read_text())["live"]
        if workers == 1:
            for prompt, ref in zip(tiny["prompts"], ev.references()):
                assert ref.continuation == greedy_continuation(ev.model, prompt, cfg.eval.max_new_tokens, ev.stop_ids)
        ev.close()
    assert rounds[2] == rounds[1] and len(rounds[1]["chain"]) == 3
    assert sorted(map(int, rounds[1]["ddtree"])) == sorted(BUDGETS)


def test_replay_over_lives_own_continuations_separates_the_loop_from_reference_drift(tiny, tmp_path):
    """When the references are not what live decoding produces (here: their continuations
    reversed, as bf16 near-ties or batched generation can make them differ), replay over the
    references no longer matches live, and replay over live's own continuations still does."""
    from dflash_dist.evaluator.measure import HeldOut
    from dflash_dist.model.capture import capture_features

    out = tmp_path / "run"
    (out / "export").mkdir(parents=True)
    ev = Evaluator(_cfg(tiny, mode="live"), out, tiny["target_dir"], tiny["prompts"], expected=None)
    drifted = []
    for ref in ev.references():
        seq = ref.prompt + ref.continuation[::-1]
        cap = capture_features(ev.model, torch.tensor([seq]), ev.identity.layer_ids, with_argmax=False)
        drifted.append(HeldOut(ref.prompt_len, len(seq), tuple(seq), cap.features[0]))
    ev._refs = drifted
    publish(tiny, out, "trained", 10)
    (r,) = ev.run_until(lambda: (True, 10), poll_s=0.05)
    ev.close()
    live, own = r.live, r.live["replay_own"]
    assert live["continuations_equal"] == 0 and r.tau_chain < live["tau_chain"] - 0.5  # replay sees the drift
    assert own["tau_chain"] == pytest.approx(live["tau_chain"], rel=0.02)
    assert read_scalars(out / "tb" / "eval")["eval/tau_replay_own_chain"][10] == pytest.approx(own["tau_chain"])


def test_uncapped_count_is_recorded_and_counts_at_least_as_much(tiny, tmp_path):
    capped, uncapped = [], []
    for count, into in (("capped", capped), ("uncapped", uncapped)):
        out = tmp_path / count
        (out / "export").mkdir(parents=True)
        publish(tiny, out, "trained", 5)
        ev = Evaluator(_cfg(tiny, count=count, max_new_tokens=10), out, tiny["target_dir"], tiny["prompts"], None)
        into += ev.run_until(lambda: (True, 5), poll_s=0.05)
        ev.close()
    c, u = capped[0], uncapped[0]
    assert c.count == "capped" and u.count == "uncapped"
    assert u.tau_chain > c.tau_chain  # 10 tokens end mid-block: the last round counts past the end
    assert all(u.tau_ddtree[b] >= c.tau_ddtree[b] for b in BUDGETS)


def test_uncapped_rounds_of_the_evaluator_equal_the_authors_loop(tiny, tmp_path):
    """The evaluator's uncapped rounds (replay, and live in live mode) are the authors' loop's
    (tests/helpers/authors_loop.py), the round at the last position included."""
    edge = 0
    for max_new in (5, 7):
        out = tmp_path / f"new{max_new}"
        (out / "export").mkdir(parents=True)
        publish(tiny, out, "trained", 5)
        cfg = _cfg(tiny, count="uncapped", mode="live", max_new_tokens=max_new)
        ev = Evaluator(cfg, out, tiny["target_dir"], tiny["prompts"], expected=None)
        ev.run_until(lambda: (True, 5), poll_s=0.05)
        rounds = json.loads((out / "eval" / "rounds" / "step_5.json").read_text())
        drafter = ev._load_drafter(out / "export" / "step_5")
        for i, prompt in enumerate(tiny["prompts"]):
            for budget, replayed, live in ((None, rounds["replay"]["chain"], rounds["live"]["chain"]),
                                           (4, rounds["replay"]["ddtree"]["4"], rounds["live"]["ddtree"]["4"])):
                want, _ = authors_loop(ev.model, drafter, prompt, max_new, ev.stop_ids, budget)
                assert replayed[i] == want and live[i] == want, (max_new, budget, i, replayed[i], live[i], want)
                edge += sum(want[:-1]) == max_new - 1
        ev.close()
    assert edge >= 1


def test_asking_for_another_mode_measures_it_for_every_evaluated_export(tiny, tmp_path):
    """`dflash-dist eval ... eval.mode=live` on a run evaluated by replay: each export gets its
    live tau, its replay tau and other modes are kept, each TensorBoard point is written once; a
    later replay-mode evaluation has nothing to do; a server measurement adds to live; a failed
    one is tried again; another eval.count is refused saying how to proceed."""
    import threading

    from dflash_dist.evaluator.policy import lacks_mode

    out = tmp_path / "run"
    (out / "export").mkdir(parents=True)
    for step, which in ((5, "random"), (10, "trained")):
        publish(tiny, out, which, step)

    def evaluate(cfg) -> tuple[Evaluator, list[EvalResult]]:
        ev = Evaluator(cfg, out, tiny["target_dir"], tiny["prompts"], expected=None)
        got = ev.run_until(lambda: (True, 10), poll_s=0.05)
        ev.close()
        return ev, got

    replay_cfg = _cfg(tiny, max_new_tokens=SHORT)
    _, replayed = evaluate(replay_cfg)
    assert [r.live for r in replayed] == [None, None]
    ev, lived = evaluate(_cfg(tiny, mode="live", max_new_tokens=SHORT))
    assert [r.step for r in lived] == [5, 10]
    for before, after in zip(replayed, lived):
        assert after.mode == "live" and after.live["tau_chain"] == pytest.approx(after.tau_chain, rel=0.05)
        assert (after.tau_chain, after.tau_ddtree, after.accept_hist) == (before.tau_chain, before.tau_ddtree,
                                                                         before.accept_hist)
        assert EvalResult.from_json(json.loads((out / "eval" / f"step_{after.step}.json").read_text())) == after
        rounds = json.loads((out / "eval" / "rounds" / f"step_{after.step}.json").read_text())
        assert set(rounds) >= {"replay", "live"}
    assert "live chain" in lived[1].table_row()
    tb_dir = out / "tb" / "eval"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/tau_chain")] == [5, 10]  # each point once
    assert [e.step for e in acc.Scalars("eval/tau_live_chain")] == [5, 10]
    assert [e.step for e in acc.Images("eval/accept_hist")] == [5, 10]

    # replay asked again: every result holds it, nothing is measured
    again, nothing = evaluate(replay_cfg)
    assert nothing == [] and again.done == {5, 10} and again.results == {r.step: r for r in lived}

    # server: added beside live; a failed measurement is tried again on the next call
    srv = FakeEngine("sglang")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        server_cfg = _cfg(tiny, mode="server", server_url=srv.url, server_max_retries=0, server_timeout_s=5,
                          max_new_tokens=SHORT)
        srv.raw = b'{"meta_info": {"spec_accept_length": -5}}'
        _, failed = evaluate(server_cfg)
        assert all(r.server_error and r.live for r in failed) and all(lacks_mode(r, "server") for r in failed)
        srv.raw = None
        _, served = evaluate(server_cfg)
    finally:
        srv.shutdown()
        srv.server_close()
    assert [r.step for r in served] == [5, 10]
    for lived_r, served_r in zip(lived, served):
        assert served_r.server_error is None and served_r.server["tau"] >= 1 and served_r.live == lived_r.live
        assert served_r.tau_chain == lived_r.tau_chain

    with pytest.raises(ValueError, match=r"step_5\.json \(and 1 more\) counts tau with eval\.count=capped, this run "
                                         r"asks eval\.count=uncapped: pass eval\.count=capped .* move .*eval and"):
        Evaluator(_cfg(tiny, count="uncapped", max_new_tokens=SHORT), out, tiny["target_dir"], tiny["prompts"],
                  expected=None)


def test_server_mode_logs_the_engines_tau(tiny, tmp_path):
    import threading

    srv = FakeEngine("sglang", fail_first=1)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        out = tmp_path / "run"
        (out / "export").mkdir(parents=True)
        publish(tiny, out, "trained", 5)
        cfg = _cfg(tiny, mode="server", server_url=srv.url, server_engine="sglang", server_concurrency=2)
        ev = Evaluator(cfg, out, tiny["target_dir"], tiny["prompts"], expected=None)
        (result,) = ev.run_until(lambda: (True, 5), poll_s=0.05)
        ev.close()
    finally:
        srv.shutdown()
        srv.server_close()
    assert PROMPTS  # the fake engine's accept length depends only on each prompt
    assert result.server["engine"] == "sglang" and result.server["requests"] == 3 and srv.requests == 4
    assert read_scalars(out / "tb" / "eval")["eval/tau_server"] == pytest.approx({5: result.server["tau"]})


@pytest.mark.parametrize("answer", ["down", "NaN"])
def test_a_failed_server_keeps_the_replay_tau_and_records_the_failure(tiny, tmp_path, answer):
    """The server down (nothing listens) or answering NaN: the checkpoint's replay tau is still
    written (eval/step_N.json, TensorBoard) and the server's failure is recorded beside it."""
    import socket
    import threading

    srv = None
    if answer == "down":
        with socket.socket() as s:  # a port nothing listens on once closed
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}"
    else:
        srv = FakeEngine("sglang", raw=b'{"meta_info": {"spec_accept_length": NaN}}')
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        url = srv.url
    try:
        out = tmp_path / "run"
        (out / "export").mkdir(parents=True)
        publish(tiny, out, "trained", 5)
        cfg = _cfg(tiny, mode="server", server_url=url, server_max_retries=0, server_timeout_s=5)
        ev = Evaluator(cfg, out, tiny["target_dir"], tiny["prompts"], expected=None)
        (result,) = ev.run_until(lambda: (True, 5), poll_s=0.05)
        ev.close()
    finally:
        if srv is not None:
            srv.shutdown()
            srv.server_close()
    assert 1.0 <= result.tau_chain <= DEMO.block_size
    assert result.server["url"] == url and url in result.server_error
    assert ("NaN" in result.server_error) if answer == "NaN" else ("attempts" in result.server_error)
    saved = json.loads((out / "eval" / "step_5.json").read_text())
    assert EvalResult.from_json(saved) == result and saved["tau_chain"] == result.tau_chain
    tb = read_scalars(out / "tb" / "eval")
    assert tb["eval/tau_chain"] == pytest.approx({5: result.tau_chain})
    assert tb["eval/server_failed"] == {5: 1.0} and "eval/tau_server" not in tb
    assert "server FAILED" in result.table_row() and f"tau chain {result.tau_chain:.2f}" in result.table_row()


def test_live_checkpoints_first_every_nth_and_the_last():
    """Which checkpoints are measured live (policy.live_checkpoint): the first (unless live_first is
    off), every live_every-th evaluated one after it, and the run's last export (train.max_steps)."""
    from dflash_dist.evaluator.policy import live_checkpoint

    exports = [300, 600, 900, 1200]

    def live(every, first, last, max_steps=1200):
        return [s for n, s in enumerate(exports) if live_checkpoint(n, s, every, first, last, max_steps)]

    assert live(1, True, False) == exports
    assert live(3, True, False) == [300, 1200]  # 1st and 4th by count
    assert live(2, True, False) == [300, 900]
    assert live(2, True, True) == [300, 900, 1200]  # ... and the last export
    assert live(4, False, True) == [1200]  # only the last (configs/mid_gpu.yaml)
    assert live(4, False, False) == []
    assert live(4, False, True, max_steps=None) == []  # a run without max_steps names no last export here
