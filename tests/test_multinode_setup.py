"""Multi-node set-up as a user meets it, on one machine: what the other nodes are told and where they
look. This machine's /etc/hosts maps its own name to 127.0.0.1 (as Debian's `127.0.1.1 host` and
many cloud images do): the address a multi-node Slurm job gives its other nodes, and the one rank 0's
rendezvous store listens on, must still be one they reach. A relative --out, a relative target
directory and reference drafter mean the same place to an actor whose node's Ray was started in
another directory (every node but the driver's: `ray start` of the cluster launcher, an srun step).
Real Ray (a head and a worker node, the ray_cluster fixture), real TCPStores.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash_dist.actors.ports import free_ports
from dflash_dist.node_address import is_loopback, network_address
from tests.conftest import REPO
from tests.helpers.sockets import listening_sockets


def _resolves_to(host: str) -> str:
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


def processes_naming(text: str) -> list[int]:
    """Live processes with `text` on their command line (a Ray node's private temp directory)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            named = proc.name.isdigit() and os.fsencode(text) in (proc / "cmdline").read_bytes()
            if named and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":  # zombies aside
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def local_step_cluster(hosts: list[str], run_dir: Path, fail_with: int | None = None, hang: bool = False,
                       worker_cpus: int = 1, wait_s: float | None = None):
    """SlurmRayCluster with its srun step's task run here: what srun runs on each other node
    (`python -m launcher.slurm_ray worker ...`, the real code, with SLURM_CPUS_ON_NODE `worker_cpus`
    as slurmstepd sets it on that node), or, with `fail_with`, a step that could not start there (a
    node down) and exits with that code, or, with `hang`, a step that runs on without its node ever
    joining (a `ray start` retrying an address it cannot reach). `wait_s`: the most start() waits for
    the other nodes once the head runs (else what its timeout leaves), so that a test of a wait that
    ends unanswered spends seconds on it while the head still has all of start()'s time to come up."""
    from launcher.slurm_ray import SlurmRayCluster

    class Cluster(SlurmRayCluster):
        def wait_for_nodes(self, step: subprocess.Popen, timeout_s: float) -> None:
            super().wait_for_nodes(step, timeout_s if wait_s is None else min(timeout_s, wait_s))

        def worker_command(self) -> list[str]:
            if fail_with is not None:
                return [sys.executable, "-c", f"raise SystemExit({fail_with})"]
            if hang:
                return [sys.executable, "-c", "import time; time.sleep(600)"]
            command = super().worker_command()
            return command[command.index(sys.executable) :]

    cluster = Cluster(hosts, run_dir=run_dir)
    cluster.env["PYTHONPATH"] = str(REPO)
    cluster.env["SLURM_CPUS_ON_NODE"] = str(worker_cpus)
    return cluster


def test_a_multi_node_slurm_head_is_reached_at_a_network_address_and_each_node_offers_its_slurm_cpus(
    tmp_path, monkeypatch
):
    """SlurmRayCluster over two hosts, this one first: the address the srun step hands the other
    node (`ray start --address`) is not a loopback address even where this node resolves its own
    name to one (it was: the other node dialled itself and never joined). The head bound there takes
    the worker node (start() returns once it joined) and a driver, both at that address. Each node
    offers Ray the CPUs Slurm gave the job on it (SLURM_CPUS_ON_NODE there): the head did, but the
    worker nodes offered the machine's whole count, and Ray placed actors on CPUs of other jobs.

    The same cluster's stop() at the end of the job (one start of a two-node cluster for both checks):
    `ray start --block` answers SIGTERM by draining its node for up to 30 s (Ray 2.60, for Serve),
    past stop()'s 20 s, so every job's end took 20 s and then SIGKILLed the srun step, whose worker
    tasks never removed their private Ray temp directories: one left in /tmp of every other node per
    job. The job's Ray processes stop at once now (nothing of ours to drain), the step exits by
    itself, and the worker node's directory goes."""
    from dflash_dist.orchestration.ray_temp import ray_temp_base
    from launcher.slurm_ray import SlurmRayCluster

    host = socket.gethostname()
    plain = SlurmRayCluster([host, "node-b"], run_dir=tmp_path)  # what the job itself makes
    command = plain.worker_command()
    plain.stop()
    assert not is_loopback(plain.address_ip), (host, _resolves_to(host), plain.address)
    assert command[:2] == ["srun", "--overlap"] and command[command.index("--address") + 1] == plain.address
    assert "--num-cpus" not in command  # the step's one command line: each node counts its own

    job = f"stop{os.getpid()}"  # names this job's temp directories (dfray-<job>-w-*: the worker node's)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    base = Path(ray_temp_base(f"{job}-w-"))
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "1")  # the batch step's, on the head's node
    worker_cpus = (os.cpu_count() or 1) + 1  # not what Ray would count on this machine by itself
    cluster = local_step_cluster([host, "node-b"], tmp_path, worker_cpus=worker_cpus)
    try:
        cluster.start(timeout_s=240)
        worker_dirs = set(base.glob(f"dfray-{job}-w-*"))
        assert len(worker_dirs) == 1, worker_dirs
        alive = "sorted((n['NodeManagerAddress'], n['Resources'].get('CPU')) for n in ray.nodes() if n['Alive'])"
        code = f"import ray\nray.init()\nprint('NODES', {alive})"
        joined = subprocess.run([sys.executable, "-c", code], env=dict(cluster.env, RAY_ADDRESS=cluster.address),
                                capture_output=True, text=True, timeout=180)  # fmt: skip
        nodes = [(cluster.address_ip, 1.0), (cluster.address_ip, float(worker_cpus))]
        assert f"NODES {nodes}" in joined.stdout, joined.stdout + joined.stderr[-3000:]
    finally:
        t0 = time.monotonic()
        cluster.stop(keep_logs=False)
        took = time.monotonic() - t0
    step = cluster.procs[1]
    assert step.returncode != -signal.SIGKILL and took < 15, (step.returncode, took)
    named = [d for d in [os.path.dirname(cluster.temp_dir), *map(str, worker_dirs)] if processes_naming(d)]
    assert not named, f"Ray processes of the stopped nodes still running: {named}"
    time.sleep(3)  # a Ray process still exiting after its node's `ray start` returned wrote its logs there again
    left = sorted(Path(ray_temp_base(job)).glob(f"dfray-{job}-*")) + sorted(base.glob(f"dfray-{job}-w-*"))
    assert not left and worker_dirs, left  # the head's directory and the worker node's


