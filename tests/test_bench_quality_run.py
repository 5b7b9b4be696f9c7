"""bench/bench_quality_run.py on the README's tiny run (the session's `readme_run`). One invocation end
to end (2 variants x 2 seeds in worker processes, the budget sized by calibration and capped at 16
samples a run: two steps of the run's 8 samples): its results, table and figure; the all-layers and
drop-top drafters differ in fc's input width; seeds differ; the run's own exports measure exactly as
the run's evaluator measured them. In this process, with the bench's own pieces: the same seed
reproduces the invocation's run point for point, and a stop (the time budget's, or a signal's) ends
a run at a step boundary with a last measurement. And on a one-rank product run (the mid config at
CPU size), the bench's default variant makes the product trainer's steps, loss and LR step for step."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import bench_quality_run  # noqa: E402
import quality_budget  # noqa: E402
import quality_data  # noqa: E402
import quality_report  # noqa: E402
import quality_train  # noqa: E402
import quality_variants  # noqa: E402

from dflash_dist.config import load_config_dict  # noqa: E402

ARGS = "--variants default,drop_top --seeds 0,1 --samples auto --max-samples 16 --checkpoints 2 --eval-prompts 4 "
ARGS += "--workers 2 --calibrate-steps 2 --device cpu"  # 2: the first step compiles, one is timed

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # as each of the bench's 2 workers on 2 cores


@contextlib.contextmanager
def _in_this_process():
    """bench_quality_run.main run here as its CLI runs it (`python bench/bench_quality_run.py ...`),
    without a second Python process importing torch and transformers again: its SIGINT/SIGTERM
    handlers and this process's torch threads are put back afterwards."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bench(readme_run, tmp_path_factory):
    """(run dir, OUT, results.json, what OUT held while the bench ran: (results, table.md) at each change,
    as a device call packing OUT mid-bench finds them, the inputs its main process built). The bench's
    main runs in this process (its main thread: it sets signal handlers), its 2 workers are its own
    spawned processes; a thread here watches OUT meanwhile. The train set and held-out references
    its main built are kept (the real functions' results, recorded on their way) for `here`."""
    root = tmp_path_factory.mktemp("qbench")
    out = root / "out"
    argv = ["--run", str(readme_run.out), "--out", str(out), *ARGS.split()]
    seen: list[tuple[dict, str]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if (out / "table.md").exists():
                md = (out / "table.md").read_text()
                res = json.loads((out / "results.json").read_text())
                same = f"{res['seconds']} s in, {len(res['runs'])} of " in md.split("\n")[0]  # not a write between
                if not done.is_set() and same and (not seen or (res, md) != seen[-1]):
                    seen.append((res, md))
            time.sleep(0.05)

    built: dict[str, tuple] = {}

    def recorded(name: str, fn):
        def call(*args, **kwargs):
            built[name] = (args, kwargs, fn(*args, **kwargs))
            return built[name][2]

        return call

    watcher = threading.Thread(target=watch, daemon=True)
    with pytest.MonkeyPatch.context() as mp, _in_this_process():
        for name in ("load_train_set", "held_out_references"):
            mp.setattr(bench_quality_run, name, recorded(name, getattr(bench_quality_run, name)))
        watcher.start()
        try:
            rc = bench_quality_run.main(argv)
        finally:
            done.set()
            watcher.join()
    assert rc == 0
    return readme_run.out, out, json.loads((out / "results.json").read_text()), seen, built


def _run(results: dict, variant: str, seed: int) -> dict:
    (run,) = [r for r in results["runs"] if r.get("variant") == variant and r.get("seed") == seed]
    return run


def test_variants_seeds_points_and_table(bench):
    run_dir, out, r, _, _ = bench
    assert r["version"] == 1 and r["run_dir"] == str(run_dir)
    manifest = [json.loads(x) for x in (run_dir / "shards" / "manifest.jsonl").read_text().splitlines()]
    assert r["data"]["samples"] == sum(m["n_samples"] for m in manifest) and r["data"]["kernel_path"] == "torch"
    assert r["held_out"]["prompts"] == 4 and r["budgets"] == [8]
    assert [v["name"] for v in r["variants"]] == ["default", "drop_top"]
    b = r["budget"]
    assert b["how"] == "auto" and len(b["calibration"]) == 2 and b["samples_fitting"] >= 16  # every worker timed
    assert b["samples_per_run"] == 16 and b["marks"] == [8, 16]  # capped by --max-samples: 2 steps of 8
    assert len(r["runs"]) == 4 and {x["status"] for x in r["runs"]} == {"done"}
    h, layers = r["target"]["hidden_size"], r["target"]["layer_ids"]
    for seed in (0, 1):
        full, top = _run(r, "default", seed), _run(r, "drop_top", seed)
        assert full["fc_in_features"] == len(layers) * h and full["target_layer_ids"] == layers
        assert top["fc_in_features"] == (len(layers) - 1) * h and top["target_layer_ids"] == layers[:-1]
        for run in (full, top):
            assert [p["samples"] for p in run["points"]] == [8, 16]
            for p in run["points"]:
                assert 1.0 <= p["tau_chain"] <= run["block_size"] and 1.0 <= p["tau_ddtree"]["8"] <= 9.0
                assert p["gpu_s"] > 0 and p["loss"] > 0 and p["mark"] is True
    a, b = _run(r, "default", 0)["points"], _run(r, "default", 1)["points"]
    assert [p["loss"] for p in a] != [p["loss"] for p in b]  # another seed: another drafter
    table = (out / "table.md").read_text()
    assert "| default | 0,1 |" in table and "| drop_top | 0,1 |" in table
    assert "- drop_top: chain " in table and "DDTree-8" in table
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the bench extra is not installed: the figure is rendered later with --report
        assert not (out / "quality_run.png").exists()
    else:
        assert (out / "quality_run.png").stat().st_size > 10_000


def test_results_and_table_are_on_disk_while_the_bench_runs(bench):
    """After every result, results.json and table.md hold what is finished so far (a device call that
    packs OUT mid-bench, or a bench killed at its limit, keeps them): before the last run ended the
    table already showed a finished run, headed as partial; the final table is not."""
    _, out, r, seen, _ = bench
    assert seen, "table.md was only written at the end"
    partial = [(res, md) for res, md in seen if 0 < len(res["runs"]) < len(r["runs"])]
    assert partial, [len(res["runs"]) for res, _ in seen]
    for res, md in partial:
        assert md.startswith(f"Partial: written while the bench ran, {res['seconds']} s in, {len(res['runs'])} of 4 ")
        for run in res["runs"]:
            assert run["status"] == "done" and run in r["runs"]  # as the final results record it
        for variant in {run["variant"] for run in res["runs"]}:
            seeds = ",".join(str(x["seed"]) for x in res["runs"] if x["variant"] == variant)
            assert f"| {variant} | {seeds} |" in md
    assert not (out / "table.md").read_text().startswith("Partial")


def test_the_runs_own_exports_measure_as_its_evaluator_measured_them(bench):
    """Same held-out prompts (the first 4 of the run's), same greedy continuations, same replay:
    the bench's tau of every export equals the run's evaluator's over those prompts."""
    run_dir, _, r, _, _ = bench
    assert r["product"] and all("tau_chain" in p.get("bench_eval", {}) for p in r["product"])
    for p in r["product"]:
        rounds = json.loads((run_dir / "eval" / "rounds" / f"step_{p['step']}.json").read_text())["replay"]
        want = statistics.mean(statistics.mean(x) for x in rounds["chain"][:4])
        assert p["bench_eval"]["tau_chain"] == pytest.approx(want, abs=1e-12)
        want8 = statistics.mean(statistics.mean(x) for x in rounds["ddtree"]["8"][:4])
        assert p["bench_eval"]["tau_ddtree"]["8"] == pytest.approx(want8, abs=1e-12)
    assert [p["samples"] for p in r["product"]] == sorted(p["samples"] for p in r["product"])


@pytest.fixture(scope="module")
def here(bench):
    """The bench's inputs as its main process built them: the train set and held-out references are
    the very ones it built (recorded by `bench`), the rest is made here the same way."""
    run_dir, _, r, _, built = bench
    inputs = quality_data.load_run(run_dir)
    args, _, (data, report) = built["load_train_set"]
    assert args[0].run_dir == inputs.run_dir and args[1] == torch.device("cpu")
    args, _, (refs, info) = built["held_out_references"]
    assert args[1:] == (4, inputs.cfg.eval.max_new_tokens, "capped", 0, 64)  # --eval-prompts 4, --gen-batch
    facts = quality_variants.Facts(inputs.cfg, data.layer_ids, report["median_supervised"], 128)
    (default,) = quality_variants.resolve(
        ["default"], inputs.config_path, Path(inputs.plan.target_dir), inputs.plan.drafter.mask_token_id, facts
    )
    sh = quality_train.Shared(data, refs, inputs.records, inputs.cfg.run.seed, inputs.plan.target_dir, "cpu", (8,),
                              "capped", inputs.plan.expected.kernel_path, 64, threading.Event(), [0], "fp32",
                              tuple(info["stop_ids"]))  # fmt: skip
    return sh, default, r


def _spec(sh, default, r: dict, seed: int) -> quality_train.RunSpec:
    n, cfg = r["budget"]["samples_per_run"], load_config_dict(default.cfg)
    steps = quality_train.steps_to(sh.data, sh.records, sh.order_seed, cfg, n)
    schedule = quality_budget.schedule(cfg, n, steps, "run", r["data"]["samples"])
    return quality_train.RunSpec(default, seed, n, schedule, tuple(r["budget"]["marks"]))


def test_a_seed_reproduces_the_invocations_run_point_for_point(here):
    sh, default, r = here
    spec = _spec(sh, default, r, 0)
    again = quality_train.train_run(sh, spec, worker=0)
    cfg = load_config_dict(default.cfg)
    assert again["steps"] == quality_train.steps_to(sh.data, sh.records, sh.order_seed, cfg, spec.samples)
    keys = ("samples", "step", "epoch", "loss", "lr", "tau_chain", "tau_ddtree", "rounds")
    assert [{k: p[k] for k in keys} for p in again["points"]] == [
        {k: p[k] for k in keys} for p in _run(r, "default", 0)["points"]
    ]


def test_a_stop_ends_the_run_at_a_step_boundary_with_a_last_measurement(here):
    """What the time budget (or SIGINT/SIGTERM) does to a running run: the step in progress
    finishes, tau is measured where it stopped, the run is marked stopped (the orchestration:
    tests/test_bench_quality_parts.py). Its only mark is the run's end: the first step's 8 samples
    are the invocation's first mark, and the stop must land between marks."""
    sh, default, r = here
    spec = _spec(sh, default, r, 0)
    spec = dataclasses.replace(spec, marks=spec.marks[-1:])
    sh.stop.set()
    try:
        res = quality_train.train_run(sh, spec, worker=0)
    finally:
        sh.stop.clear()
    assert res["status"] == "stopped" and res["steps"] == 1
    assert [p["samples"] for p in res["points"]] == [res["samples"]] and res["samples"] < 16
    assert res["points"][-1]["mark"] is False  # measured where it stopped, not at a mark: the report's tables skip it


def test_the_gpu_precision_trains_on_the_cpu_too(here):
    """The GPU ranks' precision (bf16 compute, fp32 master weights, gradients accumulated in fp32)
    run on the CPU: it trains, and close to the fp32 run."""
    sh, default, r = here
    sh.precision = "bf16"
    try:
        res = quality_train.train_run(sh, _spec(sh, default, r, 0), worker=0)
    finally:
        sh.precision = "fp32"
    assert res["status"] == "done" and res["dtype"] == "bfloat16"
    fp32 = _run(r, "default", 0)["points"]
    for p, q in zip(res["points"], fp32, strict=True):
        assert p["samples"] == q["samples"] and p["loss"] == pytest.approx(q["loss"], rel=0.05)
        assert p["lr"] == q["lr"]  # the schedule is the same


# ---- the bench's default trains as the product trains ----------------------------------------------

def test_the_default_variant_is_the_products_training(mid_cpu_run, tmp_path):
    """At the run's seed and sample count the bench's default variant (no DeepSpeed) makes the
    product trainer's steps: the same samples per step, LR and loss at every step (its
    train_log.jsonl), on a packed, max_steps-scheduled run of the code_lm target: the mid config at
    CPU size on one DeepSpeed rank (the bench emulates one rank exactly), the session's `mid_cpu_run`
    (tests/helpers/mid.py), whose product path test_mid_config checks."""
    solo_run, _ = mid_cpu_run
    steps = [json.loads(line) for line in (solo_run / "train_log.jsonl").read_text().splitlines()]
    n = steps[-1]["samples"]
    assert len(steps) == 6 and n > 6  # packed rows: more than one sample a step
    out = tmp_path / "bench"
    argv = ["--run", str(solo_run), "--out", str(out), "--device", "cpu", "--variants", "default", "--seeds", "0",
            "--samples", str(n), "--checkpoints", str(n), "--workers", "0"]  # fmt: skip
    with _in_this_process():  # --workers 0: the run in its main process, here
        assert bench_quality_run.main(argv) == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["status"] == "done" and run["steps"] == 6
    got = [(p["step"], p["samples"], p["lr"], p["loss"]) for p in run["points"]]  # a point after every step
    want = [(s["step"], s["samples"], s["lr"], s["loss"]) for s in steps]
    assert [g[:2] for g in got] == [w[:2] for w in want]
    for g, w in zip(got, want):
        assert g[2] == pytest.approx(w[2], rel=1e-9) and g[3] == pytest.approx(w[3], rel=1e-5), (g, w)
    # the product's exports (every 2 steps) are measured by the bench at equal samples: the default
    # at the run's seed is the product's training, so their tau agree (item 5's check, in the report)
    results = json.loads((out / "results.json").read_text())
    assert results["budget"]["marks_from"] == "evenly spaced and product checkpoints"
    compared = quality_report.product_vs_bench(results)
    assert [c["step"] for c in compared] == [2, 4, 6] and [c["samples"] for c in compared] == [
        s["samples"] for s in steps if s["step"] in (2, 4, 6)
    ]
    assert all(abs(c["vs_default_pct"]) < 0.5 for c in compared), compared
    assert "the product's DDTree-8 is" in (out / "table.md").read_text()
    assert all(0.0 <= p["rounds_over_8"] <= 1.0 for p in run["points"])  # block 8's cap, for the block8 decision
