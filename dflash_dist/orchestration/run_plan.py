"""The run plan: what every role of one run must agree on, computed once before anything starts.

`make_plan` checks what an earlier run left under the output directory (`plan_stages`), resolves
the target, ingests the data (with the content hash the capture ledger records), plans the LR
schedule over the samples the run will train, makes the resume decision (trainer/resume.py: the
one place it is made; ranks only verify it), and only then writes the ingested data, so a refused
run leaves an earlier run's files as they were. It hashes the target's weights (1-2 min at 27B) and
derives the provenance trainers demand and the drafter shape. The result is a frozen `RunPlan`:
the Ray pipeline uses it directly, and hands its check of the weights (`weights`: hash and file
stamp) to the capture actors and the evaluator, which load files carrying that stamp without
hashing them again (another node's are hashed there: target/weights_check.py). Under Slurm one
task computes it and writes it atomically as JSON (`<out>/plans/<key>.json`, `share_plan`), and
the other tasks of the job read it instead of repeating the work (a rank never hashes the
target; a capture slice that read the plan hashes the files it loads, as a plan read from JSON
carries no check: `RunPlan.weights`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from data_pipeline.durable_files import write_text_atomic
from data_pipeline.ledger import CaptureData
from data_pipeline.provenance import Provenance
from dflash_dist.config import Config
from dflash_dist.model.config import DrafterConfig
from dflash_dist.orchestration.later_epochs import LaterEpochs
from dflash_dist.target.loading import TargetIdentity
from dflash_dist.target.weights_check import VerifiedWeights
from dflash_dist.trainer.resume import ResumeDecision

log = logging.getLogger(__name__)

PLAN_SCHEMA = 3
PLANS_DIR = "plans"
PLAN_NAME = "run_plan.json"  # the plan of the latest Ray run, for the record (<out>/run_plan.json)
PLAN_WAIT_S = 1800.0  # a task waiting for another's plan gives up after this (that task failed)


class PipelineError(RuntimeError):
    """A stage failed or cannot start; the message says which and what to do."""


@dataclass(frozen=True)
class DataPlan:
    """The ingested conversations under <out>/data/ and the identity of what capture reads."""

    train_jsonl: str
    eval_jsonl: str | None
    capture: CaptureData  # source, data.max_train_samples, records, content hash (the ledger's record)
    tokens: int = 0  # the records' tokens as capture builds them (responses at capture.max_new_tokens if regenerated)


@dataclass(frozen=True)
class RunPlan:
    stages: tuple[str, ...]  # what runs, after what an earlier run left (a complete capture is not redone)
    resume: str  # as asked: auto, never or a checkpoint tag directory
    resume_from: ResumeDecision | None  # the decision: the checkpoint training continues from, None: step 0
    target_dir: str
    identity: TargetIdentity  # with the weight hash
    expected: Provenance  # what trainers and the evaluator demand of every shard
    drafter: DrafterConfig
    data: DataPlan | None  # None when no stage reads the conversations (training alone)
    num_samples: int | None  # samples per epoch the run trains (its LR schedule's and lost fraction's base)
    made_by: str  # who computed it (for a person reading the file)
    later_epochs: str = "keep"  # capture.later_epochs resolved: keep | recapture (later_epochs.py)
    epoch_costs: LaterEpochs | None = None  # the estimates behind it (when this run captures)
    # The check behind identity.target_hash (hash + stamp of every weight file), in memory only: handed
    # to the processes of this run that load the target (capture actors, the evaluator), which skip
    # hashing files that still carry its stamp. Never written (to_json) nor read back (from_json):
    # a plan file is only as trustworthy as whoever can write the run directory, and a stamp from it
    # could pair the plan's hash with other weights' files; a plan read back has None (hashed there).
    weights: VerifiedWeights | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> str:
        d = asdict(self)
        del d["weights"]  # in memory only (see the field)
        d["expected"] = self.expected.to_dict()
        return json.dumps({"schema": PLAN_SCHEMA, **d}, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> RunPlan:
        try:
            d = json.loads(text)
            if d.pop("schema") != PLAN_SCHEMA:
                raise ValueError(f"schema is not {PLAN_SCHEMA}")
            data = d.pop("data")
            decision = d.pop("resume_from")
            costs = d.pop("epoch_costs")
            d.pop("weights", None)  # never trusted from a file (see the field): hashed where it is loaded
            return cls(
                epoch_costs=None if costs is None else LaterEpochs(**costs),
                resume_from=None if decision is None else ResumeDecision.from_dict(decision),
                stages=tuple(d.pop("stages")),
                identity=TargetIdentity(**_tuples(d.pop("identity"))),
                expected=Provenance.from_dict(d.pop("expected"), where),
                drafter=DrafterConfig.from_dict(d.pop("drafter")),
                data=None if data is None else DataPlan(data["train_jsonl"], data["eval_jsonl"],
                                                        CaptureData(**data["capture"]), data["tokens"]),
                **d,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PipelineError(f"{where}: not a run plan this code reads ({type(e).__name__}: {e}); "
                                "delete it") from None


def _tuples(d: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def plan_stages(cfg: Config, stages: tuple[str, ...], resume: str) -> tuple[str, ...]:
    """The stages to run given what an earlier run left under cfg.out, checked before anything is
    written or started. `resume` (auto, never or a checkpoint tag directory) applies to training
    (checkpoint.plan_resume refuses never over a directory holding a run); unless it is never,
    complete (DONE) shards are reused instead of re-extracted and an unfinished capture is resumed:
    its complete shards are kept and only the samples missing from them are captured
    (data_pipeline/ledger.py)."""
    from data_pipeline.epoch_dirs import RECAPTURE, epoch_dir, read_mode
    from data_pipeline.ledger import captured_keys
    from data_pipeline.records import DONE_NAME, MANIFEST_NAME
    from dflash_dist.trainer.checkpoint import ResumeError, plan_resume

    shards = cfg.out / "shards"
    try:
        if "train" in stages:
            plan_resume(resume, cfg.out / "checkpoints")
        recapture = (read_mode(shards) or cfg.capture.later_epochs) == RECAPTURE
    except (ResumeError, ValueError) as e:
        raise PipelineError(str(e)) from None
    # every epoch's directory that will be captured (under recapture one per epoch) is complete
    epochs = range(cfg.train.epochs if recapture else 1)
    complete = all((epoch_dir(shards, e, recapture) / DONE_NAME).exists() for e in epochs)
    if "extract" in stages and "train" not in stages and recapture:
        raise PipelineError("capture.later_epochs=recapture captures each later epoch while the trainers consume the "
                            "one before: use `dflash-dist run` (extract and train together)")
    if "train" in stages and "extract" not in stages and recapture and not complete:
        raise PipelineError(f"{shards}: later epochs are captured again (later_epochs.json: recapture) and not all "
                            "of them are captured yet: continue with `dflash-dist run --resume auto`")
    if "extract" in stages and (shards / MANIFEST_NAME).exists():
        if resume == "never":
            raise PipelineError(
                f"{shards} already holds shards: pass --resume auto to reuse complete shards (and continue the "
                "training run there, if any), or use another --out"
            )
        if complete:
            log.info("extract skipped: %s is complete (%s), reusing its shards", shards, DONE_NAME)
            stages = tuple(s for s in stages if s != "extract")
        else:
            log.info("resuming the unfinished capture in %s: %d samples already settled (complete shards, skipped) "
                     "are kept, the rest is captured", shards, len(captured_keys(shards)))
    if "extract" in stages and "train" not in stages and cfg.capture.max_buffer_bytes is not None:
        raise PipelineError(
            f"capture.max_buffer_bytes={cfg.capture.max_buffer_bytes} pauses the capture until a trainer consumes "
            "shards, and this invocation runs no trainer: use `dflash-dist run`, or set capture.max_buffer_bytes=null"
        )
    if "train" in stages and "extract" not in stages and not (shards / MANIFEST_NAME).exists():
        raise PipelineError(f"no shards under {shards}: run `dflash-dist extract` with the same --out first")
    return stages


def decide_training(cfg: Config, stages: tuple[str, ...], resume: str,
                    num_samples: int | None) -> ResumeDecision | None:  # fmt: skip
    """The resume decision of the run's trainer group (trainer/resume.py), made here once, or
    None (no training, or from step 0); a checkpoint the run cannot continue is a PipelineError."""
    from dflash_dist.trainer.checkpoint import ResumeError
    from dflash_dist.trainer.ds_config import planned_schedule
    from dflash_dist.trainer.resume import decide
    from dflash_dist.trainer.state import STATE_VERSION

    if "train" not in stages:
        return None
    try:
        schedule = planned_schedule(cfg, num_samples)
        return decide(resume, cfg, cfg.out / "shards", schedule, STATE_VERSION)
    except (ResumeError, ValueError) as e:
        raise PipelineError(str(e)) from None


def planned_samples(cfg: Config, data: DataPlan | None, stages: tuple[str, ...], resume: str) -> int | None:
    """Samples per epoch: the ingested conversations when this run reads them, else those a
    complete capture was given (its manifest's plus those it skipped, non-finite or empty
    responses, as the ingested count includes them: the same base for the LR schedule and
    data.max_lost_fraction however the run is resumed), else data.max_train_samples. A training that resumes a
    checkpoint planned over a finished capture's written samples alone (a training-only run
    before the skipped ones counted) keeps that base (`_checkpoint_base`)."""
    from data_pipeline.ledger import read_skipped
    from data_pipeline.records import DONE_NAME
    from data_pipeline.shard_reader import read_manifest

    shards = cfg.out / "shards"
    if not (shards / DONE_NAME).exists():
        return data.capture.records if data is not None else cfg.data.max_train_samples
    try:  # a damaged line's error names the file, the line and the fix
        written = sum(r.n_samples for r in read_manifest(shards))
        given = data.capture.records if data is not None else written + len(read_skipped(shards))
    except ValueError as e:
        raise PipelineError(str(e)) from None
    return _checkpoint_base(cfg, resume, given, written) if "train" in stages else given


def _checkpoint_base(cfg: Config, resume: str, given: int, written: int) -> int:
    """`written` when the checkpoint `resume` picks records the LR schedule planned over it and
    not the one over `given` (the recorded plan wins: the run resumes exactly, with its schedule,
    step count and loss budget, instead of being refused as another schedule length over the same
    shards); else `given`. A checkpoint that cannot be read is left to decide_training to name."""
    from dflash_dist.trainer.checkpoint import ResumeError, plan_resume, read_marker
    from dflash_dist.trainer.ds_config import planned_schedule

    if given == written:
        return given
    try:
        path = plan_resume(resume, cfg.out / "checkpoints")
        saved = tuple(((read_marker(path) if path is not None else None) or {}).get("schedule") or ())
        if saved and saved != planned_schedule(cfg, given) and saved == planned_schedule(cfg, written):
            log.info("%s planned its LR schedule over the %d written samples (not the %d given): resumed on them",
                     path, written, given)  # fmt: skip
            return written
    except (ResumeError, ValueError):
        pass
    return given


def make_plan(cfg: Config, stages: tuple[str, ...], resume: str, made_by: str = "") -> RunPlan:
    """Everything the run's roles share, computed here once (see the module docstring)."""
    from dflash_dist.capture.data_prep import write_data
    from dflash_dist.target.loading import (
        drafter_config_for,
        expected_provenance,
        load_tokenizer,
        resolve_target_dir,
        target_identity,
        tokenizer_mask_id,
    )
    from dflash_dist.target.weights_check import hashed_weights

    stages = plan_stages(cfg, stages, resume)
    target_dir = resolve_target_dir(cfg)
    tokenizer = load_tokenizer(target_dir)
    splits, data = _plan_data(cfg, tokenizer) if ("extract" in stages or "eval" in stages) else (None, None)
    num_samples = planned_samples(cfg, data, stages, resume)
    resume_from = decide_training(cfg, stages, resume, num_samples)
    t0 = time.monotonic()
    weights = hashed_weights(target_dir)
    ident = target_identity(cfg, target_dir, weights)
    log.info("target %s: weights hashed once for the run in %.1fs (%s...)", ident.target_id, time.monotonic() - t0,
             ident.target_hash[:12])
    expected = expected_provenance(cfg, target_dir, ident, tokenizer)
    check_shard_tree(cfg, stages, expected)
    if splits is not None:  # every check passed: now the ingested files may be replaced
        write_data(cfg, splits)
    drafter = drafter_config_for(cfg, target_dir, tokenizer_mask_id(tokenizer))
    mode, costs = plan_later_epochs(cfg, stages, data, num_samples, expected, target_dir)
    return RunPlan(tuple(stages), resume, resume_from, str(target_dir), ident, expected, drafter, data, num_samples,
                   made_by or f"pid {os.getpid()} on {os.uname().nodename}", mode, costs, weights)


