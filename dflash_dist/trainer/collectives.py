"""The ranks' small messages to each other as JSON, never pickled.

torch.distributed's object collectives (`all_gather_object`, `broadcast_object_list`, ...) pickle
what a rank sends and unpickle what arrives from its peers: bytes off the network (gloo or NCCL
connections, found through the rendezvous store) that run code when loaded. Here a value travels
as JSON text: each rank encodes its value to UTF-8, the lengths go first as an int64 tensor, then
the bytes padded to the longest as one uint8 tensor, and each arrival is read with `json.loads`,
which builds data only. Bytes that are not a JSON document raise `CollectiveJsonError` naming the
rank that sent them, on every rank (every rank holds the same bytes).

What arrives is what JSON holds: dicts with str keys, lists, str, int, float, bool, None. A tuple
arrives as a list. A dict key that is not a str is refused when sending (JSON would turn 1 into
"1" silently), and so is any other type (tensors, sets, numpy scalars other than float64). Floats
round-trip exactly (written as their repr), -0.0 included. NaN and +-Infinity travel only where the
caller says so (`allow_nan=True`: Python's json writes and reads them as NaN/Infinity, which strict
JSON readers refuse); otherwise they are refused when sending and when read. A rank whose value
cannot be sent still takes part, with the length -1, so every rank raises, none is left waiting in
the collective.

The tensors live where the group's backend moves them: on the CPU for gloo (the trainer's control
group, `Trainer._ctrl`), on the rank's current CUDA device for NCCL.

Work that may fail on some ranks before a collective every rank enters (rank 0 publishing a
checkpoint, one rank reading its data) runs under `run_or_stop` / `all_reduce_or_stop`: a failure
rides in the agreement's all-reduce instead of leaving the peers in the next collective (until the
group's timeout, or for as long as the failed rank's process lives), and every rank raises there,
the failed ranks their own error, the others a `PeerError` carrying its text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
UNSENDABLE = -1  # the length a rank sends when its own value cannot be encoded
# The largest message a rank sends or accepts. A length is announced before the bytes, and every rank
# allocates the longest announced one: a peer (or anything else on the group's connections) announcing
# 2**62 bytes would otherwise make every rank try to allocate it. The trainer's messages are a trainer
# state (RNG states and the data position: tens of KB) and a step's per-sample rows.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class CollectiveJsonError(RuntimeError):
    """A value could not be sent as JSON, or what a rank sent is not a JSON document."""


class PeerError(RuntimeError):
    """Another rank failed at a point every rank passes together (its own error names the file and
    the fix, and this one carries its text); this rank stops with it instead of waiting for that
    rank in the next collective."""

    names_nothing = True  # the trainer group reports the failed rank's own error (trainer_group._classify)


def all_gather_json(value: Any, group: Any = None, *, what: str = "value", allow_nan: bool = False) -> list[Any]:
    """Every rank's `value` (in the group's rank order), as JSON carries it (module docstring).
    `what` names the value in errors."""
    device = group_device(group)
    data, problem = _encode(value, allow_nan)
    own = torch.tensor([UNSENDABLE if data is None else len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(own) for _ in range(dist.get_world_size(group))]
    dist.all_gather(lengths, own, group=group)
    sizes = [int(t.item()) for t in lengths]
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    for rank, size in zip(ranks, sizes):
        _check_size(size, rank, what, problem if rank == dist.get_rank() else None)
    buf = _padded(data, max(sizes), device)
    parts = [torch.empty_like(buf) for _ in sizes]
    dist.all_gather(parts, buf, group=group)
    return [_decode(_bytes(p, n), rank, what, allow_nan) for p, n, rank in zip(parts, sizes, ranks)]


def broadcast_json(value: Any, src: int, group: Any = None, *, what: str = "value", allow_nan: bool = False) -> Any:
    """Rank `src`'s `value` (a global rank, as torch.distributed.broadcast takes it) on every rank
    of the group, as JSON carries it; the other ranks' `value` is ignored."""
    device = group_device(group)
    data, problem = _encode(value, allow_nan) if dist.get_rank() == src else (b"", None)
    length = torch.tensor([UNSENDABLE if data is None else len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    size = int(length.item())
    _check_size(size, src, what, problem)
    buf = _padded(data if dist.get_rank() == src else None, size, device)
    dist.broadcast(buf, src=src, group=group)
    return _decode(_bytes(buf, size), src, what, allow_nan)


def all_reduce_or_stop(
    vec: torch.Tensor, read: Callable[[torch.Tensor], T], group: Any, stop: Callable[[str], PeerError]
) -> T:
    """`read(vec)`: this rank's part written into `vec` (its value returned), then `vec` all-reduced
    (SUM) in place; the last entry is the failure flag. A rank whose `read` raised sets it instead
    of raising before the collective; then every rank stops here: the failed ranks raise their own
    error (type and traceback kept), the others `stop(failed)`, where `failed` reads "rank R:
    Type: message" for each failed rank."""
    own: Exception | None = None
    value = None
    try:
        value = read(vec)
    except Exception as e:  # noqa: BLE001 - raised below on this rank, named on the others
        own, vec[-1] = e, 1
    dist.all_reduce(vec, group=group)
    if vec[-1]:
        _raise_together(own, group, stop)
    return value


def run_or_stop(fn: Callable[[], T], group: Any, stop: Callable[[str], PeerError]) -> T:
    """`fn()` on this rank (a rank with nothing to do passes one that does nothing), then one
    all-reduce of a failure flag: every rank returns, or every rank raises (all_reduce_or_stop).
    It also orders: no rank returns before every rank's `fn` ended."""
    flag = torch.zeros(1, dtype=torch.int64, device=group_device(group))
    return all_reduce_or_stop(flag, lambda _: fn(), group, stop)


def _raise_together(own: Exception | None, group: Any, stop: Callable[[str], PeerError]) -> NoReturn:
    # sendable whatever it names: a file name's undecodable bytes (lone surrogates) as \udcXX
    own_text = None if own is None else f"{type(own).__name__}: {own}".encode("utf-8", "backslashreplace").decode()
    texts = all_gather_json(own_text, group, what="error")
    if own is not None:
        raise own
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    raise stop("; ".join(f"rank {r}: {t}" for r, t in zip(ranks, texts) if t is not None))


def group_device(group: Any = None) -> torch.device:
    """Where a collective's tensors must be for this group: the current CUDA device for NCCL, the
    CPU otherwise (gloo; a mixed `cpu:gloo,cuda:nccl` group moves CPU tensors through gloo)."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(value: Any, allow_nan: bool) -> tuple[bytes | None, str | None]:
    """(UTF-8 JSON of value, None), or (None, why it cannot be sent)."""
    bad_key = _non_str_key(value)
    if bad_key is not None:
        return None, bad_key
    try:
        # a str with a lone surrogate (a file name's undecodable bytes, os.fsdecode) has no UTF-8:
        # UnicodeEncodeError, a ValueError, refused here like any other value JSON cannot carry
        data = json.dumps(value, allow_nan=allow_nan, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as e:
        return None, f"{type(e).__name__}: {e}"
    if len(data) > MAX_MESSAGE_BYTES:
        return None, (
            f"its JSON is {len(data)} bytes, over MAX_MESSAGE_BYTES ({MAX_MESSAGE_BYTES}, "
            "dflash_dist/trainer/collectives.py); send less (these messages carry states and step rows)"
        )
    return data, None


def _non_str_key(value: Any) -> str | None:
    """Where `value` has a dict key that is not a str (JSON would turn it into one), or None."""
    stack = [(value, "value")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    return f"{path} has the key {k!r} ({type(k).__name__}); JSON keys are str (it would arrive as one)"
                if isinstance(x, (dict, list, tuple)):
                    stack.append((x, f"{path}[{k!r}]"))
        elif isinstance(v, (list, tuple)):
            stack.extend((x, f"{path}[{i}]") for i, x in enumerate(v) if isinstance(x, (dict, list, tuple)))
    return None


def _check_size(size: int, rank: int, what: str, own_problem: str | None) -> None:
    if size == UNSENDABLE:
        if own_problem is not None:
            raise CollectiveJsonError(f"rank {rank}: its {what} cannot be sent as JSON: {own_problem}")
        raise CollectiveJsonError(f"rank {rank} could not send its {what} as JSON (its own error says why)")
    if size < 0 or size > MAX_MESSAGE_BYTES:
        raise CollectiveJsonError(
            f"rank {rank} announced a {what} of {size} bytes (the limit is {MAX_MESSAGE_BYTES}): not a message of "
            "this code, refused before anything was allocated; every rank of a run must run the same dflash-dist "
            "version, and nothing else may reach the group's connections"
        )


def _padded(data: bytes | None, size: int, device: torch.device) -> torch.Tensor:
    buf = torch.zeros(max(size, 1), dtype=torch.uint8)  # gloo moves no empty tensor
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf.to(device)


def _bytes(buf: torch.Tensor, size: int) -> bytes:
    return buf[:size].cpu().numpy().tobytes()


def _decode(data: bytes, rank: int, what: str, allow_nan: bool) -> Any:
    """The JSON document rank `rank` sent; anything else raises naming the rank. Data only: no
    object hook, nothing but JSON's own types is built."""

    def refuse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not allowed in this message")

    try:
        return json.loads(data.decode("utf-8"), parse_constant=None if allow_nan else refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CollectiveJsonError(
            f"rank {rank} sent a {what} of {len(data)} bytes that is not a JSON document ({type(e).__name__}: {e}; "
            f"it starts {data[:24]!r}); refused, nothing of it was run. Every rank of a run must run the same "
            "dflash-dist version, and nothing else may reach the group's connections"
        ) from None
