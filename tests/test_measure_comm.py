"""bench/measure_comm.py: the collectives the trainer's ZeRO-2 engine issues and the bytes gloo sends at
2 and 3 ranks in both gradient reductions (train.zero_grad_reduce), against bench/cost_model.py's
bytes and bench/zero_buckets.py's calls (real DeepSpeed engines, CPU, gloo, tiny shape)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from dflash_dist.actors.trainer_group import default_extensions_dir

os.environ.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())  # DeepSpeed's shm op compiles once
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import cost_model  # noqa: E402
import measure_comm  # noqa: E402

COMM_SHAPE = (128, 2, 4, 2, 32, 256)  # H, layers, heads, kv_heads, head_dim, I: 344960 parameters, k=3


def test_gloo_bytes_of_each_reduction():
    """gloo's all-reduce is a ring (the bus bytes); its reduce sends (N-1)/N x (1 + 1/N) per rank."""
    assert measure_comm.gloo_sent("reduce", 1000, 2) == pytest.approx(750)
    assert measure_comm.gloo_sent("allreduce", 1000, 2) == pytest.approx(1000)
    assert measure_comm.gloo_sent("reduce", 900, 3) == pytest.approx(800)


@pytest.fixture(scope="module")
def measured():
    """measure_comm's counts by (world, mode): both modes of a world size measured on one group of rank
    processes (measure_modes), the first time a test asks for that world size."""
    got: dict[tuple[int, str], dict] = {}

    def at(world: int, mode: str) -> dict:
        if (world, mode) not in got:
            shapes = cost_model.drafter_shapes(*COMM_SHAPE, k=3)
            for one in measure_comm.measure_modes(shapes, world, hidden=COMM_SHAPE[0], grad_accum=2):
                got[(world, one["mode"])] = one
        return got[(world, mode)]

    return at


@pytest.mark.parametrize("mode", ["allreduce", "reduce"])
@pytest.mark.parametrize("world", [2, 3])
def test_model_bytes_are_what_the_engine_moves(world, mode, measured):
    """The trainer's GPU ZeRO-2 engine (its deepspeed_config, bf16, overlap_comm, the lean step) at
    `world` gloo ranks with train.zero_grad_reduce=`mode`: DeepSpeed's comms logger records, per
    micro-batch, all-reduces (not a reduce-scatter) or reduces over the whole bf16 gradient, call by
    call the sizes zero_buckets predicts, and after the step one all-gather of the bf16 partitions;
    their bus bytes per rank are the model's, and the bytes each rank's gloo sockets sent are gloo's
    algorithm's plus its headers. With the reduce-scatter the model used to assume, the all-reduce's
    gradient bytes would be half of both."""
    got = measured(world, mode)
    assert got["mode"] == mode and got["world"] == world
    params = got["params"]
    model = cost_model.step_bytes(params, world, mode)
    wire = measure_comm.gloo_sent(mode, 2 * params, world)
    op = cost_model.GRAD_OPS[mode]
    for rank in got["ranks"]:
        assert rank["step"] == "lean" and rank["param_dtypes"] == ["torch.bfloat16"]
        assert list(rank["phases"]) == ["micro1", "micro2", "step"]
        for name in ("micro1", "micro2"):  # ZeRO-2 reduces at every backward, not only at the boundary
            phase = rank["phases"][name]
            assert list(phase["ops"]) == [op], (name, phase["ops"])
            assert sum(size * n for size, n in phase["ops"][op].items()) == 2 * params  # bf16, all of it
            assert phase["ops"][op] == got["model_calls"]
            assert phase["bus_bytes"] == pytest.approx(model["grad_reduce"], rel=1e-12)
            assert 1.0 <= phase["wire_bytes"] / wire < 1.06, (name, phase["wire_bytes"], wire)
        step = rank["phases"]["step"]
        assert step["ops"].pop("all_reduce") == {4: 1}  # the lean step's fp32 gradient norm
        (shards,) = step["ops"].values()
        assert list(step["ops"]) == [cost_model.PARAM_GATHER]
        # each rank's bf16 partition (both parameter groups), padded to a multiple of the world size
        assert 0 <= sum(shards) * world - 2 * params <= 2 * 2 * world
        assert step["bus_bytes"] == pytest.approx(model["param_gather"], rel=1e-4)
        assert 1.0 <= step["wire_bytes"] / model["param_gather"] < 1.02, step["wire_bytes"]
    lines = measure_comm.comm_report(got)
    assert lines[0].startswith(f"world {world}, {params} parameters, gradient {mode}") and len(lines) == 4
    assert "calls = model's" in lines[1] and "calls = model's" in lines[2]


def test_cli_prints_and_writes_the_counts(tmp_path):
    """`python bench/measure_comm.py` from the command line (its ranks' function lives in the script
    run as __main__): each phase's collectives beside the model's bytes, and the counts in its JSON."""
    import subprocess

    out = tmp_path / "comm.json"
    args = ["--worlds", "2", "--shape", "64,1,2,1,16,64", "--grad-reduce", "allreduce", "--json", str(out)]
    script = str(Path(measure_comm.__file__))
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 2, " in proc.stdout and "model gradient allreduce" in proc.stdout and "1.0000x" in proc.stdout
    (got,) = json.loads(out.read_text())
    assert got["world"] == 2 and got["mode"] == "allreduce" and len(got["ranks"]) == 2
    assert got["ranks"][0]["phases"]["micro1"]["ops"]["all_reduce"] == got["model_calls"]  # JSON: str keys
    with pytest.raises(SystemExit, match="--shape needs 6 numbers"):
        measure_comm.main(["--shape", "64,1"])
