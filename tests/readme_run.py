"""The README's main command, run once for the slow tier and checked by several tests.

`dflash-dist run configs/tiny.yaml` (the whole tiny config, unshortened), submitted with
`ray job submit` to a real local Ray head (started and stopped here, bound to 127.0.0.1) whose
processes all see fla as usable (tests/fla_cpu_shim on PYTHONPATH: the head, the job's driver, the
target actor, the trainers and the evaluator inherit it). tests/test_pipeline.py checks its
outputs, tests/test_launch_ray.py the job and the head, tests/test_tiny_target.py that nothing
reached fla. One run instead of three: the session fixture `readme_run` (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dflash_dist.actors.ports import free_ports

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
SHIM = Path(__file__).resolve().parent / "fla_cpu_shim"  # sitecustomize: fla.ops.gated_delta_rule imports
CONFIG = "configs/tiny.yaml"


def shim_env(calls: Path, base: dict | None = None) -> dict:
    """`base` (the environment) with the fla shim first on PYTHONPATH, its refused calls logged to `calls`."""
    return dict(base if base is not None else os.environ, PYTHONPATH=f"{SHIM}{os.pathsep}{REPO}",
                DFLASH_FLA_SHIM_CALLS=str(calls), PYTHONUNBUFFERED="1")


def _session_pids(sid: int, marker: str) -> list[int]:
    """Processes of the head's own session, or naming its private temp dir on their command
    line (whatever Ray spawned in a session of its own): only what this test started."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[3]) == sid or marker in cmdline:
            pids.append(int(proc.name))
    return pids


class LocalHead:
    """`ray start --head` on 127.0.0.1 in its own session and temp dir, with the venv on PATH."""

    def __init__(self, env: dict | None = None) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="dfray-", dir="/tmp")  # short: Ray's socket paths
        # every port of its own: Ray's fixed defaults (agent 52365, client 10001, ...) may be
        # held by another Ray on this machine, and a head whose job agent cannot bind takes no jobs
        self.port, self.dash_port, *self.other_ports = free_ports(7, "127.0.0.1")
        # Ray 2.60 turns token auth on for a new head: a token of this head's own (not the user's
        # ~/.ray/auth_token), given to the head, its job drivers and the job CLI alike
        self.env = dict(
            env if env is not None else os.environ,
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
            PYTHONUNBUFFERED="1",
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=secrets.token_hex(32),
            PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        )
        for key in ("RAY_ADDRESS", "RAY_JOB_ID", "RAY_AUTH_TOKEN_PATH"):
            self.env.pop(key, None)
        self.sid: int | None = None

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dash_port}"

    def start(self) -> None:
        ports = zip(("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                     "--metrics-export-port", "--ray-client-server-port"), self.other_ports)
        proc = subprocess.Popen(
            [str(VENV_BIN / "ray"), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(self.port),
             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dash_port), "--num-cpus", "2",
             "--temp-dir", self.temp_dir, "--disable-usage-stats", "--include-dashboard", "true",
             *(a for flag, p in ports for a in (flag, str(p)))],
            env=self.env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.sid = proc.pid
        try:
            out, _ = proc.communicate(timeout=300)  # a loaded 2-core host has taken over 120 s
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            self.stop()  # what it started so far (gcs, dashboard, monitor) in its session: none left running
            pytest.fail(f"ray start did not return in 300 s:\n{out[-4000:]}")
        if proc.returncode != 0:
            self.stop()
            pytest.fail(f"ray start failed ({proc.returncode}):\n{out[-4000:]}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, every process of this head (never `ray stop`: it stops every
        Ray cluster of the user, the ray_cluster fixture's and other people's too)."""
        if self.sid is not None:
            for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                for pid in _session_pids(self.sid, self.temp_dir):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                deadline = time.monotonic() + wait_s
                while _session_pids(self.sid, self.temp_dir) and time.monotonic() < deadline:
                    time.sleep(0.2)
            left = _session_pids(self.sid, self.temp_dir)
            assert not left, f"processes of the test's Ray head still running: {left}"
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class ReadmeRun:
    out: Path  # the run's --out
    job_id: str
    proc: subprocess.CompletedProcess  # `ray job submit` (it tails the job's output until it ends)
    status: subprocess.CompletedProcess  # `ray job status` right after, while the head was up
    calls: Path  # where the shim logs a call that reached "fla" (absent: none did)
    took_s: float

    @property
    def logs(self) -> str:
        return f"{self.proc.stdout[-6000:]}\n{self.proc.stderr[-3000:]}"


def submit_readme_run(root: Path) -> ReadmeRun:
    """Start a head, `ray job submit ... -- dflash-dist run configs/tiny.yaml --out ROOT/run`,
    query the job's status, stop the head."""
    out, calls = root / "run", root / "fla_calls.txt"
    head = LocalHead(shim_env(calls))
    head.start()
    try:
        t0 = time.monotonic()
        for attempt in range(20):  # the head's job agent comes up a few seconds after `ray start` returns
            job_id = f"dflash-test-{os.getpid()}-{attempt}"
            cmd = [str(VENV_BIN / "ray"), "job", "submit", "--address", head.dashboard, "--working-dir", ".",
                   "--submission-id", job_id, "--", "dflash-dist", "run", CONFIG, "--out", str(out)]
            proc = subprocess.run(cmd, cwd=REPO, env=head.env, capture_output=True, text=True, timeout=1800)
            if "No available agent to submit job" not in proc.stderr + proc.stdout:
                break
            time.sleep(2)
        took = time.monotonic() - t0
        status = subprocess.run([str(VENV_BIN / "ray"), "job", "status", "--address", head.dashboard, job_id],
                                env=head.env, capture_output=True, text=True, timeout=60)
    finally:
        head.stop()
    return ReadmeRun(out, job_id, proc, status, calls, took)