def test_a_slurm_nodes_ray_cpus_come_from_slurms_variables():
    """num_cpus_args, what the head and every worker node add to `ray start`: SLURM_CPUS_ON_NODE (the
    job's CPUs on the node), else SLURM_CPUS_PER_TASK x the tasks on the node; nothing outside Slurm or
    where the arguments name a count; a value that is not a count is refused naming the variable."""
    from launcher.slurm_ray import num_cpus_args

    assert num_cpus_args({"SLURM_CPUS_ON_NODE": "48"}, ["--block"]) == ["--num-cpus", "48"]
    per_task = {"SLURM_CPUS_PER_TASK": "8", "SLURM_STEP_TASKS_PER_NODE": "4,2", "SLURM_NODEID": "1"}
    assert num_cpus_args(per_task, []) == ["--num-cpus", "16"]
    assert num_cpus_args({}, []) == []
    assert num_cpus_args({"SLURM_CPUS_ON_NODE": "48"}, ["--num-cpus=4"]) == []
    with pytest.raises(ValueError, match=r"SLURM_CPUS_ON_NODE='0' is not a CPU count"):
        num_cpus_args({"SLURM_CPUS_ON_NODE": "0"}, [])


def test_a_node_that_does_not_join_fails_the_job_at_once_naming_it(tmp_path):
    """The srun step that starts Ray on the other nodes fails (a node down, `ray start` refused):
    start() raises within seconds, saying how many nodes joined and why. It returned as if the
    cluster were whole, and the run then waited ray.placement_timeout_s (600 s) for the missing
    node's resources before blaming the placement group (under ray.placement: none, for ever)."""
    from dflash_dist.orchestration.run_plan import PipelineError

    cluster = local_step_cluster([socket.gethostname(), "node-b"], tmp_path, fail_with=3)
    try:
        t0 = time.monotonic()
        try:
            cluster.start(timeout_s=240)
            raised = None
        except PipelineError as e:
            raised = str(e)
        took = time.monotonic() - t0
    finally:
        cluster.stop(keep_logs=False)
    head_dir = os.path.dirname(cluster.temp_dir)
    assert not processes_naming(head_dir), "Ray processes of the stopped head still running (they make its dir again)"
    assert raised is not None, "start() returned with a node missing"
    assert "1 of 2 nodes joined" in raised and "node-b ended with exit code 3" in raised, raised
    assert took < 60, took


