"""Host side of the capture benchmark: device-to-host copies into shared host buffers on a side
CUDA stream, drained by ShardWriters in threads or in writer processes (bench_capture.py).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data_pipeline.provenance import Provenance
from data_pipeline.records import Sample
from data_pipeline.shard_writer import ShardWriter


class HostBuffer:
    """One batch's features, argmax and ids in host memory the GPU copies into asynchronously:
    a file in /dev/shm mapped by the GPU process (and pinned there) and by writer processes."""

    def __init__(self, path: Path, tokens: int, width: int, create: bool) -> None:
        self.path, self.tokens, self.width = path, tokens, width
        self.nbytes = tokens * (2 * width + 8)
        if create:
            with open(path, "wb") as f:
                f.truncate(self.nbytes)
        raw = torch.from_file(str(path), shared=True, size=self.nbytes, dtype=torch.uint8)
        fb = tokens * width * 2
        self.features = raw[:fb].view(torch.bfloat16).view(tokens, width)
        self.argmax = raw[fb : fb + 4 * tokens].view(torch.int32)
        self.ids = raw[fb + 4 * tokens :].view(torch.int32)
        self.raw = raw

    def pin(self) -> None:
        """Page-lock it for the CUDA driver, so device-to-host copies are asynchronous DMA."""
        err = torch.cuda.cudart().cudaHostRegister(self.raw.data_ptr(), self.nbytes, 0)
        if int(err) != 0 or not self.features.is_pinned():
            raise RuntimeError(f"cudaHostRegister of {self.path} failed ({err})")

    def samples(self, keys: list[str], lengths: list[int]):
        off = 0
        for key, n in zip(keys, lengths):
            f, a, i = self.features[off : off + n], self.argmax[off : off + n], self.ids[off : off + n]
            off += n
            yield Sample(key, i, torch.ones(n, dtype=torch.uint8), f, a)


@dataclass
class SinkStats:
    shards: int = 0
    bytes: int = 0
    samples: int = 0
    write_s: float = 0.0  # summed over writers: encode + tar + fsync + rename
    gpu_waited_s: float = 0.0  # the main thread waiting for a free host buffer (writers behind)
    closed_at: float = 0.0  # perf_counter when the last shard was listed
    errors: list[str] = field(default_factory=list)


def _write_batch(writer: ShardWriter, buf: HostBuffer, keys: list[str], lengths: list[int], keep: bool) -> list:
    done = [r for r in (writer.write(s) for s in buf.samples(keys, lengths)) if r is not None]
    if not keep:
        for r in done:
            (writer.out_dir / r.name).unlink()
    return [[r.name, r.n_bytes] for r in done]


def _writer_process(
    conn,
    shard_dir: str,
    provenance: str,
    paths: list[str],
    tokens: int,
    width: int,
    keep: bool,
    max_shard_bytes: int,
    prefix: str,
) -> None:
    """A writer process: JSON requests {buf, keys, lengths} in, {shards, busy_s} (or {error}) out."""
    try:
        bufs = [HostBuffer(Path(p), tokens, width, create=False) for p in paths]
        writer = ShardWriter(shard_dir, Provenance.from_dict(json.loads(provenance)), max_shard_bytes, prefix)
        conn.send_bytes(json.dumps({"shards": [], "busy_s": 0.0}).encode())
        while (msg := json.loads(conn.recv_bytes())) is not None:
            t0 = time.perf_counter()
            shards = _write_batch(writer, bufs[msg["buf"]], msg["keys"], msg["lengths"], keep)
            conn.send_bytes(json.dumps({"shards": shards, "busy_s": time.perf_counter() - t0}).encode())
        t0 = time.perf_counter()
        last = writer.close()
        if last is not None and not keep:
            (writer.out_dir / last.name).unlink()
        shards = [[last.name, last.n_bytes]] if last is not None else []
        conn.send_bytes(json.dumps({"shards": shards, "busy_s": time.perf_counter() - t0}).encode())
    except Exception as e:  # reported to the GPU process, which raises it
        conn.send_bytes(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())


class HostSink:
    """Host buffers filled on a side CUDA stream while the GPU runs on, drained by `writers`
    ShardWriters (own prefix each, one directory) in threads of this process (mode "threads") or
    in writer processes ("processes": no GIL shared with the GPU's launch thread), or only copied
    ("d2h"). The GPU thread waits only when every buffer is in flight. Messages are JSON."""

    def __init__(
        self,
        shard_dir: Path,
        provenance: Provenance,
        writers: int,
        buffers: int,
        tokens: int,
        width: int,
        keep: bool,
        max_shard_bytes: int,
        device: str,
        mode: str,
    ) -> None:
        self.stats, self.keep, self.lock = SinkStats(), keep, threading.Lock()
        shard_dir.mkdir(parents=True, exist_ok=True)
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else shard_dir
        self.bufs = [
            HostBuffer(shm / f"bench-capture-{os.getpid()}-{i}", tokens, width, create=True) for i in range(buffers)
        ]
        self.stream = torch.cuda.Stream() if device.startswith("cuda") else None
        if self.stream is not None:
            for b in self.bufs:
                b.pin()
        self.free: queue.Queue[int] = queue.Queue()
        for i in range(buffers):
            self.free.put(i)
        self.jobs: queue.Queue = queue.Queue()
        self.procs, drains = [], []
        prov, paths = json.dumps(provenance.to_dict()), [str(b.path) for b in self.bufs]
        for w in range(writers):
            if mode == "d2h":
                drains.append((self._drain_null, None))
            elif mode == "processes":
                parent, child = mp.get_context("spawn").Pipe()
                args = (child, str(shard_dir), prov, paths, tokens, width, keep, max_shard_bytes, f"bench{w}")
                self.procs.append(mp.get_context("spawn").Process(target=_writer_process, args=args, daemon=True))
                self.procs[-1].start()
                self._reply(parent)  # ready: imports done, buffers mapped, writer open
                drains.append((self._drain_remote, parent))
            elif mode == "threads":
                drains.append((self._drain_local, ShardWriter(shard_dir, provenance, max_shard_bytes, f"bench{w}")))
            else:
                raise ValueError(f"sink mode {mode!r}: expected threads, processes or d2h")
        self.threads = [threading.Thread(target=fn, args=(arg,), daemon=True) for fn, arg in drains]
        for t in self.threads:
            t.start()

    def submit(self, cap, batch) -> None:
        """Queue the copies of `cap` (a CaptureOutput) for `batch` (keys, ids, lengths, real_tokens)."""
        t0 = time.perf_counter()
        i = self._take_buffer()
        self.stats.gpu_waited_s += time.perf_counter() - t0
        buf, argmax, event = self.bufs[i], cap.target_argmax.to(torch.int32), None
        torch.cat(batch.ids, out=buf.ids[: batch.real_tokens])
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            off = 0
            for r, n in enumerate(batch.lengths):
                buf.features[off : off + n].copy_(cap.features[r, :n], non_blocking=True)
                buf.argmax[off : off + n].copy_(argmax[r, :n], non_blocking=True)
                off += n
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
                cap.features.record_stream(self.stream)
                argmax.record_stream(self.stream)
        self.jobs.put((i, event, batch.keys, batch.lengths))

    def _take_buffer(self) -> int:
        while True:
            if self.stats.errors:
                raise RuntimeError("writer failed: " + self.stats.errors[0])
            with contextlib.suppress(queue.Empty):
                return self.free.get(timeout=1.0)

    def _jobs(self):
        while (job := self.jobs.get()) is not None:
            i, event, keys, lengths = job
            if event is not None:
                event.synchronize()
            yield i, keys, lengths

    def _drain_local(self, writer: ShardWriter) -> None:
        try:
            for i, keys, lengths in self._jobs():
                t0 = time.perf_counter()
                self._account(_write_batch(writer, self.bufs[i], keys, lengths, self.keep), time.perf_counter() - t0)
                self.free.put(i)
            t0 = time.perf_counter()
            last = writer.close()
            if last is not None and not self.keep:
                (writer.out_dir / last.name).unlink()
            self._account([[last.name, last.n_bytes]] if last else [], time.perf_counter() - t0)
        except Exception as e:  # surfaced by submit/close in the GPU thread
            self.stats.errors.append(f"{type(e).__name__}: {e}")
            writer.abort()

    def _drain_null(self, _) -> None:
        for i, _keys, _lengths in self._jobs():
            self.free.put(i)

    def _drain_remote(self, conn) -> None:
        try:
            for i, keys, lengths in self._jobs():
                conn.send_bytes(json.dumps({"buf": i, "keys": keys, "lengths": lengths}).encode())
                self._reply(conn)
                self.free.put(i)
            conn.send_bytes(json.dumps(None).encode())
            self._reply(conn)
        except Exception as e:
            self.stats.errors.append(f"{type(e).__name__}: {e}")

    def _reply(self, conn) -> None:
        msg = json.loads(conn.recv_bytes())
        if "error" in msg:
            raise RuntimeError(msg["error"])
        self._account(msg["shards"], msg["busy_s"])

    def _account(self, shards: list, busy_s: float) -> None:
        with self.lock:
            self.stats.shards += len(shards)
            self.stats.bytes += sum(n for _, n in shards)
            self.stats.write_s += busy_s

    def close(self) -> SinkStats:
        """Wait until every shard is renamed and listed; then release processes and buffers."""
        for _ in self.threads:
            self.jobs.put(None)
        for t in self.threads:
            t.join()
        self.stats.closed_at = time.perf_counter()  # before the writer processes' exit
        for p in self.procs:
            p.join(timeout=60)
        for b in self.bufs:
            if self.stream is not None:
                torch.cuda.cudart().cudaHostUnregister(b.raw.data_ptr())
            b.path.unlink(missing_ok=True)
        if self.stats.errors:
            raise RuntimeError("writer failed: " + "; ".join(self.stats.errors))
        return self.stats


class ShardJanitor:
    """Deletes finished shards (renamed `<prefix>-NNNNNN.tar`) while a long end-to-end run writes
    them, so >= 50 passes (~75 GB at the 27B shape) fit a 64 GB disk. The writes, fsyncs and
    renames are all still done and timed; only the finished files go."""

    def __init__(self, shard_dir: Path, every_s: float = 0.2) -> None:
        self.shard_dir, self.every_s = Path(shard_dir), every_s
        self.deleted = self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shard-janitor", daemon=True)
        self._thread.start()

    def _sweep(self) -> None:
        for path in self.shard_dir.glob("[!.]*.tar"):
            with contextlib.suppress(FileNotFoundError):
                size = path.stat().st_size
                path.unlink()
                self.deleted += 1
                self.bytes += size

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sweep()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sweep()
