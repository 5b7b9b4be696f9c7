"""Ray's processes in tests: a node's raylets and the idle Python workers (`ray::IDLE`) they started, and whether a
cluster prestarts them for a driver (orchestration/ray_system.py turns that off)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def raylets(session: Path | str) -> list[int]:
    """The pids of the raylets whose command line names `session` (a session or temp directory: the test's node)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and Path(os.fsdecode(argv[0])).name == "raylet" and os.fsencode(str(session)) in b" ".join(argv):
            pids.append(int(proc.name))
    return pids


def idle_workers(raylet_pid: int) -> list[int]:
    """The idle Python workers (`ray::IDLE`) the raylet has started."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            title = (entry / "cmdline").read_bytes().split(b"\0")[0]
        except (OSError, ValueError, IndexError):
            continue
        if ppid == raylet_pid and title == b"ray::IDLE":
            found.append(int(entry.name))
    return found


# a driver that joins RAY_ADDRESS on 127.0.0.1, runs an actor with a runtime_env of its own (as every actor of a run
# does), says so and stays connected until its stdin closes: Ray's default prestarts idle workers for it by then
_DRIVER = """import os, sys
import ray
ray.init(_node_ip_address="127.0.0.1", logging_level="ERROR", log_to_driver=False)
a = ray.remote(num_cpus=1)(type("Pid", (), {"pid": lambda self: os.getpid()}))
print("ACTOR", ray.get(a.options(runtime_env={"env_vars": {"DFLASH_TEST": "1"}}).remote().pid.remote()), flush=True)
sys.stdin.read()
"""


def idle_beside_a_driver(env: dict, raylet_pid: int) -> list[int]:
    """The idle workers of `raylet_pid` while _DRIVER is connected (`env` reaches the cluster: RAY_ADDRESS and its
    token) and its actor runs."""
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        line = driver.stdout.readline()
        assert line.startswith("ACTOR "), line + driver.stdout.read()
        return idle_workers(raylet_pid)
    finally:
        driver.stdin.close()
        driver.wait(timeout=60)