def test_a_node_that_never_joins_is_named_when_the_wait_ends(tmp_path):
    """The srun step runs on but one node's Ray never joins: start() gives up when its time is spent
    and names the host that did not join (and those that did), not only a count: with dozens of
    nodes, "7 of 8 nodes joined" left the operator to find the missing one in the job's log."""
    from dflash_dist.orchestration.run_plan import PipelineError

    host = socket.gethostname()
    # the wait ends unanswered however long it is (the node never comes): 3 s, not start()'s 240
    cluster = local_step_cluster([host, "node-b"], tmp_path, hang=True, wait_s=3)
    try:
        try:
            cluster.start(timeout_s=240)
            raised = None
        except PipelineError as e:
            raised = str(e)
    finally:
        cluster.stop(keep_logs=False)
    assert raised is not None, "start() returned with a node missing"
    assert "1 of 2 nodes joined" in raised and "not joined: node-b" in raised, raised
    assert f"joined: {host}" in raised, raised


def test_rank_0s_store_listens_where_the_other_nodes_reach_it():
    """Slurm's train.sbatch over two nodes names the master by its host name (MASTER_ADDR=<first
    host>). Rank 0 bound its store to what its own node resolves that name to, here loopback: the
    ranks on the other node, resolving the name to the node's address, were refused until the
    30-minute timeout. It listens on the node's network address now, and a rank joins there."""
    from dflash_dist.actors.rendezvous import rendezvous_store

    host = socket.gethostname()
    (port,) = free_ports(1)
    env = {"MASTER_ADDR": host, "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "2"}
    timeout = datetime.timedelta(seconds=60)
    got: dict = {}

    def rank0() -> None:
        try:
            got["store"] = rendezvous_store(env, timeout)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            got["error"] = e

    thread = threading.Thread(target=rank0, daemon=True)
    thread.start()
    import torch.distributed as dist

    deadline = time.monotonic() + 30
    while not (ours := [s for s in listening_sockets(os.getpid()) if s[1] == port]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ours and "error" not in got, (ours, got)
    assert all(not is_loopback(addr) for addr, _ in ours), f"rank 0's store listens on {ours}: {host} -> loopback"
    peer = dist.TCPStore(ours[0][0], port, 2, False, timeout)  # rank 1, dialling the node's address
    thread.join(30)
    peer.set("from-rank-1", "hello")
    assert got["store"].get("from-rank-1") == b"hello"


def test_a_relative_out_is_one_directory_for_the_driver_and_actors_on_other_nodes(ray_cluster, monkeypatch, tmp_path):
    """`dflash-dist run CONFIG --out runs/x` typed in one directory, with actors on a node whose
    Ray was started in another (the ray_cluster fixture's node was started in the test's own
    working directory): the actors read the config's run.out_dir, the target directory and
    eval.reference_drafter as absolute paths naming what the driver named. They got the relative
    ones and resolved them against their own working directory (another run directory entirely)."""
    import ray

    from dflash_dist.config import load_config, load_config_dict
    from dflash_dist.target.loading import expected_target_dir, resolve_target_dir
    from launcher.cli import load_cli_config

    here = tmp_path / "typed-here"
    (here / "ref" / "drafter").mkdir(parents=True)
    (here / "ref" / "drafter" / "config.json").write_text("{}")  # what the config's check looks for
    monkeypatch.chdir(here)
    cfg = load_cli_config(str(REPO / "configs" / "tiny.yaml"), ["eval.reference_drafter=ref/drafter"], "runs/x")

    @ray.remote(num_cpus=0)
    def seen(tree: dict) -> tuple[str, str, str]:
        c = load_config_dict(tree)
        return os.getcwd(), str(c.out.resolve()), str(Path(c.eval.reference_drafter).resolve())

    cwd, out, ref = ray.get(seen.remote(cfg.to_dict()))
    assert cwd != str(here)  # the actor's node was started elsewhere, as every other node is
    assert (out, ref) == (str(here / "runs" / "x"), str(here / "ref" / "drafter"))
    hf = load_config(None, ["target.kind=hf", "target.path=models/t", "data.train_path=d.jsonl"], check_files=False)
    assert resolve_target_dir(hf) == expected_target_dir(hf) == here / "models" / "t"


def test_a_relative_resume_path_is_one_checkpoint_for_the_driver_and_trainers_on_other_nodes(
    ray_cluster, monkeypatch, tmp_path
):
    """`dflash-dist run CONFIG --out runs/x --resume runs/x/checkpoints/step_2` typed in one
    directory: the driver decides on that tag (plan_resume) and hands its path to the trainer ranks,
    which check it on their own nodes (resume.verify), from where their node's Ray was started. The
    path went as typed, relative: a rank on another node found no checkpoint ("the checkpoint decided
    on for this resume is gone"), as a relative --out named another directory there before."""
    import hashlib

    import ray

    from dflash_dist.trainer import resume
    from dflash_dist.trainer.checkpoint import MARKER, ResumeError, plan_resume, write_marker
    from launcher.cli import cli_resume

    here = tmp_path / "typed-here"
    tag = here / "runs" / "x" / "checkpoints" / "step_2"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"the tag's files")
    write_marker(tag, {"step": 2})  # a complete tag, as the trainer marks one
    monkeypatch.chdir(here)
    path = plan_resume(cli_resume("runs/x/checkpoints/step_2"), here / "runs" / "x" / "checkpoints")
    decision = resume.ResumeDecision(str(path), 2, 1, 1, hashlib.sha256((path / MARKER).read_bytes()).hexdigest())

    @ray.remote(num_cpus=0)
    def verified_on_a_node(d: resume.ResumeDecision) -> tuple[str, str | None]:
        try:
            resume.verify(d)
        except ResumeError as e:
            return os.getcwd(), str(e)
        return os.getcwd(), None

    cwd, error = ray.get(verified_on_a_node.remote(decision))
    assert cwd != str(here)  # the actor's node was started elsewhere, as every other node is
    assert error is None, f"a trainer whose node's Ray started in {cwd}: {error}"
    assert (cli_resume("auto"), cli_resume("never")) == ("auto", "never")


def test_master_addr_in_the_jobs_environment_chooses_the_network_of_a_multi_node_job(tmp_path, monkeypatch):
    """A multi-node job whose nodes share a network the first host's name does not resolve to (an
    InfiniBand interface's address): MASTER_ADDR in the job's environment is where the trainers' store
    and the Ray head are reached; a loopback MASTER_ADDR over several nodes is refused naming it; one
    node stays on 127.0.0.1 whatever the environment says."""
    from launcher.slurm_ray import SlurmRayCluster
    from launcher.slurm_train import slurm_rank_environment

    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "77",
           "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}  # fmt: skip
    assert slurm_rank_environment(env, ["gpu-a", "gpu-b"], True)["MASTER_ADDR"] == "gpu-a"
    chosen = {**env, "MASTER_ADDR": "192.0.2.7"}
    assert slurm_rank_environment(chosen, ["gpu-a", "gpu-b"], True)["MASTER_ADDR"] == "192.0.2.7"
    assert slurm_rank_environment(chosen, ["gpu-a"], True)["MASTER_ADDR"] == "127.0.0.1"
    with pytest.raises(ValueError, match=r"MASTER_ADDR=127\.0\.0\.1 is a loopback address.*gpu-a"):
        slurm_rank_environment({**env, "MASTER_ADDR": "127.0.0.1"}, ["gpu-a", "gpu-b"], True)

    monkeypatch.setenv("MASTER_ADDR", "192.0.2.7")
    cluster = SlurmRayCluster([socket.gethostname(), "node-b"], run_dir=tmp_path)
    try:
        assert cluster.address_ip == "192.0.2.7" and cluster.address.startswith("192.0.2.7:")
        assert cluster.worker_command()[cluster.worker_command().index("--address") + 1] == cluster.address
    finally:
        cluster.stop()
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    with pytest.raises(ValueError, match="MASTER_ADDR=localhost is a loopback address"):
        SlurmRayCluster([socket.gethostname(), "node-b"], run_dir=tmp_path)


def test_a_head_name_that_does_not_resolve_is_a_one_line_error_naming_the_fix(tmp_path, monkeypatch):
    """`run --launcher slurm` over two nodes whose first host name this node cannot resolve: the error
    `dflash-dist run` prints in one line (ConfigError), naming the host and MASTER_ADDR, not a traceback."""
    from launcher.slurm_ray import SlurmRayCluster

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ValueError, match=r"node job on no-such-node\.invalid: .*export MASTER_ADDR="):
        SlurmRayCluster(["no-such-node.invalid", "node-b"], run_dir=tmp_path)