def check_shard_tree(cfg: Config, stages: tuple[str, ...], expected: Provenance) -> None:
    """What an earlier run left in the shard tree, checked before anything runs over it: every
    listed shard of every epoch's directory has the provenance this run demands, and training does
    not start over a finished capture that lost more samples than data.max_lost_fraction allows
    (ledger.capture_loss_problem), both as a PipelineError naming the file. The readers and
    writers check each directory they open, but under recapture a later epoch is captured from
    the token store, i.e. from what epoch 0 tokenized with its template for its target, into a
    directory that may hold no shard yet, while epoch 0's shards are already released: a changed
    target, template, layer set, dtype or kernel path would go unnoticed there. Epoch 0's
    manifest keeps its lines after its shards are deleted, so its provenance is still known."""
    from data_pipeline.epoch_dirs import epoch_dirs
    from data_pipeline.ledger import capture_loss_problem
    from data_pipeline.provenance import check_compatible
    from data_pipeline.records import DONE_NAME
    from data_pipeline.shard_reader import read_manifest

    for _, shard_dir in epoch_dirs(cfg.out / "shards"):
        try:
            for record in read_manifest(shard_dir):
                check_compatible(expected, record.provenance, str(shard_dir / record.name))
        except ValueError as e:  # ProvenanceMismatch, or a manifest line that does not parse
            raise PipelineError(str(e)) from None
        if "train" in stages and (shard_dir / DONE_NAME).exists():
            problem = capture_loss_problem(shard_dir, cfg.data.max_lost_fraction)
            if problem is not None:
                raise PipelineError(f"{problem}; training over this capture is refused")


