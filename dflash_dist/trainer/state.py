"""What a trainer rank must carry across a restart, in one dataclass (STYLE 7).

`TrainState` holds the counters, the shard stream's position after the last trained sample and
the epoch bookkeeping; `state_dict()` adds the process's RNG states. Checkpointing iterates its
fields, the preemption rewind restores a copy taken at the step boundary, and an elastic resume
(another world size) derives each new rank's state from every saved rank's with
`TrainState.for_world`. No field is listed by hand anywhere else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from data_pipeline.shard_reader import merge_reader_states
from dflash_dist.trainer import checkpoint

STATE_VERSION = 2
# field metadata: how a field carries over to another world size (TrainState.for_world)
_SHARED = {"elastic": "shared"}  # equal on every rank (lock-step): any saved rank's value
_PER_RANK = {"elastic": "per_rank"}  # this rank's own: derived from every saved rank's


@dataclass
class TrainState:
    """Where training stands on one rank. Ranks train in lock-step, so every field marked
    shared is equal on all ranks; `reader` and `epoch_samples` are each rank's own."""

    step: int = field(default=0, metadata=_SHARED)  # optimizer steps done
    epoch: int = field(default=0, metadata=_SHARED)
    samples_seen: int = field(default=0, metadata=_SHARED)  # samples all ranks trained since step 0
    # samples all ranks trained in this epoch before an elastic resume (the shard assignment
    # changed, so no per-rank count carries over: Trainer._end_epoch)
    epoch_carried: int = field(default=0, metadata=_SHARED)
    skipped_total: int = field(default=0, metadata=_SHARED)  # samples skipped (corrupt, NaN) in finished epochs
    # the epoch ended while a step was open and that step was dropped by a preemption rewind:
    # the resumed run ends this epoch at once, as the uninterrupted run did
    epoch_exhausted: bool = field(default=False, metadata=_SHARED)
    epoch_samples: int = field(default=0, metadata=_PER_RANK)  # this rank's samples trained in this epoch
    reader: dict[str, Any] | None = field(default=None, metadata=_PER_RANK)  # stream position (None: epoch start)

    def state_dict(self, on_gpu: bool = False) -> dict[str, Any]:
        """Every field, the version and this process's RNG states (checkpoint.rng_state)."""
        out: dict[str, Any] = {"version": STATE_VERSION}
        out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        out["rng"] = checkpoint.rng_state(on_gpu)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every field from `state`, and the RNG states it carries."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"trainer state version {state.get('version')!r} != {STATE_VERSION}")
        for f in dataclasses.fields(self):  # a field newer than the checkpoint keeps its default
            setattr(self, f.name, state.get(f.name, f.default))
        checkpoint.load_rng_state(state["rng"])

    def copy(self) -> TrainState:
        """A snapshot (the step boundary a preemption rewinds to). Shallow: `reader` is replaced
        by each batch's own position dict, never changed in place."""
        return dataclasses.replace(self)

    @classmethod
    def for_world(cls, saved: list[dict[str, Any]], rank: int, world: int, seed: int, on_gpu: bool) -> dict[str, Any]:
        """`rank`'s state dict (for load_state_dict) at `world` ranks from the state dicts of a
        checkpoint saved by another number of ranks: the shared fields as saved (checked equal);
        the samples trained so far in this epoch carried as one global count; the stream
        position derived from every saved rank's (reader_state_for); and a fresh RNG seeded from
        (run.seed, rank, step), since saved per-rank RNG streams have no counterpart at another
        world size. Deterministic: the same checkpoint resumed at the same world size again
        trains identically."""
        first = saved[0]
        out: dict[str, Any] = {"version": first["version"]}
        for f in dataclasses.fields(cls):
            if f.metadata["elastic"] == "shared":
                values = [s.get(f.name, f.default) for s in saved]
                assert all(v == values[0] for v in values), (f.name, values)
                out[f.name] = values[0]
        out["epoch_carried"] = int(out["epoch_carried"]) + sum(int(s["epoch_samples"]) for s in saved)
        out["epoch_samples"] = 0
        out["reader"] = reader_state_for([s["reader"] for s in saved], rank, world)
        out["rng"] = checkpoint.seeded_rng_state(checkpoint.rank_seed(seed, rank, int(first["step"])), on_gpu)
        return out


def reader_state_for(saved: list[dict[str, Any] | None], rank: int, world: int) -> dict[str, Any] | None:
    """The stream position for `rank` of `world` from every saved rank's ShardStream state
    (None: no rank had trained a sample of this epoch yet). The same world size: the rank's
    own state. Another world size: every saved rank's state merged (merge_reader_states), which
    any rank of any world size loads and skips whatever any saved rank consumed."""
    if len(saved) == world:
        return saved[rank]
    if all(s is None for s in saved):
        return None
    assert all(s is not None for s in saved), "ranks train in lock-step: all or none have a position"
    return merge_reader_states(saved)
