"""Slurm for real: a single-node cluster on 127.0.0.1 (munged, slurmctld, slurmd from Debian's
packages; tests/slurm_cluster.py), started and stopped here. The capture job array (2 tasks)
fills one shard directory and marks it DONE; the trainer-only script trains 2 srun ranks over
those shards; a trainer job signalled like Slurm's notice saves, requeues itself and resumes
from its checkpoint with one history of steps; the Ray pipeline script runs the tiny config on a
Ray cluster it starts inside the job. Without Slurm installed these fail, saying how to install.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from data_pipeline.chat_data import read_chat_jsonl
from data_pipeline.ingest import sample_keys
from data_pipeline.records import DONE_NAME, MANIFEST_NAME
from data_pipeline.shard_reader import read_manifest
from launcher.slurm_capture import parse_slice
from launcher.slurm_train import slurm_rank_environment, tasks_per_node
from tests.conftest import REPO
from tests.slurm_cluster import INSTALL_HINT, SlurmCluster, missing_programs

VENV_BIN = Path(sys.executable).parent
NUM = 16  # prompts captured: 8 per array task (2 steps of 2 ranks x 4 per epoch for the trainer job)
# the tiny config, small: short regenerations, every step logged, one eval prompt
SMALL = [
    f"data.max_train_samples={NUM}",
    "capture.max_new_tokens=16",
    "capture.batch_size=4",
    "capture.shard_bytes=400000",
    "train.log_every=1",
    "eval.num_prompts=1",
    "eval.max_new_tokens=12",
]


@pytest.fixture(scope="module")
def slurm():
    missing = missing_programs()
    if missing:
        pytest.fail(f"{INSTALL_HINT}; missing: {', '.join(missing)}")
    cluster = SlurmCluster(cpus=4)
    cluster.env["PATH"] = f"{VENV_BIN}:{cluster.env['PATH']}"  # the scripts call `dflash-dist`
    cluster.env["PYTHONUNBUFFERED"] = "1"
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def sbatch(slurm: SlurmCluster, log: Path, script: str, *args: str, opts: tuple[str, ...] = ()) -> str:
    proc = slurm.run("sbatch", "--parsable", f"--output={log}", *opts, str(REPO / "slurm" / script), *args)
    return proc.stdout.strip().split(";")[0]


def wait_job(slurm: SlurmCluster, job: str, timeout_s: float, until=None, log: Path | None = None) -> None:
    """Poll squeue (sbatch --wait backs off to tens of seconds) until the job (every array task)
    left the queue, or `until()` holds. The limits are generous: a loaded machine is slow."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if until is not None and until():
            return
        if until is None and not slurm.run("squeue", "-h", "-j", job, check=False).stdout.strip():
            return
        time.sleep(0.5)
    tail = log.read_text()[-6000:] if log is not None and log.exists() else ""
    pytest.fail(f"job {job} not done within {timeout_s:.0f} s:\n{slurm.run('squeue', check=False).stdout}\n"
                f"{tail}\n{slurm.logs()[-3000:]}")


def job_fields(slurm: SlurmCluster, job: str) -> dict[str, str]:
    text = slurm.run("scontrol", "show", "job", "-o", job).stdout
    return dict(f.split("=", 1) for f in text.split() if "=" in f)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def captured(slurm, tmp_path_factory) -> Path:
    """The capture array: 2 tasks, each its slice, into one shard directory."""
    out = tmp_path_factory.mktemp("capture") / "run"
    log = out.parent / "capture-%A_%a.out"
    job = sbatch(slurm, log, "capture_array.sbatch", "configs/tiny.yaml", "--out", str(out), *SMALL,
                 opts=("--array=0-1", "--cpus-per-task=1"))
    wait_job(slurm, job, 600)
    logs = "\n".join(p.read_text() for p in sorted(out.parent.glob("capture-*.out")))
    for task in ("0", "1"):
        fields = job_fields(slurm, f"{job}_{task}")
        assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), f"task {task}: {fields}\n{logs}"
    return out


