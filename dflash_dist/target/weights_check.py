"""The weights a process loads are the ones the run plan hashed: the features' target.

The run plan hashes the target's weight files once (provenance.hash_weight_files: the
`target_hash` of every shard's provenance and of the plan's TargetIdentity). A process that loads
the target checks that the files it loads hash to that value: a capture actor, so no shard records
a model hash its features do not come from (another node's `target.path` holding other weights);
the evaluator and each live worker, so tau is never measured against another model (another
`target_dir` on this node, or a target changed on disk since capture). A mismatch is a
`TargetWeightsMismatch` naming both hashes, the directory and what to do.

Hashing reads every byte (1-2 min at 27B), so it is done once per process and set of files, and
not at all where the run plan (or the evaluator) already hashed the same files:
- `WeightsStamp`: every weight file's resolved path, size, mtime, ctime, inode and device. The
  kernel sets ctime on every write or rename and no user call can set it back, so files with the
  stamp a hash was taken under still hold the bytes hashed. A process keeps its hashes by stamp
  (`hashed_weights`); a stamp that changed is hashed again.
- The run plan's check travels with the run (`RunPlan.weights`, in memory only): the pipeline
  hands it to every capture actor and to the evaluator, each its own Ray process; one whose files
  carry its stamp (the driver's node, the same files) loads them without hashing (an `os.stat`
  per file); another node's files (another inode, device or mtime) or a copy elsewhere are
  hashed in full there. The evaluator hands the check it holds on to its live workers the same
  way. A check comes only from our own processes, in memory: a plan read back from JSON carries
  none (run_plan.py), as a stamp read from a file anyone with write access to the run directory
  could have written would let it name the plan's hash for other weights' stamp. A check could
  only skip hashing for files that still carry the exact stamp it names.
- A capture actor checks on its own node (another node's `target.path` may hold other weights)
  and refuses before it writes anything.
- A hash that must be computed runs in a thread while the target loads (load_verified_target in
  loading.py): both read the same files, so it adds the hash's excess over the load, not the hash.
- The stamp is taken before the load and again after it (`check_unchanged`): files replaced while
  they were read are refused, not trusted.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from data_pipeline import provenance

# (resolved path, size, mtime_ns, ctime_ns, inode, device) of each weight file, in hash order
WeightsStamp = tuple[tuple[str, int, int, int, int, int], ...]

_HASHES: dict[WeightsStamp, str] = {}  # this process's hashes by stamp (hashed_weights)
_HASH_SECONDS: list[float] = []  # the seconds of every hash this process computed (hashes_made)


@dataclass(frozen=True)
class VerifiedWeights:
    """Weight files whose hash this process, or the one of ours that passed it on in memory (the
    run plan's driver, the evaluator), computed: plain strings and ints, never read from disk."""

    target_dir: str
    target_hash: str
    stamp: WeightsStamp


# what loading another model than the recorded one would do, and the other way out, by purpose
_CONSEQUENCE = {
    "eval": "tau would be measured against another model than the one the features were captured from. Point "
    "target.path at the target the shards were captured from (on every node), or restore its weights there; to "
    "evaluate this target, capture and train on it into a fresh --out",
    "capture": "the shards captured here would record a model hash their features do not come from. Give "
    "target.path the same weight files on every node (those of the node that made the run plan), or restore them "
    "here; to capture from these weights, make the run plan from them into a fresh --out",
}


class TargetWeightsMismatch(ValueError):
    """The target's weight files are not the ones the run recorded (the features' target)."""

    def __init__(self, target_dir: str, recorded: str, found: str, where: str, purpose: str = "eval") -> None:
        self.target_dir, self.recorded, self.found, self.where = target_dir, recorded, found, where
        self.purpose = purpose
        super().__init__(
            f"{where}: the target's weight files in {target_dir} hash to {found}, but the run recorded "
            f"target_hash {recorded} (the run plan's and the training shards' provenance): {_CONSEQUENCE[purpose]}"
        )

    def __reduce__(self):  # travels through Ray and process pools with its message intact
        return (type(self), (self.target_dir, self.recorded, self.found, self.where, self.purpose))


def weights_stamp(target_dir: str | os.PathLike[str]) -> WeightsStamp:
    """The stamp of the weight files `hash_weight_files` would hash (one stat each)."""
    stamp = []
    for path in provenance.weight_files(target_dir):
        st = os.stat(path)
        stamp.append((str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev))
    return tuple(stamp)


def hashed_weights(target_dir: str | os.PathLike[str]) -> VerifiedWeights:
    """The files' hash, computed once per stamp in this process (hash_weight_files, the one hash)."""
    stamp = weights_stamp(target_dir)
    found = _HASHES.get(stamp)
    if found is None:
        t0 = time.monotonic()
        found = provenance.hash_weight_files(target_dir)
        _HASH_SECONDS.append(time.monotonic() - t0)
        if weights_stamp(target_dir) != stamp:
            raise ValueError(
                f"the target's weight files in {target_dir} changed while they were hashed: "
                "wait until whatever writes them has finished, then start again"
            )
        _HASHES[stamp] = found
    return VerifiedWeights(str(target_dir), found, stamp)


def hashes_made() -> tuple[float, ...]:
    """The seconds of every hash of weight files this process computed, in order (a capture actor
    reports those of its load: none where the files carried the run plan's stamp)."""
    return tuple(_HASH_SECONDS)


def verify_weights(
    target_dir: str | os.PathLike[str],
    recorded_hash: str,
    where: str,
    verified: VerifiedWeights | None = None,
    purpose: str = "eval",
) -> VerifiedWeights:
    """The weight files in `target_dir`, checked to hash to `recorded_hash`; `verified`: a
    check already made (by the evaluator), reused while the files carry its stamp; `purpose`
    ("eval", "capture"): what the mismatch says is at stake."""
    if verified is not None and verified.target_hash == recorded_hash and weights_stamp(target_dir) == verified.stamp:
        return VerifiedWeights(str(target_dir), verified.target_hash, verified.stamp)
    got = hashed_weights(target_dir)
    if got.target_hash != recorded_hash:
        raise TargetWeightsMismatch(str(target_dir), recorded_hash, got.target_hash, where, purpose)
    return got


def check_unchanged(verified: VerifiedWeights, where: str, since: WeightsStamp | None = None) -> None:
    """After loading: the files still carry the stamp they were verified under, and carried it
    when the load began (`since`, taken then: the hash may have run alongside the load)."""
    if weights_stamp(verified.target_dir) != verified.stamp or since not in (None, verified.stamp):
        raise ValueError(
            f"{where}: the target's weight files in {verified.target_dir} changed while they were "
            "loaded and hashed: wait until whatever writes them has finished, then start again"
        )
