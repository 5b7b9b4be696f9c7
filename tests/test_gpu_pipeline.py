"""The README's main command on one GPU (configs/tiny_gpu.yaml: every role on the one GPU with
fractional shares) and the `regenerate` stage on the GPU. Marked gpu: `pytest -m gpu` on a CUDA
machine with fla + Triton (README, "On a GPU machine"). A few minutes on one H200."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_pipeline.records import DONE_NAME
from data_pipeline.shard_reader import iter_shard_samples, read_manifest
from tests.conftest import REPO

pytestmark = pytest.mark.gpu

GPU_KERNEL_PATHS = ("fla", "fla_fused", "fla_fused2")


def _env() -> dict:
    # NCCL_DEBUG=INFO: NCCL announces itself in the trainer's output, which Ray forwards to the driver
    return dict(os.environ, PYTHONUNBUFFERED="1", NCCL_DEBUG="INFO", NCCL_NVLS_ENABLE="0",
                RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")


def _cli(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=_env())
    if proc.returncode != 0:
        pytest.fail(f"dflash-dist {args[0]} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    if not torch.cuda.is_available():
        pytest.fail("pytest -m gpu needs a CUDA GPU")
    out = tmp_path_factory.mktemp("tiny_gpu") / "run"
    return out, _cli(["run", "configs/tiny_gpu.yaml", "--out", str(out)], timeout=1500)


def test_gpu_run_captures_on_fla_trains_over_nccl_and_tau_rises(gpu_run) -> None:
    out, proc = gpu_run
    records = read_manifest(out / "shards")
    assert (out / "shards" / DONE_NAME).exists() and len(records) >= 2
    paths = {r.provenance.kernel_path for r in records}
    assert len(paths) == 1 and paths <= set(GPU_KERNEL_PATHS), paths
    assert {r.provenance.dtype for r in records} == {"bfloat16"}
    sample = next(iter_shard_samples(out / "shards" / records[0].name))
    assert sample.features.dtype == torch.bfloat16 and torch.isfinite(sample.features.float()).all()

    logs = proc.stdout + proc.stderr
    assert "NCCL INFO" in logs, "the trainer did not start NCCL"

    evals = sorted((json.loads(p.read_text()) for p in (out / "eval").glob("step_*.json")), key=lambda r: r["step"])
    assert len(evals) >= 3, [r["step"] for r in evals]
    assert {r["kernel_path"] for r in evals} == paths  # the evaluator ran the shards' own path
    taus = [r["tau_chain"] for r in evals]
    assert taus[-1] > taus[0] + 0.5 and taus[-1] > 2.0, taus
    print(f"GPU run: kernel path {paths.pop()}, {len(records)} shards, tau chain per checkpoint {taus}")


def test_regenerate_stage_on_the_gpu(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.fail("pytest -m gpu needs a CUDA GPU")
    out = tmp_path / "regen"
    _cli(["regenerate", "configs/tiny_gpu.yaml", "--out", str(out), "--limit", "12", "regen.max_new_tokens=32",
          "regen.batch_size=6"], timeout=900)
    output = out / "data" / "train.regenerated.jsonl"
    lines = [json.loads(x) for x in output.read_text().splitlines()]
    rejected = out / "data" / "train.regenerated.rejected.jsonl"
    n_rejected = len(rejected.read_text().splitlines()) if rejected.exists() else 0
    assert len(lines) + n_rejected == 12
    prov = json.loads((out / "data" / "train.regenerated.provenance.json").read_text())
    assert prov["runtime"]["kernel_path"] == "fla" and prov["runtime"]["device"].startswith("cuda"), prov["runtime"]
    assert all(m["messages"][-1]["role"] == "assistant" for m in lines)
    print(f"regenerate on GPU: {len(lines)} written, {n_rejected} rejected, runtime {prov['runtime']}")
