"""The quality bench's inputs, all from one finished product run directory (`dflash-dist run
CONFIG --out DIR`): its config and run plan, the shards its capture wrote (the features the
product's kernels computed), the held-out prompts it ingested, and its own checkpoints' tau.

Training samples are decoded once (data_pipeline/shard_reader.py, every record's provenance
checked against the plan) into flat tensors: token ids, loss masks and argmax on the host (anchor
sampling and batching run there, as in the trainer), features on the compute device, all shared
with the bench's worker processes. The held-out references are the evaluator's: the target's
greedy continuation of every held-out prompt and the target's features of prompt + continuation,
computed once on the target's device and kernels (target/generation.py, model/capture.py), with
the evaluator's provenance checks.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from data_pipeline.provenance import check_compatible
from data_pipeline.records import DONE_NAME, MANIFEST_NAME, ShardRecord
from data_pipeline.shard_reader import iter_shard_samples, read_manifest, sample_order, shard_order
from dflash_dist.capture.data_prep import eval_prompt_ids, ingested_paths
from dflash_dist.capture.fused_target import features_provenance
from dflash_dist.config import Config, load_config
from dflash_dist.evaluator.evaluator import RESULT_NAME_RE, list_exports
from dflash_dist.evaluator.measure import HeldOut
from dflash_dist.model.capture import capture_features
from dflash_dist.orchestration.run_plan import PLAN_NAME, RunPlan, read_plan
from dflash_dist.target.generation import generate_in_batches, pad_token_id, stop_token_ids
from dflash_dist.target.loading import load_target, target_identity
from dflash_dist.trainer.step_log import TRAIN_LOG

log = logging.getLogger("bench_quality_run")


class BenchInputError(ValueError):
    """The run directory cannot be benchmarked; the message names the file and what to do."""


@dataclass(frozen=True)
class RunInputs:
    run_dir: Path
    config_path: Path  # <run>/config.yaml: the run's resolved config, the base of every variant
    cfg: Config
    plan: RunPlan
    records: tuple[ShardRecord, ...]


def load_run(run_dir: str | Path) -> RunInputs:
    """The run's config, plan and complete shard manifest, each checked."""
    run_dir = Path(run_dir)
    config_path, plan_path, shards = run_dir / "config.yaml", run_dir / PLAN_NAME, run_dir / "shards"
    for path, what in (
        (config_path, "the run's resolved config"),
        (plan_path, "the run plan"),
        (shards / MANIFEST_NAME, "the shard manifest"),
    ):
        if not path.is_file():
            raise BenchInputError(
                f"{path} not found ({what}): --run must be the --out of a finished "
                "`dflash-dist run` (config.yaml, run_plan.json and shards/ are written there)"
            )
    if not (shards / DONE_NAME).exists():
        raise BenchInputError(
            f"{shards}/{DONE_NAME} missing: the run's capture did not finish; finish it "
            "(`dflash-dist run ... --resume auto`) before benchmarking its shards"
        )
    cfg = load_config(config_path, check_files=False)
    plan = read_plan(plan_path)
    records = tuple(read_manifest(shards))
    if not records:
        raise BenchInputError(f"{shards}/{MANIFEST_NAME} lists no shards")
    for r in records:
        check_compatible(plan.expected, r.provenance, str(shards / r.name))
    return RunInputs(run_dir, config_path, cfg, plan, records)


@dataclass
class TrainSet:
    """Every usable captured sample, flat; sample i is [offsets[i], offsets[i+1])."""

    keys: tuple[str, ...]
    offsets: torch.Tensor  # int64 [n+1], host
    input_ids: torch.Tensor  # int32 [tokens], host
    loss_mask: torch.Tensor  # uint8 [tokens], host
    target_argmax: torch.Tensor  # int32 [tokens], host
    features: torch.Tensor  # [tokens, k*H] in the captured dtype, on the compute device
    layer_ids: tuple[int, ...]  # the captured layers, in feature-column order
    hidden_size: int

    def __len__(self) -> int:
        return len(self.keys)

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def share(self) -> TrainSet:
        """Host tensors moved to shared memory, so worker processes map them instead of copying."""
        for t in (self.offsets, self.input_ids, self.loss_mask, self.target_argmax):
            t.share_memory_()
        if not self.features.is_cuda:
            self.features.share_memory_()
        return self


