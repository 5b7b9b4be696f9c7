"""One target actor's work as a plain loop: read its slice of the conversations, let the target
regenerate the responses greedily (the paper trains on target-generated responses), capture the
k layers' features and the argmax, and write webdataset shards with provenance."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from data_pipeline.chat_data import ChatEncoder, ChatRecord, read_chat_jsonl, template_hash
from data_pipeline.records import Sample
from data_pipeline.shard_writer import ShardWriter
from dflash_dist.config import Config
from dflash_dist.model.capture import capture_features, check_kernel_path
from dflash_dist.target import TargetIdentity, load_target, provenance_for


@dataclass(frozen=True)
class CaptureResult:
    actor_index: int
    samples: int
    tokens: int
    shards: int
    kernel_path: str
    skipped: int


def my_slice(num_records: int, actor_index: int, num_actors: int) -> list[int]:
    """Record indices this actor captures: round-robin, disjoint, complete over all actors."""
    return list(range(actor_index, num_records, num_actors))


@torch.no_grad()
def greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_id: int | None,
                 pad_id: int) -> list[list[int]]:
    """Greedy responses for a batch of prompts (left-padded), each cut after its eos."""
    dev = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    out = model.generate(ids.to(dev), attention_mask=attn.to(dev), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos_id, pad_token_id=pad_id, temperature=None, top_p=None, top_k=None)
    responses = []
    for row in out[:, width:].tolist():
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id) + 1]
        responses.append(row)
    return responses


class CaptureJob:
    def __init__(self, cfg: Config, target_dir: Path, ident: TargetIdentity, train_jsonl: Path, shard_dir: Path,
                 actor_index: int, num_actors: int) -> None:
        self.cfg, self.ident = cfg, ident
        self.train_jsonl, self.shard_dir = Path(train_jsonl), Path(shard_dir)
        self.actor_index, self.num_actors = actor_index, num_actors
        self.model, self.tokenizer = load_target(cfg, Path(target_dir))
        self.kernel_path = check_kernel_path(self.model, cfg.target.allow_torch_gdn_on_cuda)
        self.encoder = ChatEncoder(self.tokenizer)
        self.provenance = provenance_for(ident, self.model, template_hash(self.tokenizer))

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
        cfg = self.cfg
        records = read_chat_jsonl(self.train_jsonl)
        if cfg.data.max_train_samples is not None:
            records = records[: cfg.data.max_train_samples]
        mine = my_slice(len(records), self.actor_index, self.num_actors)
        eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in self.tokenizer.get_vocab() \
            else self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else (eos or 0)
        samples = tokens = skipped = 0
        writer = ShardWriter(self.shard_dir, self.provenance, max_shard_bytes=cfg.capture.shard_bytes,
                             prefix=f"t{self.actor_index:03d}")
        with writer:
            for start in range(0, len(mine), cfg.capture.batch_size):
                batch = [records[i] for i in mine[start : start + cfg.capture.batch_size]]
                responses: list[list[int] | None] = [None] * len(batch)
                if cfg.capture.regenerate:
                    prompts = [self.encoder.prompt_ids(r).tolist() for r in batch]
                    responses = greedy_batch(self.model, prompts, cfg.capture.max_new_tokens, eos, pad)
                seqs = [self._sequence(r, y) for r, y in zip(batch, responses)]
                for idx, rec, (ids, mask), feats, argmax in zip(mine[start:], batch, seqs, *self._capture(seqs)):
                    if not torch.isfinite(feats).all():
                        skipped += 1
                        continue
                    writer.write(Sample(key=f"train-{idx:08d}", input_ids=torch.tensor(ids, dtype=torch.int32),
                                        loss_mask=torch.tensor(mask, dtype=torch.uint8), features=feats.cpu(),
                                        target_argmax=argmax.cpu().to(torch.int32), meta={"source": rec.where}))
                    samples += 1
                    tokens += len(ids)
        return CaptureResult(self.actor_index, samples, tokens, len(writer.records), self.kernel_path, skipped)

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
