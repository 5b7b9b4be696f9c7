"""dflash_dist/actors/local_ranks.py: N spawned gloo ranks each run one function and hand back its
result in rank order; a rank that raises or dies stops the group at once, named (its peers, waiting
in a collective, are ended rather than left until gloo's timeout). Where the ranks listen:
tests/test_rendezvous.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dflash_dist.actors.local_ranks import run_ranks
from dflash_dist.actors.trainer_group import default_extensions_dir

os.environ.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())  # DeepSpeed's shm op compiles once


def _sum_of_ranks(rank: int, world: int, scale: int) -> tuple:
    """The group is joined: an all-reduce over every rank, and the trainers' rank environment."""
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, dist.get_rank(), dist.get_world_size(), float(t), scale * rank, os.environ["MASTER_ADDR"]


def test_each_rank_runs_in_the_group_results_in_rank_order():
    got = run_ranks(_sum_of_ranks, 3, (10,))
    assert got == [(r, r, 3, 3.0, 10 * r, "127.0.0.1") for r in range(3)]


def _fail_or_wait(rank: int, world: int, out: str) -> None:
    """Rank 0 holds a torch FileBaton, as DeepSpeed's JIT build (cpp_extension) does while it builds or
    checks an op, and waits (a sleep: gloo might end a collective on its own once rank 1 has gone);
    rank 1 raises once rank 0 holds it."""
    from torch.utils.file_baton import FileBaton

    if rank == 1:
        deadline = time.monotonic() + 120
        while not Path(out, "0").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        raise ValueError("rank one's own error")
    baton = FileBaton(str(Path(out, "lock")))
    assert baton.try_acquire()
    try:
        Path(out, "0").write_text(str(os.getpid()))
        time.sleep(600)
    finally:
        baton.release()


def _die(rank: int, world: int) -> None:
    if rank == 0:
        os._exit(3)  # no result, no exception: as a process killed from outside
    time.sleep(600)


def test_a_failing_rank_is_named_and_its_peers_ended(tmp_path):
    """The error names the rank and carries its message; the waiting peer is ended, and unwinds on
    the way: its lock file is gone (killed outright, it stayed, and DeepSpeed's next build on the venv
    waited on it forever)."""
    with pytest.raises(RuntimeError, match=r"_fail_or_wait at world 2: rank 1 failed: ValueError: rank one's own err"):
        run_ranks(_fail_or_wait, 2, (str(tmp_path),))
    waiting = int((tmp_path / "0").read_text())
    with pytest.raises(ProcessLookupError):  # rank 0 was still waiting: ended and reaped
        os.kill(waiting, 0)
    assert not (tmp_path / "lock").exists()
    with pytest.raises(RuntimeError, match=r"_die at world 2: rank\(s\) \[0\] exited \[3\] without a result"):
        run_ranks(_die, 2)
