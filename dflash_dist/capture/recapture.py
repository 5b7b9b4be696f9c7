"""Later epochs captured again (`capture.later_epochs: recapture`): one target actor's slice for
epoch 0 (CaptureJob.run, which also fills the token store), then for epochs 1..E-1 in turn, each
into its own directory `<out>/shards/epoch_<e>/` (data_pipeline/epoch_dirs.py), behind the one
disk gate over the whole shard tree.

A later epoch runs the same passes as an uninterrupted epoch 0: the actor's slice in sort windows,
each packed by tokens over the sequences epoch 0 stored (never regenerated, never re-encoded), so
a sample meets the same batch composition and padding width and, on the same kernel path, gets
bit-identical features. Only the order in which the passes are submitted is permuted by
(run.seed, epoch), so each epoch's shards hold another order. (A sample whose epoch-0 pass
differed, because epoch 0 was resumed after a crash, or because capture.num_actors changed, may
differ from its epoch-0 features by rounding: tests/test_recapture.py measures it.)

Exactly once per epoch: the epoch directory's ledger says which keys are settled; a restarted
actor resumes at its first epoch without its slice marker and captures the rest. A pass holding
settled keys is still run whole (its other rows keep their rounding) and only the unsettled rows
are written. An actor starts epoch e only once epoch e-1 is DONE (every actor finished it):
otherwise an actor ahead in epoch e could fill the disk cap with shards the trainer cannot read
before epoch e-1 ends, while another actor waits for room to finish epoch e-1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path

from data_pipeline.chat_data import read_chat_jsonl
from data_pipeline.epoch_dirs import epoch_dir, finish_slice, sequences_dir, slice_finished, wait_done
from data_pipeline.ingest import sample_keys
from data_pipeline.ledger import CaptureData, captured_keys, check_capture_data, read_skipped, remove_stale_tmp
from data_pipeline.records import DONE_NAME, EMPTY_RESPONSE
from data_pipeline.token_store import remove_stale_tmp as remove_stale_store_tmp
from dflash_dist.capture.capture_job import CaptureJob, CaptureResult, my_slice, pack_by_tokens

log = logging.getLogger(__name__)


def canonical_passes(
    lengths: list[int | None], sort_window: int, token_budget: int | None, batch_size: int
) -> list[list[int]]:
    """Positions into a slice's samples (of these lengths; None: an empty response, recorded lost
    and never stored) grouped into the passes an uninterrupted epoch 0 runs: sort windows of the
    slice in order, each packed by pack_by_tokens over the window's samples that were captured."""
    passes = []
    for start in range(0, len(lengths), sort_window):
        sizes = {j: n for j in range(start, min(start + sort_window, len(lengths))) if (n := lengths[j]) is not None}
        window = list(sizes)
        groups = pack_by_tokens(list(sizes.values()), token_budget, batch_size)
        passes += [[window[j] for j in group] for group in groups]
    return passes


