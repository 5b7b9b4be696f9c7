"""One target actor's work as a plain loop: read its slice of the conversations, let the target
regenerate the responses greedily (the paper trains on target-generated responses), capture the
k layers' features and the argmax in length-sorted passes of at most `capture.token_budget`
padded tokens, and write webdataset shards with provenance.

Restartable: the slice minus the keys already settled in the shard directory (ledger.py) is
what remains, so an actor restarted by Ray redoes exactly its unfinished work. Bounded: a new
shard is opened only while the disk buffer has room (disk_budget.py)."""

from __future__ import annotations

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
        writer = ShardWriter(self.shard_dir, self.provenance, max_shard_bytes=cfg.capture.shard_bytes,
                             prefix=self.prefix, before_open=self.gate)
        bar = progress(total=len(todo), desc=f"capture {self.prefix}", unit="sample")
        with writer, bar:
            for start in range(0, len(todo), cfg.capture.sort_window):
                window = todo[start : start + cfg.capture.sort_window]
                seqs = self._sequences([records[i] for i in window])
                for group in pack_by_tokens([len(ids) for ids, _ in seqs], cfg.capture.token_budget,
                                            cfg.capture.batch_size):
                    self._capture_and_write(writer, [(window[j], seqs[j], records[window[j]]) for j in group])
                    bar.update(len(group))
        return CaptureResult(self.actor_index, counts["samples"], counts["tokens"], len(writer.records),
                             self.kernel_path, counts["skipped"], counts["resumed"], self.gate.waited_s)

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
        """Right-padded batch capture; causal layers make padding invisible to real positions."""
        dev = next(self.model.parameters()).device
        width = max(len(ids) for ids, _ in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, (s, _) in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
        cap = capture_features(self.model, ids.to(dev), self.ident.layer_ids, attention_mask=attn.to(dev),
                               allow_torch_gdn_on_cuda=self.cfg.target.allow_torch_gdn_on_cuda)
        lengths = [len(s) for s, _ in seqs]
        return ([cap.features[i, :n] for i, n in enumerate(lengths)],
                [cap.target_argmax[i, :n] for i, n in enumerate(lengths)])