@pytest.mark.slow
def test_capture_array_fills_one_directory_with_disjoint_slices_and_marks_it_done(captured):
    shards = captured / "shards"
    assert (shards / DONE_NAME).exists() and (shards / MANIFEST_NAME).exists()
    records = read_manifest(shards)
    keys = [k for r in records for k in r.keys]
    want = sample_keys(read_chat_jsonl(captured / "data" / "train.ingested.jsonl"))
    assert len(want) == NUM and sorted(keys) == sorted(want)  # every prompt exactly once
    by_task = {r.name.split("-")[0] for r in records}
    assert by_task == {"t000", "t001"}  # both array tasks wrote their own shards
    t0 = {k for r in records if r.name.startswith("t000") for k in r.keys}
    assert t0 == set(want[0::2])  # slice 0 of 2: the even records
    markers = sorted(p.name for p in (captured / "capture_slices").iterdir())
    assert markers == ["0000-of-0002.json", "0001-of-0002.json"]
    logs = "\n".join(p.read_text() for p in captured.parent.glob("capture-*.out"))
    assert "all 2 slices finished" in logs


@pytest.mark.slow
def test_trainer_only_script_saves_on_a_signal_requeues_itself_and_resumes(slurm, captured, tmp_path):
    """slurm/train.sbatch: two srun ranks over the array's shards; Slurm's notice mid-run makes
    them save and the script requeue the job, which resumes from that checkpoint and finishes."""
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(captured / "shards", out / "shards")
    log = tmp_path / "train.out"
    train_log = out / "train_log.jsonl"
    job = sbatch(slurm, log, "train.sbatch", "configs/tiny.yaml", "--out", str(out), *SMALL, "train.epochs=40",
                 "train.max_steps=10", "train.checkpoint_every=4", opts=("--ntasks=2", "--cpus-per-task=1"))
    wait_job(slurm, job, 600, log=log, until=lambda: train_log.exists() and len(read_jsonl(train_log)) >= 3)
    # Slurm's notice to the batch script (what --signal=B:USR1@120 or a TERM to it delivers)
    slurm.run("scancel", "--batch", "--signal=TERM", job)
    wait_job(slurm, job, 300, log=log, until=lambda: "Restarts=1" in slurm.run("scontrol", "show", "job", job).stdout
             and (out / "checkpoints" / "latest").exists())
    saved = (out / "checkpoints" / "latest").read_text().strip()
    wait_job(slurm, job, 600, log=log)
    text = log.read_text()  # --open-mode=append: both attempts
    fields = job_fields(slurm, job)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), text
    first, second = text.split("restart 1 on", 1)
    assert "stopped by SIGUSR1 after saving" in first and "requeueing job" in first, first
    assert f"saved {saved} and stopped" in first
    assert f"resumed from {out / 'checkpoints' / saved}" in second, second
    assert "2 rank(s), master 127.0.0.1:" in first and "finished at step 10; 0 sample(s) lost (0 unreadable" in second
    steps = [r["step"] for r in read_jsonl(train_log)]
    assert steps == list(range(1, 11))  # one history: nothing lost, nothing twice
    at = int(saved.split("_")[1])
    assert 3 <= at < 10
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_10"
    exported = {int(p.name.split("_")[1]) for p in (out / "export").glob("step_*")}
    assert {4, 8, at, 10} <= exported
    beats = {p.stem: json.loads(p.read_text()) for p in (out / "heartbeat").glob("*.json")}
    assert {k: b["state"] for k, b in beats.items()} == {"trainer-0": "finished", "trainer-1": "finished"}
    assert beats["trainer-0"]["pid"] != beats["trainer-1"]["pid"]  # two srun tasks, not one process
    assert any((out / "tb" / "train").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_pipeline_script_runs_the_tiny_config_on_a_ray_cluster_inside_the_job(slurm, tmp_path):
    out = tmp_path / "run"
    log = tmp_path / "pipeline.out"
    job = sbatch(slurm, log, "pipeline.sbatch", "configs/tiny.yaml", "--out", str(out), *SMALL,
                 "data.max_train_samples=8", "train.epochs=1", "train.checkpoint_every=2",
                 "eval.poll_s=0.2", opts=("--cpus-per-task=2",))  # one step; the evaluator sees its export at once
    wait_job(slurm, job, 900, log=log)
    text = log.read_text()
    fields = job_fields(slurm, job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "Ray head at 127.0.0.1:" in text and "Started a local Ray instance" not in text
    assert (out / "shards" / DONE_NAME).exists()
    latest = (out / "checkpoints" / "latest").read_text().strip()
    evals = sorted(int(p.stem.split("_")[1]) for p in (out / "eval").glob("step_*.json"))
    assert evals and f"step_{evals[-1]}" == latest
    beats = {p.stem: json.loads(p.read_text())["state"] for p in (out / "heartbeat").glob("*.json")}
    assert set(beats) == {"driver-0", "target-0", "trainer-0", "trainer-1", "evaluator-0"}
    assert set(beats.values()) == {"finished"}
    assert "tau chain" in text
    assert not list(Path("/tmp").glob(f"dfray-{job}-*"))  # the job's Ray temp dir went with its processes


def test_a_ray_worker_step_offers_the_jobs_cpus_on_its_node(slurm, tmp_path):
    """What a Ray worker node of `run --launcher slurm` adds to `ray start`, asked inside the srun step
    the head starts on every other node (its options: --overlap, one task per node) of a job of 2
    tasks x 2 CPUs on this 4-CPU node: the job's 4 CPUs on the node (SLURM_CPUS_ON_NODE as slurmstepd
    sets it in the step), not the step's one task's 2 nor the machine's count, which the worker nodes
    offered before (no --num-cpus)."""
    out = tmp_path / "cpus.out"
    ask = "import os; from launcher.slurm_ray import num_cpus_args; print('ARGS', num_cpus_args(os.environ, []))"
    step = f"srun --overlap --nodes=1 --ntasks=1 --ntasks-per-node=1 {sys.executable} -c \"{ask}\""
    job = slurm.run("sbatch", "--parsable", f"--output={out}", f"--chdir={REPO}", "--ntasks=2", "--cpus-per-task=2",
                    f"--wrap={step}").stdout.strip()
    wait_job(slurm, job, 120, log=out)
    assert "ARGS ['--num-cpus', '4']" in out.read_text(), out.read_text()


def test_slurm_rank_environment_from_slurm_variables():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4242",
           "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
    got = slurm_rank_environment(env, ["gpu-a", "gpu-b"], on_gpu=True)
    assert got == {"MASTER_ADDR": "gpu-a", "MASTER_PORT": str(20000 + 4242), "RANK": "5", "WORLD_SIZE": "8",
                   "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "DS_ACCELERATOR": "cuda"}
    # --gpus-per-task=1: Slurm shows each task its one GPU, which is then device 0
    assert slurm_rank_environment({**env, "CUDA_VISIBLE_DEVICES": "3"}, ["gpu-a", "gpu-b"], True)["LOCAL_RANK"] == "0"
    one_node = slurm_rank_environment({**env, "MASTER_PORT": "29999"}, ["cpu-a"], on_gpu=False)
    assert one_node["MASTER_ADDR"] == "127.0.0.1" and one_node["MASTER_PORT"] == "29999"
    assert one_node["DS_ACCELERATOR"] == "cpu"
    assert tasks_per_node({"SLURM_TASKS_PER_NODE": "2(x3),1"}) == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        slurm_rank_environment({"SLURM_NTASKS": "2"}, ["a"], on_gpu=False)
    with pytest.raises(ValueError, match="--slice '2/2'"):
        parse_slice("2/2")
