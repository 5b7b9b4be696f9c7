"""The CLI ends a failed pipeline run with one clear line and a nonzero exit, never a raw traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_dist.orchestration.pipeline import failure_text
from launcher.cli import main


def test_an_unexpected_error_is_one_line_and_exit_1(tmp_path, capsys):
    """A target directory whose config.json is cut short: transformers raises OSError inside the
    pipeline (no PipelineError); the CLI prints what and where, and exits 1."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"model_type": "qwen3", "vocab_size": ')
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "yo"}]}) + "\n")
    rc = main(["eval", "configs/tiny.yaml", "--out", str(tmp_path / "out"), "target.kind=hf",
               f"target.path={target}", f"data.train_path={data}", f"data.eval_path={data}"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "dflash-dist eval: error: OSError: " in err and str(target / "config.json") in err
    assert "Traceback" not in err


def test_a_ray_task_error_is_shown_as_its_cause():
    """What ray.get raises for an actor's error carries the remote traceback as its text: the
    message shows the cause's type and message instead."""
    from ray.exceptions import RayTaskError

    from dflash_dist.evaluator.server import ServerError

    cause = ServerError("http://127.0.0.1:9/generate: HTTP 503: b'down'")
    err = RayTaskError("EvaluatorActor.wait", "Traceback (most recent call last):\n  File ...", cause)
    err = err.as_instanceof_cause()
    with pytest.raises(ServerError):
        raise err
    assert failure_text(err) == "ServerError: http://127.0.0.1:9/generate: HTTP 503: b'down'"
    assert failure_text(ValueError("plain")) == "ValueError: plain"


def test_build_target_on_an_hf_config_says_it_builds_only_the_projects_own_targets(tmp_path, monkeypatch, capsys):
    """A real-target config's data files need not exist for build-target (it reads no data): the
    refusal names target.kind, not a missing data.train_path."""
    config = Path(__file__).resolve().parents[1] / "configs" / "qwen3-8b.yaml"
    monkeypatch.chdir(tmp_path)  # the config's relative data/train.jsonl is not here
    assert main(["build-target", str(config)]) == 2
    err = capsys.readouterr().err
    assert "target.kind is hf" in err and "data.train_path" not in err


def test_extract_refuses_a_checkpoint_path_as_resume(tmp_path, capsys):
    """extract trains nothing: `--resume PATH` (a checkpoint tag, for run and train) is refused, not taken as auto."""
    rc = main(["extract", "configs/tiny.yaml", "--out", str(tmp_path / "out"), "--resume", str(tmp_path / "step_50")])
    err = capsys.readouterr().err
    assert rc == 2 and "--resume takes auto or never" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cmd", ["run", "train"])
def test_launcher_slurm_outside_a_job_says_which_script_to_submit(cmd, tmp_path, monkeypatch, capsys):
    """`run --launcher slurm` belongs in pipeline.sbatch (the batch script itself, not an srun step),
    `train --launcher slurm` in train.sbatch's srun: outside a job the error names the scripts."""
    for key in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(key, raising=False)
    assert main([cmd, "--launcher", "slurm", "configs/tiny.yaml", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "not inside a Slurm job" in err and "slurm/pipeline.sbatch" in err and "slurm/train.sbatch" in err
