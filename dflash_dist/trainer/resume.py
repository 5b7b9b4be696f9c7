"""The resume decision, made once and verified by whoever carries it out.

`decide` is called once per trainer group start: by the run plan (orchestration/run_plan.py, and
so once per Slurm job attempt), by the driver before it restarts a failed group, or by
`start_trainer_group` for a caller without a plan. It picks the checkpoint (`plan_resume`), reads
its completion marker and refuses, before anything starts, a checkpoint the run cannot continue:
a training-relevant config change (compared field by field against `MAY_CHANGE`), another world
size under a ZeRO stage that cannot change it, other shards, another LR schedule length, or a
trainer state of another code version. The result is a frozen `ResumeDecision` that travels to
the ranks in the TrainJob; each rank `verify`s that the marker is still the one decided on (its
sha256) and loads it, without deciding anything again.

What may change across a resume is a typed table of config fields, each with the reason it
cannot change the training trajectory. Every other field must match; a field added to the config
later is training-relevant until someone adds it here with a reason. A harmless field the trainer
also reads through a derived value (`DERIVED`: data.max_length sets the packed row's length when
train.packing has no train.micro_batch_tokens) is harmless only while that value is unchanged.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dflash_dist.config import Config, load_config_dict
from dflash_dist.trainer.checkpoint import (
    ELASTIC_STAGES,
    MARKER,
    ResumeError,
    data_fingerprint_matches,
    marker_problem,
    plan_resume,
    read_marker,
)

_SHARDS = "acts only through the shards, whose provenance (target hash, layers, dtype, kernel path) the reader checks"
_DATA = "acts only through the shards; the checkpoint's manifest must be a prefix of today's (data fingerprint)"
_RESOURCE = "a resource or placement, not what is trained"
_LOGGING = "what is logged or kept, not what is trained"
_EVAL = "evaluation only"

# config field -> why changing it across a resume cannot change the training trajectory
MAY_CHANGE: dict[str, str] = {
    "run.name": "a label for people and logs",
    "run.out_dir": "where the run lives (a moved run directory resumes)",
    **{f"target.{k}": _SHARDS for k in ("kind", "path", "dtype", "device", "attn_implementation",
                                          "allow_torch_gdn_on_cuda")},  # fmt: skip
    **{f"data.{k}": _DATA for k in ("train_path", "eval_path", "format", "enable_thinking", "on_bad_record",
                                     "on_overlong", "max_train_samples", "max_length")},  # fmt: skip
    "data.max_lost_fraction": "a failure threshold for unreadable samples, not what is trained",
    **{f"capture.{k}": _DATA for k in ("regenerate", "max_new_tokens")},
    "capture.kernels": _SHARDS,
    "capture.later_epochs": "the shard tree records the mode its epochs were captured in (later_epochs.json) and "
                            "the run plan refuses another explicit one, so auto and the recorded mode are the same",
    **{f"capture.{k}": _RESOURCE for k in ("num_actors", "batch_size", "token_budget", "sort_window", "shard_bytes",
                                            "max_buffer_bytes", "consumed_shards", "buffer_stall_s", "max_restarts",
                                            "cpus_per_actor", "gpus_per_actor", "writers",
                                            "writeback_idle")},  # fmt: skip
    "train.world_size": "checked on its own: another world size is an elastic resume under ZeRO-1/2/3",
    "train.epochs": "how far to train; the LR schedule's length is checked on its own",
    "train.max_steps": "how far to train; the LR schedule's length is checked on its own",
    **{f"train.{k}": _LOGGING for k in ("checkpoint_every", "keep_checkpoints", "log_every", "log_sample_keys",
                                         "histogram_every")},  # fmt: skip
    "train.cpus_per_rank": _RESOURCE,
    "train.max_restarts": "how often a lost group is replaced, not what it trains",
    **{f"eval.{k}": _EVAL for k in ("enabled", "num_prompts", "max_new_tokens", "budgets", "poll_s", "max_backlog",
                                     "backlog_stride", "num_cpus", "num_gpus", "max_restarts", "mode", "live_every",
                                     "live_first", "live_last", "live_workers", "reference_batch",
                                     "count", "reference_drafter", "server_url", "server_engine", "server_model",
                                     "server_concurrency", "server_max_retries", "server_timeout_s")},  # fmt: skip
    **{f"ray.{k}": _RESOURCE for k in ("address", "num_cpus", "dashboard", "dashboard_host", "placement",
                                        "placement_timeout_s", "node_resources")},  # fmt: skip
    **{f"regen.{k}": "the regenerate stage's own settings (its output is checked by its provenance)"
       for k in ("source", "input", "output", "url", "model", "api_key_env", "temperature", "top_p",
                 "max_new_tokens", "batch_size", "concurrency", "max_retries", "timeout_s")},  # fmt: skip
}


# a MAY_CHANGE field that the trainer also reads through a derived value: harmless only while that
# value is the same under both configs (what it is, how it is derived from a Config)
DERIVED: dict[str, tuple[str, Callable[[Config], Any]]] = {
    "data.max_length": ("the packed row's length", Config.pack_tokens),  # micro_batch_size x max_length
}


@dataclass(frozen=True)
class ResumeDecision:
    """Where a trainer group starts: a complete checkpoint tag, as decided once."""

    tag: str  # the tag directory
    step: int
    saved_world: int  # the world size that saved it
    world: int  # this group's
    marker_sha256: str  # of its completion marker when decided: the ranks load exactly this
    changes: tuple[str, ...] = ()  # harmless config changes since, "path: old -> new"

    @property
    def elastic(self) -> bool:
        """Saved at another world size: loaded through DeepSpeed's universal checkpoint."""
        return self.saved_world != self.world

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ResumeDecision:
        return cls(**{**d, "changes": tuple(d.get("changes", ()))})


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and not (prefix == "ray." and k == "node_resources"):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def config_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(training-relevant changes, harmless changes) between two config dicts, each as
    'path: old -> new', field by field: a field is harmless only if MAY_CHANGE names it and the
    values DERIVED from it are unchanged."""
    old, new = _flatten(saved), _flatten(current)
    strict, harmless = [], []
    for key in sorted(set(old) | set(new)):
        if old.get(key, "<unset>") != new.get(key, "<unset>"):
            line = f"{key}: {old.get(key, '<unset>')!r} -> {new.get(key, '<unset>')!r}"
            derived = _derived_change(key, old[key], current) if key in old and key in new else None
            if derived is not None:
                strict.append(f"{line} ({derived})")
            else:
                (harmless if key in MAY_CHANGE else strict).append(line)
    return strict, harmless


def _derived_change(key: str, saved_value: Any, current: dict) -> str | None:
    """How the value DERIVED from `key` changes when only `key` goes from its saved value to the
    current config's; None if it does not (or `key` derives nothing)."""
    if key not in DERIVED:
        return None
    what, derive = DERIVED[key]
    section, name = key.split(".")
    before = {**current, section: {**current[section], name: saved_value}}
    try:
        was, now = derive(load_config_dict(before)), derive(load_config_dict(current))
    except ValueError as e:  # the saved value is not valid beside today's other fields
        return f"{what} cannot be derived from the saved value: {e}"
    return None if was == now else f"{what}: {was!r} -> {now!r}"


