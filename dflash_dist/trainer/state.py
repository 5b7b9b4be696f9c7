"""What a trainer rank must carry across a restart, in one dataclass (STYLE 7).

`TrainState` holds the step counter, the samples trained so far and the data source's state
(step_source.StepSource: epoch, stream position, per-epoch counts); `state_dict()` adds the
process's RNG states. Checkpointing iterates its fields, and an elastic resume (another world
size) derives each new rank's state from every saved rank's with `TrainState.for_world`. No
field is listed by hand anywhere else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dflash_dist.trainer import checkpoint
from dflash_dist.trainer.step_source import StepSource

STATE_VERSION = 3  # 2: epoch bookkeeping and the reader position kept here (before step_source.py)


@dataclass
class TrainState:
    """Where training stands on one rank. Ranks train in lock-step, so `step` and
    `samples_seen` are equal on all ranks; `source` is each rank's own."""

    step: int = 0  # optimizer steps done
    samples_seen: int = 0  # samples all ranks trained since step 0
    source: dict[str, Any] = field(default_factory=dict)  # StepSource.state_dict()

    def state_dict(self, on_gpu: bool = False) -> dict[str, Any]:
        """Every field, the version and this process's RNG states (checkpoint.rng_state): JSON
        data, which the ranks gather to rank 0 (collectives.all_gather_json); tuples come back as
        lists, which load_state_dict and the step source's reader take alike."""
        out: dict[str, Any] = {"version": STATE_VERSION}
        out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        out["rng"] = checkpoint.rng_state(on_gpu)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every field from `state`, and the RNG states it carries."""
        if state.get("version") != STATE_VERSION:
            raise checkpoint.ResumeError(
                f"trainer state version {state.get('version')!r} != {STATE_VERSION}: the checkpoint was saved by "
                "another code version; resume with that version or start a fresh run in another --out"
            )
        for f in dataclasses.fields(self):
            setattr(self, f.name, state[f.name])
        checkpoint.load_rng_state(state["rng"])

    @classmethod
    def for_world(cls, saved: list[dict[str, Any]], rank: int, world: int, seed: int, on_gpu: bool) -> dict[str, Any]:
        """`rank`'s state dict (for load_state_dict) at `world` ranks from the state dicts of a
        checkpoint saved by another number of ranks: the step and samples as saved (checked
        equal), the source's state from StepSource.for_world, and a fresh RNG seeded from
        (run.seed, rank, step), since saved per-rank RNG streams have no counterpart at another
        world size. Deterministic: the same checkpoint resumed at the same world size again
        trains identically."""
        first = saved[0]
        for key in ("step", "samples_seen"):
            values = {s[key] for s in saved}
            assert len(values) == 1, (key, values)
        return {
            "version": first["version"],
            "step": first["step"],
            "samples_seen": first["samples_seen"],
            "source": StepSource.for_world([s["source"] for s in saved], rank, world),
            "rng": checkpoint.seeded_rng_state(checkpoint.rank_seed(seed, rank, int(first["step"])), on_gpu),
        }
