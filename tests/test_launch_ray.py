"""Launching on a Ray cluster: `ray job submit` of the tiny config to a real local head (started
and stopped by tests/readme_run.py, bound to 127.0.0.1; the session's one run of the README's
command), the cluster launcher YAMLs through Ray's own config validation, and the `ray submit`
entry script."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.helpers.ray_workers import idle_beside_a_driver, raylets

VENV_BIN = Path(sys.executable).parent


@pytest.mark.slow
def test_ray_job_submit_runs_the_tiny_config(readme_run, capsys):
    """`ray job submit --working-dir . -- dflash-dist run configs/tiny.yaml` to a local head
    (the session's one run of the README's command: tests/readme_run.py)."""
    out, proc, job_id, status = readme_run.out, readme_run.proc, readme_run.job_id, readme_run.status
    logs = readme_run.logs
    assert proc.returncode == 0, f"ray job submit failed ({proc.returncode}) after {readme_run.took_s:.0f}s:\n{logs}"
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
    every = _tiny().train.checkpoint_every  # the run's own: the tiny config unchanged
    exports = sorted(int(p.name.split("_")[1]) for p in (out / "export").glob("step_*"))
    assert exports == sorted({*range(every, final + 1, every), final})
    evals = {json.loads(p.read_text())["step"]: json.loads(p.read_text()) for p in (out / "eval").glob("step_*.json")}
    assert sorted(evals) == exports
    assert all(r["tau_chain"] >= 1.0 and set(r["tau_ddtree"]) == {"4", "8"} for r in evals.values())
    assert "tau chain" in proc.stdout  # the job's own summary, tailed by `ray job submit`
    # and `status` reads the finished run back (`dflash-dist status OUT --json`: the CLI's main, in this process)
    from launcher.cli import main as cli

    capsys.readouterr()
    assert cli(["status", str(out), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
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

    # on a node of a launcher-made cluster the driver joins with the cluster's token
    from launcher.ray_auth import write_token

    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.setenv(key, "")  # recorded, so what ray_entry sets is undone after the test
        monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path))
    ray_entry.main(["configs/tiny.yaml"])
    assert "RAY_AUTH_MODE" not in os.environ  # no token file: Ray's own defaults
    write_token(tmp_path / "dflash-ray-token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "a user's other token")
    ray_entry.main(["configs/tiny.yaml"])
    assert os.environ["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN" not in os.environ
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "dflash-ray-token")


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
        reserve(ray_cluster, plan_placement(cfg, ("train",)), timeout_s=1)  # never placeable: no node has it
    assert ray_cluster.available_resources().get("CPU") == 2.0  # the refused group was removed


# ---------------------------------------------------------------------------- token authentication
def _no_auth_env(home: Path) -> dict:
    """This process's environment without any Ray token setting, HOME pointing at `home` (where
    `dflash-dist ray-start` looks for ~/dflash-ray-token and Ray for ~/.ray/auth_token)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    return env | {"HOME": str(home), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def test_cluster_yamls_start_every_ray_process_with_a_token_the_launcher_makes(monkeypatch, tmp_path, capsys):
    """Both cluster-launcher YAMLs start every Ray process through `dflash-dist ray-start` (token
    auth, refused without a private token file) and copy a token file to every node that is
    gitignored; `dflash-dist cluster-token` makes it mode 0600 without printing it, keeps it when
    asked again, replaces it with --new, and refuses a YAML whose `ray start` has no token auth."""
    import stat

    from launcher.cli import main as cli
    from launcher.ray_auth import REMOTE_TOKEN, START_COMMAND, start_problems, token_file_problem

    for name in ("cluster.yaml", "cluster_onprem.yaml"):
        path = REPO / "launcher" / name
        cluster = yaml.safe_load(path.read_text())
        assert start_problems(cluster, name) == []
        fields = ("head_start_ray_commands", "worker_start_ray_commands")
        starts = [c for f in fields for c in cluster[f] if "start" in c]
        assert len(starts) == 2 and all(f"{START_COMMAND} " in c for c in starts)
        local = cluster["file_mounts"][REMOTE_TOKEN]
        ignored = subprocess.run(["git", "check-ignore", "-q", local], cwd=REPO)
        assert ignored.returncode == 0, f"{name}: {local} is not gitignored"
        assert local not in (cluster.get("rsync_exclude") or [])  # the exclusions apply to every mount

        monkeypatch.chdir(tmp_path)  # `ray up` resolves the mount against its cwd, the checkout
        assert cli(["cluster-token", str(path)]) == 0
        token_file = tmp_path / local
        token = token_file.read_text()
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and token_file_problem(token_file) is None
        assert cli(["cluster-token", str(path)]) == 0 and token_file.read_text() == token  # kept
        assert cli(["cluster-token", "--new", str(path)]) == 0 and token_file.read_text() != token
        printed = capsys.readouterr()
        assert token not in printed.out + printed.err and token_file.read_text() not in printed.out + printed.err

    plain = yaml.safe_load((REPO / "launcher" / "cluster.yaml").read_text())
    plain["worker_start_ray_commands"] = ["ray stop", "ray start --address=$RAY_HEAD_IP:6379"]
    (tmp_path / "plain.yaml").write_text(yaml.safe_dump(plain))
    assert cli(["cluster-token", str(tmp_path / "plain.yaml")]) == 2
    refused = capsys.readouterr().err
    assert "worker_start_ray_commands: 'ray start --address=$RAY_HEAD_IP:6379' starts Ray without token auth" in refused

    # a node never starts Ray without a private token file
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    assert cli(["ray-start", "--head"]) == 2
    assert "refusing to start Ray without token authentication" in capsys.readouterr().err
    (tmp_path / "home" / "dflash-ray-token").write_text(token)
    (tmp_path / "home" / "dflash-ray-token").chmod(0o644)
    assert cli(["ray-start", "--head"]) == 2
    assert "has mode 0644: others could read the token" in capsys.readouterr().err
    garbled = tmp_path / "home" / "dflash-ray-token"
    garbled.write_bytes(b"\xff" * 40)  # private, but not a token: refused with a message, no traceback
    garbled.chmod(0o600)
    assert cli(["ray-start", "--head"]) == 2
    assert "cannot be read as a token file (UnicodeDecodeError" in capsys.readouterr().err


@pytest.mark.slow
def test_a_head_started_by_ray_start_refuses_clients_without_its_token(tmp_path):
    """`dflash-dist ray-start` (what the cluster YAMLs run on every node) starts a real head, here
    on 127.0.0.1: a client without the token and one with another token are refused by the GCS;
    one with the token file (as `ray job submit` is told in the README) connects. The token is
    in no log or file of the head's temp dir, nor in its output. The head prestarts no idle workers
    for a driver (Ray's default: one per CPU, which no actor of a run takes)."""
    import signal
    import tempfile

    from dflash_dist.actors.ports import free_ports
    from launcher.ray_auth import write_token

    home = tmp_path / "home"
    home.mkdir()
    token = write_token(home / "dflash-ray-token").read_text()
    temp_dir = tempfile.mkdtemp(prefix="dfauth-", dir="/tmp")  # short: Ray's socket paths
    port, *other = free_ports(6, "127.0.0.1")
    flags = ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
             "--metrics-export-port", "--ray-client-server-port")  # fmt: skip
    head = subprocess.Popen(
        [str(VENV_BIN / "dflash-dist"), "ray-start", "--head", "--block", "--node-ip-address", "127.0.0.1",
         "--port", str(port), "--include-dashboard", "false", "--num-cpus", "2", "--disable-usage-stats",
         "--temp-dir", temp_dir, *(a for f, p in zip(flags, other) for a in (f, str(p)))],
        env=_no_auth_env(home) | {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"},  # SIGTERM stops it at once
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    out: list[str] = []
    try:
        for line in head.stdout:
            out.append(line)
            if "Ray runtime started" in line:
                break
        assert head.poll() is None, "".join(out)
        probe = (f"import ray; ray.init(address='127.0.0.1:{port}', _node_ip_address='127.0.0.1'); "
                 "print('CPUS', ray.cluster_resources().get('CPU')); ray.shutdown()")  # fmt: skip
        one_try = {"RAY_gcs_server_port_wait_time_s": "1"}  # a refused client gives up after one attempt

        def client(extra: dict) -> subprocess.Popen:  # the three clients at once: each is mostly Python's start
            return subprocess.Popen([sys.executable, "-c", probe], env=_no_auth_env(tmp_path) | extra,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip

        def ended(p: subprocess.Popen) -> subprocess.CompletedProcess:
            try:
                stdout, stderr = p.communicate(timeout=120)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)

        clients = [client(one_try), client(one_try | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}),
                   client({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(home / "dflash-ray-token")})]
        none, wrong, right = map(ended, clients)
        assert none.returncode != 0 and "Authentication token is missing or incorrect" in none.stderr, none.stderr
        assert wrong.returncode != 0 and "Authentication token is missing or incorrect" in wrong.stderr, wrong.stderr
        assert right.returncode == 0 and "CPUS 2.0" in right.stdout, right.stdout + right.stderr
        (raylet,) = raylets(temp_dir)  # a head: no idle worker prestarted for a driver (ray_system.NO_PRESTART)
        driver_env = _no_auth_env(tmp_path) | {"RAY_AUTH_MODE": "token", "RAY_ADDRESS": f"127.0.0.1:{port}",
                                               "RAY_AUTH_TOKEN_PATH": str(home / "dflash-ray-token")}  # fmt: skip
        assert idle_beside_a_driver(driver_env, raylet) == []
        leaked = subprocess.run(["grep", "-rl", token, temp_dir], capture_output=True, text=True)
        assert leaked.stdout == "", f"the token is written in {leaked.stdout}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)
        try:
            rest = head.communicate(timeout=40)[0]
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            rest = head.communicate()[0]
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert token not in "".join(out) + (rest or "")


_LOCAL_SESSIONS = r"""
import logging, os, shlex, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
import ray
from dflash_dist.config import load_config
from dflash_dist.orchestration.pipeline import ray_session

cfg = load_config(sys.argv[1], ["ray.num_cpus=1"], out_dir=sys.argv[2])
home = os.environ["HOME"]

def probe_without_token():
    addr = ray.get_runtime_context().gcs_address
    code = f"import ray; ray.init(address={addr!r}, _node_ip_address='127.0.0.1'); print('JOINED')"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["RAY_gcs_server_port_wait_time_s"] = "1"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return r.returncode != 0 and "Authentication token is missing or incorrect" in r.stderr

def probe_through_hint():  # another shell of the run's user, given only the session's logged line
    hint = next((m for m in logged if "demands this run's token" in m), "")
    if "export " not in hint:
        return "no hint: " + repr(logged)
    addr = ray.get_runtime_context().gcs_address
    code = f"import ray; ray.init(address={addr!r}, _node_ip_address='127.0.0.1'); print('JOINED')"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["RAY_gcs_server_port_wait_time_s"] = "1"
    shell = "export " + hint.split("export ", 1)[1] + f"; exec {sys.executable} -c {shlex.quote(code)}"
    r = subprocess.run(["bash", "-c", shell], env=env, capture_output=True, text=True, timeout=120)
    return r.returncode == 0 and "JOINED" in r.stdout and (token not in hint)

logged = []
handler = logging.Handler()
handler.emit = lambda record: logged.append(record.getMessage())
logging.getLogger("dflash_dist.orchestration.pipeline").addHandler(handler)
logging.getLogger("dflash_dist.orchestration.pipeline").setLevel(logging.INFO)
with ray_session(cfg):
    token = os.environ.get("RAY_AUTH_TOKEN")
    print("TASK", ray.get(ray.remote(lambda: 41 + 1).remote()))
    print("TOKEN_FILE", os.path.exists(os.path.join(home, ".ray", "auth_token")))
    with ThreadPoolExecutor(2) as pool:  # the two clients at once: each is mostly Python's start
        refused, joins = pool.submit(probe_without_token), pool.submit(probe_through_hint)
        print("REFUSED", refused.result())
        print("HINT_JOINS", joins.result())
print("ENV_AFTER", sorted(k for k in os.environ if k.startswith("RAY_AUTH")))
# Ray's own default cluster in the same process after ours (it writes ~/.ray/auth_token), then ours again
# after Ray's: each connects only if the session reloaded Ray's cached token on its way out and in
for name, session in (("plain", None), ("ours", ray_session)):
    if session is None:
        ray.init(address="local", num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1")
        print(name.upper(), ray.get(ray.remote(lambda: 7).remote()))
        ray.shutdown()
    else:
        with session(cfg):
            print(name.upper(), ray.get(ray.remote(lambda: 7).remote()))
"""


@pytest.mark.slow
def test_a_local_run_cluster_demands_a_token_that_is_never_on_disk(tmp_path):
    """A single-node run's own Ray cluster (pipeline.ray_session) demands a token, as Ray's
    default does, but the token lives only in the run's environment: Ray's default writes it to
    ~/.ray/auth_token with mode 0644, where any local user could read it and run code as the run's
    user on its cluster. A client without the token is refused; no token file appears in HOME; the
    environment is as before afterwards; and a process that started Ray's own default cluster
    before (or after) one of ours still connects to each (Ray caches the first token it read).
    The run's user can still reach its cluster from another shell (Ray's CLI, the dashboard's token
    prompt): the session logs how (ray_token.reach_hint), without the token itself."""
    home = tmp_path / "home"
    home.mkdir()
    proc = subprocess.run([sys.executable, "-c", _LOCAL_SESSIONS, str(REPO / "configs" / "tiny.yaml"),
                           str(tmp_path / "out")], cwd=REPO, env=_no_auth_env(home), capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    out = proc.stdout
    assert "TASK 42" in out
    assert "TOKEN_FILE False" in out, out
    assert "REFUSED True" in out, out
    assert "HINT_JOINS True" in out, out
    assert "ENV_AFTER []" in out, out
    assert "PLAIN 7" in out and "OURS 7" in out, out
