"""dflash_dist/trainer/collectives.py: the ranks' messages travel as JSON on real gloo ranks (spawned
processes, local_ranks.run_ranks), exactly as sent; what a rank cannot send raises on every rank
without leaving one in the collective; and a peer's pickle, which torch's `all_gather_object` runs on
arrival (shown first), is refused as not JSON, naming the rank, and never runs."""

from __future__ import annotations

import json
import math
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dflash_dist.actors.local_ranks import run_ranks
from dflash_dist.trainer.collectives import (
    CollectiveJsonError,
    PeerError,
    all_gather_json,
    broadcast_json,
    group_device,
    run_or_stop,
)

if "TORCH_EXTENSIONS_DIR" not in os.environ:  # DeepSpeed's shm op compiles once
    # asked only here: the ranks, which import this module for their functions, inherit the value (run_ranks passes
    # this process's environment), so none of the 10 imports Ray with trainer_group (0.6 s of a core each)
    from dflash_dist.actors.trainer_group import default_extensions_dir

    os.environ["TORCH_EXTENSIONS_DIR"] = default_extensions_dir()

NESTED = {
    "text": 'ascii, ü, €, 😀, a "quote", a \\ and a\nnewline',
    "floats": [0.1, 1 / 3, 1e-310, 1.7976931348623157e308, -2.5, float(np.float32(0.1))],
    "ints": [0, -1, 2**53 + 1, 2**70, -(2**63)],
    "flags": [True, False, None],
    "tuple": (1, "two", (3.0, None)),  # arrives as lists
    "deep": {"a": {"b": [{"c": []}, {}]}, "": ""},
}
ARRIVES = json.loads(json.dumps(NESTED))  # the same with the tuples as lists


def value_of(rank: int):
    """Payloads of different types and lengths (the padding), one per rank."""
    return [NESTED, [[float(np.float32(x)) for x in (0.3, 1.5, 7.0, 1024.0)]] * 50, "", None][rank]


def _exchange(rank: int, world: int) -> dict:
    ctrl = dist.new_group(backend="gloo")  # as Trainer._ctrl under NCCL; here the world is gloo too
    out = {"device": str(group_device(None)), "ctrl_device": str(group_device(ctrl))}
    out["gathered"] = all_gather_json(value_of(rank), None)
    out["gathered_ctrl"] = all_gather_json(value_of(rank), ctrl)
    out["broadcast"] = [broadcast_json(value_of(src) if rank == src else "ignored", src, ctrl) for src in range(world)]
    zero = all_gather_json(-0.0, None)
    out["signs"] = [math.copysign(1.0, z) for z in zero]
    odd = all_gather_json([float("nan"), float("inf"), -float("inf"), rank], None, allow_nan=True)
    out["nonfinite"] = [[repr(x) for x in row] for row in odd]
    return out


def test_values_arrive_exactly_on_every_rank():
    world = 4
    got = run_ranks(_exchange, world)
    sent = [json.loads(json.dumps(value_of(r))) for r in range(world)]
    assert sent[0] == ARRIVES and ARRIVES["tuple"] == [1, "two", [3.0, None]]
    for rank, out in enumerate(got):
        assert out["device"] == out["ctrl_device"] == "cpu"
        assert out["gathered"] == out["gathered_ctrl"] == sent, rank
        assert out["broadcast"] == sent, rank
        assert out["signs"] == [-1.0] * world  # -0.0 stays negative
        assert out["nonfinite"] == [["nan", "inf", "-inf", repr(r)] for r in range(world)]
    floats = got[1]["gathered"][0]["floats"]
    assert [x.hex() for x in floats] == [x.hex() for x in NESTED["floats"]]  # bit for bit


def _unsendable(rank: int, world: int) -> dict:
    """Rank 1 sends what JSON cannot carry, one case after the other; every rank catches what it
    raised, and a last exchange shows the group still in step. The message limit is lowered to 4 KiB
    in both ranks for the over-long case."""
    from dflash_dist.trainer import collectives

    collectives.MAX_MESSAGE_BYTES = 4096
    cases = {
        "int_key": {"counts": {1: "one"}},
        "tensor": torch.ones(2),
        "nan": [1.0, float("nan")],
        "set": {"a": {1, 2}},
        "surrogate": {"shard": os.fsdecode(b"caf\xe9.tar")},  # a file name's undecodable byte: no UTF-8
        "too_long": {"rows": "x" * 5000},
    }
    out = {}
    for name, bad in cases.items():
        try:
            all_gather_json(bad if rank == 1 else "fine", None, what=name)
            out[name] = "no error"
        except CollectiveJsonError as e:
            out[name] = str(e)
    try:
        broadcast_json(torch.ones(1) if rank == 1 else None, src=1, what="broadcast tensor")
        out["broadcast"] = "no error"
    except CollectiveJsonError as e:
        out["broadcast"] = str(e)
    out["after"] = all_gather_json(rank, None)
    return out


