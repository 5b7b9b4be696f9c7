"""From captured samples to micro-batches: padding, per-sample anchors, background prefetch.

Right-padding with loss_mask 0 is safe: anchors sit only on loss-masked positions of the
sample's own (unpadded) length, a block sees context features only before its anchor, and a
label on a padded position has weight 0. Anchors are drawn per sample from a generator seeded
by (seed, epoch, sample key): every epoch gets fresh anchors, a resume replays them exactly, and
they do not depend on which samples share the batch.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from data_pipeline.records import Sample
from dflash_dist.model.loss import Anchors, sample_anchors

# MicroBatchFeeder.status(): ordered so that the MIN over ranks is the group's decision.
DRY, WAITING, READY = 0, 1, 2


@dataclass(frozen=True)
class MicroBatch:
    """One rank's micro-batch, padded to its longest sample."""

    keys: tuple[str, ...]
    input_ids: torch.Tensor  # [b, S] int64
    features: torch.Tensor  # [b, S, k*H] compute dtype
    loss_mask: torch.Tensor  # [b, S] float32, 0 on padding
    target_argmax: torch.Tensor  # [b, S] int64
    anchors: Anchors  # [b, N]
    num_tokens: int  # real (unpadded) tokens
    reader_state: dict[str, Any]  # the shard stream's position after this batch's last sample

    def to(self, device: torch.device | str) -> MicroBatch:
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            features=self.features.to(device),
            loss_mask=self.loss_mask.to(device),
            target_argmax=self.target_argmax.to(device),
            anchors=Anchors(self.anchors.positions.to(device), self.anchors.keep.to(device)),
        )


def collate(samples: list[Sample], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: input_ids/target_argmax int64 (pad 0), features in
    `dtype` (pad 0), loss_mask float32 (pad 0)."""
    if not samples:
        raise ValueError("collate: empty list of samples")
    widths = {s.features.shape[1] for s in samples}
    if len(widths) != 1:
        raise ValueError(f"collate: samples disagree on the feature width k*H: {sorted(widths)}")
    b, s_len, width = len(samples), max(s.num_tokens for s in samples), widths.pop()
    out = {
        "input_ids": torch.zeros(b, s_len, dtype=torch.int64),
        "features": torch.zeros(b, s_len, width, dtype=dtype),
        "loss_mask": torch.zeros(b, s_len, dtype=torch.float32),
        "target_argmax": torch.zeros(b, s_len, dtype=torch.int64),
    }
    for i, s in enumerate(samples):
        t = s.num_tokens
        out["input_ids"][i, :t] = s.input_ids
        out["features"][i, :t] = s.features.to(dtype)
        out["loss_mask"][i, :t] = s.loss_mask.float()
        out["target_argmax"][i, :t] = s.target_argmax
    return out


def anchor_generator(seed: int, epoch: int, key: str) -> torch.Generator:
    """A generator for one sample's anchors in one epoch (STYLE 7: seeds derive, never drift)."""
    digest = hashlib.blake2b(f"{seed}\0{epoch}\0{key}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def batch_anchors(samples: list[Sample], num_anchors: int, seed: int, epoch: int) -> Anchors:
    """Each sample's anchors from its own loss mask and generator, padded to a common N."""
    per = [
        sample_anchors(s.loss_mask[None].float(), num_anchors, anchor_generator(seed, epoch, s.key)) for s in samples
    ]
    n = max(a.positions.shape[1] for a in per)
    positions = torch.zeros(len(samples), n, dtype=torch.long)
    keep = torch.zeros(len(samples), n, dtype=torch.bool)
    for i, a in enumerate(per):
        positions[i, : a.positions.shape[1]] = a.positions[0]
        keep[i, : a.keep.shape[1]] = a.keep[0]
    return Anchors(positions, keep)


def make_micro_batch(
    samples: list[Sample], reader_state: dict[str, Any], *, dtype: torch.dtype, num_anchors: int, seed: int, epoch: int
) -> MicroBatch:
    t = collate(samples, dtype)
    return MicroBatch(
        keys=tuple(s.key for s in samples),
        input_ids=t["input_ids"],
        features=t["features"],
        loss_mask=t["loss_mask"],
        target_argmax=t["target_argmax"],
        anchors=batch_anchors(samples, num_anchors, seed, epoch),
        num_tokens=sum(s.num_tokens for s in samples),
        reader_state=reader_state,
    )


class MicroBatchFeeder:
    """Reads (sample, stream position) pairs on a background thread and queues full micro-batches.

    `status()` never blocks: READY (a batch is queued), WAITING (the producer may still deliver),
    DRY (the stream ended; `leftover` samples did not fill a batch). The trainer all-reduces it
    with MIN every step, so no rank waits inside a collective for data (a gloo/NCCL collective
    would time out while a slow capture fills the next shard). Errors of the reader thread are
    re-raised by `status()`.
    """

    def __init__(
        self,
        samples: Iterable[tuple[Sample, dict[str, Any]]],
        micro_batch_size: int,
        build: Callable[[list[Sample], dict[str, Any]], MicroBatch],
        depth: int = 2,
        stop: threading.Event | None = None,
    ) -> None:
        self._samples = samples
        self._size = micro_batch_size
        self._build = build
        self._queue: queue.Queue[MicroBatch] = queue.Queue(maxsize=depth)
        self._stop = stop or threading.Event()  # shared with the stream's stop_when
        self._dry = threading.Event()
        self._error: BaseException | None = None
        self.leftover = 0
        self._thread = threading.Thread(target=self._fill, name="micro-batch-feeder", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            pending: list[Sample] = []
            for sample, state in self._samples:
                pending.append(sample)
                if len(pending) == self._size:
                    batch = self._build(pending, state)
                    pending = []
                    while not self._stop.is_set():
                        try:
                            self._queue.put(batch, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                if self._stop.is_set():
                    return
            self.leftover = len(pending)
        except BaseException as e:  # handed to the training thread by status()
            self._error = e
        finally:
            self._dry.set()

    def status(self) -> int:
        if self._error is not None:
            raise self._error  # the reader's own error (e.g. ProvenanceMismatch), its traceback kept
        if not self._queue.empty():
            return READY
        # dry is set after the last put: re-check the queue so a final batch is not lost
        if self._dry.is_set():
            return READY if not self._queue.empty() else DRY
        return WAITING

    def take(self) -> MicroBatch:
        return self._queue.get_nowait()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def with_positions(stream: Any) -> Iterator[tuple[Sample, dict[str, Any]]]:
    """Pair each sample of a ShardStream with the stream's position just after it, so a
    checkpoint records where the last *trained* sample was, not what the prefetcher read."""
    for sample in stream:
        yield sample, stream.state_dict()
