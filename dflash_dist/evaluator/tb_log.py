"""What one EvalResult puts in TensorBoard (STYLE 10: `eval/` tags at the checkpoint's step).

Scalars, per mode and budget:
  eval/tau_chain, eval/tau_ddtree_<b>, eval/slot_acceptance_<j>          greedy replay
  eval/tau_chain_loop_free, eval/tau_ddtree_<b>_loop_free                 replay over the prompts
                                                                          whose continuation is no loop
  eval/tau_live_chain, eval/tau_live_ddtree_<b>, eval/slot_acceptance_live_<j>,
  eval/live_rounds_equal (share of rounds with replay's tau)               eval.mode=live
  eval/tau_server, or eval/server_failed = 1 when the server failed          eval.mode=server
  eval/reference_tau_chain, eval/reference_tau_ddtree_<b>,
  eval/tau_chain_vs_reference, eval/tau_ddtree_<b>_vs_reference           eval.reference_drafter
Images, every checkpoint: eval/tau_vs_step (chain and each DDTree budget over the steps so far,
the reference drafter dashed) and eval/accept_hist (this checkpoint's chain rounds by accepted
drafts; eval/accept_hist_live beside it when live ran).
"""

from __future__ import annotations

from collections.abc import Iterable

from dflash_dist.evaluator.plots import bar_plot, line_plot
from dflash_dist.evaluator.policy import EvalResult
from dflash_dist.trainer.metrics import Metrics


def scalars_of(result: EvalResult) -> dict[str, float]:
    out = {"eval/tau_chain": result.tau_chain}
    out.update({f"eval/tau_ddtree_{b}": t for b, t in result.tau_ddtree.items()})
    if result.loop_free and result.loop_free["prompts"]:
        out["eval/tau_chain_loop_free"] = result.loop_free["tau_chain"]
        out.update({f"eval/tau_ddtree_{b}_loop_free": t for b, t in result.loop_free["tau_ddtree"].items()})
    out.update({f"eval/slot_acceptance_{j}": a for j, a in enumerate(result.slot_acceptance, start=1)})
    live = result.live
    if live:
        out["eval/tau_live_chain"] = live["tau_chain"]
        out.update({f"eval/tau_live_ddtree_{b}": t for b, t in live["tau_ddtree"].items()})
        out.update({f"eval/slot_acceptance_live_{j}": a for j, a in enumerate(live["slot_acceptance"], start=1)})
        out["eval/live_rounds_equal"] = live["rounds_equal"] / max(live["rounds_compared"], 1)
        own = live.get("replay_own")
        if own:  # replay over live's own continuations (the like-for-like comparison with live)
            out["eval/tau_replay_own_chain"] = own["tau_chain"]
            out.update({f"eval/tau_replay_own_ddtree_{b}": t for b, t in own["tau_ddtree"].items()})
    if result.server_error is not None:
        out["eval/server_failed"] = 1.0
    elif result.server:
        out["eval/tau_server"] = result.server["tau"]
    ref = result.reference
    if ref:
        out["eval/reference_tau_chain"] = ref["tau_chain"]
        out["eval/tau_chain_vs_reference"] = result.tau_chain / ref["tau_chain"]
        for b, t in ref["tau_ddtree"].items():
            out[f"eval/reference_tau_ddtree_{b}"] = t
            if b in result.tau_ddtree:
                out[f"eval/tau_ddtree_{b}_vs_reference"] = result.tau_ddtree[b] / t
    return out


def images_of(result: EvalResult, history: Iterable[EvalResult]) -> dict:
    history = sorted({r.step: r for r in history}.values(), key=lambda r: r.step)
    series = {"chain": [(r.step, r.tau_chain) for r in history]}
    for b in sorted(result.tau_ddtree):
        series[f"DDTree-{b}"] = [(r.step, r.tau_ddtree[b]) for r in history if b in r.tau_ddtree]
    live = [(r.step, r.live["tau_chain"]) for r in history if r.live]
    if live:
        series["live chain"] = live
    hlines = None
    if result.reference:
        hlines = {"chain": result.reference["tau_chain"]}
        hlines.update({f"DDTree-{b}": t for b, t in sorted(result.reference["tau_ddtree"].items())})
    images = {
        "eval/tau_vs_step": line_plot(series, f"tau vs step ({result.count}), step {result.step}", hlines),
        "eval/accept_hist": bar_plot(result.accept_hist, f"replay chain rounds by accepted drafts, step {result.step}"),
    }
    if result.live:
        images["eval/accept_hist_live"] = bar_plot(result.live["accept_hist"],
                                                   f"live chain rounds by accepted drafts, step {result.step}")
    return images


def logged_tags(result: EvalResult) -> frozenset[str]:
    """The scalar and image tags `result` put in TensorBoard at its step."""
    return frozenset(scalars_of(result)) | {"eval/tau_vs_step", "eval/accept_hist"} | (
        {"eval/accept_hist_live"} if result.live else set())


def log_result(metrics: Metrics, result: EvalResult, history: Iterable[EvalResult],
               skip: frozenset[str] = frozenset()) -> None:
    """`history`: every result so far (this one included) for the tau-vs-step image. `skip`:
    tags already logged at this step (a mode added to an earlier result): not logged twice."""
    metrics.log(result.step, {k: v for k, v in scalars_of(result).items() if k not in skip})
    metrics.images(result.step, {k: v for k, v in images_of(result, history).items() if k not in skip})
    metrics.flush()
