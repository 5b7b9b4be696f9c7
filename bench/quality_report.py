"""The quality bench's report: per variant the final tau over seeds (mean ± std), whether it
separates from the default by more than the seed spread, the markdown table, and the tau vs
samples / vs GPU-seconds figure (matplotlib, the `bench` extra; without it, render the figure
later from results.json with `--report`)."""

from __future__ import annotations

import json
import logging
import os
import statistics
from pathlib import Path

from data_pipeline.durable_files import write_text_atomic

log = logging.getLogger("bench_quality_run")

FINAL = "done"  # runs that reached the full sample budget; "stopped" runs are curves only
_VERDICT = {
    "above": "separates from the default (above it on every seed)",
    "below": "separates from the default (below it on every seed)",
    "within spread": "does not separate from the default (the seed ranges overlap)",
    "n/a": "not comparable (fewer than 2 finished seeds on a side)",
}


def _mean_sd(xs: list[float]) -> tuple[float, float | None]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def _fmt(xs: list[float]) -> str:
    if not xs:
        return "-"
    m, sd = _mean_sd(xs)
    return f"{m:.3f}" if sd is None else f"{m:.3f} ± {sd:.3f}"


def _measured(lf: dict) -> bool:
    """A loop-free record with a tau: some prompt's continuation does not loop (a record of 0 prompts
    holds None; results.json files from before held NaN)."""
    tau = lf.get("tau_chain")
    return bool(lf.get("prompts", 1)) and tau is not None and tau == tau


def _pct(xs: list[float]) -> str:
    return f"{100 * statistics.mean(xs):.2f}%" if xs else "-"


def separation(variant: list[float], default: list[float]) -> str:
    """'above' / 'below' when every seed of the variant is above (below) every seed of the
    default, 'within spread' when the seed ranges overlap; 'n/a' with fewer than 2 seeds a side."""
    if len(variant) < 2 or len(default) < 2:
        return "n/a"
    if min(variant) > max(default):
        return "above"
    if max(variant) < min(default):
        return "below"
    return "within spread"


def _mark_points(run: dict, done_samples: set[int]) -> list[dict]:
    """The run's points taken at a mark (or its end), without the point a run stopped by the budget
    measures where it stopped: points say so ("mark"); in records from before that field, a stopped
    run's last point is a mark only if finished runs have a point at the same sample count."""
    pts = run.get("points") or []
    if pts and "mark" in pts[-1]:
        return [p for p in pts if p["mark"]]
    if run.get("status") == FINAL or not pts or pts[-1]["samples"] in done_samples:
        return pts
    return pts[:-1]


def _train_runs(results: dict, variant: str | None = None) -> list[dict]:
    """results.json's training runs (of `variant`): a calibration the bench's end killed is recorded
    among the runs too (kind "calibrate", the first variant and seed), and is no seed of a variant."""
    return [r for r in results["runs"] if r.get("kind", "train") == "train" and "variant" in r
            and (variant is None or r["variant"] == variant)]  # fmt: skip


def mark_points(results: dict) -> dict[int, list[tuple[dict, dict]]]:
    """{id(run): [(run, point), ...]} of every training run's mark points (see _mark_points)."""
    runs = _train_runs(results)
    done = {p["samples"] for r in runs if r.get("status") == FINAL for p in r.get("points") or []}
    return {id(r): [(r, p) for p in _mark_points(r, done)] for r in runs}


