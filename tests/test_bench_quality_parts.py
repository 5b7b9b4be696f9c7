"""The quality bench on a run directory trains "the same way" as the product: the same samples in
the same order and micro-batches (anchors included) as the trainer's shard stream makes them,
features laid out as make_micro_batch lays them out (restricted to a variant's layers, through
its codec), and variants that are one config change each (bench/quality_*.py)."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from data_pipeline.records import Sample
from data_pipeline.shard_reader import ShardStream, iter_shard_samples, read_manifest
from data_pipeline.shard_writer import ShardWriter, mark_done
from dflash_dist.config import load_config
from dflash_dist.model.loss import sample_anchors
from dflash_dist.trainer.batching import BatchLimit, group_micro_batches, make_micro_batch, with_positions
from tests.helpers.shards import make_prov, make_sample

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import quality_train  # noqa: E402
import quality_variants  # noqa: E402
from quality_data import RunInputs, epoch_order, load_train_set  # noqa: E402

PROV = make_prov(layer_ids=(1, 2, 3), hidden_size=8, dtype="bfloat16")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A shard directory of 3 shards (7, 5, 6 samples of 6-24 tokens), one sample non-finite."""
    out = tmp_path_factory.mktemp("qrun")
    shards = out / "shards"
    n = 0
    with ShardWriter(shards, PROV, prefix="a") as w:
        for count in (7, 5, 6):
            for _ in range(count):
                s = make_sample(f"s-{n}", PROV, T=6 + (5 * n) % 19, seed=n, finite=True)
                if n == 9:
                    s = Sample(s.key, s.input_ids, s.loss_mask, s.features.clone().fill_(float("nan")), s.target_argmax)
                w.write(s)
                n += 1
            w.flush()
    mark_done(shards)
    return out


def _inputs(run_dir: Path) -> RunInputs:
    return RunInputs(run_dir, run_dir / "config.yaml", None, None, tuple(read_manifest(run_dir / "shards")))


def _cfg(**train):
    return load_config(
        None,
        [
            "target.kind=tiny_stdlib",
            "data.max_length=32",
            *[f"train.{k}={'null' if v is None else v}" for k, v in train.items()],
        ],
        check_files=False,
    )


def test_the_anchor_rules_agree_where_no_response_ends_before_its_sample():
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])  # one response, to the sample's end
    a = sample_anchors(mask, 3, torch.Generator().manual_seed(1), "mask")
    b = sample_anchors(mask, 3, torch.Generator().manual_seed(1), "mask_next")
    assert torch.equal(a.positions, b.positions) and torch.equal(a.keep, b.keep)
    inner = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1]])  # a turn ends inside: the rules differ
    a = sample_anchors(inner, 8, torch.Generator().manual_seed(1), "mask")
    b = sample_anchors(inner, 8, torch.Generator().manual_seed(1), "mask_next")
    assert 2 in a.positions[a.keep].tolist() and 2 not in b.positions[b.keep].tolist()


def test_train_set_holds_every_usable_sample_and_reports_the_rest(run_dir):
    data, report = load_train_set(_inputs(run_dir), torch.device("cpu"), threads=2)
    assert len(data) == 17 and "s-9" not in data.keys and report["nonfinite_skipped"] == ["s-9"]
    turn_ends = sum(bool(((m[:-1] == 1) & (m[1:] == 0)).any()) for m in (data.loss_mask[a:b] for a, b in
                    zip(data.offsets[:-1].tolist(), data.offsets[1:].tolist())))  # fmt: skip
    assert report["samples_with_inner_turn_ends"] == turn_ends > 0  # random masks
    by_key = {
        s.key: s for rec in read_manifest(run_dir / "shards") for s in iter_shard_samples(run_dir / "shards" / rec.name)
    }
    for i, key in enumerate(data.keys):
        a, b = int(data.offsets[i]), int(data.offsets[i + 1])
        assert torch.equal(data.features[a:b], by_key[key].features)
        assert torch.equal(data.input_ids[a:b], by_key[key].input_ids)


@pytest.mark.parametrize("shuffle", [True, False])
def test_epoch_order_is_the_trainer_stream_order(run_dir, shuffle):
    data, _ = load_train_set(_inputs(run_dir), torch.device("cpu"))
    for epoch in range(3):
        stream = ShardStream(run_dir / "shards", PROV, 0, 1, epoch=epoch, seed=5, shuffle=shuffle)
        want = [s.key for s in stream]
        got = [data.keys[i] for i in epoch_order(_inputs(run_dir).records, data.keys, epoch, 5, shuffle)]
        assert got == want