def plan_later_epochs(cfg: Config, stages: tuple[str, ...], data: DataPlan | None, num_samples: int | None,
                      expected: Provenance, target_dir: Path) -> tuple[str, LaterEpochs | None]:
    """The run's later-epochs mode (later_epochs.py) and, when this run captures, its estimates,
    printed before anything runs; recorded in the shard tree (epoch_dirs.write_mode), where a
    resumed run finds it."""
    from data_pipeline.epoch_dirs import KEEP, read_mode, write_mode
    from data_pipeline.feature_codec import feature_bytes_per_token
    from data_pipeline.records import DONE_NAME
    from data_pipeline.shard_reader import read_manifest
    from dflash_dist.orchestration import later_epochs
    from dflash_dist.target.loading import DTYPES, target_matmul_params

    shards = cfg.out / "shards"
    asked = cfg.capture.later_epochs
    try:
        recorded = read_mode(shards)
        if "extract" not in stages:
            later_epochs.check_recorded(asked, recorded)
            return recorded or (KEEP if asked == "auto" else asked), None
        if (shards / DONE_NAME).exists():  # epoch 0 is captured: its real size
            records = read_manifest(shards)
            samples, tokens, source = sum(r.n_samples for r in records), sum(r.n_tokens for r in records), "captured"
        else:
            samples, tokens = num_samples or 0, data.tokens if data is not None else 0
            source = ("ingested; responses counted at capture.max_new_tokens, an upper bound" if cfg.capture.regenerate
                      else "ingested")
            if not tokens:
                tokens, source = samples * cfg.data.max_length, "samples x data.max_length, an upper bound"
        width = feature_bytes_per_token(expected.feature_encoding, DTYPES[expected.dtype].itemsize,
                                        len(expected.layer_ids), expected.hidden_size)
        try:
            params = target_matmul_params(target_dir)
        except Exception as e:  # a config transformers cannot build on the meta device: no GPU-hours estimate
            log.warning("target parameters not counted (%s: %s): GPU-hours not estimated", type(e).__name__, e)
            params = 0
        costs = later_epochs.decide(cfg, samples, tokens, source, width, params, recorded)
    except ValueError as e:
        raise PipelineError(str(e)) from None
    for line in costs.lines():
        log.info("%s", line)
    if recorded is None:
        write_mode(shards, costs.mode)
    return costs.mode, costs


