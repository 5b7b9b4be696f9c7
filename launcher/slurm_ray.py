"""`dflash-dist run CONFIG --launcher slurm`: a Ray cluster over the Slurm job's nodes, then the
pipeline on it (slurm/pipeline.sbatch runs this on the job's first node).

`ray start --head --block` here, bound to this node's address (127.0.0.1 in a one-node job; no
dashboard) with token authentication (a new token per job, in the environment of this job's
processes only: launcher/ray_auth.py), `srun ray start --block` once on every other node, the
pipeline as a child process joined through RAY_ADDRESS, and at the end every Ray process this
started is stopped (never `ray stop`, which would stop every Ray of the user on the node).
SIGUSR1/SIGTERM (Slurm's notice before the time limit, forwarded by the batch script) goes on as
SIGUSR1 to the trainer ranks, found by their heartbeats (pid, host): they save at the next step
boundary and the pipeline ends; this exits 0 and the script requeues, and the requeued run
continues with `--resume auto`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from data_pipeline.durable_files import write_text_atomic
from dflash_dist.actors.ports import free_ports
from dflash_dist.config import Config, ConfigError
from dflash_dist.node_address import network_address
from dflash_dist.orchestration.ray_system import head_start_args
from dflash_dist.orchestration.ray_temp import make_private_ray_temp, release_ray_temp
from launcher.ray_auth import new_token, with_auth
from launcher.slurm_train import given_master_addr, step_hostnames, tasks_per_node

log = logging.getLogger(__name__)
NOTICES = (signal.SIGTERM, signal.SIGUSR1)
RAYLET_WAIT = "RAY_raylet_start_wait_time_s"  # Ray's own (lower-case) config variable
DRAIN_TIMEOUT = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"  # Ray's: how long `ray start --block` drains at SIGTERM
_HEAD_PORT_FLAGS = (
    "--port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
    "--ray-client-server-port",
)


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


# run with the job's Ray environment: the alive nodes counted each second ("NODES n HOST...", their host
# names) until ARGV[1] are
_WAIT_FOR_NODES = """import sys, time
import ray
ray.init(logging_level="ERROR", log_to_driver=False)
last = None
while True:
    hosts = sorted(node["NodeManagerHostname"] for node in ray.nodes() if node["Alive"])
    if hosts != last:
        print("NODES", len(hosts), *hosts, flush=True)
        last = hosts
    if len(hosts) >= int(sys.argv[1]):
        break
    time.sleep(1)