def training_config_hash(cfg_dict: dict) -> str:
    """Hash of the training-relevant fields (every field MAY_CHANGE does not name)."""
    relevant = {k: v for k, v in _flatten(cfg_dict).items() if k not in MAY_CHANGE}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def check_resumable(saved: dict[str, Any], cfg_dict: dict, world_size: int, shard_dir: str | Path,
                    where: str) -> list[str]:  # fmt: skip
    """Refuse a checkpoint (its marker: config, world_size, data) under a changed training config
    or other shards, or at another world size unless its ZeRO stage is in ELASTIC_STAGES; returns
    the harmless changes (a world-size change among them) for the caller to print."""
    strict, harmless = config_changes(saved["config"], cfg_dict)
    saved_world = saved.get("world_size")
    if saved_world != world_size:
        stage = saved["config"]["train"]["zero_stage"]
        if stage not in ELASTIC_STAGES:
            stages = ", ".join(str(s) for s in ELASTIC_STAGES)
            raise ResumeError(
                f"{where} was saved by {saved_world} ranks, this group has {world_size}: resuming at another world "
                f"size works for ZeRO stages {stages} (through DeepSpeed's universal checkpoint), this run uses "
                f"ZeRO-{stage}: resume with train.world_size={saved_world} or use another --out"
            )
    if strict:
        raise ResumeError(
            f"{where}: training-relevant config changed since that checkpoint: {'; '.join(strict)}. Resume with "
            "the checkpoint's values (see its dflash_checkpoint.json) or start a fresh run in another --out"
        )
    if not data_fingerprint_matches(saved["data"], shard_dir):
        data = saved["data"]
        raise ResumeError(
            f"{where} trained on {data['shards']} shard(s) that {shard_dir}/manifest.jsonl does not start with: "
            "resume on the same shards or start a fresh run"
        )
    return harmless


