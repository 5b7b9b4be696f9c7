"""The Ray clusters the product starts keep their session directories (unix sockets, logs,
runtime_resources) where no other local user can reach them (dflash_dist/orchestration/ray_temp.py).

Ray 2.60 makes its temp directory and every session directory in it mode 0777: /tmp/ray for the
local cluster of `dflash-dist run`, and the Slurm head's `mkdtemp` --temp-dir (0700 when made)
alike; a worker node without --temp-dir made the head's path there. Here each of the three is
started for real (a local cluster through pipeline.ray_session, the Slurm head through
SlurmRayCluster, and a worker node through `python -m launcher.slurm_ray worker`, joined to that
head on this host) and its session directory checked: some directory above it is ours with no
search permission for group or others, and it is removed when the cluster stops. The local cluster
also prestarts no idle workers (pipeline.LOCAL_SYSTEM_CONFIG).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dflash_dist.orchestration.ray_temp import ray_temp_base
from tests.conftest import REPO
from tests.helpers.config import config_from
from tests.helpers.ray_workers import idle_beside_a_driver, idle_workers, raylets


def others_can_reach(path: Path) -> bool:
    """Whether every directory down to `path` lets group or others through (none is ours and 0700-like)."""
    me = os.getuid()
    for d in [*reversed(path.parents), path]:
        st = os.stat(d)
        if st.st_uid == me and not st.st_mode & 0o011:
            return False
    return True


def _wait_for(predicate, timeout_s: float = 180.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


class _Pid:
    def pid(self) -> int:
        return os.getpid()


def test_the_slurm_head_is_private_and_prestarts_no_workers(tmp_path):
    """The head's sockets are private and removed with it. It starts Python workers only when asked
    (ray_system.NO_PRESTART, given to `ray start --head`, the whole cluster's config): Ray's default
    prestarts one per CPU with the first driver (the node wait's or the pipeline's), which no actor of
    a run takes."""
    from launcher.slurm_ray import SlurmRayCluster

    cluster = SlurmRayCluster([socket.gethostname()])
    try:
        cluster.start()
        head = Path(cluster.temp_dir)
        session = _wait_for(lambda: next(head.glob("session_2*"), None), what="the head's session directory")
        assert not others_can_reach(session / "sockets"), f"{session}: other users can reach the head's sockets"
        (raylet,) = raylets(session)
        assert idle_beside_a_driver(dict(cluster.env, RAY_ADDRESS=cluster.address), raylet) == []
    finally:
        cluster.stop()
    assert not head.parent.exists(), f"{head.parent} outlived the cluster"


def test_a_slurm_worker_node_is_private(tmp_path):
    """`python -m launcher.slurm_ray worker ARGS` (srun runs it on every other node) starts `ray
    start ARGS` with a private --temp-dir of its own. Here ARGS start a node of its own (`--head`:
    this host cannot join a second raylet to a head on 127.0.0.1 with multi-node clusters off),
    which is what decides where the node keeps its files. Stopped once it runs (_start_worker):
    stopped while it starts, `ray start` waits a minute for its GCS before it exits."""
    worker, found = _start_worker(log=tmp_path / "worker.log")
    try:
        assert not others_can_reach(found / "sockets"), f"{found}: other users can reach the node's sockets"
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=120)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    assert not found.parent.parent.exists(), f"{found.parent.parent} outlived the node"


def _start_worker(*worker_args: str, log: Path) -> tuple[subprocess.Popen, Path]:
    """`python -m launcher.slurm_ray worker [WORKER_ARGS] ARGS` as test_a_slurm_worker_node_is_private
    starts it (a node of its own), its output in `log`; with its session directory once the node runs
    (`ray start` says so, then watches its processes: stopped while it starts, it waits a minute for
    its GCS)."""
    from dflash_dist.actors.ports import free_ports
    from launcher.slurm_ray import _HEAD_PORT_FLAGS

    ports = free_ports(len(_HEAD_PORT_FLAGS), "127.0.0.1")
    before = set(Path(ray_temp_base("x-w-")).glob("dfray-*"))
    with open(log, "w") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "launcher.slurm_ray", "worker", *worker_args, "--head", "--block",
             "--node-ip-address", "127.0.0.1", "--include-dashboard", "false", "--disable-usage-stats", "--num-cpus",
             "1", *(a for flag, port in zip(_HEAD_PORT_FLAGS, ports) for a in (flag, str(port)))],
            env=dict(os.environ, PYTHONPATH=str(REPO), RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0"), cwd=REPO,
            start_new_session=True, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def ours(pid: int) -> bool:  # in the worker's process group (another Ray node of this machine's is not)
        try:
            return os.getpgid(pid) == worker.pid
        except ProcessLookupError:
            return False

    def session():
        if worker.poll() is not None:  # it will never run: say why now, not when _wait_for gives up
            raise AssertionError(f"the worker node exited ({worker.returncode}):\n{log.read_text()[-3000:]}")
        new = set(Path(ray_temp_base("x-w-")).glob("dfray-*")) - before
        found = [s for d in new for s in (d / "ray").glob("session_2*") if (s / "sockets" / "raylet").exists()
                 and any(ours(p) for p in raylets(s))]  # fmt: skip
        return found[0] if found and "Ray runtime started" in log.read_text() else None

    try:
        return worker, _wait_for(session, what="the worker node's raylet")
    except BaseException:
        with contextlib.suppress(ProcessLookupError):  # its group may be gone with it
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        raise


def _stopped(worker: subprocess.Popen) -> int:
    try:
        return worker.wait(timeout=120)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


def test_a_slurm_worker_node_keeps_its_logs_when_its_ray_fails(tmp_path):
    """The worker node's raylet dies (killed here): `ray start --block` stops the node by itself and
    the worker keeps the node's Ray logs, saying where, as the head and a local run keep theirs after
    a failure. They were removed on every exit."""
    worker, session = _start_worker(log=tmp_path / "worker.log")
    try:
        for pid in raylets(session):
            os.kill(pid, signal.SIGKILL)
        assert _stopped(worker) != 0
        text = (tmp_path / "worker.log").read_text()
        assert (session / "logs" / "raylet.out").is_file(), "the node's Ray logs were removed"
        assert f"Ray's logs of this run are kept in {session.parent}/session_*/logs on {socket.gethostname()} " \
               "(this node's Ray ended by itself with exit code 1;" in text, text[-3000:]  # fmt: skip
        assert not others_can_reach(session / "logs")
    finally:
        shutil.rmtree(session.parent.parent, ignore_errors=True)


def test_a_slurm_worker_node_keeps_its_logs_when_the_job_failed(tmp_path):
    """A failed job's head writes its failure flag in the run directory before it stops the workers
    (SlurmRayCluster.stop, below); a worker stopped (SIGTERM) while the flag exists keeps its logs,
    one stopped without it removes them (test_a_slurm_worker_node_is_private)."""
    flag = tmp_path / "ray-job-7.failed"
    worker, session = _start_worker("--keep-logs-if", str(flag), log=tmp_path / "worker.log")
    try:
        flag.write_text("the job failed\n")
        os.killpg(worker.pid, signal.SIGTERM)
        _stopped(worker)
        assert (session / "logs" / "raylet.out").is_file(), "the node's Ray logs were removed"
        assert f"on {socket.gethostname()} (the job failed ({flag});" in (tmp_path / "worker.log").read_text()
    finally:
        shutil.rmtree(session.parent.parent, ignore_errors=True)


def test_a_failed_jobs_head_tells_its_workers_to_keep_their_logs(tmp_path):
    """SlurmRayCluster of a multi-node job passes its failure flag to the workers' command and, when
    the job failed, writes it before any process is stopped and removes it once they are; a job that
    ended well writes none. A process standing in for the srun step reports what it saw at SIGTERM."""
    from launcher.slurm_ray import KEEP_LOGS_FLAG, SlurmRayCluster

    host = socket.gethostname()
    cluster = SlurmRayCluster([host, host], run_dir=tmp_path)
    command = cluster.worker_command()
    at = command.index("worker")
    assert command[at + 1 : at + 3] == [KEEP_LOGS_FLAG, str(cluster.failed_flag)]
    assert cluster.failed_flag.parent == tmp_path
    seen = tmp_path / "seen"
    step = ("import os, signal, sys, time\n"
            "def stop(*_):\n"
            f"    open({str(seen)!r}, 'w').write(str(os.path.exists({str(cluster.failed_flag)!r})))\n"
            "    sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            f"open({str(seen)!r}, 'w').write('ready')\n"
            "time.sleep(60)\n")  # fmt: skip
    for failed in (True, False):
        seen.unlink(missing_ok=True)
        cluster.procs = [subprocess.Popen([sys.executable, "-c", step], start_new_session=True)]
        _wait_for(lambda: seen.exists(), 30, "the stand-in step")
        cluster.stop(keep_logs=failed)
        assert seen.read_text() == str(failed)
        assert not cluster.failed_flag.exists()
        shutil.rmtree(Path(cluster.temp_dir).parent, ignore_errors=True)


def test_a_flag_left_by_an_earlier_attempt_of_the_job_is_not_this_attempts_failure(tmp_path):
    """A requeued job keeps its SLURM_JOB_ID, so its failure flag has the name of the earlier attempt's.
    That attempt's head, killed while it stopped its workers (Slurm's KillWait after a preemption notice:
    stop() waits up to 25 s for them), never removed its flag; the new attempt's workers then kept their
    Ray logs on every node although it ended well. The flag is removed when the new cluster is made."""
    from launcher.slurm_ray import SlurmRayCluster

    host = socket.gethostname()
    stale = tmp_path / f"ray-job-{os.environ.get('SLURM_JOB_ID', 'x')}.failed"
    stale.write_text("the job failed: worker nodes keep their Ray logs\n")  # the earlier attempt's
    cluster = SlurmRayCluster([host, host], run_dir=tmp_path)
    try:
        assert cluster.failed_flag == stale
        seen = tmp_path / "seen"
        step = ("import os, signal, sys, time\n"
                "def stop(*_):\n"
                f"    open({str(seen)!r}, 'w').write(str(os.path.exists({str(stale)!r})))\n"
                "    sys.exit(0)\n"
                "signal.signal(signal.SIGTERM, stop)\n"
                f"open({str(seen)!r}, 'w').write('ready')\n"
                "time.sleep(60)\n")  # fmt: skip
        cluster.procs = [subprocess.Popen([sys.executable, "-c", step], start_new_session=True)]
        _wait_for(lambda: seen.exists(), 30, "the stand-in step")
        cluster.stop(keep_logs=False)  # this attempt ended well
        assert seen.read_text() == "False", "the workers saw the earlier attempt's flag: they kept their logs"
    finally:
        shutil.rmtree(Path(cluster.temp_dir).parent, ignore_errors=True)


def test_a_worker_node_of_a_multi_node_job_goes_on_to_join_its_head():
    """With more than one host, the environment SlurmRayCluster gives every Ray process (srun passes it
    to `python -m launcher.slurm_ray worker` on the other nodes) lets `ray start --address` join: with
    Ray's multi-node switch off (as for one host) it aborted at once ("Multi-node Ray clusters are not
    supported on Windows and OSX"), so no other node ever joined. No head listens at the address here:
    the worker getting as far as choosing its node IP and dialling is what is checked."""
    from dflash_dist.actors.ports import free_ports
    from launcher.slurm_ray import SlurmRayCluster

    host = socket.gethostname()
    one, two = SlurmRayCluster([host]), SlurmRayCluster([host, host])
    try:
        assert one.env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
        assert two.env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
        (port,) = free_ports(1, "127.0.0.1")
        job = f"join{os.getpid()}"  # names the worker's temp dir (dfray-<job>-w-*): no other run's is touched
        worker = subprocess.Popen(
            [sys.executable, "-m", "launcher.slurm_ray", "worker", "--block", "--address", f"127.0.0.1:{port}",
             "--disable-usage-stats", "--num-cpus", "1"],
            env=dict(two.env, PYTHONPATH=str(REPO), SLURM_JOB_ID=job), cwd=REPO, start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        lines: list[str] = []
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                line = worker.stdout.readline()
                if not line:
                    break
                lines.append(line)
                if "Local node IP" in line or "Multi-node Ray clusters are not supported" in line:
                    break
        finally:
            if worker.poll() is None:  # still dialling a head that is not there (Ray waits for it ~30 s)
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
            for d in Path(ray_temp_base(f"{job}-w-")).glob(f"dfray-{job}-w-*"):  # its temp dir, left by the kill
                shutil.rmtree(d, ignore_errors=True)
        text = "".join(lines)
        assert "Multi-node Ray clusters are not supported" not in text, text
        assert "Local node IP" in text, text
    finally:
        one.stop()
        two.stop()


def _short_dir(length: int) -> Path:
    """A new directory of ours whose path is `length` bytes long, under /tmp."""
    top = Path(tempfile.mkdtemp(prefix="h", dir="/tmp"))
    pad = length - len(str(top)) - 1
    assert pad >= 1, length
    (top / ("p" * pad)).mkdir()
    return top / ("p" * pad)


def test_the_private_temp_dir_goes_where_ray_would_put_its_own(monkeypatch):
    """Ray keeps its directory under $RAY_TMPDIR, else $TMPDIR (Linux), else /tmp; a user who moved it
    off a small /tmp (its logs, spilled objects) had it moved back by a fixed /tmp."""
    from dflash_dist.orchestration.ray_temp import make_private_ray_temp

    ray_tmp, tmp = _short_dir(16), _short_dir(17)
    try:
        monkeypatch.setenv("TMPDIR", str(tmp))
        monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
        made = Path(make_private_ray_temp("7-"))
        assert made.parent.parent == ray_tmp and made.parent.name.startswith("dfray-7-")
        assert made.parent.stat().st_mode & 0o777 == 0o700
        monkeypatch.delenv("RAY_TMPDIR")
        assert Path(make_private_ray_temp()).parent.parent == tmp
    finally:
        shutil.rmtree(ray_tmp.parent)
        shutil.rmtree(tmp.parent)


def test_a_temp_base_too_long_for_rays_sockets_falls_back_to_tmp(monkeypatch):
    from dflash_dist.orchestration.ray_temp import SOCKET_PATH_MAX, make_private_ray_temp

    long = _short_dir(60)
    try:
        monkeypatch.setenv("RAY_TMPDIR", str(long))
        made = Path(make_private_ray_temp("12345678-w-"))
        assert made.parent.parent == Path("/tmp")
        worst = f"{made}/session_2026-12-05_20-55-02_123456_4194304/sockets/plasma_store.99"
        assert len(worst) <= SOCKET_PATH_MAX
        shutil.rmtree(made.parent)
        monkeypatch.setenv("RAY_TMPDIR", str(long / "missing"))
        made = Path(make_private_ray_temp())
        assert made.parent.parent == Path("/tmp")
        shutil.rmtree(made.parent)
    finally:
        shutil.rmtree(long.parent)


def test_the_local_cluster_of_a_run_is_private_prestarts_no_workers_and_fits_the_longest_ray_tmpdir(
    tmp_path, monkeypatch
):
    """The local cluster of a run (pipeline.ray_session), started once for three checks. Its session's
    sockets are private: the only directory above them others cannot pass is the run's own (the test's
    RAY_TMPDIR is opened to them, as /tmp is), and it is removed when the cluster stops.

    It starts Python workers only when asked (pipeline.LOCAL_SYSTEM_CONFIG). Ray's default prestarts one
    per CPU with the first driver, which no actor of a run takes (each carries its own runtime_env,
    compile_cache.actor_runtime_env): with 2 CPUs, 2 idle workers beside a run's actor.

    RAY_TMPDIR is of the longest length ray_temp_base keeps (one byte more goes to /tmp): Ray's real socket
    paths there fit, the cluster starts, and its session lies under it."""
    import ray

    from dflash_dist.compile_cache import actor_runtime_env
    from dflash_dist.orchestration.pipeline import ray_session
    from dflash_dist.orchestration.ray_temp import _SOCKET_TAIL, RAY_DIR, SOCKET_PATH_MAX, ray_temp_base

    length = SOCKET_PATH_MAX - _SOCKET_TAIL - len(f"/dfray-XXXXXXXX/{RAY_DIR}")
    base = _short_dir(length)
    try:
        for d in (base.parent, base):  # others pass through the test's directories (mkdtemp made the top 0700)
            d.chmod(0o755)
        assert others_can_reach(base)
        monkeypatch.setenv("RAY_TMPDIR", str(base))
        assert ray_temp_base() == str(base)
        monkeypatch.setenv("RAY_TMPDIR", str(base) + "q")
        assert ray_temp_base() == "/tmp"
        monkeypatch.setenv("RAY_TMPDIR", str(base))
        cfg = config_from({"target": {"kind": "tiny_stdlib"}, "ray": {"num_cpus": 2},
                           "run": {"out_dir": str(tmp_path)}})  # fmt: skip
        with ray_session(cfg):
            node = ray._private.worker.global_worker.node
            session = Path(node.get_session_dir_path())
            assert session.parent.parent.parent == base
            sockets = [p for p in (session / "sockets").iterdir() if p.is_socket()]
            assert sockets and all(len(str(p)) <= SOCKET_PATH_MAX for p in sockets), sockets
            assert not others_can_reach(session / "sockets"), f"{session}: other users can reach this run's Ray sockets"
            (raylet,) = node.all_processes["raylet"]
            actor = ray.remote(num_cpus=1)(_Pid).options(runtime_env=actor_runtime_env()).remote()
            ray.get(actor.pid.remote())  # the actor runs: its own worker, never an idle one
            assert idle_workers(raylet.process.pid) == []  # Ray's default: 2 by now (started with the driver)
        assert not session.parent.parent.exists(), f"{session} outlived the cluster"
    finally:
        shutil.rmtree(base.parent)


def test_a_failed_runs_ray_logs_are_kept_and_a_finished_runs_removed(caplog):
    """private_ray_temp (the local cluster of `dflash-dist run`) and SlurmRayCluster.stop: the private
    directory goes when the run ends normally; when it fails, Ray's logs in it (what a failure is read
    from: the raylet's, every worker's output) stay, and the log says where. They were removed on every
    exit (Ray's /tmp/ray kept them before the directories were private)."""
    from dflash_dist.orchestration.ray_temp import private_ray_temp
    from launcher.slurm_ray import SlurmRayCluster

    def session_log(temp_dir: str) -> Path:
        logs = Path(temp_dir) / "session_2026-12-05_21-00-00_000000_1" / "logs"
        logs.mkdir(parents=True)
        (logs / "raylet.err").write_text("the raylet's last words\n")
        return logs / "raylet.err"

    with private_ray_temp() as ok:
        session_log(ok)
    assert not Path(ok).parent.exists()
    with pytest.raises(RuntimeError, match="the run failed"), private_ray_temp() as failed:
        kept = session_log(failed)
        raise RuntimeError("the run failed")
    try:
        assert kept.read_text() == "the raylet's last words\n"
        assert f"Ray's logs of this run are kept in {failed}/session_*/logs" in caplog.text
        assert not others_can_reach(kept.parent)  # still private
    finally:
        shutil.rmtree(Path(failed).parent)
    with pytest.raises(KeyboardInterrupt), private_ray_temp() as stopped:  # Ctrl-C: no failure to read
        session_log(stopped)
        raise KeyboardInterrupt
    assert not Path(stopped).parent.exists()
    for keep in (False, True):
        cluster = SlurmRayCluster([socket.gethostname()])  # never started: stop() has only the directory to do
        Path(cluster.temp_dir).mkdir()
        kept = session_log(cluster.temp_dir)
        cluster.stop(keep_logs=keep)
        assert kept.exists() == keep
        shutil.rmtree(Path(cluster.temp_dir).parent, ignore_errors=True)