@pytest.mark.parametrize("packing", [False, True])
def test_micro_batches_are_the_trainers(run_dir, packing):
    """Bench micro-batches (host parts from make_micro_batch over feature-less samples, features
    gathered from the shared tensor) equal the trainer's: ShardStream -> group_micro_batches ->
    make_micro_batch with real features, epoch after epoch."""
    cfg = _cfg(
        micro_batch_size=3, num_anchors=4, packing=packing, micro_batch_tokens=48 if packing else None, shuffle=True
    )
    data, _ = load_train_set(_inputs(run_dir), torch.device("cpu"))
    sh = quality_train.Shared(data, [], _inputs(run_dir).records, 3, "", "cpu", (8,), "capped", "torch", 4, None, None)
    bench = quality_train.micro_batches(sh, cfg, seed=11, dtype=torch.float32)
    pack = cfg.pack_tokens()
    limit = BatchLimit(3, pack, pack is not None)
    for epoch in range(2):
        stream = with_positions(ShardStream(run_dir / "shards", PROV, 0, 1, epoch=epoch, seed=3, shuffle=True))
        for samples, _, _ in group_micro_batches(stream, limit, keep_short=True):  # as step_source's feeder
            want = make_micro_batch(
                samples, {}, dtype=torch.float32, num_anchors=4, seed=11, epoch=epoch, pack_tokens=pack
            )
            got_epoch, got, idx = next(bench)
            assert got_epoch == epoch and got.keys == want.keys
            for name in ("input_ids", "loss_mask", "target_argmax"):
                assert torch.equal(getattr(got, name), getattr(want, name)), name
            for name in ("positions", "keep", "starts", "ends"):
                a, b = getattr(got.anchors, name), getattr(want.anchors, name)
                assert (a is None and b is None) or torch.equal(a, b), name
            feats = quality_train.batch_features(data, idx, got, pack is not None, (0, 1, 2), None, torch.float32)
            assert torch.equal(feats, want.features)
            top = quality_train.batch_features(data, idx, got, pack is not None, (0, 1), None, torch.float32)
            assert torch.equal(top, want.features[..., :16])  # drop_top: the first two layers' columns
            mid = quality_train.batch_features(data, idx, got, pack is not None, (1,), None, torch.float32)
            assert torch.equal(mid, want.features[..., 8:16])


def test_a_codec_changes_only_the_real_rows(run_dir, monkeypatch):
    monkeypatch.setitem(quality_variants.FEATURE_CODECS, "x2", lambda t, k: t * 2 + 1)
    data, _ = load_train_set(_inputs(run_dir), torch.device("cpu"))
    cfg = _cfg(micro_batch_size=3, num_anchors=4, packing=False)
    sh = quality_train.Shared(data, [], _inputs(run_dir).records, 0, "", "cpu", (8,), "capped", "torch", 4, None, None)
    _, mb, idx = next(quality_train.micro_batches(sh, cfg, seed=0, dtype=torch.float32))
    plain = quality_train.batch_features(data, idx, mb, False, (0, 1, 2), None, torch.float32)
    coded = quality_train.batch_features(data, idx, mb, False, (0, 1, 2), "x2", torch.float32)
    real = mb.loss_mask.new_zeros(mb.loss_mask.shape, dtype=torch.bool)
    for j, i in enumerate(idx):
        real[j, : data.length(i)] = True
    # the codec sees the stored (bf16) features, as the shard encoding would
    assert torch.equal(coded[real], (plain[real].to(torch.bfloat16) * 2 + 1).float()) and not coded[~real].any()


