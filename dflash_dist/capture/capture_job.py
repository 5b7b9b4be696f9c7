"""One target actor's work as a plain loop: read its slice of the conversations, let the target
regenerate the responses greedily (the paper trains on target-generated responses), capture the
k layers' features and the argmax in length-sorted passes of at most `capture.token_budget`
padded tokens, and write webdataset shards with provenance.

Restartable: the slice minus the keys already settled in the shard directory (ledger.py) is
what remains, so an actor restarted by Ray redoes exactly its unfinished work. Bounded: a new
shard is opened only while the disk buffer has room (disk_budget.py). With `recapture` (later
epochs captured again, capture/recapture.py) each sort window's sequences are first put in the
token store (the stored ones reused, never regenerated), so every key the ledger holds has the
exact sequence its features came from. A regenerated response that is empty (the target stopped at
once: generation.is_empty_response, the `regenerate` stage's rule) makes no sample: its key is
recorded lost in the ledger (skipped.jsonl, `empty_response`), never captured nor stored, and
counted against data.max_lost_fraction like a non-finite one."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from data_pipeline.chat_data import ChatEncoder, ChatRecord, read_chat_jsonl
from data_pipeline.disk_budget import BufferGate, BufferPolicy
from data_pipeline.epoch_dirs import sequences_dir
from data_pipeline.ingest import sample_keys
from data_pipeline.ledger import CaptureData, captured_keys, check_capture_data, record_skipped, remove_stale_tmp
from data_pipeline.provenance import Provenance
from data_pipeline.records import EMPTY_RESPONSE, SKIPPED_NAME
from data_pipeline.token_store import SequenceStore, estimate_bytes, write_sequences
from dflash_dist.capture.fused_target import features_provenance
from dflash_dist.capture.host_sink import ThreadWriter, WriterPool, open_writers
from dflash_dist.config import Config
from dflash_dist.logging_setup import progress
from dflash_dist.model.capture import capture_features
from dflash_dist.target.generation import (
    generate_responses,
    is_empty_response,
    pad_token_id,
    response_text,
    stop_token_ids,
)
from dflash_dist.target.loading import TargetIdentity, load_verified_target
from dflash_dist.target.weights_check import VerifiedWeights, hashes_made

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureResult:
    """What one attempt of one actor did (a restarted actor reports only its own attempt)."""

    actor_index: int
    samples: int
    tokens: int
    shards: int
    kernel_path: str
    skipped: int  # non-finite features or an empty regenerated response: recorded in the ledger, not written
    resumed: int  # samples of this actor's slice already settled before this attempt
    waited_s: float  # paused for the disk buffer
    weights_hashed: int = 0  # hashes of the weight files the job's load computed (0: their stamp was the plan's)


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
    """One actor's capture around a built target (`load` builds it from the run plan's target; the
    capture bench builds one around a random target and drives `capture_passes` alone). Every
    pass goes the one way: captured, then submitted to the writers (`capture.writers` processes,
    or the capture thread for 0: host_sink.open_writers)."""

    def __init__(self, cfg: Config, model, provenance: Provenance, shard_dir: Path, actor_index: int = 0,
                 num_actors: int = 1, tokenizer=None, recapture: bool = False) -> None:
        self.cfg, self.model, self.provenance = cfg, model, provenance
        self.kernel_path = provenance.kernel_path
        self.shard_dir = Path(shard_dir)  # epoch 0's, the shard tree's root
        self.actor_index, self.num_actors = actor_index, num_actors
        self.prefix = f"t{actor_index:03d}"
        self.tokenizer = tokenizer  # for run(): the conversations' chat template, regeneration
        self.encoder = None if tokenizer is None else ChatEncoder(tokenizer, enable_thinking=cfg.data.enable_thinking)
        self.writers: ThreadWriter | WriterPool | None = None
        self.gate = BufferGate(self.shard_dir, BufferPolicy.from_config(cfg, recapture))  # over the whole tree
        self.store = SequenceStore(sequences_dir(self.shard_dir)) if recapture else None  # the token store
        self.counts = {"epoch": 0, "todo": 0, "resumed": 0, "samples": 0, "skipped": 0, "tokens": 0}
        self.empty = 0  # this run's (or epoch's) empty regenerated responses, recorded lost (in counts' skipped)
        self.weights_hashed = 0  # hashes of the target's weight files `load` computed

    @classmethod
    def load(cls, cfg: Config, target_dir: str | Path, ident: TargetIdentity, shard_dir: str | Path,
             actor_index: int, num_actors: int, recapture: bool = False,
             verified: VerifiedWeights | None = None) -> CaptureJob:
        """The job of one target actor: its target loaded here, its weight files checked on this node
        to hash to the run plan's (the identity's target_hash, which every shard records: another
        model's weights are refused before anything is written; hashed while the target loads, and
        not at all where they carry the stamp of the plan's check `verified` (the driver's node) or
        the plan hashed them in this process), its kernel path checked, fused if capture.kernels
        says so. `weights_hashed` counts the hashes the load computed."""
        where = f"target actor {actor_index} on {socket.gethostname()}"
        before = len(hashes_made())
        model, tokenizer, _ = load_verified_target(cfg, Path(target_dir), ident.target_hash, where, verified,
                                                   purpose="capture")
        hashed = hashes_made()[before:]
        if hashed:
            why = ("they do not carry the stamp of the run plan's check (another node's files, or others)"
                   if verified is not None else "no check of the run plan was handed over")
            log.info("actor %d: the target's weight files in %s hashed here in %.1f s (alongside the load): %s",
                     actor_index, target_dir, sum(hashed), why)
        else:
            log.info("actor %d: the target's weight files in %s were checked by their stamp (hashed by the run "
                     "plan): not hashed again", actor_index, target_dir)
        provenance, _ = features_provenance(cfg, ident, model, tokenizer)
        job = cls(cfg, model, provenance, Path(shard_dir), actor_index, num_actors, tokenizer, recapture)
        job.weights_hashed = len(hashed)
        return job

    def progress(self) -> dict:
        """For the heartbeat: counts of this attempt and whether it waits for disk room."""
        return {**self.counts, "waiting_for_disk": self.gate.waiting, "waited_s": round(self.gate.waited_s, 1)}

    def _sequence(self, rec: ChatRecord, response: list[int] | None) -> tuple[list[int], list[int]]:
        assert self.encoder is not None, "CaptureJob without a tokenizer captures given passes only"
        if response is None:
            enc = self.encoder.encode(rec)
            ids, mask = enc.input_ids.tolist(), enc.loss_mask.tolist()
        else:
            prompt = self.encoder.prompt_ids(rec).tolist()
            ids, mask = prompt + response, [0] * len(prompt) + [1] * len(response)
        limit = self.cfg.data.max_length
        return ids[:limit], mask[:limit]

    def run(self, train_jsonl: str | Path, data: CaptureData) -> CaptureResult:
        """Capture this actor's slice of the run plan's conversations (`train_jsonl`, the first
        `data.records` of them, as the plan identified them in `data`) minus what the ledger
        already holds. The plan checked `data` against an earlier capture; the ledger records it
        before the first shard (a first capture) and nothing here derives it again."""
        cfg, counts = self.cfg, self.counts
        records = read_chat_jsonl(Path(train_jsonl))[: data.records]
        self.keys = sample_keys(records)  # from content: a key names the same conversation on any rerun
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        check_capture_data(self.shard_dir, data)  # records the plan's data identity (the first capture)
        remove_stale_tmp(self.shard_dir, self.prefix)  # an earlier attempt's unfinished shard
        settled = captured_keys(self.shard_dir)
        ours = my_slice(len(records), self.actor_index, self.num_actors)
        todo = [i for i in ours if self.keys[i] not in settled]
        counts["todo"], counts["resumed"] = len(todo), len(ours) - len(todo)
        self.empty = 0
        if counts["resumed"]:
            log.info("actor %d: %d of %d samples already captured (ledger of %s); capturing the other %d",
                     self.actor_index, counts["resumed"], len(ours), self.shard_dir, len(todo))
        bar = progress(total=len(todo), desc=f"capture {self.prefix}", unit="sample")
        passes = ([(self.keys[i], ids, mask, {"source": rec.where}) for i, (ids, mask), rec in items]
                  for items in self._passes(records, todo, on_lost=bar.update))
        with bar:
            done = self.capture_passes(passes, on_pass=lambda items: bar.update(len(items)))
        self.gate.waited_s = done.waited_disk_s
        where = f"{cfg.capture.writers} writer processes" if cfg.capture.writers else "the capture thread"
        log.info("actor %d: %d samples in %d shards written by %s (busy %.1f s; capture waited %.1f s for a buffer)",
                 self.actor_index, done.samples, done.shards, where, done.busy_s, done.gpu_waited_s)
        return CaptureResult(self.actor_index, counts["samples"], counts["tokens"], done.shards, self.kernel_path,
                             counts["skipped"], counts["resumed"], done.waited_disk_s, self.weights_hashed)

    def _passes(self, records: list[ChatRecord], todo: list[int], on_lost=None):
        """The capture passes over `todo`: [(record index, (ids, loss mask), record)] each. A sort
        window's empty responses are recorded lost (record_empty) and left out before it is packed,
        as recapture.canonical_passes leaves them out of later epochs; `on_lost(n)` is told of them."""
        cfg = self.cfg
        for start in range(0, len(todo), cfg.capture.sort_window):
            window = todo[start : start + cfg.capture.sort_window]
            if self.store is None:
                seqs = self._sequences([records[i] for i in window])
            else:  # recapture: through the token store
                seqs = self._stored(records, window)
            kept = [(i, q) for i, q in zip(window, seqs) if q is not None]
            if len(kept) < len(window):
                self.record_empty([self.keys[i] for i, q in zip(window, seqs) if q is None])
                if on_lost is not None:
                    on_lost(len(window) - len(kept))
            for group in pack_by_tokens([len(q[0]) for _, q in kept], cfg.capture.token_budget, cfg.capture.batch_size):
                yield [(kept[j][0], kept[j][1], records[kept[j][0]]) for j in group]

    def _stored(self, records: list[ChatRecord], window: list[int]) -> list[tuple[list[int], list[int]] | None]:
        """The window's sequences through the token store: stored ones as they were (an earlier
        attempt's, never regenerated), the others made and stored (one tar, behind the disk gate)
        before any of them is captured; None for an empty response (never stored)."""
        assert self.store is not None
        new = [i for i in window if self.keys[i] not in self.store]
        lost: set[int] = set()
        if new:
            made = self._sequences([records[i] for i in new])
            lost = {i for i, q in zip(new, made) if q is None}
            seqs = [(self.keys[i], *q) for i, q in zip(new, made) if q is not None]
            if seqs:
                self.gate(pending=estimate_bytes(len(ids) for _, ids, _ in seqs))
                write_sequences(self.store.dir, self.prefix, seqs)
                self.store.refresh()
        stored = iter(self.store.get([self.keys[i] for i in window if i not in lost]))
        return [None if i in lost else next(stored) for i in window]

    def writer_pool(self, shard_dir: Path | None = None) -> ThreadWriter | WriterPool:
        """The writers of a shard directory (default this job's; a later epoch's under recapture):
        capture.writers processes (started, ready), or for 0 the capture thread's own ShardWriter."""
        cfg = self.cfg
        return open_writers(cfg, shard_dir or self.shard_dir, self.provenance, self.prefix, self.actor_index,
                            cfg.capture.writers, gate=self.gate, device=next(self.model.parameters()).device,
                            tokens_hint=cfg.capture.token_budget or 0)

    def capture_passes(self, passes, on_pass=None, pool: ThreadWriter | WriterPool | None = None,
                       settled: frozenset[str] = frozenset()):
        """Capture each pass [(key, ids, loss mask, meta)] and submit it to the writers (`pool`,
        else writer_pool()): written on this thread, or by writer processes through pinned host
        buffers (capture/host_sink.py) while the GPU runs the next pass; returns the writers'
        SinkCounts once every shard is listed. An error aborts the writers (no unfinished shard).
        Rows whose key is `settled` are captured with their pass (its composition, and so every
        row's rounding, stays that of the whole pass) but not written; a pass of only settled
        rows is not run."""
        self.writers = pool = pool or self.writer_pool()
        try:
            for items in passes:
                rows = [r for r, item in enumerate(items) if item[0] not in settled]
                if not rows:
                    continue
                cap, attn = self._capture_padded([(ids, mask) for _, ids, mask, _ in items])
                features, argmax = cap.features, cap.target_argmax
                if len(rows) < len(items):
                    index = torch.tensor(rows, device=attn.device)
                    features, argmax, attn = features[index], argmax[index], attn[index]
                    items = [items[r] for r in rows]
                pool.submit(features, argmax, attn, items)
                self._sync_counts()
                if on_pass is not None:
                    on_pass(items)
            done = pool.close()
        except BaseException:
            pool.abort()
            raise
        finally:
            self.writers = None
        self._sync_counts(done)
        return done

    def _sync_counts(self, c=None) -> None:
        c = c or (self.writers.counts if self.writers is not None else None)
        if c is not None:
            self.counts.update(samples=c.samples, tokens=c.tokens, skipped=c.skipped + self.empty)

    def record_empty(self, keys: list[str], shard_dir: Path | None = None) -> None:
        """Record `keys` lost in the ledger of `shard_dir` (default epoch 0's) as empty regenerated
        responses: settled, never captured, counted in `skipped` and against data.max_lost_fraction."""
        if not keys:
            return
        for key in keys:
            record_skipped(shard_dir or self.shard_dir, key, EMPTY_RESPONSE, self.actor_index)
        self.empty += len(keys)
        self.counts["skipped"] += len(keys)
        log.warning("actor %d: %d sample(s) whose regenerated response was empty (first: %s) recorded as lost in %s, "
                    "not captured", self.actor_index, len(keys), keys[0], (shard_dir or self.shard_dir) / SKIPPED_NAME)

    def _sequences(self, batch: list[ChatRecord]) -> list[tuple[list[int], list[int]] | None]:
        """(input ids, loss mask) per record: the recorded conversation, or its prompt plus the
        target's greedy response (generated in batch_size batches of similar prompt lengths); None
        where that response is empty (generation.is_empty_response: no sample is made of it)."""
        cfg = self.cfg
        if not cfg.capture.regenerate:
            return [self._sequence(r, None) for r in batch]
        stops = stop_token_ids(self.tokenizer)
        pad = pad_token_id(self.tokenizer, stops)
        prompts = [self.encoder.prompt_ids(r).tolist() for r in batch]
        order = sorted(range(len(batch)), key=lambda i: len(prompts[i]))
        responses: list[list[int] | None] = [None for _ in batch]
        for s in range(0, len(order), cfg.capture.batch_size):
            chunk = order[s : s + cfg.capture.batch_size]
            generated = generate_responses(self.model, [prompts[i] for i in chunk], cfg.capture.max_new_tokens,
                                           stops, pad)
            for i, y in zip(chunk, generated):
                responses[i] = None if is_empty_response(response_text(self.tokenizer, y)) else list(y.tokens)
        return [None if y is None else self._sequence(r, y) for r, y in zip(batch, responses)]

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
        cap = capture_features(self.model, ids.to(dev, non_blocking=True), self.provenance.layer_ids,
                               attention_mask=None, allow_torch_gdn_on_cuda=self.cfg.target.allow_torch_gdn_on_cuda)
        return cap, attn.to(dev, non_blocking=True)
