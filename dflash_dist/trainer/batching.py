"""From captured samples to micro-batches: padding, per-sample anchors, background prefetch.

Right-padding with loss_mask 0 is safe: anchors sit only on loss-masked positions of the
sample's own (unpadded) length, a block sees context features only before its anchor, and a
label on a padded position has weight 0. Anchors are drawn per sample from a generator seeded
by (seed, epoch, sample key): every epoch gets fresh anchors, a resume replays them exactly, and
they do not depend on which samples share the batch.

A micro-batch holds `train.micro_batch_size` samples, or with `train.micro_batch_tokens` as many
as fit the token budget padded (`BatchLimit`). Either way its end depends only on the sample
sequence, so a resume from the position after a batch's last sample rebuilds the same batches.
DeepSpeed's `train_micro_batch_size_per_gpu` stays micro_batch_size with a token budget: the
engine uses it only for bookkeeping (train_batch_size, throughput), never to split a batch.

`train.packing`: the samples of a token-budget micro-batch are concatenated into one row of
exactly `micro_batch_tokens` (sum of lengths <= budget, not longest x count), each sample's anchors
drawn as unpacked and shifted to its offset, with its document bounds (loss.Anchors starts/ends:
no block sees or is labelled by another sample). One row shape: flex_attention compiles once.
Per-sample diagnostics then come per row (`lengths` holds the row's real tokens).
"""

from __future__ import annotations