def test_a_target_directory_missing_on_a_node_names_the_node_the_path_and_the_fix(tmp_path):
    """A multi-node run whose target directory exists on the driver's node only: the process that loads
    it on another node (a trainer rank's embedding and lm_head, a capture actor's or the evaluator's
    load_verified_target) fails with an error naming that node (host name and address), the path, and
    what to do: shared storage at the same path, or a copy there. It said "hash_weight_files: ... is not
    a directory" or "no *.safetensors weight files", naming no node, among many nodes' logs."""
    from dflash_dist.config import load_config
    from dflash_dist.target.loading import TargetNotOnNode, load_embeddings, load_verified_target

    host = socket.gethostname()
    missing = tmp_path / "models" / "target"
    fix = "put the target on storage every node mounts at the same path, or copy it to"
    with pytest.raises(TargetNotOnNode) as info:
        load_embeddings(missing, "trainer rank 3")
    text = str(info.value)
    assert text.startswith(f"trainer rank 3: the target directory {missing} does not exist on node {host} ("), text
    assert f"({network_address(host)})" in text and f"{fix} {missing} on {host} " in text, text
    assert isinstance(info.value, ValueError)  # deterministic: the trainer group is not restarted for it

    cfg = load_config(None, ["target.kind=hf", f"target.path={missing}", "data.train_path=d.jsonl"], check_files=False)
    path = re.escape(str(missing))
    with pytest.raises(TargetNotOnNode, match=rf"^target actor 0 on {host}: the target directory {path} does not exist "
                                              rf"on node {host} \(.*{fix}"):
        load_verified_target(cfg, missing, "0" * 64, f"target actor 0 on {host}", purpose="capture")
    missing.parent.mkdir(parents=True)
    missing.write_text("a file where the directory should be")
    with pytest.raises(TargetNotOnNode, match=rf"the target directory {path} is not a directory on node {host}"):
        load_embeddings(missing)