def test_a_value_json_cannot_carry_raises_on_every_rank_and_no_rank_hangs():
    got = run_ranks(_unsendable, 2, timeout_s=120)
    sender, peer = got[1], got[0]
    assert "rank 1: its int_key cannot be sent as JSON: value['counts'] has the key 1 (int)" in sender["int_key"]
    assert "rank 1: its tensor cannot be sent as JSON: TypeError: Object of type Tensor" in sender["tensor"]
    assert "rank 1: its nan cannot be sent as JSON: ValueError: Out of range float values" in sender["nan"]
    assert "rank 1: its set cannot be sent as JSON: TypeError: Object of type set" in sender["set"]
    assert "rank 1: its surrogate cannot be sent as JSON: UnicodeEncodeError: " in sender["surrogate"]
    assert "rank 1: its broadcast tensor cannot be sent as JSON" in sender["broadcast"]
    assert (
        "rank 1: its too_long cannot be sent as JSON: its JSON is 5011 bytes, over MAX_MESSAGE_BYTES (4096"
        in (sender["too_long"])
    )
    for name in ("int_key", "tensor", "nan", "set", "surrogate", "too_long", "broadcast tensor"):
        key = "broadcast" if name.startswith("broadcast") else name
        assert peer[key] == f"rank 1 could not send its {name} as JSON (its own error says why)"
    assert sender["after"] == peer["after"] == [0, 1]


BAD_NAME = os.fsdecode(b"/data/caf\xe9.tar")  # a file name with a byte that is not UTF-8


def _stop_together(rank: int, world: int) -> dict:
    """run_or_stop with the work failing on rank 1, on rank 0, on both, on none; every rank catches
    what it raised, and a last exchange shows the group still in step."""
    failing = {"rank_1": {1}, "rank_0": {0}, "both": {0, 1}, "none": set()}
    out = {}
    for name, ranks in failing.items():

        def work(name=name, ranks=ranks) -> str:
            if rank in ranks:
                raise ValueError(f"{BAD_NAME}: truncated ({name}, rank {rank})")
            return f"done {name}"

        def stop(failed: str) -> PeerError:
            return PeerError(f"rank {rank} stops: {failed}")

        try:
            out[name] = {"value": run_or_stop(work, None, stop)}
        except Exception as e:  # noqa: BLE001 - the outcome under test
            out[name] = {"type": type(e).__name__, "text": str(e)}
    out["after"] = all_gather_json(rank, None)
    return out


def test_run_or_stop_raises_on_every_rank_with_the_failed_ranks_text():
    """The failed rank raises its own error, its peer a PeerError naming it with its text, even when
    that text names a file whose name is not UTF-8 (it used to raise UnicodeEncodeError before the
    error exchange on the failed rank, leaving its peer in it)."""
    r0, r1 = run_ranks(_stop_together, 2, timeout_s=60)
    shown = BAD_NAME.encode("utf-8", "backslashreplace").decode()  # /data/caf\udce9.tar
    assert r1["rank_1"] == {"type": "ValueError", "text": f"{BAD_NAME}: truncated (rank_1, rank 1)"}
    assert r0["rank_1"] == {"type": "PeerError", "text": f"rank 0 stops: rank 1: ValueError: {shown}: truncated "
                                                         "(rank_1, rank 1)"}  # fmt: skip
    assert r0["rank_0"]["type"] == "ValueError" and r1["rank_0"]["type"] == "PeerError"
    assert r1["rank_0"]["text"] == f"rank 1 stops: rank 0: ValueError: {shown}: truncated (rank_0, rank 0)"
    assert [r["both"]["type"] for r in (r0, r1)] == ["ValueError", "ValueError"]
    assert r0["none"] == {"value": "done none"} and r1["none"] == {"value": "done none"}
    assert r0["after"] == r1["after"] == [0, 1]


class Payload:
    """What a hostile peer sends: unpickling it runs `touch <flag>`."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def _raw_gather(data: bytes) -> None:
    """A peer speaking collectives.py's wire format (lengths, then padded bytes) with bytes of its choosing."""
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64))
    buf = torch.zeros(max(int(t) for t in lengths), dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.all_gather([torch.empty_like(buf) for _ in lengths], buf)


def _raw_broadcast(data: bytes, src: int) -> None:
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=src)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=src)


