"""Where captured passes are written: on the capture thread (`capture.writers: 0`, ThreadWriter) or off it
(WriterPool), both behind one interface (`submit` a pass, `close`, `abort`; `open_writers` picks) and one per-row
rule (`write_row`: a row with NaN/Inf on a real token goes to the ledger, any other row into the shard), so both
write the same samples bit for bit.

Off the GPU thread: each pass's features, argmax, ids, loss masks and finiteness flags are copied on a side CUDA
stream into a host buffer (a /dev/shm file mapped here, page-locked, and mapped by the writer processes), and writer
processes encode and write them as webdataset shards while the GPU runs the next passes (`capture.writers`).

A pass's rows are split into contiguous groups balanced by tokens, one job per group, so every writer works on one
pass at once and the drain after the last pass is a group's write, not the whole buffer's by one writer (a pass is
not cut into groups of fewer than `min_group_tokens`, about 32 MiB of output). A buffer returns to the free list
when every group of it is written. The GPU thread only queues copies and waits when every buffer is still being
written. Each writer process owns a ShardWriter of its own prefix (`<actor prefix>-w<N>`, in the actor's shard
directory; the actor's stale-tmp cleanup covers them) with the disk-buffer gate, records non-finite samples in the
ledger, and answers each batch with its counts. Messages are JSON. Writer processes run one torch thread each:
OpenMP pools of several processes spinning beside the GPU's launch thread cost the GPU time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data_pipeline.disk_budget import BufferGate
from data_pipeline.ledger import record_skipped
from data_pipeline.records import Sample
from data_pipeline.shard_reader import NONFINITE
from data_pipeline.shard_writer import ShardWriter
from dflash_dist.capture.driver_room import leave_driver_room

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MIN_GROUP_BYTES = 32 << 20  # a pass is split into groups of at least this much output


def split_rows(lengths: list[int], groups: int, min_tokens: int) -> list[tuple[int, int]]:
    """[row start, row end) of at most `groups` contiguous non-empty row groups covering a pass
    with these row lengths, with the fewest tokens possible in the largest group (the one the
    drain after the last pass waits for); fewer groups where a group would hold under
    `min_tokens` tokens on average (one for a small pass)."""
    rows, total = len(lengths), sum(lengths)
    g = max(1, min(groups, rows, total // max(1, min_tokens)))
    if g == 1:
        return [(0, rows)]

    def fill(cap: int) -> list[int]:  # group starts, each group filled up to cap tokens
        starts, held = [0], 0
        for r, n in enumerate(lengths):
            if held + n > cap:
                starts.append(r)
                held = 0
            held += n
        return starts

    lo, hi = max(lengths), total  # the least cap that needs at most g groups: binary search
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(fill(mid)) <= g else (mid + 1, hi)
    starts = fill(lo)
    return list(zip(starts, starts[1:] + [rows]))


BUFFER_DIR_PREFIX = "dflash-capture-"
_LOCK = ".owner.lock"  # flock'd by the owning process for the directory's life: a lockable one is orphaned


def buffer_parent() -> Path:
    """Where host buffers live: /dev/shm (RAM, shared with the writer processes), else the node's
    temporary directory (never the shard tree, which may be a network filesystem)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def claim_buffer_dir(parent: Path, prefix: str, sweep: bool | None = None) -> tuple[Path, int | None]:
    """A fresh directory for one WriterPool's host buffers under `parent` and the fd of its owner
    lock (None where flock is refused). First (`sweep`; default: in /dev/shm, a local RAM
    filesystem, never where flock may be node-local on a network filesystem), directories of pools whose process died
    without closing them (SIGKILL, OOM: up to capture.writers + 1 passes of RAM each) are removed:
    a flock dies with its holder, whatever the PID namespace. The lock is taken under a temporary
    name and then renamed into place, so a sweeper never finds a named lock that is not yet held;
    only this user's directories are swept."""
    if Path(parent) == Path("/dev/shm") if sweep is None else sweep:
        for old in Path(parent).glob(f"{BUFFER_DIR_PREFIX}*"):
            with contextlib.suppress(OSError):
                if old.lstat().st_uid != os.getuid():
                    continue
                fd = os.open(old / _LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while the owner lives
                    if os.fstat(fd).st_ino != os.stat(old / _LOCK).st_ino:
                        continue  # not the lock we hold (the directory changed meanwhile)
                    freed = sum(f.stat().st_size for f in old.iterdir())
                    shutil.rmtree(old, ignore_errors=True)
                    log.warning("removed %s, the host buffers of a capture whose process died (%.2f GB)", old,
                                freed / 1e9)
                finally:
                    os.close(fd)
    path = Path(tempfile.mkdtemp(prefix=f"{BUFFER_DIR_PREFIX}{prefix}-", dir=parent))
    fd = os.open(path / f"{_LOCK}.tmp", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:  # a filesystem without flock: a lockless directory, never swept
        log.warning("%s: no owner lock (%s); if this process dies, remove the directory by hand", path, e)
        os.close(fd)
        os.unlink(path / f"{_LOCK}.tmp")
        return path, None
    os.rename(path / f"{_LOCK}.tmp", path / _LOCK)
    return path, fd


def release_buffer_dir(path: Path, lock_fd: int | None) -> None:
    """The pool's directory gone (its buffers released first) and its owner lock let go. A
    directory that still holds a buffer keeps its lock file, so the next sweep removes it."""
    leftovers = [f for f in path.iterdir() if f.name != _LOCK] if path.is_dir() else []
    if not leftovers:
        with contextlib.suppress(OSError):
            (path / _LOCK).unlink()
        with contextlib.suppress(OSError):
            path.rmdir()
    if lock_fd is not None:
        with contextlib.suppress(OSError):
            os.close(lock_fd)


def no_room(parent: Path, need: int, what: str) -> str:
    du = shutil.disk_usage(parent)
    return (
        f"capture host buffers: {need / 1e9:.2f} GB do not fit in {parent} ({du.free / 1e9:.2f} of "
        f"{du.total / 1e9:.2f} GB free; {what}). The writer processes need capture.writers + 1 buffers of a "
        "capture pass each (capture.token_budget tokens x k x hidden x 2 bytes), in shared memory that also "
        "counts against the container's memory limit: give the container more shared memory (docker "
        "--shm-size, the Slurm or Kubernetes /dev/shm size) and memory, or lower capture.writers or "
        "capture.token_budget"
    )


class HostBuffer:
    """One pass's outputs in a shared file: features [tokens, width] of the feature dtype, then
    argmax int32, ids int32, loss mask uint8 per token and a finiteness byte per sequence."""

    def __init__(self, path: Path, tokens: int, rows: int, width: int, dtype: str, create: bool) -> None:
        self.path, self.tokens, self.rows, self.width, self.dtype = Path(path), tokens, rows, width, dtype
        fb = tokens * width * torch.empty((), dtype=DTYPES[dtype]).element_size()
        self.nbytes = self.size(tokens, rows, width, dtype)
        if create:
            self._create()
        raw = torch.from_file(str(self.path), shared=True, size=self.nbytes, dtype=torch.uint8)
        self.raw = raw
        self.features = raw[:fb].view(DTYPES[dtype]).view(tokens, width)
        self.argmax = raw[fb : fb + 4 * tokens].view(torch.int32)
        self.ids = raw[fb + 4 * tokens : fb + 8 * tokens].view(torch.int32)
        self.mask = raw[fb + 8 * tokens : fb + 9 * tokens]
        self.finite = raw[fb + 9 * tokens :]
        self.pinned = False

    @staticmethod
    def size(tokens: int, rows: int, width: int, dtype: str) -> int:
        """Bytes of a buffer of `tokens` tokens and `rows` sequences (the layout above)."""
        return tokens * (width * torch.empty((), dtype=DTYPES[dtype]).element_size() + 9) + rows

    def _create(self) -> None:
        """The file at its full size with its memory reserved now: a sparse file in a /dev/shm too
        small for it would kill the first process that touches a page past the room (SIGBUS), not
        fail here."""
        with open(self.path, "wb") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, self.nbytes)
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):  # no fallocate here: sparse, as before
                    f.truncate(self.nbytes)
                    return
                f.close()
                self.path.unlink(missing_ok=True)
                raise RuntimeError(no_room(self.path.parent, self.nbytes, f"{self.path}: {e.strerror}")) from None

    def spec(self) -> list:
        return [str(self.path), self.tokens, self.rows, self.width, self.dtype]

    def pin(self) -> None:
        """Page-lock it for the CUDA driver, so device-to-host copies are asynchronous DMA."""
        err = torch.cuda.cudart().cudaHostRegister(self.raw.data_ptr(), self.nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {self.path} ({self.nbytes} bytes) failed ({err})")
        self.pinned = True

    def release(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.raw.data_ptr())
            self.pinned = False
        self.path.unlink(missing_ok=True)


@dataclass
class SinkCounts:
    samples: int = 0
    tokens: int = 0
    skipped: int = 0
    shards: int = 0
    bytes: int = 0
    busy_s: float = 0.0  # writer time summed over writers (encode + tar + fsync + rename)
    waited_disk_s: float = 0.0  # writers paused for the disk buffer (disk_budget.py)
    writebacks: int = 0  # write-back ranges writer processes started while idle (capture.writeback_idle)
    writeback_s: float = 0.0  # their seconds, summed over writers (not in busy_s: no job was waiting)
    writeback_max_s: float = 0.0  # the longest single range: the most a job arriving meanwhile waited
    gpu_waited_s: float = 0.0  # the GPU thread waiting for a free host buffer (writers behind)
    jobs: int = 0  # row groups sent to the writers (a pass is one or several: split_rows)
    errors: list[str] = field(default_factory=list)


def row_finite(features: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """[b] per padded row of a pass: no NaN/Inf on its real tokens (padding may hold anything)."""
    return (torch.isfinite(features).all(-1) | (attention == 0)).all(-1).to(torch.uint8)


def write_row(writer: ShardWriter, shard_dir: str | Path, actor: int, out: dict, key: str, ids: torch.Tensor,
              mask: torch.Tensor, features: torch.Tensor, argmax: torch.Tensor, meta: dict, finite: bool) -> None:
    """One captured row: into the shard, or (non-finite) its key into the ledger; counted in `out`."""
    if not finite:
        record_skipped(shard_dir, key, NONFINITE, actor)
        out["skipped"] += 1
        return
    writer.write(Sample(key=key, input_ids=ids, loss_mask=mask, features=features, target_argmax=argmax, meta=meta))
    out["samples"] += 1
    out["tokens"] += int(ids.shape[0])


class ThreadWriter:
    """`capture.writers: 0`: each pass written on the capture thread as it is submitted (one
    ShardWriter of the actor's prefix, behind the disk-buffer gate)."""

    def __init__(self, cfg, shard_dir: Path, provenance, prefix: str, actor_index: int,
                 gate: BufferGate | None) -> None:
        self.counts = SinkCounts()
        self.shard_dir, self.actor = shard_dir, actor_index
        self.gate = gate
        self.writer = ShardWriter(shard_dir, provenance, cfg.capture.shard_bytes, prefix, before_open=gate)

    def submit(self, features: torch.Tensor, argmax: torch.Tensor, attention: torch.Tensor,
               items: list[tuple[str, list[int], list[int], dict]]) -> None:
        """Write one pass now (WriterPool.submit's arguments)."""
        t0 = time.perf_counter()
        finite = row_finite(features, attention).tolist()
        argmax = argmax.to(torch.int32)
        out = {"samples": 0, "tokens": 0, "skipped": 0}
        for r, (key, ids, mask, meta) in enumerate(items):
            n = len(ids)
            write_row(self.writer, self.shard_dir, self.actor, out, key, torch.tensor(ids, dtype=torch.int32),
                      torch.tensor(mask, dtype=torch.uint8), features[r, :n].cpu(), argmax[r, :n].cpu(), meta,
                      bool(finite[r]))
        c = self.counts
        for k in ("samples", "tokens", "skipped"):
            setattr(c, k, getattr(c, k) + out[k])
        c.shards, c.bytes = len(self.writer.records), sum(r.n_bytes for r in self.writer.records)
        c.jobs += 1
        c.busy_s += time.perf_counter() - t0

    def close(self) -> SinkCounts:
        """The last shard closed and listed."""
        self.writer.close()
        c = self.counts
        c.shards, c.bytes = len(self.writer.records), sum(r.n_bytes for r in self.writer.records)
        c.waited_disk_s = self.gate.waited_s if self.gate is not None else 0.0
        return c

    def abort(self) -> None:
        """After an error: the unfinished shard is deleted; completed ones stay listed."""
        self.writer.abort()


def open_writers(cfg, shard_dir: Path, provenance, prefix: str, actor_index: int, writers: int,
                 gate: BufferGate | None, device: torch.device | str = "cpu",
                 tokens_hint: int = 0) -> ThreadWriter | WriterPool:
    """`writers` writer processes (WriterPool, started and ready), or for 0 the capture thread."""
    if writers == 0:
        return ThreadWriter(cfg, shard_dir, provenance, prefix, actor_index, gate)
    return WriterPool(cfg, shard_dir, provenance, prefix, actor_index, writers, device=device, gate=gate is not None,
                      tokens_hint=tokens_hint, gate_at=gate)


def _writer_main(conn, spec: dict) -> None:
    """A writer process: {buf: spec, row0, tok0, items: [[key, n, meta], ...]} in (a row group of
    a buffer: its first row and token there), counts (or {error}) out."""
    torch.set_num_threads(1)
    from data_pipeline.disk_budget import BufferPolicy
    from data_pipeline.provenance import Provenance
    from dflash_dist.config import load_config_dict

    writer = None
    try:
        cfg = load_config_dict(spec["cfg"])
        gate_dir, policy = spec["gate_at"] or (spec["shard_dir"], dataclasses.asdict(BufferPolicy.from_config(cfg)))
        parent = os.getppid()  # the capture process; a SIGKILLed one leaves this writer running, maybe at the gate
        gate = BufferGate(gate_dir, BufferPolicy(**policy),  # the tree's root: every epoch directory counts
                          abandon=lambda: None if os.getppid() == parent else
                          f"the capture process {parent} that started this writer is gone (its restart redoes it)")
        writer = ShardWriter(spec["shard_dir"], Provenance.from_dict(spec["provenance"]), cfg.capture.shard_bytes,
                             spec["prefix"], before_open=gate if spec["gate"] else None)
        bufs: dict[str, HostBuffer] = {}
        conn.send_bytes(b"{}")
        idle = {"writebacks": 0, "writeback_s": 0.0}  # started while idle, not yet in a reply

        def idle_figures() -> dict:
            out = {**idle, "writeback_max_s": writer.writeback_max_s}
            idle.update(writebacks=0, writeback_s=0.0)
            return out

        while True:
            if cfg.capture.writeback_idle and not conn.poll(0.002):  # no job: the open shard to the disk meanwhile
                t0, calls0 = time.perf_counter(), writer.writeback_calls
                writer.start_writeback(stop=lambda: conn.poll(0))  # in ranges, until a job comes
                idle["writebacks"] += writer.writeback_calls - calls0
                idle["writeback_s"] += time.perf_counter() - t0
            if (msg := json.loads(conn.recv_bytes())) is None:
                break
            t0, waited0, shards0 = time.perf_counter(), gate.waited_s, len(writer.records)
            path = msg["buf"][0]
            if path not in bufs or bufs[path].spec() != msg["buf"]:
                bufs = {p: b for p, b in bufs.items() if Path(p).exists()}  # unmap buffers the GPU side re-made
                bufs[path] = HostBuffer(Path(path), *msg["buf"][1:], create=False)
            buf, off = bufs[path], msg["tok0"]
            out = {"samples": 0, "tokens": 0, "skipped": 0}
            for row, (key, n, meta) in enumerate(msg["items"], msg["row0"]):
                sl = slice(off, off + n)
                off += n
                write_row(writer, spec["shard_dir"], spec["actor"], out, key, buf.ids[sl], buf.mask[sl],
                          buf.features[sl], buf.argmax[sl], meta, bool(buf.finite[row]))
            done = writer.records[shards0:]
            out.update(shards=len(done), bytes=sum(r.n_bytes for r in done), busy_s=time.perf_counter() - t0,
                       waited_disk_s=gate.waited_s - waited0, **idle_figures())
            conn.send_bytes(json.dumps(out).encode())
        t0 = time.perf_counter()
        last = writer.close()
        conn.send_bytes(json.dumps({"samples": 0, "tokens": 0, "skipped": 0, "shards": int(last is not None),
                                    "bytes": last.n_bytes if last else 0, "busy_s": time.perf_counter() - t0,
                                    "waited_disk_s": 0.0, **idle_figures()}).encode())
    except BaseException as e:  # reported to the GPU process, which raises it
        if writer is not None:
            writer.abort()
        with contextlib.suppress(Exception):
            conn.send_bytes(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        return
    # Every shard is fsynced, renamed and listed, and the last reply sent: nothing is left to
    # flush but logging. An interpreter with torch loaded takes ~0.6 s to tear down, which the
    # GPU side's close() would wait for after the capture's last pass.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _gone(conn, proc) -> RuntimeError:
    """A writer process that left: its own error if it sent one before the parent asked (a failed
    write-back while idle), else what the exit says."""
    with contextlib.suppress(Exception):
        if conn.poll(0) and "error" in (msg := json.loads(conn.recv_bytes())):
            return RuntimeError(msg["error"])
    proc.join(timeout=5)
    return RuntimeError(
        f"capture writer process {proc.name} (pid {proc.pid}) ended without a reply, exit code {proc.exitcode}: "
        "killed (out of memory? see the kernel log), or it could not start (under the spawn start method a "
        "script that starts a capture must guard its entry point with `if __name__ == '__main__':`)"
    )


def _send(conn, proc, data: bytes) -> None:
    try:
        conn.send_bytes(data)
    except (BrokenPipeError, ConnectionResetError):
        raise _gone(conn, proc) from None


class WriterPool:
    """`writers` writer processes and `writers + spare` host buffers (sized on demand: a pass
    larger than a buffer gets the buffer re-made at its size). `submit` is called on the GPU
    thread right after a capture pass and queues its row groups (split_rows) as jobs that the
    writers take as they come free; `close` waits until every shard is renamed and listed."""

    def __init__(self, cfg, shard_dir: Path, provenance, prefix: str, actor_index: int, writers: int,
                 spare_buffers: int = 1, device: torch.device | str = "cpu", gate: bool = True,
                 tokens_hint: int = 0, min_group_tokens: int | None = None, gate_at: BufferGate | None = None) -> None:
        self.counts, self.lock = SinkCounts(), threading.Lock()
        self.tokens_hint = tokens_hint  # first size of each buffer (capture.token_budget)
        self.device = torch.device(device)
        self.dtype, self.width = provenance.dtype, provenance.feature_width
        token_bytes = HostBuffer.size(1, 0, self.width, self.dtype)
        self.min_group_tokens = min_group_tokens or -(-MIN_GROUP_BYTES // token_bytes)
        n_bufs = writers + spare_buffers
        where = buffer_parent()
        if tokens_hint:  # all buffers at their first size (_buffer) must fit, not only the first passes'
            need = n_bufs * HostBuffer.size(tokens_hint, 64, self.width, self.dtype)
            if need > shutil.disk_usage(where).free:
                raise RuntimeError(no_room(where, need, f"{n_bufs} buffers of {tokens_hint} tokens"))
        leave_driver_room(self.device)  # a stream allocates outside torch's cache, which may hold the whole card
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.procs, self.threads = [], []
        self.bufs: list[HostBuffer | None] = [None] * n_bufs
        self.buf_dir, self._buf_lock = claim_buffer_dir(where, prefix)
        self.pending = [0] * len(self.bufs)  # row groups of each buffer not written yet
        self._generation = 0
        self.free: queue.Queue[int] = queue.Queue()
        for i in range(len(self.bufs)):
            self.free.put(i)
        self.jobs: queue.Queue = queue.Queue()
        ctx = mp.get_context("spawn")
        at = None if gate_at is None else [str(gate_at.shard_dir), dataclasses.asdict(gate_at.policy)]
        spec = {"cfg": cfg.to_dict(), "shard_dir": str(shard_dir), "provenance": provenance.to_dict(),
                "actor": actor_index, "gate": gate, "gate_at": at}  # gate_at: the capture's gate (root, policy)
        env_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # the children's OpenMP pools: one thread (module docstring)
        conns = []
        try:
            for w in range(writers):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_writer_main, args=(child, {**spec, "prefix": f"{prefix}-w{w}"}), daemon=True,
                                name=f"dflash-writer-{prefix}-{w}")
                p.start()
                self.procs.append(p)
                conns.append(parent)
        except BaseException:  # a process could not start: the others stopped, the buffer directory released
            self.abort()
            raise
        finally:
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_threads
        try:
            for conn, proc in zip(conns, self.procs):  # the writers start up side by side
                self._reply(conn, proc)  # ready: imports done, writer open
                self.threads.append(threading.Thread(target=self._drain, args=(conn, proc), daemon=True))
        except BaseException:  # a writer could not start: stop the others
            self.abort()
            raise
        for t in self.threads:
            t.start()

    def _buffer(self, i: int, tokens: int, rows: int) -> HostBuffer:
        buf = self.bufs[i]
        if buf is None or buf.tokens < tokens or buf.rows < rows:
            if buf is not None:
                buf.release()
            self._generation += 1
            tokens = max(tokens, buf.tokens if buf else self.tokens_hint)
            buf = HostBuffer(self.buf_dir / f"buf{i}-{self._generation}", tokens, max(rows, 64), self.width,
                             self.dtype, create=True)
            if self.stream is not None:
                leave_driver_room(self.device)
                buf.pin()
            self.bufs[i] = buf
        return buf

    def submit(self, features: torch.Tensor, argmax: torch.Tensor, attention: torch.Tensor,
               items: list[tuple[str, list[int], list[int], dict]]) -> None:
        """Queue one pass: features [b, T, width] and argmax [b, T] on the device, attention [b, T]
        (1 on real tokens), items per row (key, ids, loss mask, meta). Returns without waiting for
        the copies unless every buffer is in flight."""
        t0 = time.perf_counter()
        i = self._take()
        self.counts.gpu_waited_s += time.perf_counter() - t0
        lengths = [len(ids) for _, ids, _, _ in items]
        buf = self._buffer(i, sum(lengths), len(items))
        off = 0
        for (_, ids, mask, _), n in zip(items, lengths):
            buf.ids[off : off + n] = torch.as_tensor(ids, dtype=torch.int32)
            buf.mask[off : off + n] = torch.as_tensor(mask, dtype=torch.uint8)
            off += n
        finite = row_finite(features, attention)  # [b], on the device
        argmax = argmax.to(torch.int32)
        event = None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            off = 0
            for r, n in enumerate(lengths):
                buf.features[off : off + n].copy_(features[r, :n], non_blocking=True)
                buf.argmax[off : off + n].copy_(argmax[r, :n], non_blocking=True)
                off += n
            buf.finite[: len(items)].copy_(finite, non_blocking=True)
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
                for t in (features, argmax, finite):
                    t.record_stream(self.stream)  # the caching allocator keeps them until the copies ran
        rows = [[k, n, meta] for (k, _, _, meta), n in zip(items, lengths)]
        groups = split_rows(lengths, len(self.procs), self.min_group_tokens)
        self.pending[i] = len(groups)  # the buffer is free, so no writer touches this count now
        with self.lock:
            self.counts.jobs += len(groups)
        for r0, r1 in groups:
            self.jobs.put((i, event, {"buf": buf.spec(), "row0": r0, "tok0": sum(lengths[:r0]), "items": rows[r0:r1]}))

    def _take(self) -> int:
        while True:
            if self.counts.errors:
                raise RuntimeError(f"capture writer failed: {self.counts.errors[0]}")
            with contextlib.suppress(queue.Empty):
                return self.free.get(timeout=1.0)

    def _drain(self, conn, proc) -> None:
        try:
            while (job := self.jobs.get()) is not None:
                i, event, msg = job
                if event is not None:
                    event.synchronize()
                _send(conn, proc, json.dumps(msg).encode())
                self._reply(conn, proc)
                with self.lock:
                    self.pending[i] -= 1
                    if self.pending[i] == 0:  # the buffer's last group: it can take the next pass
                        self.free.put(i)
            _send(conn, proc, b"null")
            self._reply(conn, proc)
        except Exception as e:  # surfaced by submit/close on the GPU thread
            self.counts.errors.append(f"{type(e).__name__}: {e}")

    def _reply(self, conn, proc) -> None:
        try:
            msg = json.loads(conn.recv_bytes())
        except EOFError:
            raise _gone(conn, proc) from None
        if "error" in msg:
            raise RuntimeError(msg["error"])
        with self.lock:
            c = self.counts
            for k in ("samples", "tokens", "skipped", "shards", "bytes", "writebacks"):
                setattr(c, k, getattr(c, k) + int(msg.get(k, 0)))
            c.busy_s += float(msg.get("busy_s", 0.0))
            c.writeback_s += float(msg.get("writeback_s", 0.0))
            c.writeback_max_s = max(c.writeback_max_s, float(msg.get("writeback_max_s", 0.0)))
            c.waited_disk_s += float(msg.get("waited_disk_s", 0.0))

    def close(self) -> SinkCounts:
        """Every queued pass written and every writer's last shard closed; then processes and
        buffers released. Raises if a writer failed (its unfinished shard is deleted). The buffers
        whose passes are all written go first, while the writers finish the last passes: unpinning a
        pass-sized buffer takes time that would otherwise come after the last shard is listed."""
        try:
            for _ in self.threads:
                self.jobs.put(None)
            # no pass comes after close(): a buffer whose pass is written is unpinned and unlinked now; its pages go
            # with our mapping when the pool goes, not with the writers' exits, which close() waits for
            while any(t.is_alive() for t in self.threads) or not self.free.empty():
                with contextlib.suppress(queue.Empty):
                    if (b := self.bufs[self.free.get(timeout=0.01)]) is not None:
                        b.release()
            for t in self.threads:
                t.join()
        finally:
            for p in self.procs:
                p.join(timeout=120)
                if p.is_alive():
                    p.kill()
            self._release_all()
        if self.counts.errors:
            raise RuntimeError("capture writer failed: " + "; ".join(self.counts.errors))
        return self.counts

    def abort(self) -> None:
        """After an error on the GPU thread: stop the writers (their unfinished shards are
        deleted by the next attempt's stale-tmp cleanup) and release the buffers."""
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.join(timeout=30)
        self._release_all()

    def _release_all(self) -> None:
        """Every buffer unpinned and unlinked, then the directory; first the copy stream synchronized: an error
        path can leave queued copies into a buffer that no writer thread waited for."""
        if self.stream is not None:
            with contextlib.suppress(Exception):
                self.stream.synchronize()
        for b in self.bufs:
            if b is not None:
                with contextlib.suppress(Exception):
                    b.release()
        self._release_dir()

    def _release_dir(self) -> None:
        if self._buf_lock is not None:  # once: the fd number may be another file's afterwards
            release_buffer_dir(self.buf_dir, self._buf_lock)
            self._buf_lock = None