def load_train_set(inputs: RunInputs, device: torch.device, threads: int = 4) -> tuple[TrainSet, dict]:
    """Decode every shard once (`threads` shards at a time), skipping and counting samples the
    trainer would skip (non-finite features). Returns the set and a report of what was read."""
    shards = inputs.run_dir / "shards"
    total = sum(r.n_tokens for r in inputs.records)
    prov = inputs.records[0].provenance
    width = len(prov.layer_ids) * prov.hidden_size
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[prov.dtype]
    feats = torch.empty(total, width, dtype=dtype, device=device)
    ids = torch.empty(total, dtype=torch.int32)
    mask = torch.empty(total, dtype=torch.uint8)
    argmax = torch.empty(total, dtype=torch.int32)
    keys, offsets, nonfinite, at = [], [0], [], 0
    t0 = time.monotonic()

    def read(record: ShardRecord):
        samples = list(iter_shard_samples(shards / record.name, record=record))
        if [s.key for s in samples] != list(record.keys):
            raise BenchInputError(
                f"{shards / record.name}: its samples are not the manifest's keys; the shard "
                "was changed after the capture (re-run the capture)"
            )
        return samples

    with ThreadPoolExecutor(max(1, threads)) as pool:
        for lo in range(0, len(inputs.records), max(1, threads)):  # a window: bounded decoded bytes in flight
            for samples in pool.map(read, inputs.records[lo : lo + max(1, threads)]):
                for s in samples:
                    n = s.num_tokens
                    feats[at : at + n].copy_(s.features)
                    if not bool(torch.isfinite(feats[at : at + n]).all()):
                        nonfinite.append(s.key)  # the trainer's reader skips these too
                        continue
                    ids[at : at + n], mask[at : at + n], argmax[at : at + n] = s.input_ids, s.loss_mask, s.target_argmax
                    keys.append(s.key)
                    at += n
                    offsets.append(at)
    if nonfinite:
        log.warning(
            "%d captured samples hold NaN/Inf features and are left out, as the trainer leaves them: %s",
            len(nonfinite),
            nonfinite[:5],
        )
    if not keys:
        raise BenchInputError(f"{shards}: no usable sample")
    lengths = torch.tensor(offsets).diff()
    spans = list(zip(offsets[:-1], offsets[1:]))
    supervised = torch.stack([mask[a:b].sum() for a, b in spans]).float()
    # samples with a supervised token followed by an unsupervised one before their end: only there do
    # the anchor rules mask and mask_next (loss.sample_anchors) draw different anchors
    turn_ends = sum(bool(((mask[a : b - 1] == 1) & (mask[a + 1 : b] == 0)).any()) for a, b in spans)
    report = {
        "samples": len(keys),
        "tokens": at,
        "nonfinite_skipped": nonfinite,
        "shards": len(inputs.records),
        "median_len": int(lengths.median()),
        "max_len": int(lengths.max()),
        "median_supervised": int(supervised.median()),
        "samples_with_inner_turn_ends": turn_ends,
        "feature_dtype": prov.dtype,
        "feature_bytes": at * width * feats.element_size(),
        "kernel_path": prov.kernel_path,
        "read_s": round(time.monotonic() - t0, 1),
    }
    log.info(
        "train set: %d samples, %d tokens (median %d, supervised median %d), %.1f GB of features on %s in %.0f s",
        len(keys),
        at,
        report["median_len"],
        report["median_supervised"],
        report["feature_bytes"] / 1e9,
        device,
        report["read_s"],
    )
    data = TrainSet(
        tuple(keys),
        torch.tensor(offsets, dtype=torch.int64),
        ids[:at],
        mask[:at],
        argmax[:at],
        feats[:at],
        tuple(prov.layer_ids),
        prov.hidden_size,
    )
    return data, report


def epoch_order(
    records: tuple[ShardRecord, ...], keys: tuple[str, ...], epoch: int, seed: int, shuffle: bool
) -> list[int]:
    """The product trainer's sample order in `epoch` at world size 1 (shard_reader's shard_order and
    sample_order), as indices into `keys` (samples the reader would skip are left out)."""
    index = {k: i for i, k in enumerate(keys)}
    out = []
    for record in shard_order(list(records), epoch, seed):
        for i in sample_order(record.name, record.n_samples, epoch, seed, shuffle):
            j = index.get(record.keys[i])
            if j is not None:
                out.append(j)
    return out


