"""One gloo group of N ranks as spawned processes on this machine, each running one function, for the
checks and benches that need real multi-rank DeepSpeed engines without Ray (bench/measure_comm.py,
tests/test_grad_reduce.py, tests/test_zero_step.py). The ranks join through the trainers' own
rendezvous (rendezvous.join_group: its store listens on 127.0.0.1 only, never on every interface
as torch's env:// store does), and a failing rank stops the group at once, named, instead of leaving
its peers in a collective until gloo's timeout. Peers are stopped with SIGTERM, which a rank turns
into an exception: a rank inside DeepSpeed's JIT build (torch's cpp_extension, on every
deepspeed.init_distributed) releases the build's lock file on the way out; killed outright, it left
the lock behind and every later process on this venv's TORCH_EXTENSIONS_DIR waited on it forever.

The ranks are forks of multiprocessing's fork server, which imports torch once (PRELOAD) and forks
each rank of every later call from that single-threaded process: a spawned rank imported torch and
DeepSpeed again (~4.5 s of a core per rank on a 2-core EPYC; a check of 2 + 3 ranks spent most of
its time there). Forked, a rank still runs its own interpreter state from there on: the function's
module imported in it, this process's sys.path and working directory (multiprocessing's preparation
data, as for spawn) and this process's current environment (passed along: the fork server's own is
that of its start)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dflash_dist.actors.ports import free_ports
from dflash_dist.actors.rendezvous import interpreter_bin_first, join_group

HOST = "127.0.0.1"  # the store, and so gloo's connections, on loopback only
STOP_GRACE_S = 10.0  # after SIGTERM, how long a rank gets to unwind before SIGKILL
# what the fork server imports once, before any rank forks (a module that fails to import is left to the rank). Not
# DeepSpeed: its import picks the accelerator with torch.cuda.is_available(), which initialises the CUDA driver on a
# GPU host, and a fork of a process that did cannot use CUDA; each rank imports it (~0.5 s of a core)
PRELOAD = ("torch", "torch.distributed", "dflash_dist.actors.local_ranks")


def run_ranks(fn: Callable[..., Any], world: int, args: tuple = (), timeout_s: float = 300.0) -> list:
    """fn(rank, world, *args) on each of `world` gloo ranks; their results in rank order. Each rank is
    a fork of the fork server (never of this process: fork is unsafe once torch runs threads) with one
    torch thread, so `fn` must be a module-level function and its arguments and result picklable. Raises
    RuntimeError naming the rank when one raises (its traceback), exits without a result, or no results
    come within `timeout_s`; the ranks still running are then stopped (module docstring)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (the first call of a process)
    results = ctx.Queue()
    port = free_ports(1, HOST)[0]
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world, port, results, args, dict(os.environ)),
                    daemon=True)
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    name = f"{getattr(fn, '__qualname__', fn)} at world {world}"
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    done = False
    try:
        while len(got) < world:
            try:
                rank, error, value = results.get(timeout=1.0)
            except queue_mod.Empty:
                gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
                if gone:
                    codes = [procs[r].exitcode for r in gone]
                    raise RuntimeError(f"{name}: rank(s) {gone} exited {codes} without a result") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: no result from rank(s) {sorted(set(range(world)) - set(got))} "
                                       f"in {timeout_s:.0f} s") from None  # fmt: skip
                continue
            if error is not None:
                raise RuntimeError(f"{name}: rank {rank} failed: {error}")
            got[rank] = value
        done = True
    finally:
        for p in procs:
            p.join(timeout=30 if done else 0)  # after a failure the peers may wait in a collective: end them
            if p.exitcode is None:
                p.terminate()  # our own child, by its handle: SIGTERM, _Stopped in the rank
        for p in procs:
            p.join(timeout=STOP_GRACE_S)
            if p.exitcode is None:  # blocked in C++ (a gloo collective), where no Python handler runs
                p.kill()
                p.join()
    return [got[rank] for rank in range(world)]


class _Stopped(BaseException):
    """SIGTERM from run_ranks: unwind (finally blocks run, locks are released) and exit quietly."""


def _stop(signum: int, _frame) -> None:
    raise _Stopped(signum)


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, results, args: tuple,
               env: dict[str, str]) -> None:
    """One rank: the caller's environment, the trainers' rank environment on loopback, join_group, fn;
    its result or its error to the parent."""
    signal.signal(signal.SIGTERM, _stop)
    os.environ.clear()
    os.environ.update(env)  # the caller's, as a spawned rank inherited it (the fork server's is older)
    interpreter_bin_first()  # as run_rank: DeepSpeed's JIT ops built by this venv's ninja, not rebuilt by another
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))  # fmt: skip
    try:
        join_group(dict(os.environ), on_gpu=False)
        results.put((rank, None, fn(rank, world, *args)))
    except _Stopped:
        pass  # the parent stopped the group and reads no more
    except BaseException as e:  # noqa: BLE001 - the parent raises it, naming the rank
        results.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-4000:]}", None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
