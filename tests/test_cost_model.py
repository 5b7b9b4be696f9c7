"""bench/cost_model.py: the world-size-N estimate's arithmetic (both gradient reductions,
train.zero_grad_reduce, and bench/zero_buckets.py's timeline) and its optimizer measurement on a 1/N
slice of the drafter's tensors through a real DeepSpeed engine (CPU, gloo, tiny shape). Its bytes and
calls against a real multi-rank engine: tests/test_measure_comm.py."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

from dflash_dist.actors.trainer_group import default_extensions_dir

os.environ.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())  # DeepSpeed's shm op compiles once
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import cost_model  # noqa: E402
import zero_buckets  # noqa: E402

P = 1.73e9  # the 27B drafter's trainable parameters


def test_bus_bandwidth_of_placements():
    assert cost_model.bus_gbps((9,), 450, 50, 0.8) == pytest.approx(360)
    assert cost_model.bus_gbps((5, 4), 450, 50, 0.8) == pytest.approx(160)  # 4 NICs carry the crossings
    assert cost_model.bus_gbps((8, 1), 450, 50, 0.8) == pytest.approx(40)  # the lone rank's one NIC


def test_estimate_counts_ring_bytes_and_what_hides():
    x = cost_model.Inputs(fwd_ms=100, bwd_ms=100, opt_ms=5, params=P, world=9, grad_accum=2, tail_params=0)
    fast = cost_model.estimate(x, 360)
    ring_gb = 8 / 9 * 2 * P / 1e9  # (N-1)/N of the bf16 buffer per rank: the all-gather
    assert fast["grad_reduce_gb_per_micro"] == pytest.approx(2 * ring_gb)  # an all-reduce: twice that
    assert fast["all_gather_gb_per_step"] == pytest.approx(ring_gb)
    assert fast["all_gather_ms"] == pytest.approx(ring_gb / 360 * 1e3)
    assert fast["reduce_hidden"] and fast["reduce_exposed_ms"] == 0
    assert fast["step_ms"] == pytest.approx(2 * 200 + 5 + fast["all_gather_ms"])
    assert fast["samples_per_s_per_gpu"] == pytest.approx(2 / fast["step_ms"] * 1e3)
    slow = cost_model.estimate(x, 20)  # 308 ms of all-reduce per micro-batch: longer than the backward
    assert not slow["reduce_hidden"]
    assert slow["reduce_exposed_ms"] == pytest.approx(slow["grad_reduce_ms"] - 100)
    tail = cost_model.estimate(cost_model.Inputs(100, 100, 5, P, 9, tail_params=25600 * 5120), 360)
    assert tail["reduce_exposed_ms"] == pytest.approx(2 * 8 / 9 * 2 * 25600 * 5120 / 360e9 * 1e3)  # fc: after
    assert cost_model.estimate(cost_model.Inputs(100, 100, 5, P, 1), 360)["all_gather_ms"] == 0  # one rank


def test_reduce_mode_prices_each_destinations_share():
    """train.zero_grad_reduce=reduce: one reduce per destination of its 1/N share, M bytes of bus each:
    2P per micro-batch (the all-reduce's 2(N-1)/N x 2P: 1.78x that at 9 ranks)."""
    ar, rd = cost_model.step_bytes(P, 9), cost_model.step_bytes(P, 9, "reduce")
    assert rd["grad_reduce"] == pytest.approx(2 * P) and ar["grad_reduce"] == pytest.approx(16 / 9 * 2 * P)
    assert rd["param_gather"] == ar["param_gather"]
    x = cost_model.Inputs(fwd_ms=100, bwd_ms=100, opt_ms=5, params=P, world=9, grad_accum=2, tail_params=0)
    slow = cost_model.estimate(x, 20, "reduce")  # no buckets: ideally overlapped
    assert slow["grad_reduce_ms"] == pytest.approx(2 * P / 20e9 * 1e3)  # 173 ms > the backward
    assert slow["reduce_exposed_ms"] == slow["ideal_exposed_ms"] == pytest.approx(slow["grad_reduce_ms"] - 100)


def test_timeline_waits_for_earlier_reductions_and_the_reduce_paths_syncs():
    """zero_buckets.backward_ms on two buckets of 10 ms of backward each: the all-reduce overlaps the
    next bucket's backward (the compute stream waits only for reductions issued before its bucket);
    the reduce path's device sync before each call stalls the backward behind all but a bucket's
    last reduce."""
    two = [zero_buckets.Bucket(10, (4, 6)), zero_buckets.Bucket(10, (10,))]
    call = float  # 1 ms per element
    # compute 0-10, calls 10-14-20; compute 10-20; its call 20-30 (the end: 30)
    assert zero_buckets.backward_ms(two, 20, call) == 30
    # sync at 10, call 10-14; the host waits to 14, call 14-20; compute only from 14 (the host) to 24, call 24-34
    assert zero_buckets.backward_ms(two, 20, call, host_sync=True) == 34
    assert zero_buckets.backward_ms(two, 20, call, sync_ms=0.5, host_sync=True) == 35.5  # 3 syncs, one hidden
    # three buckets, long calls: the third bucket's backward waits for the first bucket's reduction
    three = [zero_buckets.Bucket(10, (15,))] * 3
    # compute 0-10, call 10-25; compute 10-20, call 25-40; compute from 25 (waits) to 35, call 40-55
    assert zero_buckets.backward_ms(three, 30, call) == 55


def test_drafter_buckets_follow_the_training_backward():
    """The 27B drafter's buckets at 9 ranks: every gradient element once in both modes, fc last (the
    backward's last gradient, the first layer), the MLP matrices alone (each > H^2); the reduce path
    issues more, smaller calls (a bucket's slices go to up to N destinations)."""
    shape = [5120, 5, 32, 8, 128, 17408]
    total = sum(math.prod(s) for s in cost_model.drafter_shapes(*shape))
    order = cost_model.gradient_order(5)
    assert order[-1] == "fc.weight" and order[1] == "layers.4.mlp.down_proj.weight"
    got = {m: cost_model.drafter_buckets(shape, 9, m) for m in zero_buckets.MODES}
    for buckets in got.values():
        assert sum(sum(b.calls) for b in buckets) == sum(b.numel for b in buckets) == total
        assert buckets[-1].numel == 25600 * 5120
        assert sum(b.numel == 17408 * 5120 for b in buckets) == 15
    calls = {m: sum(len(b.calls) for b in got[m]) for m in got}
    assert calls["allreduce"] < calls["reduce"], calls
    assert [b.numel for b in got["allreduce"]] == [b.numel for b in got["reduce"]]


def test_main_prints_each_placement(capsys):
    """Both gradient reductions per placement, on the 27B drafter's buckets: the reduce path moves
    0.56x the bytes at 9 ranks, yet exposes more where the all-reduce hides (one NVLink domain:
    its device syncs), less where the all-reduce is longer than the backward (8+1)."""
    assert cost_model.main(["--fwd-ms", "105", "--bwd-ms", "100", "--opt-ms", "4", "--params", "1.73e9"]) == 0
    out = capsys.readouterr().out
    rows = {}
    for placement in ("9 per node", "5+4 per node", "8+1 per node"):
        lines = [line for line in out.splitlines() if placement in line]
        assert [("gradient allreduce" in line, "gradient reduce" in line) for line in lines] == [(1, 0), (0, 1)]
        rows[placement] = [float(line.split("-> ")[1].split()[0]) for line in lines]  # samples/s per GPU
    assert rows["9 per node"][0] > rows["9 per node"][1] and rows["8+1 per node"][0] < rows["8+1 per node"][1]
    with pytest.raises(SystemExit, match="does not add up"):
        cost_model.main(["--fwd-ms", "1", "--bwd-ms", "1", "--opt-ms", "1", "--params", "1", "--placements", "4+4"])


def test_measured_optimizer_step_on_a_slice(single_rank_gloo, tmp_path):
    """The three steps run on a 1/N slice of a tiny drafter's tensors through DeepSpeed (CPU), and main
    feeds the measured lean step (the GPU default) into the estimate."""
    shapes = cost_model.drafter_shapes(64, 2, 4, 2, 16, 128, k=3)
    assert shapes[0] == (64, 3 * 64)  # fc first: [H, k*H]
    full = sum(math.prod(s) for s in shapes)
    got = cost_model.measure_opt(shapes, world=4, steps=2, device="cpu", hidden=64)
    assert full / 4 <= got["params"] <= full / 4 + 64 * len(shapes)
    assert got["deepspeed_ms"] > 0 and got["lean_ms"] > 0 and got["fused_ms"] > 0


def test_cli_measures_the_optimizer_on_cpu(tmp_path):
    """`--measure-opt --device cpu` from the command line: the script sets up its own one-rank gloo group
    (it used to pass no group to DeepSpeed on CPU and die in deepspeed.initialize) and feeds the
    measured step into the estimate and its JSON."""
    import json
    import subprocess

    from dflash_dist.actors.ports import free_ports

    env = {**os.environ, "MASTER_PORT": str(free_ports(1, "127.0.0.1")[0])}
    out = tmp_path / "cost.json"
    args = "--measure-opt --device cpu --shape 64,2,4,2,16,128 --world 4 --placements 4 --fwd-ms 1 --bwd-ms 1"
    args += f" --params 1e6 --opt-steps 2 --json {out}"
    script = str(Path(cost_model.__file__))
    proc = subprocess.run([sys.executable, script, *args.split()], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "optimizer step on a 1/4 slice" in proc.stdout
    got = json.loads(out.read_text())
    assert got["measured_opt"]["lean_ms"] > 0 and got["estimates"]


def test_the_one_rank_group_listens_on_loopback_only(tmp_path):
    """`--measure-opt` starts its own one-rank group; its store listened on every interface (torch's
    env:// rendezvous binds the wildcard address whatever MASTER_ADDR says), reachable from the
    network for as long as the bench ran. It now goes through actors/rendezvous.py: every socket the
    process listens on is on 127.0.0.1."""
    import json
    import subprocess

    from dflash_dist.actors.ports import free_ports

    port = free_ports(1, "127.0.0.1")[0]
    code = (
        "import json, os, sys; sys.path.insert(0, 'bench'); import cost_model; "
        "cost_model._init_single_rank('cpu'); from tests.test_rendezvous import listening_sockets; "
        "print(json.dumps(listening_sockets(os.getpid())))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME")}
    env.update(MASTER_PORT=str(port), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    listening = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ["127.0.0.1", port] in listening and all(host == "127.0.0.1" for host, _ in listening), listening