def decide(mode: str, cfg: Any, shard_dir: str | Path, schedule: tuple[int, str],
           state_version: int) -> ResumeDecision | None:  # fmt: skip
    """The checkpoint a new trainer group of `cfg` starts from (None: step 0), checked against
    this run: `mode` auto, never or a tag directory (plan_resume); `schedule` the LR schedule
    (length, unit) this run plans; `state_version` the trainer state version it reads."""
    path = plan_resume(mode, cfg.out / "checkpoints")
    if path is None:
        return None
    raw = (path / MARKER).read_bytes()
    meta = read_marker(path)
    if meta is None:  # plan_resume returned it as complete a moment ago: changed under us
        raise ResumeError(f"{path}/{MARKER} changed while the resume was decided; retry")
    where, world = str(path), cfg.train.world_size
    harmless = check_resumable(meta, cfg.to_dict(), world, shard_dir, where)
    if meta.get("state_version") != state_version:
        raise ResumeError(
            f"{where} holds trainer state version {meta.get('state_version')!r}, this code reads {state_version}: "
            "resume with the code version that saved it, or start a fresh run in another --out"
        )
    saved_span = tuple(meta.get("schedule") or ())
    if saved_span != tuple(schedule):
        saved_text = f"{saved_span[0]} {saved_span[1]}s" if len(saved_span) == 2 else "an unknown length"
        hint = f"train.max_steps={saved_span[0]}" if saved_span[1:] == ("step",) else "the same data and train.epochs"
        raise ResumeError(
            f"{where}: its LR schedule spans {saved_text}, this run's {schedule[0]} {schedule[1]}s (from "
            f"train.epochs, train.max_steps and the samples captured): resume with {hint}, or start a fresh run "
            "in another --out"
        )
    if meta["world_size"] != world:
        harmless = sorted({*harmless, f"train.world_size: {meta['world_size']!r} -> {world!r}"})
    return ResumeDecision(str(path), int(meta["step"]), int(meta["world_size"]), world,
                          hashlib.sha256(raw).hexdigest(), tuple(harmless))  # fmt: skip


def verify(decision: ResumeDecision) -> dict[str, Any]:
    """A rank's check that the decided checkpoint is still the one decided on; its marker."""
    path = Path(decision.tag)
    try:
        raw = (path / MARKER).read_bytes()
    except OSError as e:
        raise ResumeError(f"{path}: the checkpoint decided on for this resume is gone ({e})") from None
    if hashlib.sha256(raw).hexdigest() != decision.marker_sha256:
        raise ResumeError(f"{path}/{MARKER} changed after the resume was decided: restart the run (--resume auto)")
    meta = read_marker(path)
    if meta is None:
        raise ResumeError(f"{path} is no longer a complete checkpoint: {marker_problem(path)}")
    return meta
