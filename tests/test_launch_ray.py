"""Launching on a Ray cluster: `ray job submit` of the tiny config to a real local head (started
and stopped by this test, bound to 127.0.0.1), the cluster launcher YAMLs through Ray's own
config validation, and the `ray submit` entry script."""

from __future__ import annotations

import contextlib
import json
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
import yaml

from dflash_dist.actors.ports import free_ports
from tests.conftest import REPO

VENV_BIN = Path(sys.executable).parent
# the tiny config, shortened: one epoch of 48 samples (a few optimizer steps), an export every 2
SHORT = [
    "data.max_train_samples=48",
    "train.epochs=1",
    "train.checkpoint_every=2",
    "eval.num_prompts=2",
    "eval.max_new_tokens=16",
]


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

    def __init__(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="dfray-", dir="/tmp")  # short: Ray's socket paths
        # every port of its own: Ray's fixed defaults (agent 52365, client 10001, ...) may be
        # held by another Ray on this machine, and a head whose job agent cannot bind takes no jobs
        self.port, self.dash_port, *self.other_ports = free_ports(7, "127.0.0.1")
        # Ray 2.60 turns token auth on for a new head: a token of this head's own (not the user's
        # ~/.ray/auth_token), given to the head, its job drivers and the job CLI alike
        self.env = dict(
            os.environ,
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
        proc = subprocess.Popen(
            [
                str(VENV_BIN / "ray"),
                "start",
                "--head",
                "--node-ip-address",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dashboard-host",
                "127.0.0.1",
                "--dashboard-port",
                str(self.dash_port),
                "--num-cpus",
                "2",
                "--temp-dir",
                self.temp_dir,
                "--disable-usage-stats",
                "--include-dashboard",
                "true",
                *(
                    a
                    for flag, p in zip(
                        (
                            "--dashboard-agent-listen-port",
                            "--dashboard-agent-grpc-port",
                            "--runtime-env-agent-port",
                            "--metrics-export-port",
                            "--ray-client-server-port",
                        ),
                        self.other_ports,
                    )
                    for a in (flag, str(p))
                ),
            ],
            env=self.env,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.sid = proc.pid
        out, _ = proc.communicate(timeout=120)
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


@pytest.fixture
def local_head():
    head = LocalHead()
    head.start()
    try:
        yield head
    finally:
        head.stop()


@pytest.mark.slow
def test_ray_job_submit_runs_the_tiny_config(local_head, tmp_path):
    out = tmp_path / "run"
    t0 = time.monotonic()
    for attempt in range(20):  # the head's job agent comes up a few seconds after `ray start` returns
        job_id = f"dflash-test-{os.getpid()}-{attempt}"
        cmd = [
            str(VENV_BIN / "ray"),
            "job",
            "submit",
            "--address",
            local_head.dashboard,
            "--working-dir",
            ".",
            "--submission-id",
            job_id,
            "--",
            "dflash-dist",
            "run",
            "configs/tiny.yaml",
            "--out",
            str(out),
            *SHORT,
        ]
        proc = subprocess.run(cmd, cwd=REPO, env=local_head.env, capture_output=True, text=True, timeout=1200)
        if "No available agent to submit job" not in proc.stderr + proc.stdout:
            break
        time.sleep(2)
    took = time.monotonic() - t0
    logs = f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"ray job submit failed ({proc.returncode}) after {took:.0f}s:\n{logs}"
    status = subprocess.run(
        [str(VENV_BIN / "ray"), "job", "status", "--address", local_head.dashboard, job_id],
        env=local_head.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert f"Job '{job_id}' succeeded" in status.stdout, status.stdout + status.stderr

    # the job joined the head (not a cluster of its own) and placed every role in one group
    assert "Started a local Ray instance" not in proc.stdout, logs
    # its outputs: shards, a complete checkpoint, exports and tau of each, TensorBoard, heartbeats
    assert (out / "shards" / "DONE").exists() and (out / "shards" / "manifest.jsonl").stat().st_size > 0
    beats = {(b["role"], b["index"]): b for b in map(json.loads, map(Path.read_text, (out / "heartbeat").glob("*")))}
    assert set(beats) == {("driver", 0), ("target", 0), ("trainer", 0), ("trainer", 1), ("evaluator", 0)}
    assert all(b["state"] == "finished" for b in beats.values()), beats
    final = beats[("trainer", 0)]["info"]["step"]
    assert final >= 4 and beats[("trainer", 1)]["info"]["step"] == final
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{final}" and (out / "checkpoints" / latest).is_dir()
    exports = sorted(int(p.name.split("_")[1]) for p in (out / "export").glob("step_*"))
    assert exports == sorted({*range(2, final + 1, 2), final})
    evals = {json.loads(p.read_text())["step"]: json.loads(p.read_text()) for p in (out / "eval").glob("step_*.json")}
    assert sorted(evals) == exports
    assert all(r["tau_chain"] >= 1.0 and set(r["tau_ddtree"]) == {"4", "8"} for r in evals.values())
    assert "tau chain" in proc.stdout  # the job's own summary, tailed by `ray job submit`
    # and `status` reads the finished run back
    status = subprocess.run(
        [str(VENV_BIN / "dflash-dist"), "status", str(out), "--json"], capture_output=True, text=True, timeout=120
    )
    s = json.loads(status.stdout)
    assert s["trainer"]["step"] == final and s["eval"]["step"] == final and s["shards"]["capture_done"]
    assert {r["state"] for r in s["roles"]} == {"finished"}


def test_cluster_yamls_pass_rays_own_validation():
    """`ray up` runs prepare_config (provider defaults; the on-prem provider's own checks) then
    validate_config (Ray's JSON schema and cross-field rules): both YAMLs must pass them."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    cloud = yaml.safe_load((REPO / "launcher" / "cluster.yaml").read_text())
    prepared = prepare_config(cloud)
    validate_config(prepared)
    types = prepared["available_node_types"]
    head, workers = types[prepared["head_node_type"]], [t for n, t in types.items() if n != prepared["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["max_workers"] == 0
    assert workers and all(t["resources"]["GPU"] >= 1 for t in workers)
    # the node resources the config's ray.node_resources may name are declared by GPU node types
    declared = {r for t in workers for r in t["resources"] if r not in ("CPU", "GPU", "memory")}
    assert {"dflash_target", "dflash_trainer"} <= declared
    setup = " ".join(prepared["setup_commands"])
    assert "pip install" in setup and "~/dflash-dist" in setup
    assert "." in prepared["file_mounts"].values()  # this checkout, copied by `ray up` run in its root

    onprem = yaml.safe_load((REPO / "launcher" / "cluster_onprem.yaml").read_text())
    prepared = prepare_config(onprem)
    validate_config(prepared)
    assert prepared["provider"]["type"] == "local"
    assert prepared["provider"]["head_ip"] and prepared["provider"]["worker_ips"]


def test_cluster_yaml_with_a_mistake_is_refused_by_ray():
    """The validation the test above relies on does reject a broken config."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    cloud = yaml.safe_load((REPO / "launcher" / "cluster.yaml").read_text())
    cloud["available_node_types"]["gpu_trainer"]["min_wrokers"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(cloud))


def test_ray_entry_joins_the_cluster_and_runs_the_cli_from_the_project(monkeypatch, tmp_path):
    import launcher.cli
    from launcher import ray_entry

    seen = {}

    def fake_cli(argv):
        seen.update(argv=argv, cwd=Path.cwd(), address=os.environ.get("RAY_ADDRESS"))
        return 0

    monkeypatch.setattr(launcher.cli, "main", fake_cli)
    monkeypatch.setenv("RAY_ADDRESS", "")  # recorded, so the value ray_entry sets is undone after the test
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.chdir(tmp_path)  # `ray submit` runs the script from the head's home directory
    assert ray_entry.main(["configs/tiny.yaml", "train.lr=1e-3"]) == 0
    assert seen == {"argv": ["run", "configs/tiny.yaml", "train.lr=1e-3"], "cwd": REPO, "address": "auto"}
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    ray_entry.main(["configs/tiny.yaml"])
    assert seen["address"] == "10.0.0.1:6379"


def _tiny(*overrides: str):
    from dflash_dist.config import load_config

    return load_config(REPO / "configs" / "tiny.yaml", list(overrides))


def test_placement_plan_has_a_bundle_per_role_process_with_its_resources_and_node():
    from dflash_dist.orchestration.placement import NODE_RESOURCE_AMOUNT, plan_placement

    plan = plan_placement(_tiny(), ("extract", "train", "eval"))
    assert plan.strategy == "PACK"
    assert plan.roles == (("target", 0), ("trainer", 0), ("trainer", 1), ("evaluator", 0))
    assert plan.bundles == ({"CPU": 0.5},) * 4
    gpu = _tiny(
        "capture.num_actors=2",
        "capture.gpus_per_actor=1",
        "train.world_size=4",
        "train.gpus_per_rank=1",
        "eval.num_gpus=1",
        "ray.placement=spread",
        "ray.node_resources.target=dflash_target",
        "ray.node_resources.trainer=dflash_trainer",
    )
    plan = plan_placement(gpu, ("extract", "train", "eval"))
    assert plan.strategy == "SPREAD" and len(plan.bundles) == 7
    node = NODE_RESOURCE_AMOUNT
    assert plan.bundles[plan.bundle_index("target", 1)] == {"CPU": 0.5, "GPU": 1.0, "dflash_target": node}
    assert plan.bundles[plan.bundle_index("trainer", 3)] == {"CPU": 0.5, "GPU": 1.0, "dflash_trainer": node}
    assert plan.bundles[plan.bundle_index("evaluator", 0)] == {"CPU": 0.5, "GPU": 1.0}
    # only the roles of the stages that run; none at all without placement
    assert plan_placement(gpu, ("eval",)).roles == (("evaluator", 0),)
    assert plan_placement(_tiny("eval.enabled=false"), ("eval",)) is None
    assert plan_placement(_tiny("ray.placement=none"), ("extract", "train", "eval")) is None


def test_placement_refuses_an_empty_bundle_and_constrains_nodes_without_a_group():
    from dflash_dist.config import ConfigError
    from dflash_dist.orchestration.placement import NODE_RESOURCE_AMOUNT, actor_placement, plan_placement

    with pytest.raises(ConfigError, match="evaluator role requests no CPU, GPU or node resource"):
        plan_placement(_tiny("eval.num_cpus=0"), ("extract", "train", "eval"))
    cfg = _tiny("ray.placement=none", "ray.node_resources.trainer=dflash_trainer")
    assert actor_placement(cfg, "trainer", 1, None, None) == {"resources": {"dflash_trainer": NODE_RESOURCE_AMOUNT}}
    assert actor_placement(cfg, "target", 0, None, None) == {}


@pytest.mark.slow
def test_roles_run_in_their_bundles_and_an_unplaceable_group_fails_naming_the_resource(ray_cluster):
    from dflash_dist.orchestration.placement import actor_placement, plan_placement, release, reserve

    @ray_cluster.remote(num_cpus=0.5)
    class Probe:
        def where(self) -> str:
            return ray_cluster.get_runtime_context().get_placement_group_id()

    cfg = _tiny()
    plan = plan_placement(cfg, ("extract", "train", "eval"))
    pg = reserve(ray_cluster, plan, timeout_s=60)
    try:
        probes = [Probe.options(**actor_placement(cfg, role, i, plan, pg)).remote() for role, i in plan.roles]
        assert set(ray_cluster.get([p.where.remote() for p in probes], timeout=60)) == {pg.id.hex()}
        for p in probes:
            ray_cluster.kill(p)
    finally:
        release(pg)

    cfg = _tiny("ray.node_resources.trainer=dflash_trainer")
    with pytest.raises(TimeoutError, match=r"trainer\[1\] \{'CPU': 0.5, 'dflash_trainer': 0.001\}"):
        reserve(ray_cluster, plan_placement(cfg, ("train",)), timeout_s=3)
    assert ray_cluster.available_resources().get("CPU") == 2.0  # the refused group was removed