def summarize(results: dict, at: int | None = None) -> list[dict]:
    """One row per variant (in the order the variants were given), from results.json's runs: the
    final point of each run that reached its full budget, or with `at` the mark point at that sample
    count of each run that reached it (a run the budget stopped later counts too)."""
    budget = str(results["budgets"][0])
    rows = []
    finals: dict[str, dict[str, list[float]]] = {}
    marked = mark_points(results) if at is not None else {}
    for v in results["variants"]:
        runs = _train_runs(results, v["name"])
        if at is None:
            done = [r for r in runs if r.get("status") == FINAL and r.get("points")]
            final = {id(r): r["points"][-1] for r in done}
        else:
            final = {id(r): p for r in runs for _, p in marked.get(id(r), []) if p["samples"] == at}
            done = [r for r in runs if id(r) in final]
        f = {
            "chain": [final[id(r)]["tau_chain"] for r in done],
            "tree": [final[id(r)]["tau_ddtree"][budget] for r in done],
            "loss": [final[id(r)]["loss"] for r in done],
            "gpu_s": [final[id(r)]["gpu_s"] if at is not None else r["gpu_s"] for r in done],
            "over_8": [final[id(r)]["rounds_over_8"] for r in done if "rounds_over_8" in final[id(r)]],
            "loop_free": [final[id(r)]["loop_free"]["tau_chain"] for r in done
                          if final[id(r)].get("loop_free") and _measured(final[id(r)]["loop_free"])],  # fmt: skip
        }
        finals[v["name"]] = f
        rows.append(
            {
                "variant": v["name"],
                "aliases": v.get("aliases", []),
                "doc": v["doc"],
                "seeds": [r["seed"] for r in done],
                "not_final": {r["seed"]: r.get("status") for r in runs if r not in done},
                "runs": len(runs),
                "samples": final[id(done[0])]["samples"] if done else None,
                # seeds whose held-out continuations all loop: no loop-free tau to average (never NaN)
                "loop_free_none": sum(not _measured(final[id(r)]["loop_free"]) for r in done
                                      if final[id(r)].get("loop_free")),  # fmt: skip
                **{k: vals for k, vals in f.items()},
            }
        )
    base = finals.get("default")
    for row in rows:
        for key in ("chain", "tree", "loop_free"):  # loop_free: where the features, not the loops, carry tau
            if base is None or row["variant"] == "default" or not row[key] or not base[key]:
                row[f"{key}_gap"], row[f"{key}_vs_default"] = None, "n/a"
                continue
            row[f"{key}_gap"] = statistics.mean(row[key]) - statistics.mean(base[key])
            row[f"{key}_vs_default"] = separation(row[key], base[key])
    return rows


