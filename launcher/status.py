"""`dflash-dist status DIR [--json]`: where a run stands, read from its files alone (no Ray
connection, so it works from any host that mounts DIR, during the run or after it).

  shards      produced (manifest.jsonl, DONE) and consumed (the trainer ranks' heartbeats), over every
              epoch's directory (capture.later_epochs: recapture captures each epoch into its own)
  epochs      the epoch being captured (the first whose directory is not DONE) and the one being trained,
              counted from 1 as "N of M" (the --json output keeps the files' 0-based indices)
  disk        bytes of shard files under DIR/shards (every epoch directory and the token store) vs the
              configured max_buffer_bytes
  trainer     step, epoch, loss (train_log.jsonl), tokens/s (TensorBoard, as of its last flush)
  eval        the newest eval/step_N.json: tau of the chain and of each DDTree budget; a failed evaluator
              (what failed, where its log is: the driver's heartbeat, or the evaluator's own)
  roles       driver, target actors, trainer ranks, evaluator: alive, finished, failed, lost
              (silent for longer than its heartbeat allows) or not started (heartbeat/*.json)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from dflash_dist.actors.heartbeat import liveness, read_heartbeats

BUFFER_CAP_KEYS = ("capture.max_buffer_bytes",)


def _last_json_line(path: Path, tail_bytes: int = 65536) -> dict | None:
    """The last complete line of a JSONL file, reading only its tail."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - tail_bytes))
            lines = [ln for ln in f.read().split(b"\n")[:-1] if ln.strip()]  # [:-1]: a line being appended
    except FileNotFoundError:
        return None
    return json.loads(lines[-1]) if lines else None


def _config_value(cfg: dict, dotted: str):
    node: Any = cfg
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _tokens_per_s(tb_train: Path) -> dict | None:
    """The last train/tokens_per_s TensorBoard holds (the trainer flushes it every minute)."""
    if not any(tb_train.glob("events.out.tfevents.*")):
        return None
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_train), size_guidance={"scalars": 1, "histograms": 1})  # 1: keeps the last
    acc.Reload()
    if "train/tokens_per_s" not in acc.Tags()["scalars"]:
        return None
    last = acc.Scalars("train/tokens_per_s")[-1]
    return {"value": last.value, "step": last.step}


def _shards(out: Path, cfg: dict, beats: list[dict]) -> tuple[dict, dict]:
    from data_pipeline.epoch_dirs import RECAPTURE, epoch_dir, epoch_dirs, read_mode, sequences_dir
    from data_pipeline.records import BUFFER_NAME, DONE_NAME, TMP_PREFIX
    from data_pipeline.shard_reader import read_manifest

    shard_dir = out / "shards"
    dirs = [d for _, d in epoch_dirs(shard_dir)] if shard_dir.is_dir() else []
    records = [(d, r) for d in dirs for r in read_manifest(d)]
    files = [p for d in [*dirs, sequences_dir(shard_dir)] for p in (d.glob("*.tar") if d.is_dir() else ())]
    present = {p: p.stat().st_size for p in files}
    temps = [p for d in [*dirs, sequences_dir(shard_dir)] for p in (d.glob(f"{TMP_PREFIX}*") if d.is_dir() else ())]
    in_flight = sum(p.stat().st_size for p in temps)
    trainers = [b for b in beats if b.get("role") == "trainer"]
    mode = read_mode(shard_dir) if shard_dir.is_dir() else None
    epochs = _config_value(cfg, "train.epochs") or 1
    captured_per_dir = range(epochs) if mode == RECAPTURE else range(1)
    pending = [e for e in captured_per_dir if not (epoch_dir(shard_dir, e, mode == RECAPTURE) / DONE_NAME).exists()]
    shards = {
        "produced": len(records),
        "samples": sum(r.n_samples for _, r in records),
        "tokens": sum(r.n_tokens for _, r in records),
        "bytes": sum(r.n_bytes for _, r in records),
        "capture_done": not pending,
        "later_epochs": mode,
        "epochs": epochs,
        "capture_epoch": pending[0] if pending else None,  # the epoch being captured; None: all captured
        "deleted": sum(1 for d, r in records if d / r.name not in present),
        # ShardStream positions: shards every rank finished in its current epoch
        "consumed_this_epoch": sum(b["info"].get("shards_consumed", 0) for b in trainers) if trainers else None,
        "epoch": max((b["info"].get("epoch", 0) for b in trainers), default=None),
    }
    cap = next((v for k in BUFFER_CAP_KEYS if (v := _config_value(cfg, k)) is not None), None)
    used = sum(present.values()) + in_flight
    disk = {
        "used_bytes": used,
        "in_flight_bytes": in_flight,
        "cap_bytes": cap,
        "used_frac": used / cap if cap else None,
    }
    # the capture/trainer's own account (data_pipeline/disk_budget.py): bytes counted against the
    # cap (not yet trained and checkpointed) and shards released to deletion
    buffer = json.loads((shard_dir / BUFFER_NAME).read_text()) if (shard_dir / BUFFER_NAME).is_file() else None
    if buffer is not None:
        disk["unconsumed_bytes"] = buffer.get("unconsumed_bytes")
        shards["released"] = buffer.get("shards_released")
    return shards, disk