def _plan_data(cfg: Config, tokenizer) -> tuple[dict, DataPlan]:
    """Ingest the data (capture/data_prep.py, nothing written yet) and, when shards from an
    earlier capture are there, refuse to go on over other conversations than theirs (the
    ledger's capture_data.json). Returns the ingested splits (for write_data) and the plan."""
    from data_pipeline.ledger import DATA_NAME, DataChanged, check_capture_data
    from dflash_dist.capture.data_prep import capture_data, ingest_data, ingested_paths

    splits = ingest_data(cfg, tokenizer)
    capture = capture_data(cfg, splits["train"][0])
    shards = cfg.out / "shards"
    if (shards / DATA_NAME).exists():
        try:
            check_capture_data(shards, capture)
        except DataChanged as e:
            raise PipelineError(str(e)) from None
    train_jsonl = ingested_paths(cfg, "train")[0]
    eval_jsonl = ingested_paths(cfg, "eval")[0] if "eval" in splits else None
    return splits, DataPlan(str(train_jsonl), str(eval_jsonl) if eval_jsonl else None, capture,
                            splits["train"][1].tokens)


def plan_path(out: Path, key: str) -> Path:
    return out / PLANS_DIR / f"{key}.json"


def write_plan(path: Path, plan: RunPlan) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, plan.to_json())