def held_out_references(
    inputs: RunInputs, num_prompts: int, max_new_tokens: int, count: str, extra_tokens: int, batch: int
) -> tuple[list[HeldOut], dict]:
    """The evaluator's references (Evaluator.references, then `_usable` and `_counted` for
    `count`) for the run's held-out prompts, generated `batch` prompts at a time: the target loaded
    as the evaluator loads it, its kernel path and provenance checked against the run plan, greedy
    continuations (`extra_tokens` more past each end for uncapped counting), features of prompt +
    continuation; capped counting keeps the prompts whose continuation has 2+ tokens. The info
    holds the stop tokens (uncapped replay stops after the round that drafts one)."""
    cfg, plan = inputs.cfg, inputs.plan
    t0 = time.monotonic()
    eval_jsonl = Path(plan.data.eval_jsonl) if plan.data and plan.data.eval_jsonl else ingested_paths(cfg, "eval")[0]
    if not eval_jsonl.is_file():
        raise BenchInputError(f"{eval_jsonl} not found: the run has no ingested held-out prompts (data.eval_path)")
    target_dir = Path(plan.target_dir)
    ident = target_identity(cfg, target_dir)
    if ident.target_hash != plan.identity.target_hash:
        raise BenchInputError(
            f"{target_dir}: its weights changed since the run ({PLAN_NAME} has "
            f"{plan.identity.target_hash[:12]}..., now {ident.target_hash[:12]}...): rebuild the "
            "run's target or re-run the run"
        )
    model, tokenizer = load_target(cfg, target_dir)
    prov, gdn_path = features_provenance(cfg, ident, model, tokenizer)  # as the evaluator
    check_compatible(plan.expected, prov, f"the bench's target {target_dir} as loaded here")
    prompts = eval_prompt_ids(eval_jsonl, tokenizer, num_prompts, cfg.data.enable_thinking)
    if len(prompts) < num_prompts:
        log.warning("%s holds %d held-out prompts, fewer than the %d asked for", eval_jsonl, len(prompts), num_prompts)
    stops = stop_token_ids(tokenizer)
    pad = pad_token_id(tokenizer, stops)
    dev = next(model.parameters()).device
    refs = []
    gens = generate_in_batches(model, prompts, max_new_tokens, stops, pad, batch)
    heads = [p + list(g.tokens) for p, g in zip(prompts, gens)]
    tails = (
        [list(g.tokens) for g in generate_in_batches(model, heads, extra_tokens, (), pad, batch)]
        if extra_tokens
        else [[] for _ in heads]
    )
    for prompt, head, tail in zip(prompts, heads, tails):
        if count == "capped" and len(head) - len(prompt) < 2:  # the first token comes from the prompt: no round
            continue
        cap = capture_features(
            model,
            torch.tensor([head], device=dev),
            ident.layer_ids,
            with_argmax=False,
            allow_torch_gdn_on_cuda=cfg.target.allow_torch_gdn_on_cuda,
        )
        assert cap.kernel_path == gdn_path, (cap.kernel_path, prov)
        refs.append(HeldOut(len(prompt), len(head), tuple(head + tail), cap.features[0]))
    if not refs:
        raise BenchInputError(
            f"none of the {len(prompts)} prompts of {eval_jsonl} got a greedy continuation of 2+ "
            "tokens: check the prompts and --eval-tokens"
        )
    info = {
        "prompts": len(refs),
        "asked": num_prompts,
        "eval_jsonl": str(eval_jsonl),
        "max_new_tokens": max_new_tokens,
        "continuation_tokens": sum(r.end - r.prompt_len for r in refs),
        "kernel_path": prov.kernel_path,
        "count": count,
        "stop_ids": list(stops),
        "device": str(dev),
        "seconds": round(time.monotonic() - t0, 1),
    }
    log.info(
        "held-out references: %d prompts, %d continuation tokens on %s (%s) in %.0f s",
        info["prompts"],
        info["continuation_tokens"],
        dev,
        prov.kernel_path,
        info["seconds"],
    )
    del model
    return refs, info


def product_checkpoints(run_dir: Path) -> list[dict]:
    """The run's own checkpoints: export directory, samples trained by then (train_log.jsonl) and
    the tau its evaluator measured (eval/step_N.json), oldest first."""
    samples = {}
    train_log = run_dir / TRAIN_LOG
    if train_log.is_file():
        for line in train_log.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                samples[int(row["step"])] = int(row["samples"])
    own = {}
    eval_dir = run_dir / "eval"
    if eval_dir.is_dir():
        for f in eval_dir.iterdir():
            m = RESULT_NAME_RE.fullmatch(f.name)
            if m:
                r = json.loads(f.read_text())
                own[int(m.group(1))] = {
                    "tau_chain": r["tau_chain"],
                    "tau_ddtree": r["tau_ddtree"],
                    "prompts": r.get("prompts"),
                }
    return [
        {"step": step, "export": str(path), "samples": samples.get(step), "own_eval": own.get(step)}
        for step, path in list_exports(run_dir / "export").items()
    ]