def _rows_md(rows: list[dict], budget) -> list[str]:
    """The markdown table of summarize's rows."""
    lines = [
        f"| variant | seeds | tau chain | tau DDTree-{budget} | chain vs default | DDTree-{budget} vs default | "
        "train loss | chain rounds over 8 tokens | tau chain, loop-free prompts | GPU-s / run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r["variant"] + (f" (= {', '.join(r['aliases'])})" if r["aliases"] else "")
        gaps = []
        for key in ("chain", "tree"):
            gap = r[f"{key}_gap"]
            gaps.append("-" if gap is None else f"{gap:+.3f} ({r[f'{key}_vs_default']})")
        gpu = f"{statistics.mean(r['gpu_s']):.1f}" if r["gpu_s"] else "-"
        free = _fmt(r["loop_free"]) + ("" if r["loop_free_gap"] is None else
                                       f" ({r['loop_free_gap']:+.3f}, {r['loop_free_vs_default']})")
        if r["loop_free_none"]:  # seeds with 0 loop-free prompts: said, not averaged in
            none = f"{r['loop_free_none']} seed{'s' if r['loop_free_none'] > 1 else ''}"
            free = "n/a (0 loop-free prompts)" if not r["loop_free"] else f"{free}; {none} n/a (0 loop-free prompts)"
        lines.append(
            f"| {name} | {','.join(map(str, r['seeds'])) or '-'} | {_fmt(r['chain'])} | {_fmt(r['tree'])} | "
            f"{gaps[0]} | {gaps[1]} | {_fmt(r['loss'])} | {_pct(r['over_8'])} | {free} | {gpu} |"
        )
    return lines


def _verdicts(rows: list[dict], budget) -> list[str]:
    return [f"- {r['variant']}: chain {_VERDICT[r['chain_vs_default']]}; DDTree-{budget} "
            f"{_VERDICT[r['tree_vs_default']]}." for r in rows if r["variant"] != "default"]  # fmt: skip


def common_marks(results: dict) -> list[tuple[int, list[dict]]]:
    """Where some runs did not reach their final point (the time budget stopped them): the tables at
    earlier marks that every run of more variants reached, largest first: [(samples, rows)], each
    row a variant all of whose runs have a point at that mark. Empty when every run finished."""
    final = summarize(results)
    if not any(r["not_final"] for r in final):
        return []
    complete = {r["variant"] for r in final if not r["not_final"] and r["seeds"]}
    counts = sorted({p["samples"] for pts in mark_points(results).values() for _, p in pts}, reverse=True)
    out = []
    for at in counts:
        rows = [r for r in summarize(results, at) if r["seeds"] and len(r["seeds"]) == r["runs"]]
        names = {r["variant"] for r in rows}
        if "default" in names and len(names) > 1 and not names <= complete:
            out.append((at, rows))
            complete |= names
    return out


def table(results: dict) -> str:
    """The markdown table (mean ± std over seeds of the final checkpoint) and one line per variant
    saying whether it separates from the default; where the time budget stopped runs before their
    final point, also the tables at the earlier marks that every run of more variants reached."""
    budget = results["budgets"][0]
    rows = summarize(results)
    lines = _rows_md(rows, budget)
    notes = []
    notes += _verdicts(rows, budget)
    notes += [f"- {r['variant']}: seeds without a final point: {r['not_final']}" for r in rows if r["not_final"]]
    for at, at_rows in common_marks(results):
        notes += ["", f"At {at} samples, a mark every seed of these variants reached (the same columns; GPU-s "
                  "by then):", "", *_rows_md(at_rows, budget), "", *_verdicts(at_rows, budget)]  # fmt: skip
    samples = next((r["samples"] for r in rows if r["samples"]), None)
    seen = f"{samples} samples seen per run" if samples else "no run reached its full sample budget"
    head = (
        f"Final checkpoint ({seen}); ± is the standard deviation over seeds; "
        "'separates' = every seed of the variant on one side of every seed of the default; "
        "'chain rounds over 8 tokens': the rounds in which block 8's cap would have bound (mean over seeds); "
        "'loop-free prompts': tau over the held-out prompts whose continuation does not end in a loop."
    )
    product = [p for p in results.get("product", []) if "tau_chain" in (p.get("bench_eval") or {})]
    if product:
        notes += [
            "",
            f"The product run's own exports, measured the same way ({results['held_out']['prompts']} prompts):",
        ]
        for p in product:
            own = p.get("own_eval") or {}
            mine = p["bench_eval"]
            theirs = (
                f" [its evaluator, {own.get('prompts')} prompts: {own['tau_chain']:.3f} / "
                f"{own['tau_ddtree'].get(str(budget), float('nan')):.3f}]"
                if own
                else ""
            )
            notes.append(
                f"- step {p['step']} ({p['samples']} samples): chain {mine['tau_chain']:.3f}, "
                f"DDTree-{budget} {mine['tau_ddtree'][str(budget)]:.3f}{theirs}"
            )
        for c in product_vs_bench(results):
            notes.append(
                f"- at {c['samples']} samples the product's DDTree-{budget} is {c['product']:.3f}: "
                f"{c['vs_default_pct']:+.1f}% against the bench's default ({c['default']:.3f}, seed "
                f"{c['default_seed']}, the product's own recipe and order), {c['vs_best_pct']:+.1f}% against "
                f"the best variant, {c['best']} ({c['best_tau']:.3f} over seeds {c['best_seeds']})"
            )
    return "\n".join([head, "", *lines, "", *notes])


def product_vs_bench(results: dict) -> list[dict]:
    """At every product checkpoint the bench also measured at equal samples (product-aligned marks):
    the product's DDTree tau against the bench's default at the run's seed (the product's own recipe,
    order and seed without DeepSpeed: a gap is a product defect) and against the variant with the
    highest mean over seeds at that sample count, in percent."""
    budget = str(results["budgets"][0])
    seed = results["seeds"][0] if results.get("seeds") else None
    out = []
    for p in results.get("product", []):
        mine = p.get("bench_eval") or {}
        if "tau_ddtree" not in mine or not p.get("samples"):
            continue
        at: dict[str, dict[int, float]] = {}
        for r in results["runs"]:
            for pt in r.get("points") or []:
                if pt["samples"] == p["samples"]:
                    at.setdefault(r["variant"], {})[r["seed"]] = pt["tau_ddtree"][budget]
        if seed not in at.get("default", {}):
            continue
        best = max(at, key=lambda v: statistics.mean(at[v].values()))
        prod, dflt, top = mine["tau_ddtree"][budget], at["default"][seed], statistics.mean(at[best].values())
        out.append({"samples": p["samples"], "step": p["step"], "product": prod, "default": dflt, "default_seed": seed,
                    "vs_default_pct": 100 * (prod / dflt - 1), "best": best, "best_tau": top,
                    "best_seeds": sorted(at[best]), "vs_best_pct": 100 * (prod / top - 1)})  # fmt: skip
    return out


def _curves(results: dict, name: str, x_key: str, y_key: str, budget: str):
    """Mean and std over the variant's seeds per mark (the i-th mark point of each run: runs the
    budget stopped count up to their last mark; the point a stopped run measures where it stopped
    sits between marks and is left out, as in the tables, or it would be averaged with the other
    seeds' next mark)."""
    marked = mark_points(results)
    runs = [[p for _, p in marked[id(r)]] for r in results["runs"] if r.get("variant") == name and marked.get(id(r))]
    n = max((len(pts) for pts in runs), default=0)
    xs, ms, sds = [], [], []
    for i in range(n):
        pts = [run[i] for run in runs if len(run) > i]
        ys = [p[y_key] if y_key == "tau_chain" else p["tau_ddtree"][budget] for p in pts]
        xs.append(statistics.mean(p[x_key] for p in pts))
        ms.append(statistics.mean(ys))
        sds.append(statistics.stdev(ys) if len(ys) > 1 else 0.0)
    return xs, ms, sds


def plot(results: dict, png: Path) -> bool:
    """tau (chain, DDTree) against samples seen and against GPU-seconds, mean ± std band per
    variant; the product run's own exports, measured the same way, dashed. False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budget = str(results["budgets"][0])
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    cmap = plt.get_cmap("tab10")
    for i, v in enumerate(results["variants"]):
        colour = "black" if v["name"] == "default" else cmap(i % 10)
        style = "-" if i < 10 else "--"
        for col, y_key in enumerate(("tau_chain", "tau_ddtree")):
            for row, x_key in enumerate(("samples", "gpu_s")):
                xs, ms, sds = _curves(results, v["name"], x_key, y_key, budget)
                if not xs:
                    continue
                ax = axes[row][col]
                ax.plot(
                    xs, ms, style, color=colour, marker=".", label=v["name"], lw=2 if v["name"] == "default" else 1.2
                )
                ax.fill_between(
                    xs, [m - s for m, s in zip(ms, sds)], [m + s for m, s in zip(ms, sds)], color=colour, alpha=0.12
                )
    product = [p for p in results.get("product", []) if p.get("bench_eval") and p.get("samples")]
    for col, y_key in enumerate(("tau_chain", "tau_ddtree")):
        if product:
            ys = [
                p["bench_eval"][y_key] if y_key == "tau_chain" else p["bench_eval"]["tau_ddtree"][budget]
                for p in product
            ]
            axes[0][col].plot([p["samples"] for p in product], ys, "k--", marker="x", label="product run's exports")
        for row, x_label in enumerate(("training samples seen", "GPU-seconds (fair share of the shared device)")):
            ax = axes[row][col]
            ax.set_xlabel(x_label)
            ax.set_ylabel("tau")
            ax.set_title(f"greedy-replay tau, {'chain' if y_key == 'tau_chain' else 'DDTree-' + budget}")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    seeds = sorted({r["seed"] for r in results["runs"] if "seed" in r})
    fig.suptitle(f"{results['target']['target_id']}: recipe variants, mean ± std over seeds {seeds}")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    tmp = png.with_name(png.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, png)
    return True


def write_results(out: Path, results: dict, tabled: str | None = None) -> str | None:
    """OUT/results.json, and with `tabled` OUT/table.md too, each written then renamed. "partial": after
    every result while the bench runs, so that what is on disk at any moment (a device call packing it
    mid-bench, a bench killed at its limit) holds every run finished so far, the table headed as partial
    (a table that cannot be made yet is left for the next result); "final": once the runs are over.
    Returns the table."""
    write_text_atomic(out / "results.json", json.dumps(results, indent=1) + "\n")
    if tabled is None:
        return None
    if tabled == "final":
        md = table(results)
    else:
        try:
            md = table(results)
        except Exception:  # a partial record the report cannot show must not end the bench
            log.exception("table.md not rewritten after this result")
            return None
        runs = results["budget"].get("runs", "?")
        md = (
            f"Partial: written while the bench ran, {results['seconds']} s in, {len(results['runs'])} of {runs} "
            f"runs recorded (the figure comes at the end, or from `--report {out / 'results.json'}`).\n\n{md}"
        )
    write_text_atomic(out / "table.md", md + "\n")
    return md