def test_variants_are_one_config_change_each(tmp_path, monkeypatch):
    """Each registered variant resolves to the run's config with its change only; duplicates fold
    into aliases; a codec not registered yet is refused by name."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(
        '{"hidden_size": 8, "num_hidden_layers": 8, "vocab_size": 64, "intermediate_size": 16}'
    )
    config = tmp_path / "config.yaml"
    config.write_text(
        "target: {kind: tiny_stdlib}\ncapture: {num_layers: 3}\n"
        "drafter: {num_layers: 3, num_heads: 2, num_kv_heads: 1, head_dim: 4, block_size: 16}\n"
        "train: {num_anchors: 64, grad_accum: 2}\n"
    )
    base = load_config(config, check_files=False)
    facts = quality_variants.Facts(base, (1, 3, 5), median_supervised=40, window=32)
    names = [n for n in quality_variants.default_names()]
    got = {r.name: r for r in quality_variants.resolve(names, config, target, 63, facts)}
    d = got["default"]
    assert d.drafter.target_layer_ids == (1, 3, 5) and d.feature_layers == (0, 1, 2)
    assert got["drop_top"].drafter.target_layer_ids == (1, 3) and got["drop_top"].feature_layers == (0, 1)
    assert "block16" not in got and "block16" in d.aliases  # the run's block is 16 already
    assert got["block8"].drafter.block_size == 8 and got["block8"].drafter.loss_decay_gamma == 4.0
    assert got["sliding"].drafter.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert got["sliding"].drafter.sliding_window == 32
    assert "full" not in got and "full" in d.aliases  # every layer full already
    # a sliding run (configs/mid_gpu.yaml since the seventh lease): sliding at its window is the
    # default's run, and full attention the alternative measured
    slid = quality_variants.resolve(["default", "sliding", "full"], config, target, 63, facts,
                                    ("drafter.layer_types=[sliding_attention, sliding_attention, full_attention]",
                                     "drafter.sliding_window=32"))  # fmt: skip
    assert [(r.name, r.aliases) for r in slid] == [("default", ("sliding",)), ("full", ())]
    assert slid[1].drafter.layer_types == ("full_attention",) * 3 and slid[1].drafter.sliding_window is None
    # a block-8 run (configs/mid_gpu.yaml since the ninth lease): block8 is the default's run, block 16
    # the alternative measured, and the peers' recipes (block 16 both) no longer fold into the default
    b8 = quality_variants.resolve(["default", "block8", "block16", "peer_modelopt"], config, target, 63, facts,
                                  ("drafter.block_size=8",))  # fmt: skip
    assert [(r.name, r.aliases) for r in b8] == [("default", ("block8",)), ("block16", ("peer_modelopt",))]
    assert b8[0].drafter.block_size == 8 and b8[1].drafter.block_size == 16 and b8[1].drafter.loss_decay_gamma == 7.0
    assert got["anchors_half"].cfg["train"]["num_anchors"] == 20  # half of the 40 the default draws
    # D-PACE is the default (since 2026-12-04), so dpace and Model-Optimizer's recipe (D-PACE at block 16)
    # are the default itself; decay is the alternative measured
    assert "dpace" not in got and {"dpace", "peer_modelopt"} <= set(d.aliases)
    assert got["decay"].cfg["train"]["position_weighting"] == "decay"
    spec = got["peer_specforge"].cfg["train"]
    assert (spec["anchor_rule"], spec["loss_norm"], spec["gamma"]) == ("mask_next", "step_slots", 7.0)
    for name, r in got.items():  # nothing else changed
        for section in ("train", "drafter"):
            changed = {k for k in r.cfg[section] if r.cfg[section][k] != d.cfg[section][k]}
            assert changed <= {o.split("=")[0].split(".")[1] for o in r.overrides if o.startswith(section)}, name
    assert "mask_next" in got and "mask_next" not in d.aliases
    assert "step_slots" in got and base.train.grad_accum * base.train.world_size > 1
    # with one micro-batch an optimizer step (grad_accum 1 at world size 1) the step's slots are the
    # micro-batch's: step_slots normalises as micro_batch does, so it is the default's run
    single = quality_variants.resolve(["default", "step_slots", "decay"], config, target, 63, facts,
                                      ("train.grad_accum=1", "train.world_size=1"))  # fmt: skip
    assert [(r.name, r.aliases) for r in single] == [("default", ("step_slots",)), ("decay", ())]
    # ...and with single-turn data too (the mid_gpu run), SpecForge's recipe is the decay run
    single = quality_variants.resolve(["default", "step_slots", "decay", "peer_specforge"], config, target, 63,
                                      replace(facts, anchor_rules_agree=True),
                                      ("train.grad_accum=1", "train.world_size=1"))  # fmt: skip
    assert [(r.name, r.aliases) for r in single] == [("default", ("step_slots",)), ("decay", ("peer_specforge",))]
    # on data whose responses end their samples the two anchor rules draw the same anchors: one run
    agree = quality_variants.resolve(["default", "mask_next"], config, target, 63,
                                     replace(facts, anchor_rules_agree=True))  # fmt: skip
    assert [r.name for r in agree] == ["default"] and agree[0].aliases == ("mask_next",)
    # ...and SpecForge's recipe (gamma 7 = block 16's default) is then decay with step_slots: with both
    # set for every variant, it is the default's run
    agree = quality_variants.resolve(["default", "step_slots", "peer_specforge"], config, target, 63,
                                     replace(facts, anchor_rules_agree=True),
                                     ("train.position_weighting=decay", "train.loss_norm=step_slots"))  # fmt: skip
    assert [(r.name, r.aliases) for r in agree] == [("default", ("step_slots", "peer_specforge"))]
    fp8 = got["fp8_features"]  # the same training but for the stored features' encoding
    assert fp8.codec == "fp8" and fp8.drafter == d.drafter and fp8.cfg["train"] == d.cfg["train"]
    odd = quality_variants.Variant("odd", "a codec nobody registered", lambda f: {}, codec="nope")
    monkeypatch.setitem(quality_variants.REGISTRY, "odd", odd)
    assert "odd" not in quality_variants.default_names()
    with pytest.raises(ValueError, match="nope"):
        quality_variants.resolve(["default", "odd"], config, target, 63, facts)


class _FakePool:
    """Workers whose tasks take `task[1]` seconds, end early once the stop event is set (as a
    training run does at its next step), or never end (`stuck`)."""

    def __init__(self, workers: int, stop, stuck: bool = False) -> None:
        self.procs = list(range(workers))
        self.busy: dict[int, tuple] = {}
        self.started: dict[int, float] = {}
        self.stop, self.stuck = stop, stuck
        self.given: list[tuple] = []

    def give(self, w: int, task: tuple) -> None:
        self.busy[w], self.started[w] = task, time.monotonic()
        self.given.append(task)

    def take(self, timeout: float):
        time.sleep(0.01)
        for w, task in list(self.busy.items()):
            done = time.monotonic() - self.started[w] >= task[1]
            if not self.stuck and (done or self.stop.is_set()):
                del self.busy[w]
                return {"worker": w, "task": task, "status": "done" if done else "stopped"}
        return None


def test_the_time_budget_stops_handing_out_runs_and_ends_the_running_ones():
    import threading

    import bench_quality_run

    stop, got = threading.Event(), []
    pool = _FakePool(2, stop)
    now = time.monotonic()
    tasks = [("train", 0.2, i) for i in range(5)]
    left = bench_quality_run._run_until(pool, tasks, now + 0.3, now + 5, stop, got.append)
    assert stop.is_set() and [r["status"] for r in got] == ["done", "done", "stopped", "stopped"]
    assert left == [tasks[4]] and len(pool.given) == 4  # the fifth was never started
    assert time.monotonic() - now < 1.0

    stop, got = threading.Event(), []
    pool = _FakePool(2, stop, stuck=True)  # runs that ignore the stop: the hard limit returns them
    now = time.monotonic()
    left = bench_quality_run._run_until(pool, tasks, now + 0.2, now + 0.5, stop, got.append)
    assert got == [] and left == [tasks[2], tasks[3], tasks[4], tasks[0], tasks[1]]
    assert 0.5 <= time.monotonic() - now < 1.5


def test_the_in_process_pool_runs_tasks_as_the_workers_do(tmp_path):
    """--workers 0: the same task records as a worker's (not_run after a stop, a failure's traceback)."""
    import threading
    from types import SimpleNamespace

    import bench_quality_run

    stop = threading.Event()
    sh = quality_train.Shared(None, [], (), 0, str(tmp_path), "cpu", (8,), "capped", "torch", 4, stop, [0])
    pool = bench_quality_run.InlinePool(sh, threads=1)
    spec = SimpleNamespace(variant=SimpleNamespace(name="v"), seed=3)
    got, later = [], time.monotonic() + 60
    bad = ("product", {"export": str(tmp_path / "nope"), "step": 5, "samples": 1})
    assert bench_quality_run._run_until(pool, [bad], later, later, stop, got.append) == []
    assert got[0]["kind"] == "product" and got[0]["status"] == "failed" and "safetensors" in got[0]["error"]
    stop.set()  # the budget is spent: a run handed out now is not run, the ones after it not handed out
    left = bench_quality_run._run_until(pool, [("train", spec), bad], later, later, stop, got.append)
    assert got[1] == {"kind": "train", "worker": 0, "variant": "v", "seed": 3, "status": "not_run"} and left == [bad]


def test_the_budget_fits_every_run_in_the_time_left():
    import quality_budget

    cals = [{"step_s": 0.5, "samples_per_step": 8.0, "warmup_s": 20.0, "eval_s": 10.0},
            {"step_s": 0.4, "samples_per_step": 8.0, "warmup_s": 5.0, "eval_s": 6.0}]  # fmt: skip
    n, info = quality_budget.fit_samples(cals, 1000.0, runs=9, slots=4, checkpoints=4, products=2, max_samples=10**6,
                                         whole_steps=True)  # fmt: skip
    # the slowest worker counts: eval 10 s (a trained drafter's measurement costs what calibration's
    # does), 15 s kept back, 2 product measurements on 4 slots, 3 rounds of runs per slot, 4
    # measurements and a compile each
    per_run = (1000 - 15 - 2 * 10 / 4) / 3 - 4 * 10 - 20
    assert info["per_run_s"] == pytest.approx(per_run) and info["step_s"] == 0.5
    assert n == int(0.9 * per_run / 0.5 * 8) // 8 * 8 and n % 8 == 0
    assert quality_budget.fit_samples(cals, 1000.0, 9, 4, 4, 2, 100, True)[0] == 96  # capped, whole steps
    assert quality_budget.fit_samples(cals, 10.0, 9, 4, 4, 2, 100, False)[0] == 16  # no time: two steps
    assert quality_budget.marks(100, 4) == (25, 50, 75, 100) and quality_budget.marks(3, 4) == (1, 2, 3)


def test_fewer_workers_run_where_seven_shares_would_be_too_small_to_train_in():
    """The H100 lease of 2026-12-05: 58.8 GiB free of 79.2 after the shared data gave each of 7
    workers 2.4 GiB and every calibration died of OOM; 4 workers fit, each with 8.7 GiB. The H200
    (119 GiB free of 139.8) keeps its 7. Nothing fits: the error says what to do."""
    import quality_budget

    gib = 2**30
    fit, share = quality_budget.fit_workers(int(58.8 * gib), int(79.18 * gib), 7)
    assert fit == 4 and share * 79.18 == pytest.approx((58.8 - 4 * 6) / 4)
    fit, share = quality_budget.fit_workers(int(119 * gib), int(139.8 * gib), 7)
    assert fit == 7 and share * 139.8 == pytest.approx((119 - 7 * 6) / 7)
    assert quality_budget.fit_workers(int(30 * gib), int(80 * gib), 1)[0] == 1
    with pytest.raises(RuntimeError, match=r"not one worker fits the 10.0 GiB .* run with --workers 0"):
        quality_budget.fit_workers(10 * gib, 80 * gib, 3)


def test_marks_at_the_product_checkpoints_compare_product_and_bench_at_equal_samples():
    import quality_budget
    import quality_report

    # the largest product checkpoint that fits the budget is the run's length, every one up to it a mark
    assert quality_budget.product_marks(9000, [4010, 8032, None, 12050]) == (8032, (4010, 8032))
    assert quality_budget.product_marks(4000, [4010, 8032]) is None  # none fits: evenly spaced marks instead
    assert quality_budget.product_marks(9000, []) is None
    # auto: the run ends at 8032, and its curve still has the evenly spaced points (the figure's); the
    # one at 4016 is the product's 4010 (not a second tau measurement 6 samples later)
    aligned = quality_budget.product_marks(9000, [4010, 8032, None, 12050])
    assert quality_budget.run_marks(9000, 4, aligned, auto=True) == (
        8032, (2008, 4010, 6024, 8032), "product checkpoints and evenly spaced")
    # a fixed length is kept, the product checkpoints within it added (4500 within a quarter of the
    # spacing of 4010: measured there), the run's end measured where it is
    assert quality_budget.run_marks(9000, 2, aligned, auto=False) == (
        9000, (4010, 8032, 9000), "evenly spaced and product checkpoints")
    assert quality_budget.run_marks(4000, 2, None, auto=True) == (4000, (2000, 4000), "evenly spaced")
    # the product's checkpoints of the seventh lease (steps 300/600/900/1200): 2 marks a run are 2 tau
    # measurements, as fit_samples counts them, where the fit reaches step 300 (the seventh lease's
    # figures on 4 workers) or step 600 (the same figures on 7)
    product = [5365, 10986, 16260, 21713]
    for fitting, want in ((6342, (2682, 5365)), (11622, (5365, 10986))):
        n, marks, _ = quality_budget.run_marks(fitting, 2, quality_budget.product_marks(fitting, product), auto=True)
        assert marks == want, (fitting, n, marks)
    assert quality_budget.run_marks(5365, 4, (5365, (5365,)), auto=True)[1] == (1341, 2682, 4024, 5365)

    def run(variant, seed, taus):
        pts = [{"samples": n, "tau_ddtree": {"8": t}} for n, t in zip((4010, 8032), taus)]
        return {"variant": variant, "seed": seed, "points": pts}

    results = {"budgets": [8], "seeds": [0, 1, 2],
               "runs": [run("default", 0, (2.0, 3.0)), run("default", 1, (9.0, 9.0)), run("dpace", 0, (2.1, 3.4)),
                        run("dpace", 1, (2.3, 3.2))],
               "product": [{"step": 200, "samples": 4010, "bench_eval": {"tau_ddtree": {"8": 1.9}}},
                           {"step": 400, "samples": 8032, "bench_eval": {"tau_ddtree": {"8": 2.97}}},
                           {"step": 600, "samples": 12050, "bench_eval": {"tau_ddtree": {"8": 4.0}}}]}  # fmt: skip
    got = quality_report.product_vs_bench(results)
    assert [c["samples"] for c in got] == [4010, 8032]  # 12050: no bench point at equal samples
    # against the default at the product's seed (0), not the mean over seeds; best = highest mean over seeds
    assert got[1]["default"] == 3.0 and got[1]["vs_default_pct"] == pytest.approx(-1.0)
    assert got[1]["best"] == "default" and got[1]["best_tau"] == 6.0  # (3.0 + 9.0) / 2
    assert got[0]["best"] == "default" and got[0]["vs_best_pct"] == pytest.approx(100 * (1.9 / 5.5 - 1))


def test_the_table_shows_where_block_8s_cap_would_bind_and_the_loop_free_tau():
    """Per variant, the share of chain rounds that took more than 8 tokens (mean over the finished
    seeds) and tau over the loop-free prompts with its gap to the default; '-' for results written
    before the bench recorded them."""
    import quality_report

    def run(variant, seed, chain, over=None):
        point = {"samples": 100, "tau_chain": chain, "tau_ddtree": {"8": chain + 0.3}, "loss": 1.0}
        if over is not None:
            point["rounds_over_8"] = over
            point["loop_free"] = {"tau_chain": chain - 0.5, "tau_ddtree": {"8": chain - 0.2}, "prompts": 50}
        return {"variant": variant, "seed": seed, "status": "done", "points": [point], "gpu_s": 1.0, "samples": 100}

    results = {"budgets": [8], "variants": [{"name": n, "doc": n} for n in ("default", "block8", "old")],
               "runs": [run("default", 0, 2.5, 0.010), run("default", 1, 2.6, 0.030), run("block8", 0, 2.7, 0.0),
                        run("block8", 1, 2.8, 0.0), run("old", 0, 2.0), run("old", 1, 2.1)]}  # fmt: skip
    rows = {line.split(" | ")[0].lstrip("| "): line for line in quality_report.table(results).splitlines()
            if line.startswith("| ") and not line.startswith("| variant")}
    assert "chain rounds over 8 tokens" in quality_report.table(results)
    assert " | 2.00% | 2.050 ± 0.071 | " in rows["default"] and " | - | - | " in rows["old"]
    # loop-free tau's gap and separation from the default, as for the other columns
    assert " | 0.00% | 2.250 ± 0.071 (+0.200, above) | " in rows["block8"]


def test_the_table_says_n_a_where_every_held_out_continuation_loops():
    """A run whose held-out continuations all loop has no loop-free tau (measure.loop_free: prompts 0,
    taus None; NaN in results.json files written before): the column says "n/a (0 loop-free prompts)",
    averages only the seeds that have one, and never shows NaN."""
    import quality_report

    def run(variant, seed, chain, free):
        lf = {"tau_chain": free, "tau_ddtree": {"8": free}, "prompts": 0 if free is None or free != free else 40,
              "loops": 10}  # fmt: skip
        point = {"samples": 100, "tau_chain": chain, "tau_ddtree": {"8": chain}, "loss": 1.0, "loop_free": lf}
        return {"variant": variant, "seed": seed, "status": "done", "points": [point], "gpu_s": 1.0, "samples": 100}

    nan = float("nan")
    results = {"budgets": [8], "variants": [{"name": n, "doc": n} for n in ("default", "mixed", "looping")],
               "runs": [run("default", 0, 2.5, 2.0), run("default", 1, 2.6, 2.2), run("mixed", 0, 2.7, 2.4),
                        run("mixed", 1, 2.8, None), run("looping", 0, 2.0, None), run("looping", 1, 2.1, nan)]}
    md = quality_report.table(results)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines()
            if line.startswith("| ") and not line.startswith("| variant")}  # fmt: skip
    assert "nan" not in md.lower()
    assert " | n/a (0 loop-free prompts) | " in rows["looping"]
    assert " | 2.400 (+0.300, n/a); 1 seed n/a (0 loop-free prompts) | " in rows["mixed"]
    assert " | 2.100 ± 0.141 | " in rows["default"]


@pytest.mark.parametrize("packing", [False, True])
def test_steps_to_counts_the_runs_own_steps(run_dir, packing):
    """The LR schedule of a run in steps needs its step count before it starts: steps_to counts
    `steps`' grouping (packed steps hold varying sample counts; an epoch's last step is short and
    never spans two epochs, as trainer/step_source.py hands it out)."""
    cfg = _cfg(micro_batch_size=3, num_anchors=4, packing=packing, micro_batch_tokens=48 if packing else None,
               grad_accum=2)  # fmt: skip
    data, _ = load_train_set(_inputs(run_dir), torch.device("cpu"))
    sh = quality_train.Shared(data, [], _inputs(run_dir).records, 3, "", "cpu", (8,), "capped", "torch", 4, None, None)
    stream = quality_train.steps(sh, cfg, seed=0, dtype=torch.float32)
    seen, n_steps, counts, epochs = 0, 0, {}, []
    while seen < 60:  # past three epochs of 17 samples
        epoch, chunk = next(stream)
        assert 1 <= len(chunk) <= 2
        epochs.append(epoch)
        seen += sum(len(mb.keys) for mb, _ in chunk)
        n_steps += 1
        counts[seen] = n_steps
        if epoch == 0:
            assert seen <= 17  # the first epoch's steps hold only its samples
    assert 17 in counts and 34 in counts  # every epoch ends with a step of its own (short if need be)
    assert epochs == sorted(epochs)
    for target in [1, *counts, seen - 1]:
        got = quality_train.steps_to(data, _inputs(run_dir).records, 3, cfg, target)
        assert got == min(n for s, n in counts.items() if s >= target)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fp8_round_trip_on_the_device_is_the_shard_encodings(dtype):
    """fp8_features trains on round_trip_fp8's features: bit for bit what a shard stored with
    capture.feature_dtype fp8 decodes to (encode_fp8 then decode_fp8), zero rows and the large
    values of a few tokens included."""
    from data_pipeline.feature_codec import decode_fp8, encode_fp8, round_trip_fp8

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3 * 16, generator=g) * torch.logspace(-3, 3, 40)[:, None]
    x[5] = 0.0
    x[7, :16] *= 1e4  # one layer of one token far larger than the rest
    x = x.to(dtype)
    want = decode_fp8(encode_fp8(x, 3), list(x.shape), dtype, 3)
    got = round_trip_fp8(x, 3)
    assert got.dtype == dtype and torch.equal(got, want) and not torch.equal(got, x)


def test_the_lease_commands_parse():
    """bench/LEASES.md's Lease A, as gpu_session.sh passes it: QBENCH_ARGS after --run/--out/--time-budget-s
    (and before the retry's --workers 0) parse as bench_quality_run's arguments, every variant registered
    and available; each TRAIN_STEP_SETTINGS word is bench_train_step's. A typo there costs the lease's bench
    (argparse exits at once, the retry too) or the trainer step (its settings are read after the engine)."""
    import re
    import shlex

    import bench_quality_run
    import quality_variants
    from train_step_settings import parse_setting

    text = (Path(__file__).resolve().parents[1] / "bench" / "LEASES.md").read_text()
    lease = text[text.index("## Lease A") : text.index("## Lease B")]
    qbench, settings = re.findall(r'QBENCH_ARGS="([^"]+)"', lease), re.findall(r'TRAIN_STEP_SETTINGS="([^"]+)"', text)
    assert qbench and settings, lease
    for line in qbench:
        head = ["--run", "/tmp/mid_gpu", "--out", "/tmp/gpu/quality", "--time-budget-s", "300"]
        args = bench_quality_run._args([*head, *shlex.split(line)])
        assert args.workers == 7 and args.schedule == "product" and args.variants.split(",")[0] == "default"
        assert all(quality_variants.available(n) for n in args.variants.split(",")), args.variants
        assert args.checkpoints == 2  # 4 marks a run cost the seventh lease the third seed of 3 variants
        assert bench_quality_run._args([*head, *shlex.split(line), "--workers", "0"]).workers == 0
    for line in settings:
        for setting in line.split(","):
            parse_setting(setting)


def test_runs_the_budget_stopped_still_give_3_seed_tables_at_the_marks_they_reached():
    """The H100 lease of 2026-12-05 (seventh): the time budget stopped the third seed of three
    variants, so the final table had 2 seeds for them; every seed had passed the marks at 4025
    samples (all but block8) and 2685 (all). The report adds those tables, without the point a
    stopped run measures where it stopped (between marks): neither the "mark": false point of new
    records, nor, in records from before that field, a stopped run's last point at a sample count
    no finished run has."""
    import quality_report

    def run(variant, seed, counts, status="done", legacy=False):
        pts = []
        for n in counts:
            chain = 1.0 + n / 1000 + (0.5 if variant == "wide" else 0.0) + seed / 100
            p = {"samples": n, "tau_chain": chain, "tau_ddtree": {"8": chain + 0.3}, "loss": 1.0, "gpu_s": n / 100}
            if not legacy:
                p["mark"] = n in (1000, 2000, 3000)
            pts.append(p)
        return {"variant": variant, "seed": seed, "status": status, "points": pts, "gpu_s": 1.0,
                "samples": counts[-1]}  # fmt: skip

    runs = [run("default", s, (1000, 2000, 3000)) for s in (0, 1, 2)]
    runs += [run("wide", 0, (1000, 2000, 3000)), run("wide", 1, (1000, 2000, 3000)),
             run("wide", 2, (1000, 2000, 2500), "stopped")]  # fmt: skip
    runs += [run("short", 0, (1000, 2000, 3000)), run("short", 1, (1000, 2000, 3000)),
             run("short", 2, (1000, 1500), "stopped", legacy=True)]  # fmt: skip
    results = {"budgets": [8], "variants": [{"name": n, "doc": n} for n in ("default", "wide", "short")],
               "runs": runs}  # fmt: skip
    marks = quality_report.common_marks(results)
    assert [(at, [r["variant"] for r in rows]) for at, rows in marks] == [
        (2000, ["default", "wide"]), (1000, ["default", "wide", "short"])]
    wide = marks[0][1][1]
    assert wide["seeds"] == [0, 1, 2] and wide["chain_vs_default"] == "above"
    assert wide["chain"] == pytest.approx([3.5, 3.51, 3.52]) and wide["gpu_s"] == [20.0, 20.0, 20.0]
    # the figure's curves too: point i of a run is its i-th mark, never where the budget stopped it
    # (wide's seed 2 at 2500 was averaged with the other seeds' 3000, short's seed 2 at 1500 with 2000)
    xs, ms, _ = quality_report._curves(results, "wide", "samples", "tau_chain", "8")
    assert xs == [1000, 2000, 3000] and ms[2] == pytest.approx(4.505)
    assert quality_report._curves(results, "short", "samples", "tau_chain", "8")[0] == [1000, 2000, 3000]
    md = quality_report.table(results)
    assert "At 2000 samples, a mark every seed of these variants reached" in md
    assert "| wide | 0,1,2 | 3.510 ± 0.010 |" in md and "| wide | 0,1 | 4.505 ± 0.007 |" in md
    # a calibration the bench's end killed (bench_quality_run: pool.close() records every busy task
    # among the runs) is no seed of the default: the same tables, no 'seeds without a final point'
    killed = {**results, "runs": [*runs, {"kind": "calibrate", "status": "killed", "variant": "default", "seed": 0}]}
    assert quality_report.table(killed) == md
    # every run finished: the final table alone
    done = {**results, "runs": [r for r in runs if r["status"] == "done"]}
    assert quality_report.common_marks(done) == [] and "a mark every seed" not in quality_report.table(done)
