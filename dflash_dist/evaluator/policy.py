"""What the evaluator does next, as pure functions of its status (STYLE 8), and the records it
exchanges with the rest of the pipeline (STYLE 5).

Nothing here touches files, models or Ray, so the decisions are tested on plain lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

EVAL_RESULT_VERSION = 2
_READS_VERSIONS = (1, 2)  # version 1 lacks mode, count, live, server, reference


def pending_steps(available: list[int], done: set[int], max_backlog: int = 4, stride: int = 2) -> list[int]:
    """Exports still to evaluate, oldest first.

    Only exports newer than the newest evaluated one count: an older unevaluated export was
    skipped on purpose (see below), and evaluating it now would log a curve out of order.
    When more than `max_backlog` are waiting, the evaluator has fallen behind the trainer: it
    keeps the newest and every `stride`-th one counted back from it, and drops the rest. The
    newest is never dropped, so the last checkpoint of a run is always evaluated. Callers
    evaluate the first step and ask again, so the choice follows exports that appear meanwhile.
    """
    if max_backlog < 1 or stride < 1:
        raise ValueError(f"pending_steps: need max_backlog >= 1 and stride >= 1, got {max_backlog=} {stride=}")
    newest_done = max(done, default=-1)
    todo = sorted(s for s in set(available) if s > newest_done and s not in done)
    if len(todo) <= max_backlog:
        return todo
    return todo[::-1][::stride][::-1]


def should_stop(trainer_finished: bool, final_step: int | None, done: set[int]) -> bool:
    """True once the trainer is finished and its final export was evaluated.

    `final_step` None means the trainer finished without naming a last export (it wrote none):
    there is nothing more to wait for. Callers ask only when no export is pending, so exports
    already on disk are evaluated first either way.
    """
    if not trainer_finished:
        return False
    return final_step is None or any(s >= final_step for s in done)


def live_checkpoint(evaluated: int, step: int, live_every: int, live_first: bool, live_last: bool,
                    max_steps: int | None) -> bool:
    """Whether the checkpoint of `step`, after `evaluated` others, is measured live (or by the
    server): every `live_every`-th evaluated checkpoint counting the first as 0 (the first itself
    only with `live_first`), and, with `live_last`, the run's last export (step `max_steps`)."""
    if live_last and max_steps is not None and step >= max_steps:
        return True
    return evaluated % live_every == 0 and (evaluated > 0 or live_first)


def lacks_mode(result: EvalResult, mode: str) -> bool:
    """True when `result` does not hold what eval.mode=`mode` measures, so the export is measured
    again for it (keeping the modes it holds). Replay is in every result. A live/server result
    of a checkpoint that eval.live_every skipped holds none and is complete; a failed server
    measurement is tried again."""
    if mode == "live":
        return result.live is None and result.mode != "live"
    if mode == "server":
        return result.server_error is not None or (result.server is None and result.mode != "server")
    return False


@dataclass(frozen=True)
class EvalRequest:
    """One export to evaluate: `<out>/export/step_<step>/` (config.json + model.safetensors)."""

    step: int
    export_dir: str

    @property
    def path(self) -> Path:
        return Path(self.export_dir)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "export_dir": self.export_dir}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EvalRequest:
        return cls(step=int(d["step"]), export_dir=str(d["export_dir"]))