"""
KEEP_LOGS_FLAG = "--keep-logs-if"  # run_worker's own option, before the `ray start` arguments


class SlurmRayCluster:
    """The Ray processes of this job: the head (here) and one `srun` step of workers. `run_dir`: the
    run's directory, which every node mounts, where a failed job leaves its workers the word to keep
    their Ray logs (`failed_flag`)."""

    def __init__(self, hostnames: list[str], run_dir: Path | None = None) -> None:
        self.hosts = hostnames
        job = os.environ.get("SLURM_JOB_ID", "x")
        self.failed_flag = None if run_dir is None else Path(run_dir) / f"ray-job-{job}.failed"
        if self.failed_flag is not None:  # an earlier attempt's (a requeue keeps the job id), its head killed in stop()
            self.failed_flag.unlink(missing_ok=True)
        # the head runs here, on the first host: with others, the address they reach it at (not a loopback
        # address this node's /etc/hosts may give its own name: they would dial themselves and never join)
        # (MASTER_ADDR in the job's environment, when set, is that address: a chosen network's, as for the trainers)
        try:
            self.address_ip = "127.0.0.1" if len(hostnames) == 1 else (
                given_master_addr(os.environ, hostnames) or network_address(hostnames[0]))
        except OSError as e:  # no address beyond loopback, or the name does not resolve: the fix, in one line
            raise ConfigError(f"the Ray head of this {len(hostnames)}-node job on {hostnames[0]}: {e}; or export "
                              "MASTER_ADDR=<this node's address on the network the nodes share>") from None
        # the head's sessions inside a directory of ours no other user can enter (ray_temp.py)
        self.temp_dir = make_private_ray_temp(f"{job}-")
        self.ports = free_ports(len(_HEAD_PORT_FLAGS))
        self.address = f"{self.address_ip}:{self.ports[0]}"
        # the nodes listen on the cluster network: every Ray process demands this job's own token
        # (srun passes the environment on; it is never written to a file or printed)
        # Ray's multi-node switch, set either way (the job's environment, which srun passes on, may carry
        # a value): off on one host, where every Ray process is on 127.0.0.1 (with it on, Ray resolves
        # 127.0.0.1 to the machine's external address: PLATFORM.md); on with several, Ray's own Linux
        # default, without which `ray start --address` on the other nodes aborts ("Multi-node Ray clusters
        # are not supported on Windows and OSX") and the job never gets their GPUs
        multi_node = "1" if len(hostnames) > 1 else "0"
        self.env = with_auth(dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=multi_node), token=new_token())
        self.env.setdefault(RAYLET_WAIT, "120")  # a loaded node registers its raylet slowly
        # SIGTERM stops a node at once: Ray 2.60 otherwise drains it for up to 30 s first (for Serve; nothing of
        # ours), past stop()'s wait, whose SIGKILL then left every worker node's temp directory behind
        self.env.setdefault(DRAIN_TIMEOUT, "0")
        self.env.pop("RAY_ADDRESS", None)
        self.procs: list[subprocess.Popen] = []

    def start(self, timeout_s: float = 300.0) -> None:
        res = num_cpus_args(os.environ, [])  # the job's CPUs on this node (each worker node counts its own)
        head = [_ray_bin(), "start", "--head", "--block", "--node-ip-address", self.address_ip,
                "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", self.temp_dir, *res,
                *(a for flag, port in zip(_HEAD_PORT_FLAGS, self.ports) for a in (flag, str(port)))]
        head += head_start_args(head)  # no idle workers prestarted for the drivers (the node wait's, the pipeline's)
        proc = subprocess.Popen(head, env=self.env, start_new_session=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)
        up = threading.Event()
        threading.Thread(target=_relay, args=(proc, up), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not up.wait(0.5):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head did not start (exit code {proc.poll()}, {timeout_s:.0f} s)")
        if len(self.hosts) > 1:  # one raylet per other node, as one job step
            step = subprocess.Popen(self.worker_command(), env=self.env, start_new_session=True)
            self.procs.append(step)
            self.wait_for_nodes(step, deadline - time.monotonic())
        log.info("Ray head at %s on %s; %d worker node(s)", self.address, self.hosts[0], len(self.hosts) - 1)

    def wait_for_nodes(self, step: subprocess.Popen, timeout_s: float) -> None:
        """Until a Ray node runs on every host of the job. A node that cannot start or join (down, a
        port taken, an address it cannot reach) fails the job here, naming it, instead of the run
        waiting ray.placement_timeout_s for resources that never come (or for ever, under
        ray.placement: none) and then blaming the placement group."""
        want = len(self.hosts)
        waiter = subprocess.Popen([sys.executable, "-c", _WAIT_FOR_NODES, str(want)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, env=dict(self.env, RAY_ADDRESS=self.address))
        counts: list[str] = []
        threading.Thread(target=lambda: counts.extend(waiter.stdout), daemon=True).start()
        deadline = time.monotonic() + max(timeout_s, 1.0)
        try:
            while waiter.poll() is None and step.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
        finally:
            if waiter.poll() is None:
                waiter.kill()
            waiter.wait()
        if waiter.returncode == 0 and step.poll() is None:
            return
        from dflash_dist.orchestration.run_plan import PipelineError

        # the head's node runs (start saw it); not yet counted: it alone, as far as anyone knows
        last = next((line.split()[1:] for line in reversed(counts) if line.startswith("NODES ")), None)
        joined, names = (last[0], last[1:]) if last else ("1", [self.hosts[0]])
        if step.poll() is not None:
            why = f"the srun step starting Ray on {', '.join(self.hosts[1:])} ended with exit code {step.returncode}"
        elif waiter.returncode not in (0, -signal.SIGKILL):
            why = f"the head could not be asked ({''.join(counts)[-500:].strip()})"
        else:
            why = f"not every node joined within {timeout_s:.0f} s ({missing_hosts(self.hosts, names)})"
        raise PipelineError(f"the job's Ray cluster: {joined} of {want} nodes joined the head at {self.address} on "
                            f"{self.hosts[0]}: {why}; the nodes' Ray output is in the job's log")

    def worker_command(self) -> list[str]:
        """The srun step that starts a Ray node on every other host (run_worker there)."""
        others = len(self.hosts) - 1
        keep = [KEEP_LOGS_FLAG, str(self.failed_flag)] if self.failed_flag is not None else []
        return ["srun", "--overlap", f"--nodes={others}", f"--ntasks={others}", "--ntasks-per-node=1",
                f"--exclude={self.hosts[0]}", sys.executable, "-m", "launcher.slurm_ray", "worker", *keep,
                "--block", "--address", self.address, "--disable-usage-stats"]  # fmt: skip

    def stop(self, keep_logs: bool = False) -> None:
        """SIGTERM (then SIGKILL) each started process group; `ray start --block` stops its own. The
        private temp directories are removed, or kept with their Ray logs (`keep_logs`: the job failed):
        the head's here, and each worker node's, told by `failed_flag` (written before they are
        stopped, removed once they are gone), which a worker reads when its node stops."""
        if keep_logs and self.failed_flag is not None and len(self.hosts) > 1:  # workers to tell
            with contextlib.suppress(OSError):  # not written: the workers remove their logs, as before
                write_text_atomic(self.failed_flag, "the job failed: worker nodes keep their Ray logs\n")
        for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
            for p in self.procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, sig)
            deadline = time.monotonic() + wait_s
            while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
                time.sleep(0.2)
        if self.procs:  # the head node's processes still exiting (node_processes), before its directory goes
            end_node_processes(self.temp_dir, self.procs[0].pid)
        if self.failed_flag is not None:
            self.failed_flag.unlink(missing_ok=True)
        release_ray_temp(self.temp_dir, keep=keep_logs)


def run_worker(args: list[str]) -> int:
    """`python -m launcher.slurm_ray worker [--keep-logs-if FILE] RAY_START_ARGS...`, one srun task on
    each other node: `ray start RAY_START_ARGS --temp-dir DIR` with DIR private to this user on this
    node (ray_temp.py; without it the node would make the head's temp path here, open to all).
    SIGTERM and SIGINT are passed on to `ray start --block`, which stops its node. DIR is removed
    when Ray stops, unless something failed, the rule of the head and of a local run: this node's
    Ray ended without being asked to (one of its processes died, it could not start or join), this
    process failed, or the job did (FILE exists when the node stops: SlurmRayCluster.stop). Then its
    Ray logs stay, and the log says where. The node offers Ray the CPUs Slurm gave the job on it
    (num_cpus_args), not the machine's count."""
    keep_if = None
    if args[:1] == [KEEP_LOGS_FLAG]:
        keep_if, args = Path(args[1]), args[2:]
    args = [*args, *num_cpus_args(os.environ, args)]  # this node's CPUs of the job, as the head counts its own
    temp_dir = make_private_ray_temp(f"{os.environ.get('SLURM_JOB_ID', 'x')}-w-")
    asked: list[int] = []  # the stop signals passed on
    why = "this worker failed"
    try:
        proc = subprocess.Popen([_ray_bin(), "start", *args, "--temp-dir", temp_dir])

        def stop(signum, _frame) -> None:
            asked.append(signum)
            proc.send_signal(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)
        rc = proc.wait()
        why = None if asked or rc == 0 else f"this node's Ray ended by itself with exit code {rc}"
        end_node_processes(temp_dir, os.getpgrp())  # this node's, still exiting, before DIR goes (below)
        return rc
    finally:
        if why is None and keep_if is not None and keep_if.exists():
            why = f"the job failed ({keep_if})"
        release_ray_temp(temp_dir, keep=why is not None, why=why or "")


def slurm_node_cpus(env: Mapping[str, str]) -> int | None:
    """The CPUs Slurm gave this job (step) on this node: SLURM_CPUS_ON_NODE, which slurmstepd sets for
    each node in the batch step and in every srun task (the job's allocation on the node: a 2-task x
    2-CPU job's srun step of one task sees 4), else SLURM_CPUS_PER_TASK x the step's tasks on this
    node; None outside Slurm. A value that is not a positive integer is a ConfigError naming it."""
    if "SLURM_CPUS_ON_NODE" in env:
        return _cpu_count("SLURM_CPUS_ON_NODE", env["SLURM_CPUS_ON_NODE"])
    if "SLURM_CPUS_PER_TASK" in env and ("SLURM_STEP_TASKS_PER_NODE" in env or "SLURM_TASKS_PER_NODE" in env):
        tasks = tasks_per_node(env)[int(env.get("SLURM_NODEID", "0"))]
        return _cpu_count("SLURM_CPUS_PER_TASK", env["SLURM_CPUS_PER_TASK"]) * tasks
    return None


def _cpu_count(name: str, value: str) -> int:
    if not value.strip().isdigit() or int(value) < 1:
        raise ConfigError(f"{name}={value!r} is not a CPU count: start the job through sbatch/srun, which set it")
    return int(value)


def num_cpus_args(env: Mapping[str, str], start_args: list[str]) -> list[str]:
    """`--num-cpus N` for `ray start` on this node: the CPUs Slurm gave the job here (slurm_node_cpus).
    Left to Ray, a node offers the machine's whole count and Ray schedules actors onto CPUs the job
    was not given (other jobs' on a shared node). None when the arguments name a count already or
    outside Slurm."""
    if any(a == "--num-cpus" or a.startswith("--num-cpus=") for a in start_args):
        return []
    cpus = slurm_node_cpus(env)
    return [] if cpus is None else ["--num-cpus", str(cpus)]


def node_processes(temp_dir: str, pgid: int) -> list[int]:
    """The live processes (zombies aside) of a Ray node of ours but this one: those of process group
    `pgid` (`ray start --block` and the node's own processes, some renamed `ray::...`) and those
    naming the node's private `temp_dir` on their command line (Ray's workers, each in a session of
    its own). `ray start --block` returns while they may still be exiting; Ray's idle workers
    outlived it by ~20 s and then wrote their logs into the removed directory, making it again."""
    found, marker = [], os.fsencode(temp_dir)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            named = marker in Path(entry.path, "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and (int(fields[2]) == pgid or named):  # state, ppid, pgrp
            found.append(int(entry.name))
    return found


def end_node_processes(temp_dir: str, pgid: int, grace_s: float = 10.0) -> None:
    """SIGTERM, then after `grace_s` SIGKILL, to what node_processes finds, until none is left."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        deadline = time.monotonic() + wait_s
        pids = node_processes(temp_dir, pgid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        while pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = node_processes(temp_dir, pgid)
        if not pids:
            return


def missing_hosts(hosts: list[str], joined: list[str]) -> str:
    """Which of the job's `hosts` have no Ray node among `joined` (the nodes' own host names, which
    Slurm's node names match up to the domain), and which joined: "not joined: b, c; joined: a"."""
    have = {name.split(".")[0] for name in joined}
    absent = [h for h in hosts if h.split(".")[0] not in have]
    return f"not joined: {', '.join(absent) or '?'}; joined: {', '.join(joined) or '-'}"


def _relay(proc: subprocess.Popen, up: threading.Event) -> None:
    """Copy `ray start --block`'s output to ours; set `up` once it says the node runs."""
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if "Ray runtime started" in line:
            up.set()


def signal_refusal(beat: dict, now: float) -> str | None:
    """Why the trainer named by heartbeat `beat` (on this host) must not be signalled, or None.
    A heartbeat is a file on shared storage that anyone who can write there could forge, so the
    pid is signalled only if the record is fresh (neither stale nor from the future), the pid is
    not init's nor ours, and the live process is the one that wrote it (same kernel start time,
    our user)."""
    from dflash_dist.actors.heartbeat import INTERVAL_S, STALE_INTERVALS, process_start

    pid, age = beat["pid"], now - beat["updated"]
    window = STALE_INTERVALS * min(beat["interval_s"], INTERVAL_S)
    if pid <= 1 or pid == os.getpid():
        return f"pid {pid} cannot be a trainer rank"
    if not -window <= age <= window:
        return f"its heartbeat is not fresh (updated {age:.0f} s ago; a live rank's is under {window:.0f} s old)"
    start = process_start(pid)
    if start is None:
        return f"pid {pid} does not exist"
    if start != beat.get("proc_start"):
        return f"pid {pid} is another process than the one that wrote the heartbeat (start time {start}, recorded " \
               f"{beat.get('proc_start')!r})"  # fmt: skip
    if os.stat(f"/proc/{pid}").st_uid != os.getuid():
        return f"pid {pid} belongs to another user"
    return None


def notify_local(beat: dict, signum: int, now: float | None = None) -> bool:
    """Send `signum` to the trainer of heartbeat `beat` on this host if signal_refusal allows it;
    False (logged) if not."""
    why = signal_refusal(beat, time.time() if now is None else now)
    if why is not None:
        log.warning("not signalling trainer %s (pid %s): %s", beat["index"], beat["pid"], why)
        return False
    try:
        os.kill(beat["pid"], signum)
    except ProcessLookupError:
        return False
    return True


def forward_notice(out: Path, signum: int, quiet: bool = False) -> list[str]:
    """SIGUSR1 to every running trainer rank (from its heartbeat); returns whom it reached. A rank
    on another node is signalled there by the same checks (`python -m launcher.slurm_ray notify`)."""
    from dflash_dist.actors.heartbeat import HEARTBEAT_DIR, read_heartbeats

    here, reached = socket.gethostname(), []
    for beat in read_heartbeats(out, skip_bad=True):
        if beat["role"] != "trainer" or beat["state"] != "running":
            continue
        who = f"trainer {beat['index']} (pid {beat['pid']} on {beat['host']})"
        if beat["host"] == here:
            if notify_local(beat, signal.SIGUSR1):
                reached.append(who)
        else:
            path = Path(out).resolve() / HEARTBEAT_DIR / f"trainer-{beat['index']}.json"
            subprocess.Popen(["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={beat['host']}",
                              sys.executable, "-m", "launcher.slurm_ray", "notify", str(path)])  # fmt: skip
            reached.append(who)
    if reached or not quiet:
        log.info("%s: asked %s to save and stop", signal.Signals(signum).name, reached or "no running trainer (yet)")
    return reached


def main(argv: list[str]) -> int:
    """`python -m launcher.slurm_ray notify HEARTBEAT_FILE`: forward_notice's step on another
    node: SIGUSR1 to the trainer that heartbeat names, if signal_refusal allows it there.
    `python -m launcher.slurm_ray worker [--keep-logs-if FILE] RAY_START_ARGS...`: run_worker."""
    from dflash_dist.actors.heartbeat import check_record

    if argv[:1] == ["worker"]:
        return run_worker(argv[1:])
    if len(argv) != 2 or argv[0] != "notify":
        print("usage: python -m launcher.slurm_ray notify HEARTBEAT_FILE | worker RAY_START_ARGS...", file=sys.stderr)
        return 2
    path = Path(argv[1])
    try:
        beat = check_record(json.loads(path.read_text()), str(path))
    except (OSError, ValueError) as e:
        print(f"launcher.slurm_ray notify: {e}", file=sys.stderr)
        return 1
    return 0 if notify_local(beat, signal.SIGUSR1) else 1


def run_on_slurm_ray(cfg: Config, pipeline_argv: list[str]) -> int:
    """Start the job's Ray cluster, run `dflash-dist <pipeline_argv>` on it, stop the cluster."""
    if cfg.ray.address:
        raise ConfigError(f"ray.address={cfg.ray.address!r} with --launcher slurm: the job starts its own cluster; "
                          "leave ray.address unset")
    cluster = SlurmRayCluster(step_hostnames(os.environ), run_dir=cfg.out)
    notices: list[int] = []
    told: list[str] = []  # the trainers a notice reached

    def notice(signum, _frame) -> None:
        notices.append(signum)
        told.extend(forward_notice(cfg.out, signum))

    previous = {s: signal.signal(s, notice) for s in NOTICES}
    rc = None
    try:
        cluster.start()
        env = dict(cluster.env, RAY_ADDRESS=cluster.address)
        for s in NOTICES:  # the driver inherits ignoring the notices: the trainers act on them
            signal.signal(s, signal.SIG_IGN)
        driver = subprocess.Popen([sys.executable, "-m", "launcher.cli", *pipeline_argv], env=env)
        for s in NOTICES:
            signal.signal(s, notice)
        while True:
            try:
                rc = driver.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if notices and not told:  # the notice came before the trainers ran: tell them now
                    told.extend(forward_notice(cfg.out, notices[-1], quiet=True))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        cluster.stop(keep_logs=rc != 0)  # a failed job (or this process's own error) keeps the head's Ray logs
    if notices:
        log.info("stopped on %s: requeue to continue (--resume auto)", signal.Signals(notices[0]).name)
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
