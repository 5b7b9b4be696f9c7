"""One target actor's work as a plain loop: read its slice of the conversations, let the target
regenerate the responses greedily (the paper trains on target-generated responses), capture the
k layers' features and the argmax in length-sorted passes of at most `capture.token_budget`
padded tokens, and write webdataset shards with provenance.

Restartable: the slice minus the keys already settled in the shard directory (ledger.py) is
what remains, so an actor restarted by Ray redoes exactly its unfinished work. Bounded: a new
shard is opened only while the disk buffer has room (disk_budget.py)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from data_pipeline.chat_data import ChatEncoder, ChatRecord, read_chat_jsonl, template_hash
from data_pipeline.disk_budget import BufferGate, BufferPolicy
from data_pipeline.ingest import content_hash, sample_keys
from data_pipeline.ledger import CaptureData, captured_keys, check_capture_data, record_skipped, remove_stale_tmp
from data_pipeline.records import Sample
from data_pipeline.shard_reader import NONFINITE
from data_pipeline.shard_writer import ShardWriter
from dflash_dist.capture.data_prep import data_sources
from dflash_dist.capture.fused_target import KERNEL_PATH_OF, fuse_target
from dflash_dist.capture.host_sink import WriterPool
from dflash_dist.config import Config
from dflash_dist.logging_setup import progress
from dflash_dist.model.capture import capture_features, check_kernel_path
from dflash_dist.target.generation import generate_responses, pad_token_id, stop_token_ids
from dflash_dist.target.loading import TargetIdentity, load_target, provenance_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureResult:
    """What one attempt of one actor did (a restarted actor reports only its own attempt)."""

    actor_index: int
    samples: int
    tokens: int
    shards: int
    kernel_path: str
    skipped: int  # non-finite features: recorded in the ledger, not written
    resumed: int  # samples of this actor's slice already settled before this attempt
    waited_s: float  # paused for the disk buffer


def my_slice(num_records: int, actor_index: int, num_actors: int) -> list[int]:
    """Record indices this actor captures: round-robin, disjoint, complete over all actors."""
    return list(range(actor_index, num_records, num_actors))


def pack_by_tokens(lengths: list[int], token_budget: int | None, batch_size: int) -> list[list[int]]:
    """Indices into `lengths` grouped into capture passes. With a budget: longest first, each
    pass as many sequences as fit (longest x count <= budget; an overlong one alone). Without:
    `batch_size` per pass in the given order."""
    if token_budget is None:
        return [list(range(i, min(i + batch_size, len(lengths)))) for i in range(0, len(lengths), batch_size)]
    passes: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        if passes and lengths[passes[-1][0]] * (len(passes[-1]) + 1) <= token_budget:
            passes[-1].append(i)
        else:
            passes.append([i])
    return passes


class CaptureJob:
    def __init__(self, cfg: Config, target_dir: Path, ident: TargetIdentity, train_jsonl: Path, shard_dir: Path,
                 actor_index: int, num_actors: int) -> None:
        self.cfg, self.ident = cfg, ident
        self.train_jsonl, self.shard_dir = Path(train_jsonl), Path(shard_dir)
        self.actor_index, self.num_actors = actor_index, num_actors
        self.prefix = f"t{actor_index:03d}"
        self.model, self.tokenizer = load_target(cfg, Path(target_dir))
        self.kernel_path = check_kernel_path(self.model, cfg.target.allow_torch_gdn_on_cuda)
        self.encoder = ChatEncoder(self.tokenizer, enable_thinking=cfg.data.enable_thinking)
        self.provenance = provenance_for(
            ident, self.model, template_hash(self.tokenizer, cfg.data.enable_thinking)
        )
        if cfg.capture.kernels != "eager":
            if self.kernel_path != "fla":
                raise ValueError(f"capture.kernels={cfg.capture.kernels} needs fla's kernels on CUDA; this target runs "
                                 f"{self.kernel_path!r} (set target.device=cuda with flash-linear-attention and "
                                 "triton installed)")
            fuse_target(self.model, layers=cfg.capture.kernels == "fused2")
            self.kernel_path = KERNEL_PATH_OF[cfg.capture.kernels]
            self.provenance = dataclasses.replace(self.provenance, kernel_path=self.kernel_path)
        self.pool: WriterPool | None = None
        self.gate = BufferGate(self.shard_dir, BufferPolicy.from_config(cfg))
        self.counts = {"todo": 0, "resumed": 0, "samples": 0, "skipped": 0, "tokens": 0}

    def progress(self) -> dict:
        """For the heartbeat: counts of this attempt and whether it waits for disk room."""
        return {**self.counts, "waiting_for_disk": self.gate.waiting, "waited_s": round(self.gate.waited_s, 1)}

    def _sequence(self, rec: ChatRecord, response: list[int] | None) -> tuple[list[int], list[int]]:
        if response is None:
            enc = self.encoder.encode(rec)
            ids, mask = enc.input_ids.tolist(), enc.loss_mask.tolist()
        else:
            prompt = self.encoder.prompt_ids(rec).tolist()
            ids, mask = prompt + response, [0] * len(prompt) + [1] * len(response)
        limit = self.cfg.data.max_length
        return ids[:limit], mask[:limit]

    def run(self) -> CaptureResult:
        cfg, counts = self.cfg, self.counts
        records = read_chat_jsonl(self.train_jsonl)
        if cfg.data.max_train_samples is not None:
            records = records[: cfg.data.max_train_samples]
        self.keys = sample_keys(records)  # from content: a key names the same conversation on any rerun
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        source, _ = data_sources(cfg)
        check_capture_data(self.shard_dir, CaptureData(str(source) if source else None, cfg.data.max_train_samples,
                                                       len(records), content_hash(self.keys)))
        remove_stale_tmp(self.shard_dir, self.prefix)  # an earlier attempt's unfinished shard
        settled = captured_keys(self.shard_dir)
        ours = my_slice(len(records), self.actor_index, self.num_actors)
        todo = [i for i in ours if self.keys[i] not in settled]
        counts["todo"], counts["resumed"] = len(todo), len(ours) - len(todo)
        if counts["resumed"]:
            log.info("actor %d: %d of %d samples already captured (ledger of %s); capturing the other %d",
                     self.actor_index, counts["resumed"], len(ours), self.shard_dir, len(todo))
        if cfg.capture.writers:
            return self._run_with_writers(records, todo)
        writer = ShardWriter(self.shard_dir, self.provenance, max_shard_bytes=cfg.capture.shard_bytes,
                             prefix=self.prefix, before_open=self.gate)
        bar = progress(total=len(todo), desc=f"capture {self.prefix}", unit="sample")
        with writer, bar:
            for items in self._passes(records, todo):
                self._capture_and_write(writer, items)
                bar.update(len(items))
        return CaptureResult(self.actor_index, counts["samples"], counts["tokens"], len(writer.records),
                             self.kernel_path, counts["skipped"], counts["resumed"], self.gate.waited_s)

    def _passes(self, records: list[ChatRecord], todo: list[int]):
        """The capture passes over `todo`: [(record index, (ids, loss mask), record)] each."""
        cfg = self.cfg
        for start in range(0, len(todo), cfg.capture.sort_window):
            window = todo[start : start + cfg.capture.sort_window]
            seqs = self._sequences([records[i] for i in window])
            for group in pack_by_tokens([len(ids) for ids, _ in seqs], cfg.capture.token_budget,
                                        cfg.capture.batch_size):
                yield [(window[j], seqs[j], records[window[j]]) for j in group]

    @classmethod
    def for_model(cls, cfg: Config, model, provenance, layer_ids, shard_dir: Path, actor_index: int = 0) -> CaptureJob:
        """A job around an already built model and its provenance, for capture_passes alone
        (bench/bench_capture.py measures this path on a random 27B-shaped target)."""
        job = cls.__new__(cls)
        job.cfg, job.model, job.provenance, job.shard_dir = cfg, model, provenance, Path(shard_dir)
        job.ident = TargetIdentity("", provenance.target_id, provenance.target_hash, tuple(layer_ids),
                                   provenance.hidden_size, provenance.dtype)
        job.actor_index, job.num_actors, job.prefix = actor_index, 1, f"t{actor_index:03d}"
        job.kernel_path, job.pool = provenance.kernel_path, None
        job.gate = BufferGate(job.shard_dir, BufferPolicy.from_config(cfg))
        job.counts = {"todo": 0, "resumed": 0, "samples": 0, "skipped": 0, "tokens": 0}
        return job

    def writer_pool(self) -> WriterPool:
        """capture.writers writer processes (started, ready) for this job's shard directory."""
        cfg = self.cfg
        return WriterPool(cfg, self.shard_dir, self.provenance, self.prefix, self.actor_index, cfg.capture.writers,
                          device=next(self.model.parameters()).device, tokens_hint=cfg.capture.token_budget or 0)

    def capture_passes(self, passes, on_pass=None, pool: WriterPool | None = None):
        """Capture each pass [(key, ids, loss mask, meta)] and hand it to the writer processes
        (`pool`, else writer_pool()) through pinned host buffers (capture/host_sink.py) while the
        GPU runs the next pass; returns the writers' SinkCounts once every shard is listed."""
        self.pool = pool = pool or self.writer_pool()
        try:
            for items in passes:
                cap, attn = self._capture_padded([(ids, mask) for _, ids, mask, _ in items])
                pool.submit(cap.features, cap.target_argmax, attn, items)
                self._sync_counts()
                if on_pass is not None:
                    on_pass(items)
            done = pool.close()
        except BaseException:
            pool.abort()
            raise
        finally:
            self.pool = None
        self._sync_counts(done)
        return done

    def _run_with_writers(self, records: list[ChatRecord], todo: list[int]) -> CaptureResult:
        """capture.writers > 0: capture_passes over this actor's passes."""
        cfg, counts = self.cfg, self.counts
        bar = progress(total=len(todo), desc=f"capture {self.prefix}", unit="sample")
        passes = ([(self.keys[i], ids, mask, {"source": rec.where}) for i, (ids, mask), rec in items]
                  for items in self._passes(records, todo))
        with bar:
            done = self.capture_passes(passes, on_pass=lambda items: bar.update(len(items)))
        self.gate.waited_s = done.waited_disk_s
        log.info("actor %d: %d samples in %d shards by %d writer processes (busy %.1f s; GPU thread waited %.1f s "
                 "for a buffer)", self.actor_index, done.samples, done.shards, cfg.capture.writers, done.busy_s,
                 done.gpu_waited_s)
        return CaptureResult(self.actor_index, counts["samples"], counts["tokens"], done.shards, self.kernel_path,
                             counts["skipped"], counts["resumed"], done.waited_disk_s)

    def _sync_counts(self, c=None) -> None:
        c = c or (self.pool.counts if self.pool is not None else None)
        if c is not None:
            self.counts.update(samples=c.samples, tokens=c.tokens, skipped=c.skipped)

    def _sequences(self, batch: list[ChatRecord]) -> list[tuple[list[int], list[int]]]:
        """(input ids, loss mask) per record: the recorded conversation, or its prompt plus the
        target's greedy response (generated in batch_size batches of similar prompt lengths)."""
        cfg = self.cfg
        if not cfg.capture.regenerate:
            return [self._sequence(r, None) for r in batch]
        stops = stop_token_ids(self.tokenizer)
        pad = pad_token_id(self.tokenizer, stops)
        prompts = [self.encoder.prompt_ids(r).tolist() for r in batch]
        order = sorted(range(len(batch)), key=lambda i: len(prompts[i]))
        responses: list[list[int]] = [[] for _ in batch]
        for s in range(0, len(order), cfg.capture.batch_size):
            chunk = order[s : s + cfg.capture.batch_size]
            generated = generate_responses(self.model, [prompts[i] for i in chunk], cfg.capture.max_new_tokens,
                                           stops, pad)
            for i, y in zip(chunk, generated):
                responses[i] = list(y.tokens)
        return [self._sequence(r, y) for r, y in zip(batch, responses)]

    def _capture_and_write(self, writer: ShardWriter, items: list[tuple[int, tuple[list[int], list[int]], ChatRecord]]):
        """One target pass over `items`; each sample's features checked for NaN/Inf, then written
        (or its key recorded as skipped)."""
        feats, argmaxes = self._capture([seq for _, seq, _ in items])
        for (idx, (ids, mask), rec), f, a in zip(items, feats, argmaxes):
            key = self.keys[idx]
            if not bool(torch.isfinite(f).all()):
                record_skipped(self.shard_dir, key, NONFINITE, self.actor_index)
                self.counts["skipped"] += 1
                continue
            writer.write(Sample(key=key, input_ids=torch.tensor(ids, dtype=torch.int32),
                                loss_mask=torch.tensor(mask, dtype=torch.uint8), features=f.cpu(),
                                target_argmax=a.cpu().to(torch.int32), meta={"source": rec.where}))
            self.counts["samples"] += 1
            self.counts["tokens"] += len(ids)

    def _capture(self, seqs: list[tuple[list[int], list[int]]]):
        """Per-sequence features and argmax of one right-padded capture pass."""
        cap, _ = self._capture_padded(seqs)
        lengths = [len(s) for s, _ in seqs]
        return ([cap.features[i, :n] for i, n in enumerate(lengths)],
                [cap.target_argmax[i, :n] for i, n in enumerate(lengths)])

    def _capture_padded(self, seqs: list[tuple[list[int], list[int]]]):
        """(CaptureOutput [b, T_max], attention mask [b, T_max] on the device) of one right-padded
        pass; causal layers make padding invisible to real positions."""
        dev = next(self.model.parameters()).device
        width = max(len(ids) for ids, _ in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, (s, _) in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
        # Right padding by construction: no mask for the model (what capture_features does with one
        # after checking it on the device, a sync per pass that would leave the GPU idle meanwhile).
        cap = capture_features(self.model, ids.to(dev, non_blocking=True), self.ident.layer_ids, attention_mask=None,
                               allow_torch_gdn_on_cuda=self.cfg.target.allow_torch_gdn_on_cuda)
        return cap, attn.to(dev, non_blocking=True)