def _roles(cfg: dict, beats: list[dict], now: float) -> list[dict]:
    expected = {"driver": 1}
    stages = next((b["info"].get("stages") for b in beats if b.get("role") == "driver"), None) or []
    if "extract" in stages:
        expected["target"] = _config_value(cfg, "capture.num_actors") or 1
    if "train" in stages:
        expected["trainer"] = _config_value(cfg, "train.world_size") or 1
    if "eval" in stages and _config_value(cfg, "eval.enabled") is not False:
        expected["evaluator"] = 1
    rows = [
        {
            "role": b["role"],
            "index": b["index"],
            "state": liveness(b, now),
            "age_s": now - b["updated"],
            "host": b.get("host"),
            "pid": b.get("pid"),
            "info": b.get("info", {}),
            "error": b.get("error"),
        }
        for b in beats
    ]
    have = {(r["role"], r["index"]) for r in rows}
    rows += [
        {
            "role": role,
            "index": i,
            "state": "not started",
            "age_s": None,
            "host": None,
            "pid": None,
            "info": {},
            "error": None,
        }
        for role, n in expected.items()
        for i in range(n)
        if (role, i) not in have
    ]
    order = ("driver", "target", "trainer", "evaluator")
    return sorted(rows, key=lambda r: (order.index(r["role"]) if r["role"] in order else 9, r["index"]))


def collect(out: str | os.PathLike[str], now: float | None = None) -> dict:
    """Everything `status` shows, as one JSON-able dict. Raises ValueError if DIR holds no run."""
    out = Path(out)
    now = time.time() if now is None else now
    if not ((out / "config.yaml").is_file() or (out / "shards").is_dir()):
        raise ValueError(f"{out} holds no dflash-dist run (no config.yaml, no shards/): pass the run's --out DIR")
    cfg = yaml.safe_load((out / "config.yaml").read_text()) if (out / "config.yaml").is_file() else {}
    beats = read_heartbeats(out)
    shards, disk = _shards(out, cfg or {}, beats)
    last = _last_json_line(out / "train_log.jsonl")
    steps = [b["info"]["step"] for b in beats if b.get("role") == "trainer" and "step" in b.get("info", {})]
    latest = out / "checkpoints" / "latest"
    trainer = {
        "step": max([last["step"] if last else 0, *steps]) if (last or steps) else None,
        "epoch": last["epoch"] if last else None,
        "loss": last["loss"] if last else None,
        "samples": last["samples"] if last else None,
        "tokens_per_s": _tokens_per_s(out / "tb" / "train"),
        "latest_checkpoint": latest.read_text().strip() if latest.is_file() else None,
        "max_steps": _config_value(cfg, "train.max_steps"),
        # samples lost so far as data.max_lost_fraction holds them: unreadable plus capture-skipped per
        # epoch read (every rank reports the group's count)
        "samples_lost": max((b["info"]["samples_lost"] for b in beats
                             if b.get("role") == "trainer" and "samples_lost" in b.get("info", {})), default=None),
    }
    evals = (
        sorted((out / "eval").glob("step_*.json"), key=lambda p: int(p.stem.split("_")[1]))
        if (out / "eval").is_dir()
        else []
    )
    eval_ = {"evaluated": len(evals), "step": None, "tau_chain": None, "tau_ddtree": {}}
    if evals:
        r = json.loads(evals[-1].read_text())
        eval_.update(step=r["step"], tau_chain=r["tau_chain"], tau_ddtree=r["tau_ddtree"])
        if r.get("reference"):  # eval.reference_drafter: this checkpoint's tau against it
            eval_.update(reference_tau_chain=r["reference"]["tau_chain"],
                         tau_chain_vs_reference=r["tau_chain"] / r["reference"]["tau_chain"])
    eval_["failed"] = _eval_failure(beats)
    return {
        "out": str(out),
        "run": _config_value(cfg, "run.name"),
        "time": now,
        "shards": shards,
        "disk": disk,
        "trainer": trainer,
        "eval": eval_,
        "roles": _roles(cfg or {}, beats, now),
    }


