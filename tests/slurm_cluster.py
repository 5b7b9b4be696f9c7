"""A real single-node Slurm cluster on 127.0.0.1 for tests: munged, slurmctld and slurmd from
Debian's packages, with every file (config, keys, state, logs, sockets) in one private temp
directory and nothing in /etc. Started and stopped by the test (by pid file); tests/setup_and_run.sh installs
the packages. Slurm without cgroups: proctrack/linuxproc, task/none (PLATFORM.md)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from dflash_dist.actors.ports import free_ports

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sacct")
INSTALL_HINT = (
    "Slurm is not installed: as root run `apt-get update && apt-get install -y slurmctld slurmd slurm-client munge` "
    "(tests/setup_and_run.sh, the README's test command, does this)"
)
SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")


def missing_programs() -> list[str]:
    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    return [p for p in DAEMONS if shutil.which(p, path=path) is None]


def _which(name: str) -> str:
    found = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *SBIN]))
    assert found, name
    return found


class SlurmCluster:
    """One node (this host's name, at 127.0.0.1) in partition `debug`. `env` points the Slurm
    clients at it (SLURM_CONF); pass it to every sbatch/squeue/scontrol call."""

    def __init__(self, cpus: int = 4) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="dfslurm-", dir="/tmp"))  # short: munge's socket path
        self.dir.chmod(0o755)  # munged runs as the munge user and needs to reach its files
        self.cpus = cpus
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.socket"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for key in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if key != "SLURM_CONF":
                del self.env[key]
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):  # sbatch exports our env
            self.env.pop(key, None)
        self._pidfiles = [self.dir / "slurmd.pid", self.dir / "slurmctld.pid", self.dir / "munge" / "munged.pid"]

    def _write_config(self) -> None:
        ctld_port, slurmd_port = free_ports(2, "127.0.0.1")
        d = self.dir
        for sub in ("state", "spool", "log"):
            (d / sub).mkdir()
        # CPUs may exceed the host's cores (config_overrides): jobs of the tests share 2 cores anyway
        self.conf.write_text(
            f"""ClusterName=dftest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=5
StateSaveLocation={d / "state"}
SlurmdSpoolDir={d / "spool"}
SlurmctldPidFile={d / "slurmctld.pid"}
SlurmdPidFile={d / "slurmd.pid"}
SlurmctldLogFile={d / "log" / "slurmctld.log"}
SlurmdLogFile={d / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
FirstJobId={random.randint(1000, 900000)}
KillWait=30
MinJobAge=600
NodeName={self.node} NodeAddr=127.0.0.1 NodeHostname={self.node} CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _start_munge(self) -> None:
        m = self.dir / "munge"
        m.mkdir()
        m.chmod(0o755)  # munged: clients need execute permission on the socket directory
        key = m / "munge.key"
        subprocess.run([_which("mungekey"), "-c", "-k", str(key)], check=True, capture_output=True)
        shutil.chown(m, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        key.chmod(0o600)
        seed = m / "munged.seed"
        subprocess.run(
            [
                "runuser", "-u", "munge", "--", _which("munged"), f"--socket={self.munge_socket}",
                f"--key-file={key}", f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}",
                f"--seed-file={seed}",
            ],
            check=True,
            capture_output=True,
            text=True,
        )

    def start(self) -> None:
        self._write_config()
        self._start_munge()
        env = dict(self.env)
        for daemon in ("slurmctld", "slurmd"):
            proc = subprocess.run([_which(daemon)], env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{daemon} failed to start: {proc.stderr}\n{self.logs()}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip()
            if out in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm node did not come up (state {out!r}):\n{self.logs()}")

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def logs(self) -> str:
        parts = []
        for f in (self.dir / "log" / "slurmctld.log", self.dir / "log" / "slurmd.log"):
            if f.exists():
                parts.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-40:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job, then SIGTERM each daemon by its pid file (SIGKILL if it lingers)."""
        with contextlib.suppress(Exception):
            self.run("scancel", "--user", "root", check=False, timeout=20)
        for pidfile in self._pidfiles:
            with contextlib.suppress(OSError, ValueError):
                pid = int(pidfile.read_text().strip())
                os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and _alive(pid):
                    time.sleep(0.2)
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie of ours is gone for our purposes
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True