def pass_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order epoch `epoch` submits `n` passes in: a permutation seeded by (seed, epoch),
    from hashes (the same on every Python and for every restart)."""

    def h(i: int) -> bytes:
        return hashlib.blake2b(f"passes\0{seed}\0{epoch}\0{i}".encode(), digest_size=8).digest()

    return sorted(range(n), key=h)


def capture_epochs(job: CaptureJob, train_jsonl: str | Path, data: CaptureData) -> CaptureResult:
    """Every epoch of this actor's slice (epoch 0, then 1..train.epochs-1), each marked finished
    in its directory (the last actor to finish marks it DONE); an epoch this actor already
    finished (a restarted actor) is skipped. Returns the counts of this attempt over all epochs."""
    assert job.store is not None, "CaptureJob(recapture=True)"
    cfg, root, i, n = job.cfg, job.shard_dir, job.actor_index, job.num_actors
    remove_stale_store_tmp(sequences_dir(root), job.prefix)
    total = None
    for epoch in range(cfg.train.epochs):
        where = epoch_dir(root, epoch, recapture=True)
        if slice_finished(where, i, n) or (where / DONE_NAME).exists():
            log.info("actor %d: epoch %d of its slice already captured (%s)", i, epoch, where)
            continue
        if epoch > 0:
            waited = wait_done(epoch_dir(root, epoch - 1, recapture=True))
            if waited > 1:
                log.info("actor %d: waited %.0f s for the other actors to finish epoch %d", i, waited, epoch - 1)
        job.counts["epoch"], job.gate.waited_s = epoch, 0.0
        result = job.run(train_jsonl, data) if epoch == 0 else capture_later_epoch(job, epoch, train_jsonl, data)
        if finish_slice(where, i, n, dataclasses.asdict(result)):
            log.info("epoch %d captured: %s marked DONE", epoch, where)
        total = result if total is None else _sum(total, result)
    if total is None:  # every epoch was finished by an earlier attempt
        total = CaptureResult(i, 0, 0, 0, job.kernel_path, 0, len(my_slice(data.records, i, n)), 0.0,
                              job.weights_hashed)
    return total


def empty_responses(root: Path) -> set[str]:
    """The keys epoch 0 (the shard tree's root) recorded lost as empty regenerated responses: they
    are not in the token store, and each later epoch records them lost in its own ledger too (as a
    non-finite sample is skipped again in every epoch), so every epoch's ledger accounts for every
    conversation and the lost count holds them once per epoch, as it does for a non-finite one."""
    return {r["key"] for r in read_skipped(root) if r.get("reason") == EMPTY_RESPONSE}


def capture_later_epoch(job: CaptureJob, epoch: int, train_jsonl: str | Path, data: CaptureData) -> CaptureResult:
    """Epoch `epoch` (>= 1) of this actor's slice from the token store, minus what its ledger holds."""
    cfg, store = job.cfg, job.store
    assert store is not None and epoch >= 1
    shard_dir = epoch_dir(job.shard_dir, epoch, recapture=True)
    records = read_chat_jsonl(Path(train_jsonl))[: data.records]
    keys = sample_keys(records)
    shard_dir.mkdir(parents=True, exist_ok=True)
    check_capture_data(shard_dir, data)  # the epoch's ledger is over the same conversations
    remove_stale_tmp(shard_dir, job.prefix)
    settled = frozenset(captured_keys(shard_dir))
    ours = my_slice(len(records), job.actor_index, job.num_actors)
    empty = empty_responses(job.shard_dir)  # epoch 0's: never stored, lost in every epoch
    store.refresh()
    store.get([keys[r] for r in ours if keys[r] not in store and keys[r] not in empty])  # raises naming any other
    passes = canonical_passes(
        [None if keys[r] in empty else store.length(keys[r]) for r in ours],
        cfg.capture.sort_window,
        cfg.capture.token_budget,
        cfg.capture.batch_size,
    )
    order = pass_order(len(passes), cfg.run.seed, epoch)
    resumed = sum(keys[r] in settled for r in ours)
    job.counts.update(todo=len(ours) - resumed, resumed=resumed, samples=0, skipped=0, tokens=0)
    job.empty = 0
    job.record_empty([keys[r] for r in ours if keys[r] in empty and keys[r] not in settled], shard_dir)
    if resumed:
        log.info(
            "actor %d epoch %d: %d of %d samples already captured (ledger of %s); capturing the other %d",
            job.actor_index,
            epoch,
            resumed,
            len(ours),
            shard_dir,
            len(ours) - resumed,
        )

    def items():
        for p in order:
            rows = [ours[j] for j in passes[p]]
            seqs = store.get([keys[r] for r in rows])
            yield [(keys[r], ids, mask, {"source": records[r].where}) for r, (ids, mask) in zip(rows, seqs)]

    done = job.capture_passes(items(), pool=job.writer_pool(shard_dir), settled=settled)
    job.gate.waited_s = done.waited_disk_s
    log.info(
        "actor %d epoch %d: %d samples in %d shards (%d passes in the epoch's order)",
        job.actor_index,
        epoch,
        done.samples,
        done.shards,
        len(passes),
    )
    c = job.counts
    return CaptureResult(
        job.actor_index,
        c["samples"],
        c["tokens"],
        done.shards,
        job.kernel_path,
        c["skipped"],
        resumed,
        done.waited_disk_s,
        job.weights_hashed,
    )


def _sum(a: CaptureResult, b: CaptureResult) -> CaptureResult:
    return dataclasses.replace(
        a,
        samples=a.samples + b.samples,
        tokens=a.tokens + b.tokens,
        shards=a.shards + b.shards,
        skipped=a.skipped + b.skipped,
        resumed=a.resumed + b.resumed,
        waited_s=a.waited_s + b.waited_s,
    )