@dataclass(frozen=True)
class EvalResult:
    """tau of one export (SPEC 4): what `eval/step_N.json` holds.

    tau_* are greedy replay's: the mean over prompts of each prompt's mean tau_round;
    accept_hist counts chain rounds by accepted drafts 0..B-1; slot_acceptance[j-1] is the share
    of chain rounds whose draft slot j was accepted. `count` is how a round at the
    continuation's end was counted ("capped" | "uncapped"). `live` (eval.mode=live, at the
    checkpoints it ran) holds live speculative decoding's tau_chain, tau_ddtree, accept_hist,
    slot_acceptance, rounds and how many rounds and continuations equal replay's; `server` the
    engine's ServerResult JSON, or {"engine", "url", "error"} when the server failed (the replay
    tau is recorded all the same); `reference` the reference drafter's tau_chain and tau_ddtree
    (replay, and live when measured) on the same prompts, for the ratio; `loop_free` replay's tau
    over the prompts whose reference continuation does not end in a loop (a loop is trivial to draft).
    """

    step: int
    tau_chain: float
    tau_ddtree: dict[int, float]
    accept_hist: tuple[int, ...]
    slot_acceptance: tuple[float, ...]
    prompts: int
    rounds: int
    kernel_path: str
    seconds: float
    mode: str = "replay"
    count: str = "capped"
    live: dict[str, Any] | None = None
    server: dict[str, Any] | None = None
    reference: dict[str, Any] | None = None
    # replay's tau over the prompts whose reference continuation does not end in a loop (measure.loop_free)
    loop_free: dict[str, Any] | None = None
    # the measured export's file checksums (its dflash_export.json `checksums.files`): a result whose
    # export/step_N holds other files since (a resume from an earlier checkpoint wrote it again) is
    # not that export's; None: written before this was recorded, or an export without a record
    export: dict[str, str] | None = None

    @property
    def server_error(self) -> str | None:
        """Why the server tau of this checkpoint is missing (None: measured, or not asked)."""
        return (self.server or {}).get("error")

    def table_row(self) -> str:
        """One line of the end-of-run table: replay tau, and live/server beside it where measured."""
        trees = "  ".join(f"DDTree-{b} {t:.2f}" for b, t in sorted(self.tau_ddtree.items()))
        row = f"step {self.step:>6}: tau chain {self.tau_chain:.2f}  {trees}"
        if self.loop_free and self.loop_free["loops"]:
            row += f"  (loop-free prompts: chain {loop_free_text(self.loop_free)})"
        if self.live:
            row += f"  | live chain {self.live['tau_chain']:.2f}"
        if self.server_error is not None:
            row += f"  | server FAILED: {self.server_error}"
        elif self.server:
            row += f"  | server {self.server['tau']:.2f}"
        return row

    @property
    def tau_chain_vs_reference(self) -> float | None:
        """This export's replay chain tau over the reference drafter's (None without one)."""
        ref = (self.reference or {}).get("tau_chain")
        return self.tau_chain / ref if ref else None

    def to_json(self) -> dict[str, Any]:
        return {
            "version": EVAL_RESULT_VERSION,
            "step": self.step,
            "mode": self.mode,
            "count": self.count,
            "tau_chain": self.tau_chain,
            "tau_ddtree": {str(b): t for b, t in sorted(self.tau_ddtree.items())},
            "accept_hist": list(self.accept_hist),
            "slot_acceptance": list(self.slot_acceptance),
            "prompts": self.prompts,
            "rounds": self.rounds,
            "kernel_path": self.kernel_path,
            "seconds": self.seconds,
            "live": self.live,
            "server": self.server,
            "reference": self.reference,
            "tau_chain_vs_reference": self.tau_chain_vs_reference,
            "loop_free": None if self.loop_free is None else {
                **self.loop_free, "tau_ddtree": {str(b): t for b, t in sorted(self.loop_free["tau_ddtree"].items())}},
            "export": self.export,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str = "<eval result>") -> EvalResult:
        if not isinstance(d, dict) or d.get("version") not in _READS_VERSIONS:
            got = d.get("version") if isinstance(d, dict) else type(d).__name__
            raise ValueError(
                f"{where}: eval result version {got!r}, this code reads {list(_READS_VERSIONS)}: "
                "delete the file to have the step evaluated again"
            )
        try:
            return cls(
                step=int(d["step"]),
                tau_chain=float(d["tau_chain"]),
                tau_ddtree={int(b): float(t) for b, t in d["tau_ddtree"].items()},
                accept_hist=tuple(int(x) for x in d["accept_hist"]),
                slot_acceptance=tuple(float(x) for x in d["slot_acceptance"]),
                prompts=int(d["prompts"]),
                rounds=int(d["rounds"]),
                kernel_path=str(d["kernel_path"]),
                seconds=float(d["seconds"]),
                mode=str(d.get("mode", "replay")),
                count=str(d.get("count", "capped")),
                live=tau_record_from_json(d.get("live")),
                server=d.get("server"),
                reference=tau_record_from_json(d.get("reference")),
                loop_free=_loop_free_from_json(d.get("loop_free")),
                export=None if d.get("export") is None else {str(k): str(v) for k, v in d["export"].items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{where}: not a valid eval result ({type(e).__name__}: {e})") from None


def tau_record_from_json(d: dict[str, Any] | None) -> dict[str, Any] | None:
    """A tau record read back from JSON: its tau_ddtree keys are budgets (ints) again."""
    if d is None:
        return None
    out = dict(d)
    for key, value in d.items():
        if key.endswith("tau_ddtree") and isinstance(value, dict):
            out[key] = {int(b): None if t is None else float(t) for b, t in value.items()}
        elif key == "replay_own" and isinstance(value, dict):  # live: replay over live's own continuations
            out[key] = tau_record_from_json(value)
    return out


def _loop_free_from_json(d: dict[str, Any] | None) -> dict[str, Any] | None:
    """measure.loop_free's record read back; one of 0 prompts written before its taus became None
    (they were NaN then) reads as None too."""
    out = tau_record_from_json(d)
    if out is not None and not out.get("prompts"):
        out["tau_chain"] = None
        out["tau_ddtree"] = {b: None for b in out.get("tau_ddtree", {})}
    return out


def loop_free_text(record: dict[str, Any], digits: int = 2) -> str:
    """measure.loop_free's chain tau as a table or a log line shows it: "n/a (0 loop-free prompts)"
    when every prompt's continuation loops (no tau to show, never NaN)."""
    tau = record.get("tau_chain")
    if not record.get("prompts") or tau is None or tau != tau:
        return f"n/a ({record.get('prompts', 0)} loop-free prompts)"
    return f"{tau:.{digits}f}"