import hashlib
import itertools
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
    lengths: tuple[int, ...] = ()  # each sample's real tokens (diagnostics by length)

    def to(self, device: torch.device | str) -> MicroBatch:
        """Non-blocking: the features come from pinned memory on a GPU machine (collate), so the
        copy is queued behind the running step instead of stalling it."""

        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        a = self.anchors
        return replace(
            self,
            input_ids=move(self.input_ids),
            features=move(self.features),
            loss_mask=move(self.loss_mask),
            target_argmax=move(self.target_argmax),
            anchors=Anchors(move(a.positions), move(a.keep), move(a.starts), move(a.ends)),
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
    pin = torch.cuda.is_available()  # page-locked on GPU machines: MicroBatch.to copies without a sync
    out = {
        "input_ids": torch.zeros(b, s_len, dtype=torch.int64),
        "features": torch.zeros(b, s_len, width, dtype=dtype, pin_memory=pin),
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


def batch_anchors(
    samples: list[Sample], num_anchors: int, seed: int, epoch: int, anchor_rule: str = "mask"
) -> Anchors:
    """Each sample's anchors from its own loss mask and generator, padded to a common N."""
    per = [
        sample_anchors(s.loss_mask[None].float(), num_anchors, anchor_generator(seed, epoch, s.key), anchor_rule)
        for s in samples
    ]
    n = max(a.positions.shape[1] for a in per)
    positions = torch.zeros(len(samples), n, dtype=torch.long)
    keep = torch.zeros(len(samples), n, dtype=torch.bool)
    for i, a in enumerate(per):
        positions[i, : a.positions.shape[1]] = a.positions[0]
        keep[i, : a.keep.shape[1]] = a.keep[0]
    return Anchors(positions, keep)


def anchor_slots(k: int, num_anchors: int) -> int:
    """The anchor slots of a packed row holding k anchors: m x num_anchors where m = ceil(k /
    num_anchors) rounded up to 1..7 or 4..7 x 2^e (3 significant bits). Each slot count is a new
    flex_attention shape, and the compiled kernel is specialised to its shape (a row of 20 samples
    can hold 1 to ~25 x num_anchors anchors): this keeps the shapes to ~4 per doubling (20 up to
    m = 64), padded by under num_anchors or 25% (slots with keep False, weight 0)."""
    m = max(1, -(-k // num_anchors))
    if m > 7:
        e = m.bit_length() - 3
        m = -(-m >> e) << e
    return m * num_anchors


def pack(
    samples: list[Sample], dtype: torch.dtype, row_tokens: int, anchors: Anchors, num_anchors: int
) -> tuple[dict[str, torch.Tensor], Anchors]:
    """One row of max(row_tokens, total) tokens holding the samples back to back (zeros after), and
    their anchors ([len(samples), N] as batch_anchors draws them) in row coordinates with document
    bounds, padded to `anchor_slots(k, num_anchors)` (few shapes)."""
    lengths = [s.num_tokens for s in samples]
    row = max(row_tokens, sum(lengths))
    widths = {s.features.shape[1] for s in samples}
    if len(widths) != 1:
        raise ValueError(f"pack: samples disagree on the feature width k*H: {sorted(widths)}")
    out = {  # dtypes and pinning as collate's
        "input_ids": torch.zeros(1, row, dtype=torch.int64),
        "features": torch.zeros(1, row, widths.pop(), dtype=dtype, pin_memory=torch.cuda.is_available()),
        "loss_mask": torch.zeros(1, row, dtype=torch.float32),
        "target_argmax": torch.zeros(1, row, dtype=torch.int64),
    }
    pos, starts, ends, off = [], [], [], 0
    for i, (smp, n) in enumerate(zip(samples, lengths)):
        out["input_ids"][0, off : off + n] = smp.input_ids
        out["features"][0, off : off + n] = smp.features.to(dtype)
        out["loss_mask"][0, off : off + n] = smp.loss_mask.float()
        out["target_argmax"][0, off : off + n] = smp.target_argmax
        kept = anchors.positions[i][anchors.keep[i]]
        pos.append(kept + off)
        starts.append(torch.full_like(kept, off))
        ends.append(torch.full_like(kept, off + n))
        off += n
    pos, starts, ends = torch.cat(pos), torch.cat(starts), torch.cat(ends)
    k = pos.numel()
    n_pad = anchor_slots(k, num_anchors) - k
    keep = torch.cat([torch.ones(k, dtype=torch.bool), torch.zeros(n_pad, dtype=torch.bool)])
    pos, starts, ends = (torch.cat([x, x.new_zeros(n_pad)])[None] for x in (pos, starts, ends))
    return out, Anchors(pos, keep[None], starts, ends)


def make_micro_batch(
    samples: list[Sample], reader_state: dict[str, Any], *, dtype: torch.dtype, num_anchors: int, seed: int, epoch: int,
    anchor_rule: str = "mask", pack_tokens: int | None = None,
) -> MicroBatch:
    """pack_tokens (train.packing with micro_batch_tokens): one packed row of that many tokens."""
    if pack_tokens is not None:
        t, anchors = pack(samples, dtype, pack_tokens, batch_anchors(samples, num_anchors, seed, epoch, anchor_rule),
                          num_anchors)
        return MicroBatch(
            keys=tuple(s.key for s in samples), input_ids=t["input_ids"], features=t["features"],
            loss_mask=t["loss_mask"], target_argmax=t["target_argmax"], anchors=anchors,
            num_tokens=sum(s.num_tokens for s in samples), reader_state=reader_state,
            lengths=(sum(s.num_tokens for s in samples),),
        )
    t = collate(samples, dtype)
    return MicroBatch(
        keys=tuple(s.key for s in samples),
        input_ids=t["input_ids"],
        features=t["features"],
        loss_mask=t["loss_mask"],
        target_argmax=t["target_argmax"],
        anchors=batch_anchors(samples, num_anchors, seed, epoch, anchor_rule),
        num_tokens=sum(s.num_tokens for s in samples),
        reader_state=reader_state,
        lengths=tuple(s.num_tokens for s in samples),
    )


def empty_batch(width: int, dtype: torch.dtype, block_size: int, num_anchors: int,
                pack_tokens: int | None) -> MicroBatch:  # fmt: skip
    """A zero-weight micro-batch for a slot a rank has no data for (step_source.py): one anchor on
    zeros, in the shapes real batches take (a packed row of `pack_tokens`, else one block), so the
    rank makes the same forward, backward and collectives as its peers; the trainer multiplies
    its loss by 0."""
    length = pack_tokens or block_size + 1
    n = num_anchors if pack_tokens else 1
    keep = torch.zeros(1, n, dtype=torch.bool)
    keep[0, 0] = True
    bounds = (torch.zeros(1, n, dtype=torch.long), torch.full((1, n), length, dtype=torch.long))
    return MicroBatch(
        keys=(),
        input_ids=torch.zeros(1, length, dtype=torch.int64),
        features=torch.zeros(1, length, width, dtype=dtype),
        loss_mask=torch.ones(1, length, dtype=torch.float32),
        target_argmax=torch.zeros(1, length, dtype=torch.int64),
        anchors=Anchors(torch.zeros(1, n, dtype=torch.long), keep, *(bounds if pack_tokens else (None, None))),
        num_tokens=0,
        reader_state={},
    )


@dataclass(frozen=True)
class BatchLimit:
    """Where a micro-batch ends: after `size` samples, or with a token budget, before the sample
    that would make the padded size (longest x count) exceed `tokens` (a batch has at least one
    sample, even one longer than the budget)."""

    size: int
    tokens: int | None = None
    packed: bool = False  # train.packing: the budget bounds the sum of lengths (one packed row)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"train.micro_batch_size must be >= 1, got {self.size}")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"train.micro_batch_tokens must be >= 1 (or null for count-based), got {self.tokens}")

    def fits(self, lengths: list[int], new: int) -> bool:
        """Whether a sample of `new` tokens may join a batch of `lengths`."""
        if not lengths:
            return True
        if self.tokens is None:
            return len(lengths) < self.size
        if self.packed:
            return sum(lengths) + new <= self.tokens
        return max(max(lengths), new) * (len(lengths) + 1) <= self.tokens

    def full(self, lengths: list[int]) -> bool:
        """Whether no further sample can join (a sample of any length would exceed the limit)."""
        if self.tokens is None:
            return len(lengths) >= self.size
        if self.packed:
            return sum(lengths) >= self.tokens
        return bool(lengths) and max(lengths) * (len(lengths) + 1) > self.tokens


def group_micro_batches(
    pairs: Iterable[tuple[Sample, dict[str, Any]]], limit: BatchLimit, keep_short: bool = False
) -> Iterator[tuple[list[Sample], dict[str, Any], bool]]:
    """(samples, position after the last of them, complete) per micro-batch. A batch is emitted
    as soon as it is full or the next sample does not fit; at the end of the stream the rest is
    emitted with complete=False when counting samples (a short batch: the caller drops it unless
    `keep_short`), complete=True with a token budget (it fits the budget: a batch like any other)."""
    pending: list[Sample] = []
    lengths: list[int] = []
    last: dict[str, Any] = {}
    for sample, state in pairs:
        if pending and not limit.fits(lengths, sample.num_tokens):
            yield pending, last, True
            pending, lengths = [], []
        pending.append(sample)
        lengths.append(sample.num_tokens)
        last = state
        if limit.full(lengths):
            yield pending, last, True
            pending, lengths = [], []
    if pending:
        yield pending, last, limit.tokens is not None or keep_short


class MicroBatchFeeder:
    """Reads (sample, stream position) pairs on a background thread and queues full micro-batches.

    Batches end where `BatchLimit(micro_batch_size, micro_batch_tokens)` says.
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
        micro_batch_tokens: int | None = None,
        packed: bool = False,
        keep_short: bool = False,
    ) -> None:
        self._samples = samples
        self._keep_short = keep_short  # the stream's last micro-batch is handed out even when short
        self._limit = BatchLimit(micro_batch_size, micro_batch_tokens, packed)
        self._build = build
        self._queue: queue.Queue[MicroBatch] = queue.Queue(maxsize=depth)
        self._stop = stop or threading.Event()  # shared with the stream's stop_when
        self._dry = threading.Event()
        self._error: BaseException | None = None
        self.leftover = 0
        self.end_state: dict[str, Any] | None = None  # the stream's position once it ended (DRY)
        self._thread = threading.Thread(target=self._fill, name="micro-batch-feeder", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            pairs = itertools.takewhile(lambda _: not self._stop.is_set(), self._samples)  # close() stops reading
            for samples, state, complete in group_micro_batches(pairs, self._limit, self._keep_short):
                if not complete:
                    self.leftover = len(samples)
                    break
                batch = self._build(samples, state)
                while not self._stop.is_set():
                    try:
                        self._queue.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            if not self._stop.is_set() and hasattr(self._samples, "state"):
                self.end_state = self._samples.state()  # the stream's end: trailing skips included
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

    def peek(self) -> MicroBatch:
        """The batch `take` returns next (call only when status() is READY; one consumer)."""
        with self._queue.mutex:
            return self._queue.queue[0]

    @property
    def problems(self) -> list[str]:
        """What the stream could not read, one line per shard (for error messages)."""
        return list(getattr(self._samples, "problems", []))

    @property
    def skipped(self) -> dict[str, int]:
        """The stream's skip counts so far, including skips after the last batch (at DRY)."""
        return dict(getattr(self._samples, "skipped", {}))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


class with_positions:  # noqa: N801 (used like a function)
    """Pair each sample of a ShardStream with the stream's position just after it, so a
    checkpoint records where the last *trained* sample was, not what the prefetcher read.
    `skipped` reads the stream's skip counts (safe from another thread)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __iter__(self) -> Iterator[tuple[Sample, dict[str, Any]]]:
        for sample in self.stream:
            yield sample, self.stream.state_dict()

    @property
    def skipped(self) -> dict[str, int]:
        return self.stream.skipped

    @property
    def problems(self) -> list[str]:
        return list(getattr(self.stream, "problems", []))

    def state(self) -> dict[str, Any]:
        """The stream's position now (after its end: every sample processed, skips included)."""
        return self.stream.state_dict()