def _eval_failure(beats: list[dict]) -> str | None:
    """A failed evaluator, as the driver said it when it happened (what failed, where its log is, that
    training goes on), else from the evaluator's own last heartbeat; None while it works."""
    said = next((b["info"].get("evaluator_failed") for b in beats if b["role"] == "driver"), None)
    if said:
        return str(said)
    beat = next((b for b in beats if b["role"] == "evaluator" and b["state"] == "failed"), None)
    if beat is None:
        return None
    log = beat["info"].get("log")
    return f"{beat['error']}" + (f"; its log: {log} on {beat['host']}" if log else "")


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _f(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _nth(epoch: int | None) -> str:
    """A 0-based epoch index as the user counts it (from 1)."""
    return "-" if epoch is None else str(epoch + 1)


def render(s: dict) -> tuple[list[tuple[str, str]], list[list[str]]]:
    """The summary as (label, value) rows and the role table's rows."""
    sh, disk, tr, ev = s["shards"], s["disk"], s["trainer"], s["eval"]
    # epochs shown counted from 1, "N of M" (the JSON keeps the files' 0-based indices); the shard stream's
    # epoch equals M once every epoch was read
    n_epochs = sh["epochs"]
    if sh["consumed_this_epoch"] is None:
        consumed = "-"
    elif sh["epoch"] is not None and sh["epoch"] >= n_epochs:
        consumed = f"{sh['consumed_this_epoch']} (all {n_epochs} epochs read)"
    else:
        consumed = f"{sh['consumed_this_epoch']} (epoch {_nth(sh['epoch'])} of {n_epochs})"
    tps = tr["tokens_per_s"]
    cap = f"of {_bytes(disk['cap_bytes'])} ({disk['used_frac']:.0%})" if disk["cap_bytes"] else "(no cap)"
    taus = "  ".join(f"DDTree-{b} {v:.2f}" for b, v in sorted(ev["tau_ddtree"].items(), key=lambda x: int(x[0])))
    if sh["later_epochs"] == "recapture":
        capturing = f"capturing {_nth(sh['capture_epoch'])}" if sh["capture_epoch"] is not None else "all captured"
    else:
        capturing = "capturing 1" if sh["capture_epoch"] is not None else "captured once"
    later = sh["later_epochs"] or "-"
    epochs = f"{capturing}, training {_nth(tr['epoch'])} (of {n_epochs}; later epochs: {later})"
    summary = [
        ("epochs", epochs),
        (
            "shards produced",
            f"{sh['produced']} ({sh['samples']} samples, {sh['tokens']} tokens, "
            f"{_bytes(sh['bytes'])}){'; capture done' if sh['capture_done'] else ''}",
        ),
        ("shards consumed", f"{consumed}; released {sh.get('released', '-')}; deleted {sh['deleted']}"),
        ("disk buffer", f"{_bytes(disk['used_bytes'])} {cap}; unconsumed {_bytes(disk.get('unconsumed_bytes'))}"),
        (
            "trainer",
            f"step {_f(tr['step'], 'd')} epoch {_nth(tr['epoch'])} of {n_epochs} loss {_f(tr['loss'], '.4f')}; "
            f"checkpoint {tr['latest_checkpoint'] or '-'}",
        ),
        ("samples lost", _f(tr["samples_lost"], "d")),  # unreadable + capture-skipped, as data.max_lost_fraction holds
        ("tokens/s", f"{tps['value']:.0f} (at step {tps['step']})" if tps else "-"),
        ("tau", f"step {ev['step']}: chain {ev['tau_chain']:.2f}  {taus}" if ev["step"] is not None else "-"),
        *([("evaluator", f"FAILED: {ev['failed']}")] if ev.get("failed") else []),
        *([("tau vs reference", f"chain {ev['tau_chain_vs_reference']:.2f}x the reference drafter's "
                                f"{ev['reference_tau_chain']:.2f}")] if "tau_chain_vs_reference" in ev else []),
    ]
    roles = [
        [
            f"{r['role']}[{r['index']}]",
            r["state"],
            "-" if r["age_s"] is None else f"{r['age_s']:.0f}s ago",
            f"{r['host'] or '-'}:{r['pid'] or '-'}",
            r["error"] or json.dumps(r["info"], sort_keys=True),
        ]
        for r in s["roles"]
    ]
    return summary, roles


def print_status(s: dict) -> None:
    summary, roles = render(s)
    header = ["role", "state", "heartbeat", "host:pid", "info"]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"run {s['run'] or '-'} in {s['out']}")
        for label, value in summary:
            print(f"  {label:<16} {value}")
        print("  " + "  ".join(f"{h:<12}" for h in header))
        for row in roles:
            print("  " + "  ".join(f"{c:<12}" for c in row))
        return
    top = Table(title=f"run {s['run'] or '-'} in {s['out']}", show_header=False)
    for label, value in summary:
        top.add_row(label, value)
    table = Table(*header)
    for row in roles:
        table.add_row(*row)
    console = Console()
    console.print(top)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dflash-dist status", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="the run's output directory (run.out_dir / --out)")
    ap.add_argument("--json", action="store_true", help="print the status as one JSON object")
    args = ap.parse_args(argv)
    try:
        s = collect(args.dir)
    except ValueError as e:
        print(f"dflash-dist status: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(s, indent=2, sort_keys=True))
    else:
        print_status(s)
    return 0