def _hostile_peer(rank: int, world: int, old_flag: str, new_flag: str) -> dict:
    out = {}
    # torch's object collective, as the trainer used it: every rank unpickles the peer's bytes
    got: list = [None] * world
    dist.all_gather_object(got, Payload(old_flag) if rank == 1 else "state", group=None)
    out["old_ran"] = Path(old_flag).exists()
    dist.barrier()
    # the same payload as bytes on collectives.py's wire format
    payload = pickle.dumps(Payload(new_flag))
    for kind in ("gather", "broadcast", "huge"):
        try:
            if rank == 1 and kind == "huge":  # a length of 1 TiB announced, no bytes sent
                dist.all_gather(
                    [torch.zeros(1, dtype=torch.int64) for _ in range(world)], torch.tensor([2**40], dtype=torch.int64)
                )
                out[kind] = "sent"
            elif kind == "huge":
                out[kind] = f"got {all_gather_json('state', None, what='trainer state')}"
            elif rank == 1 and kind == "gather":
                _raw_gather(payload)
                out[kind] = "sent"
            elif rank == 1:
                _raw_broadcast(payload, src=1)
                out[kind] = "sent"
            elif kind == "gather":
                out[kind] = f"got {all_gather_json('state', None, what='trainer state')}"
            else:
                out[kind] = f"got {broadcast_json(None, src=1, what='conversion error')}"
        except CollectiveJsonError as e:
            out[kind] = str(e)
    out["after"] = all_gather_json(rank, None)
    return out


def test_a_peers_pickle_is_refused_as_not_json_and_never_runs(tmp_path):
    old_flag, new_flag = tmp_path / "ran_by_all_gather_object", tmp_path / "ran_by_all_gather_json"
    got = run_ranks(_hostile_peer, 2, (str(old_flag), str(new_flag)), timeout_s=120)
    victim = got[0]
    assert victim["old_ran"] and old_flag.exists(), "all_gather_object ran the peer's payload (the threat)"
    n = len(pickle.dumps(Payload(str(new_flag))))
    assert victim["gather"].startswith(f"rank 1 sent a trainer state of {n} bytes that is not a JSON document"), victim
    assert victim["broadcast"].startswith(f"rank 1 sent a conversion error of {n} bytes that is not a JSON document")
    assert "refused, nothing of it was run" in victim["gather"]
    assert victim["huge"].startswith(
        f"rank 1 announced a trainer state of {2**40} bytes (the limit is 67108864): "
        "not a message of this code, refused before anything was allocated"
    ), victim
    assert not new_flag.exists(), "the payload ran"
    assert victim["after"] == got[1]["after"] == [0, 1]


def test_the_trainer_state_survives_the_trip_and_restores_the_rngs(single_rank_gloo):
    """TrainState.state_dict through all_gather_json: the same JSON on arrival, and loading it
    continues every RNG stream (torch, Python, NumPy) where the sender's would. A state saved by
    earlier versions (torch RNG as a uint8 tensor, Python's as tuples) still loads."""
    from dflash_dist.trainer import checkpoint
    from dflash_dist.trainer.state import TrainState

    torch.manual_seed(11)
    random.seed(12)
    np.random.seed(13)
    np.random.randn()  # NumPy now holds a cached gaussian
    state = TrainState(step=7, samples_seen=56, source={"version": 1, "epoch": 0, "reader": None})
    sent = state.state_dict(on_gpu=False)
    (arrived,) = all_gather_json(sent, None, what="trainer state")
    assert arrived == json.loads(json.dumps(sent))
    expected = (torch.rand(4).tolist(), random.random(), np.random.randn(3).tolist())

    for form in ("arrived", "earlier version"):
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        restored = TrainState()
        if form == "earlier version":
            rng = dict(arrived["rng"])
            rng["torch"] = torch.tensor(rng["torch"], dtype=torch.uint8)
            version, internal, gauss = rng["python"]
            rng["python"] = (version, tuple(internal), gauss)
            arrived = {**arrived, "rng": rng}
        restored.load_state_dict(arrived)
        assert (restored.step, restored.samples_seen, restored.source) == (7, 56, state.source)
        assert (torch.rand(4).tolist(), random.random(), np.random.randn(3).tolist()) == expected, form
    assert checkpoint.rng_state(False)["cuda"] is None


@pytest.mark.parametrize("bad", [b"\x80\x81", b'{"a": 1', b"[1, 2] trailing", b"NaN", b"[" * 100_000])
def test_what_is_not_a_json_document_is_named(bad):
    """The decoder alone (no ranks): bad UTF-8, a cut document, trailing bytes, a NaN where none is
    allowed, nesting deeper than the parser takes."""
    from dflash_dist.trainer.collectives import _decode

    with pytest.raises(CollectiveJsonError, match=r"^rank 3 sent a row of \d+ bytes that is not a JSON document"):
        _decode(bad, 3, "row", allow_nan=False)
