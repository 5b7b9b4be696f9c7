"""Recipe quality on a finished product run: every recipe variant trained, with several seeds, on
the features the run's own capture path wrote (its shards: the target's real kernels), by the
trainer's own pieces, and measured by greedy-replay tau (chain and DDTree) against samples seen
and against GPU-seconds.

    python bench/bench_quality_run.py --run DIR                      # every variant, 3 seeds, ~8 min budget
    python bench/bench_quality_run.py --run DIR --variants default,drop_top --seeds 0,1 --samples 64
    python bench/bench_quality_run.py --report OUT/results.json      # table and figure again

DIR is the --out of `dflash-dist run CONFIG --out DIR` after it finished (config.yaml,
run_plan.json, shards/ with DONE, data/, export/, eval/, train_log.jsonl). The default variant is
the run's config exactly (drafter shape, lr, anchors, block, micro-batching/packing, epochs,
order): with seed = run.seed and the product's sample count, it is the product's own training
without DeepSpeed. Every variant (bench/quality_variants.py) is one change of that config; every
run sees the same samples in the same order and the same sample budget; the seed changes the
drafter's initialisation and the anchor draws.

Flow: the shards are decoded once into the compute device's memory (bench/quality_data.py); the
held-out references (the run's held-out prompts, the target's greedy continuations and their
features on the target's kernels) are computed once; `--workers` processes share both (CUDA IPC
or shared memory) and train the runs side by side on the one device (bench/quality_train.py).
`--samples auto` first times a few steps and one tau measurement on every worker at once and
sizes the per-run sample budget so that all runs fit `--time-budget-s`; when the budget runs out
anyway, running runs stop at a step boundary with a last measurement, queued ones are skipped,
and the results are written. The product run's own exports are measured the same way (its tau
per checkpoint against samples, for comparing the product to the bench at equal samples).

Writes OUT/results.json (every point of every run, the budget and how it was chosen, the data,
the machine), OUT/table.md (the markdown table), and the figure (--png; needs matplotlib, the
`bench` extra: without it, `--report` renders it later from results.json). results.json and
table.md are rewritten after every finished run (the table headed as partial until the end).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.multiprocessing as tmp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import quality_budget  # noqa: E402
from quality_data import held_out_references, load_run, load_train_set, product_checkpoints  # noqa: E402
from quality_report import plot, table, write_results  # noqa: E402
from quality_train import RunSpec, Shared, run_task, steps, steps_to, worker_main  # noqa: E402
from quality_variants import REGISTRY, Facts, available, default_names, resolve  # noqa: E402

from dflash_dist.config import load_config_dict  # noqa: E402

log = logging.getLogger("bench_quality_run")
RESULTS_VERSION = 1


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="a finished `dflash-dist run` output directory")
    ap.add_argument("--out", default=str(ROOT / "runs/bench_quality_run"))
    ap.add_argument("--png", default=None, help="the figure (default OUT/quality_run.png)")
    ap.add_argument("--variants", default=None, help="comma-separated (default: every registered one that runs here)")
    ap.add_argument("--seeds", default=None, help="comma-separated (default: run.seed, +1, +2)")
    ap.add_argument("--samples", default="auto", help="samples per run: a number, or auto (fit --time-budget-s)")
    ap.add_argument(
        "--max-samples",
        type=int,
        default=None,
        help="cap of --samples auto (default: what the product run trained, from its train_log.jsonl)",
    )
    ap.add_argument(
        "--schedule",
        choices=("run", "product"),
        default="run",
        help="LR schedule over the bench's own samples, or the product run's (cut where the bench stops)",
    )
    ap.add_argument("--checkpoints", type=int, default=4, help="tau measurements per run, evenly spaced in samples")
    ap.add_argument(
        "--time-budget-s", type=float, default=480.0, help="wall time for everything, data loading included"
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        help="training processes sharing the device (GPU 4, CPU 2); 0: every run in this process",
    )
    ap.add_argument(
        "--eval-prompts", type=int, default=None, help="held-out prompts (default: the run's eval.num_prompts)"
    )
    ap.add_argument(
        "--eval-tokens", type=int, default=None, help="greedy tokens per prompt (default eval.max_new_tokens)"
    )
    ap.add_argument("--budgets", default="8", help="DDTree node budgets, comma-separated (the first is tabled)")
    ap.add_argument("--window", type=int, default=128, help="sliding window of the `sliding` variant")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a run-config override for every variant, the default included (repeatable)",
    )
    ap.add_argument("--calibrate-steps", type=int, default=6)
    ap.add_argument("--max-walks", type=int, default=64, help="held-out prompts replayed in one batched forward")
    ap.add_argument("--gen-batch", type=int, default=64, help="held-out prompts per greedy-generation batch")
    ap.add_argument("--no-product", action="store_true", help="do not measure the run's own exports")
    ap.add_argument(
        "--no-align",
        action="store_true",
        help="tau only at --checkpoints evenly spaced marks, not also at the product run's checkpoints (their "
        "sample counts are marks too; with --samples auto the largest that fits the budget is the run's length)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="training precision; auto: the trainer's (bf16 with fp32 master weights on a GPU, fp32 on CPU)",
    )
    ap.add_argument("--report", default=None, help="only render the table and figure of a results.json")
    args = ap.parse_args(argv)
    if args.report is None and args.run is None:
        ap.error("--run DIR is required (or --report RESULTS.json)")
    if args.samples != "auto" and not (args.samples.isdigit() and int(args.samples) > 0):
        ap.error(f"--samples {args.samples!r}: a positive number of samples, or auto")
    if args.workers is not None and args.workers < 0:
        ap.error(f"--workers must be >= 0, got {args.workers}")
    for name in (
        "checkpoints",
        "eval_prompts",
        "eval_tokens",
        "max_samples",
        "calibrate_steps",
        "max_walks",
        "gen_batch",
        "window",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in (args.variants or "").split(","):
        if name and name not in REGISTRY:
            ap.error(f"--variants: unknown {name!r}; registered: {', '.join(REGISTRY)}")
        if name and not available(name):
            ap.error(
                f"--variants: {name!r} needs the feature codec {REGISTRY[name].codec!r}, not registered yet "
                "(FEATURE_CODECS in bench/quality_variants.py)"
            )
    if args.calibrate_steps < 2:
        ap.error("--calibrate-steps must be >= 2 (the first step compiles; the others are timed)")
    for flag, text in (("--seeds", args.seeds), ("--budgets", args.budgets)):
        if text is not None and not all(x.strip().isdigit() for x in text.split(",")):
            ap.error(f"{flag} {text!r}: comma-separated non-negative integers")
    return args


class InlinePool:
    """--workers 0: the tasks run one after another in this process (no worker processes, no
    CUDA IPC); the same interface as Pool."""

    def __init__(self, shared: Shared, threads: int) -> None:
        self.shared, self.procs, self.busy = shared, [None], {}
        torch.set_num_threads(threads)

    def give(self, w: int, task: tuple) -> None:
        self.busy[w] = task

    def take(self, timeout: float) -> dict | None:
        if not self.busy:
            return None
        w, task = next(iter(self.busy.items()))
        res = run_task(self.shared, task, w)
        del self.busy[w]
        return res

    def close(self, grace_s: float = 0.0) -> list[tuple]:
        return []


class Pool:
    """The worker processes, one task each at a time (main hands out the next when one returns)."""

    def __init__(self, shared: Shared, workers: int, threads: int, ctx) -> None:
        self.results = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(workers)]
        self.procs = [
            ctx.Process(
                target=worker_main,
                args=(w, shared, self.inboxes[w], self.results, threads),
                name=f"bench-worker-{w}",
                daemon=True,
            )
            for w in range(workers)
        ]
        for p in self.procs:
            p.start()
        self.busy: dict[int, tuple] = {}

    def give(self, w: int, task: tuple) -> None:
        self.busy[w] = task
        self.inboxes[w].put(task)

    def take(self, timeout: float) -> dict | None:
        try:
            res = self.results.get(timeout=timeout)
        except queue.Empty:
            dead = [w for w, p in enumerate(self.procs) if w in self.busy and not p.is_alive()]
            if dead:
                w = dead[0]
                kind, payload = self.busy.pop(w)
                return {
                    "kind": kind,
                    "worker": w,
                    "status": "failed",
                    "error": f"worker {w} died (exit code {self.procs[w].exitcode})",
                    **_names(kind, payload),
                }
            return None
        self.busy.pop(res["worker"], None)
        return res

    def close(self, grace_s: float = 15.0) -> list[tuple]:
        """Ask every worker to end; terminate those still busy after `grace_s` (their tasks are returned)."""
        for q in self.inboxes:
            q.put(None)
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        killed = []
        for w, p in enumerate(self.procs):
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
                if w in self.busy:
                    killed.append(self.busy.pop(w))
        return killed


def memory_share(device: torch.device, workers: int) -> tuple[int, float | None]:
    """quality_budget.fit_workers on this GPU's memory left after the shared data; (workers, None)
    off CUDA or with no worker processes."""
    if device.type != "cuda" or workers < 1:
        return workers, None
    torch.cuda.empty_cache()  # this process's cached blocks are free for the workers
    free, total = torch.cuda.mem_get_info(device)
    fit, share = quality_budget.fit_workers(free, total, workers)
    if fit < workers:
        log.warning("%d workers do not fit the %.1f GiB left on %s after the shared data: %d run, %.1f GiB each",
                    workers, free / 2**30, device, fit, share * total / 2**30)  # fmt: skip
    return fit, share


def _names(kind: str, payload) -> dict:
    if kind in ("train", "calibrate"):
        return {"variant": payload.variant.name, "seed": payload.seed}
    return {"step": payload["step"]}


def _run_until(pool, tasks: list[tuple], soft: float, hard: float, stop, on_result) -> list[tuple]:
    """Hand out `tasks` as workers free up; at `soft` (a timer, so it also reaches a run in this
    process) the runs are told to stop (running ones end with a last measurement, the rest are not
    started); past `hard` busy workers are given up on. Returns the tasks never finished."""
    todo = list(tasks)

    def budget_spent() -> None:
        if not stop.is_set():
            log.warning("time budget: stopping the runs in progress, %d queued ones are not run", len(todo))
            stop.set()

    timer = threading.Timer(max(0.0, soft - time.monotonic()), budget_spent)
    timer.daemon = True
    timer.start()
    try:
        for w in range(len(pool.procs)):
            if todo:
                pool.give(w, todo.pop(0))
        while pool.busy and time.monotonic() < hard:
            res = pool.take(timeout=1.0)
            if res is None:
                continue
            on_result(res)
            if todo and not stop.is_set():
                pool.give(res["worker"], todo.pop(0))
    finally:
        timer.cancel()
    return todo + list(pool.busy.values())


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    if args.report:
        results = json.loads(Path(args.report).read_text())
        md = table(results)
        png = Path(args.png or Path(args.report).with_name("quality_run.png"))
        print(md)
        print(f"figure: {png}" if plot(results, png) else "matplotlib is not installed: no figure")
        return 0
    t0 = time.monotonic()
    soft = t0 + args.time_budget_s
    out = Path(args.out)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # the workers' memory share names its device by index
        device = torch.device("cuda", torch.cuda.current_device())
    workers = (4 if device.type == "cuda" else 2) if args.workers is None else args.workers
    precision = args.precision if args.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    slots = max(1, workers)  # runs at a time (--workers 0: one, in this process)
    threads = max(1, (os.cpu_count() or 2) // slots)
    inputs = load_run(args.run)
    cfg, plan = inputs.cfg, inputs.plan
    data, data_report = load_train_set(inputs, device, threads=min(8, os.cpu_count() or 2))
    window_cut = float(
        sum(
            int(data.loss_mask[int(data.offsets[i]) + args.window : int(data.offsets[i + 1])].sum())
            for i in range(len(data))
        )
        / max(1, int(data.loss_mask.sum()))
    )
    data_report["window"] = {"window": args.window, "supervised_beyond_window": round(window_cut, 3)}
    facts = Facts(
        cfg,
        tuple(data.layer_ids),
        data_report["median_supervised"],
        args.window,
        anchor_rules_agree=data_report["samples_with_inner_turn_ends"] == 0,
    )
    names = args.variants.split(",") if args.variants else default_names()
    variants = resolve(
        names, inputs.config_path, Path(plan.target_dir), plan.drafter.mask_token_id, facts, tuple(args.set)
    )
    default = next((v for v in variants if v.name == "default"), None)
    if default is not None and not args.set and default.drafter != plan.drafter:
        raise ValueError(
            f"{inputs.config_path} gives the drafter {default.drafter}, {args.run}/run_plan.json "
            f"{plan.drafter}: the run directory is inconsistent"
        )
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [cfg.run.seed + i for i in range(3)]
    budgets = tuple(int(b) for b in args.budgets.split(","))
    extra = max(v.drafter.block_size for v in variants) - 1 if cfg.eval.count == "uncapped" else 0
    refs, ref_info = held_out_references(
        inputs,
        args.eval_prompts or cfg.eval.num_prompts,
        args.eval_tokens or cfg.eval.max_new_tokens,
        cfg.eval.count,
        extra,
        args.gen_batch,
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()
    product = [] if args.no_product else product_checkpoints(inputs.run_dir)
    trained = max((p["samples"] or 0 for p in product), default=0) or (cfg.train.epochs * len(data))
    max_samples = args.max_samples or trained
    probe = Shared(data, [], inputs.records, cfg.run.seed, plan.target_dir, "cpu", budgets, cfg.eval.count, "", 1,
                   None, None)  # fmt: skip
    first_steps = [mb for _, chunk in itertools.islice(steps(probe, load_config_dict(variants[0].cfg), seeds[0],
                                                            torch.float32), 4) for mb, _ in chunk]  # fmt: skip
    estimate = quality_budget.estimate(variants[0].drafter, first_steps)
    log.info(
        "cost model: %.3f TFLOP per training sample; at %.0f%% of %.0f TFLOP/s: %.0f samples/s on the device",
        estimate["tflop_per_sample"],
        quality_budget.ASSUMED_MFU * 100,
        quality_budget.H200_BF16_TFLOPS,
        estimate["samples_per_s"],
    )
    results = {
        "bench": "quality_run",
        "version": RESULTS_VERSION,
        "run_dir": str(inputs.run_dir),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "args": vars(args),
        "machine": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "workers": workers,
            "threads_per_worker": threads,
            "precision": precision,
            "cpus": os.cpu_count(),
        },
        "target": {
            "target_id": plan.identity.target_id,
            "target_hash": plan.identity.target_hash,
            "layer_ids": list(plan.identity.layer_ids),
            "hidden_size": plan.identity.hidden_size,
            "kernel_path": plan.expected.kernel_path,
        },
        "data": data_report,
        "held_out": ref_info,
        "budgets": list(budgets),
        "seeds": seeds,
        "variants": [
            {
                "name": v.name,
                "doc": v.doc,
                "overrides": list(v.overrides),
                "aliases": list(v.aliases),
                "drafter": asdict(v.drafter),
                "feature_layers": list(v.feature_layers),
                "codec": v.codec,
            }
            for v in variants
        ],
        "estimate": estimate,
        "budget": {},
        "runs": [],
        "product": product,
        "seconds": None,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_results(out, results)

    ctx = tmp.get_context("spawn")
    stop = ctx.Event()
    asked = workers
    workers, fraction = memory_share(device, workers)
    if workers != asked:  # fewer processes, each with more threads
        slots, threads = workers, max(1, (os.cpu_count() or 2) // workers)
        results["machine"].update(workers=workers, threads_per_worker=threads, workers_asked=asked)
        write_results(out, results)
    if fraction is not None:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the workers' (spawned)
        results["memory_fraction_per_worker"] = round(fraction, 4)
    shared = Shared(
        data.share(),
        refs,
        inputs.records,
        cfg.run.seed,
        plan.target_dir,
        str(device),
        budgets,
        cfg.eval.count,
        plan.expected.kernel_path,
        args.max_walks,
        stop,
        ctx.Array("i", slots),
        precision,
        tuple(ref_info["stop_ids"]),
        fraction,
    )
    pool = Pool(shared, workers, threads, ctx) if workers else InlinePool(shared, threads)

    def on_signal(signum, _frame) -> None:  # Ctrl-C, or a scheduler's SIGTERM: stop as at the time budget
        if not stop.is_set():
            log.warning(
                "%s: stopping the runs in progress (a last measurement each); queued runs are not run",
                signal.Signals(signum).name,
            )
            stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    failed = False
    try:
        budget = {
            "time_budget_s": args.time_budget_s,
            "setup_s": round(time.monotonic() - t0, 1),
            "max_samples": max_samples,
            "checkpoints": args.checkpoints,
            "schedule": args.schedule,
        }
        runs = len(variants) * len(seeds)
        if args.samples == "auto":
            first = variants[0]
            vcfg = load_config_dict(first.cfg)
            cal = RunSpec(
                first,
                seeds[0],
                10**12,
                quality_budget.schedule(vcfg, max_samples, max_samples, "run", len(data)),  # only its LR matters
                (),
                calibrate_steps=args.calibrate_steps,
            )
            cals: list[dict] = []
            _run_until(
                pool,
                [("calibrate", cal)] * slots,
                soft,
                soft + 60,
                stop,
                lambda r: cals.append(r) if r.get("status") != "failed" else None,
            )
            if not cals:
                raise RuntimeError("calibration failed on every worker: see the log")
            samples, fit = quality_budget.fit_samples(
                cals,
                soft - time.monotonic(),
                runs,
                slots,
                args.checkpoints,
                len(product),
                max_samples,
                cfg.pack_tokens() is None and cfg.train.micro_batch_tokens is None,  # count-based steps
            )
            budget.update(how="auto", calibration=cals, **fit)
        else:
            samples = int(args.samples)
            budget["how"] = "fixed"
        aligned = None if args.no_align else quality_budget.product_marks(samples, [p["samples"] for p in product])
        samples, marks, budget["marks_from"] = quality_budget.run_marks(
            samples, args.checkpoints, aligned, args.samples == "auto"
        )

        def _schedule(v, n: int) -> tuple[int, str]:
            vcfg = load_config_dict(v.cfg)
            n_steps = steps_to(data, inputs.records, cfg.run.seed, vcfg, n)
            return quality_budget.schedule(vcfg, n, n_steps, args.schedule, len(data))

        budget.update(samples_per_run=samples, marks=list(marks), runs=runs)
        log.info(
            "budget: %d samples per run, tau at %s, %d runs on %d workers (%s)",
            samples,
            list(marks),
            runs,
            workers,
            budget["how"],
        )
        results["budget"] = budget
        specs = [
            RunSpec(
                v,
                s,
                samples,
                _schedule(v, samples),
                marks,
            )
            for s in seeds
            for v in variants
        ]  # seed-major: a budget cut still leaves every comparison
        tasks = [("product", p) for p in product] + [("train", s) for s in specs]

        def on_result(res: dict) -> None:
            nonlocal failed
            failed |= res.get("status") == "failed"
            if res["kind"] == "product":
                for p in results["product"]:
                    if p["step"] == res.get("step"):
                        p["bench_eval"] = (
                            {k: res[k] for k in ("tau_chain", "tau_ddtree", "eval_s")}
                            if ("tau_chain" in res)
                            else {"error": res.get("error")}
                        )
            else:
                results["runs"].append(res)
            results["seconds"] = round(time.monotonic() - t0, 1)
            write_results(out, results, "partial")

        left_over = _run_until(
            pool,
            tasks,
            soft - quality_budget.reserve_s(results["budget"].get("eval_s_estimate", 5.0)),
            soft + 45,
            stop,
            on_result,
        )
        running = list(pool.busy.values())  # past the hard limit: close() ends them and records them killed
        for kind, payload in left_over:
            if kind == "train" and (kind, payload) not in running:
                results["runs"].append({"kind": kind, "status": "not_run", **_names(kind, payload)})
    finally:
        for kind, payload in pool.close():
            failed = True
            results["runs"].append({"kind": kind, "status": "killed", **_names(kind, payload)})
    results["seconds"] = round(time.monotonic() - t0, 1)
    md = write_results(out, results, "final")
    png = Path(args.png or out / "quality_run.png")
    drawn = plot(results, png)
    print(md)
    print(
        f"results: {out / 'results.json'}; figure: {png if drawn else 'none (matplotlib is not installed: '}"
        f"{'' if drawn else 'run --report ' + str(out / 'results.json') + ' where it is)'}"
    )
    log.info("total %.0f s", results["seconds"])
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, RuntimeError, FileNotFoundError) as e:  # bad input: the message names what to fix
        print(f"bench_quality_run: {e}", file=sys.stderr)
        sys.exit(2)