def read_plan(path: Path) -> RunPlan:
    return RunPlan.from_json(path.read_text(), str(path))


def check_plan_paths(plan: RunPlan, cfg: Config, resume: str, where: str) -> RunPlan:
    """`plan`, read from `where` by another task of the job, if the paths it names are the ones this
    task's own config and command give: the target's directory, the ingested files under
    <out>/data/, a checkpoint under <out>/checkpoints/ (or the --resume PATH given). A plan file is
    as writable as the run directory (and a job's key is predictable, so one can be put there
    before the job starts): another path would have this task read a model, conversations or a
    checkpoint from outside the run. Else a PipelineError naming the field."""
    from dflash_dist.capture.data_prep import ingested_paths
    from dflash_dist.target.loading import expected_target_dir

    wrong = []
    if Path(plan.target_dir) != expected_target_dir(cfg):
        wrong.append(f"target_dir {plan.target_dir!r} (this task's target: {str(expected_target_dir(cfg))!r})")
    if plan.data is not None:
        for split, got, optional in (("train", plan.data.train_jsonl, False), ("eval", plan.data.eval_jsonl, True)):
            own = str(ingested_paths(cfg, split)[0])
            if got != own and not (optional and got is None):
                wrong.append(f"data.{split}_jsonl {got!r} (this run's: {own!r})")
    if plan.resume_from is not None:
        tag = Path(plan.resume_from.tag)
        if tag.parent != cfg.out / "checkpoints" and tag != Path(resume):
            wrong.append(f"resume_from.tag {plan.resume_from.tag!r} (not under {cfg.out / 'checkpoints'}, nor "
                         f"--resume {resume})")  # fmt: skip
    if wrong:
        raise PipelineError(f"{where}: names {'; '.join(wrong)}: this plan was not made for this run's config (or "
                            "not by dflash-dist); delete it and resubmit the job")  # fmt: skip
    return plan


def fail_plan(out: Path, key: str, message: str) -> None:
    """The leader of job `key` could not make the plan: the waiting tasks stop with `message`
    instead of waiting PLAN_WAIT_S for a plan that will not come."""
    path = plan_path(out, key).with_suffix(".failed")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, message + "\n")


def share_plan(cfg: Config, stages: tuple[str, ...], resume: str, key: str, leader: bool | None = None,
               wait_s: float = PLAN_WAIT_S) -> RunPlan:
    """The plan of the job `key` (a Slurm job id, step id and restart count: another srun in the
    same allocation gets its own plan): the leader computes and writes it; every other task waits
    for that file and reads it, or stops with the leader's error (`fail_plan`). `leader=None`:
    whoever first creates `<key>.lock` leads (the tasks of a job array, which have no rank); a
    leader that fails removes its lock, so a waiting task takes over."""
    path = plan_path(cfg.out, key)
    lock, failed = path.with_suffix(".lock"), path.with_suffix(".failed")
    deadline = time.monotonic() + wait_s
    waited = False
    while not path.exists():
        if leader is None:
            lock.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                try:
                    plan = make_plan(cfg, stages, resume, made_by=key)
                    write_plan(path, plan)
                    return plan
                finally:
                    lock.unlink(missing_ok=True)
        elif leader:
            try:
                plan = make_plan(cfg, stages, resume, made_by=key)
            except Exception as e:
                fail_plan(cfg.out, key, f"{type(e).__name__}: {e}")
                raise
            write_plan(path, plan)
            return plan
        elif failed.exists():
            raise PipelineError(f"the task computing the run plan {path} failed: {failed.read_text().strip()}")
        if time.monotonic() > deadline:
            raise PipelineError(f"{path} did not appear within {wait_s:.0f}s: the task computing the run plan failed "
                                "(see its log); resubmit the job")
        waited = True
        time.sleep(0.5)
    if waited:
        log.info("run plan %s read (computed by another task of the job)", path)
    return check_plan_paths(read_plan(path), cfg, resume, str(path))
