"""Launching on a Ray cluster: `ray job submit` of the tiny config to a real local head (started
and stopped by tests/readme_run.py, bound to 127.0.0.1; the session's one run of the README's
command), the cluster launcher YAMLs through Ray's own config validation, and the `ray submit`
entry script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

VENV_BIN = Path(sys.executable).parent


@pytest.mark.slow
def test_ray_job_submit_runs_the_tiny_config(readme_run):
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
