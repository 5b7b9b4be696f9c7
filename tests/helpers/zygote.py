"""Rank processes forked from a zygote: one process imports torch, DeepSpeed and the trainer once,
and each rank of a test's process group is a fresh fork of it. A rank started as
`python -m tests.test_X SPEC` imported them again (several seconds of a core per rank; a module
that starts ten ranks spent most of its time there).

Each rank is a fork of the zygote (never of the test process, whose threads make a fork unsafe,
nor of another rank), with its own environment (RANK, MASTER_PORT, ...), its output in a log file,
and its exit code as a process's: the zygote reaps it and reports it. The zygote runs as
`python -m tests.helpers.zygote MODULE...` (the modules to import); it reads one JSON request a
line on stdin and writes `started PID` / `exit PID CODE` lines on stdout; at stdin's end it kills
the ranks still running (its own children) and exits.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# what a trainer rank imports (torch._dynamo and torch.utils.tensorboard: late, through DeepSpeed's engine and the
# metrics), for a zygote whose ranks run the Trainer
TRAINER_MODULES = ("torch", "torch.distributed", "deepspeed", "dflash_dist.trainer.loop", "dflash_dist.trainer.engine",
                   "dflash_dist.actors.trainer_group", "torch._dynamo", "torch.utils.tensorboard")


class Forked:
    """A rank forked by the zygote: its pid, and its exit code once the zygote has reaped it
    (negative: killed by that signal), as subprocess.Popen's poll/wait/kill."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid

    def poll(self) -> int | None:
        return self.zygote.codes.get(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.zygote.changed:
            while self.pid not in self.zygote.codes:
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or self.zygote.ended:
                    raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0)
                self.zygote.changed.wait(left)
            return self.zygote.codes[self.pid]

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # reaped meanwhile
                os.kill(self.pid, signal.SIGKILL)  # a child of our zygote, by its pid


class Zygote:
    """The zygote process (started here, with `modules` imported); `start` forks a rank of it."""

    def __init__(self, modules: list[str], stderr_log: Path) -> None:
        self.codes: dict[int, int] = {}
        self.changed = threading.Condition()
        self.ended = False
        self._started: list[int] = []
        with open(stderr_log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.zygote", *modules], cwd=REPO,
                                         env=os.environ | {"OMP_NUM_THREADS": "1"}, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True)  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            word, pid, *code = line.split()  # `started PID` or `exit PID CODE`
            with self.changed:
                if word == "started":
                    self._started.append(int(pid))
                else:
                    self.codes[int(pid)] = int(code[0])
                self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def start(self, target: str, args: list[str], env: dict[str, str], log: Path, timeout_s: float = 300) -> Forked:
        """Fork a rank that runs `target` ("module:function") on `args`, with `env` added to its
        environment and its stdout and stderr in `log` (the first waits for the zygote's imports)."""
        with self.changed:
            n = len(self._started)
            self.proc.stdin.write(json.dumps({"target": target, "args": args, "env": env, "log": str(log)}) + "\n")
            self.proc.stdin.flush()
            deadline = time.monotonic() + timeout_s
            while len(self._started) == n:
                assert not self.ended and time.monotonic() < deadline, "the zygote did not fork (see its log)"
                self.changed.wait(1.0)
            return Forked(self, self._started[n])

    def close(self) -> None:
        """End the zygote: it kills any rank still running and exits."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # our own child, by handle
                self.proc.wait()
        self._reader.join(timeout=5)


def _rank(request: dict) -> None:
    """In the forked child: its output to the log, its environment, the target; never returns."""
    code = 1
    try:
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.update(request["env"])
        module, name = request["target"].split(":")
        getattr(importlib.import_module(module), name)(*request["args"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported as the rank's exit code, with its traceback in the log
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(modules: list[str]) -> None:
    out = os.fdopen(os.dup(1), "w")  # the replies; whatever the imports print goes to stderr
    os.dup2(2, 1)
    for module in modules:
        importlib.import_module(module)
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        while children:  # reap every rank that has ended
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            out.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
            out.flush()
        if not readable:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                out.close()
                _rank(request)
            children.add(pid)
            out.write(f"started {pid}\n")
            out.flush()
    for pid in children:
        os.kill(pid, signal.SIGKILL)  # stdin closed: the test is done with them
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    serve(sys.argv[1:])
