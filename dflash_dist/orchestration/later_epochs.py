"""Keep or capture again: what a run's later epochs cost both ways, and which way `auto` goes.

keep: epoch 0's shards are kept and re-read by every later epoch, so the whole set stays on disk;
the target runs once. recapture: every epoch is captured again from the token store
(capture/recapture.py) and its shards deleted once trained, so the shard tree stays within
`capture.max_buffer_bytes` plus one shard per producer for any number of epochs; the target runs
once per epoch.

  set bytes  = samples x mean tokens x k x H x bytes per value   (one epoch's features; fp8: k x (H+1)
               bytes per token; tar headers, ids, masks and argmax not counted)
  disk       keep: the set (epochs > 1: every shard is re-read); recapture: min(epochs x set,
               cap + one shard per producer) plus the token store (~5 bytes per token + tar headers)
  GPU-hours  = passes x tokens x 2 x target params / (rate x 790e12 FLOP/s) / 3600, passes = 1 (keep)
               or epochs (recapture); params without the input embedding (a lookup); rate is capture's
               share of the 790 TFLOP/s bf16 matmul rate measured on one H200 at the 27B shape, by
               capture.kernels (CAPTURE_RATES), each converted from tokens/s with the parameters this formula
               counts: eager 0.55 (SPEC.md section 6: 8.5k tokens/s, the plain fla forward alone, so no
               shard writing: it flatters eager), fused2 0.70 (capture_job end to end over 50 passes, 10817
               tokens/s: docs/BENCHMARKS.md, the eighth lease), fused assumed equal to fused2 (their compute
               measured equal there, 11236 and 11230 tokens/s side by side; fused never ran end to end at
               it). Regeneration (the same both ways) is not counted.

auto picks recapture when there are several epochs and one epoch's set would not fit the cap. The
decision is recorded in the shard tree (epoch_dirs.write_mode) and kept by a resumed run.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from data_pipeline.epoch_dirs import KEEP, RECAPTURE

log = logging.getLogger(__name__)

MATMUL_FLOP_S = 790e12  # the bf16 matmul rate measured on one H200 (SPEC.md section 6)
# capture.kernels -> (share of MATMUL_FLOP_S, where it was measured): one H200's capture rate (module docstring)
CAPTURE_RATES = {
    "eager": (0.55, "the plain forward's 8.5k tokens/s on one H200 (SPEC.md section 6)"),
    "fused": (0.70, "fused2's rate (fused's compute measured equal on one H200)"),
    "fused2": (0.70, "capture_job end to end on one H200 (docs/BENCHMARKS.md, eighth lease)"),
}
STORE_BYTES_PER_TOKEN = 5  # int32 id + uint8 loss-mask entry
STORE_BYTES_PER_SAMPLE = 4096  # three tar members' headers and padding


@dataclass(frozen=True)
class LaterEpochs:
    """The run plan's decision on later epochs, with the estimates it printed."""

    asked: str  # capture.later_epochs
    mode: str  # keep | recapture: what runs
    reason: str
    epochs: int
    samples: int  # per epoch
    tokens: int  # per epoch
    tokens_source: str
    bytes_per_token: int  # stored feature bytes per token
    cap_bytes: int | None
    set_bytes: int  # one epoch's shards
    keep_disk_bytes: int
    recapture_disk_bytes: int
    target_params: int  # without the input embedding
    keep_gpu_hours: float
    recapture_gpu_hours: float
    capture_kernels: str = "eager"  # capture.kernels, whose rate the GPU-hours assume (plans before it: eager)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def lines(self) -> list[str]:
        """What the run plan prints before anything runs."""
        cap = "none" if self.cap_bytes is None else human_bytes(self.cap_bytes)
        if not self.target_params:
            keep_h = recapture_h = "unknown (target parameters not counted)"
        else:
            keep_h, recapture_h = f"{self.keep_gpu_hours:.3g}", f"{self.recapture_gpu_hours:.3g}"
        return [
            f"later epochs: {self.epochs} epoch(s) of {self.samples} samples, {self.tokens} tokens each "
            f"({self.tokens_source}); {self.bytes_per_token} feature bytes/token; one epoch's shards "
            f"{human_bytes(self.set_bytes)}; capture.max_buffer_bytes {cap}",
            f"  keep:      disk {human_bytes(self.keep_disk_bytes)}, target {keep_h} GPU-hours",
            f"  recapture: disk {human_bytes(self.recapture_disk_bytes)}, target {recapture_h} "
            f"GPU-hours (capture.kernels={self.capture_kernels} at {rate_text(self.capture_kernels)}; "
            f"target {self.target_params / 1e9:.3g}B params without embedding)",
            f"  capture.later_epochs={self.asked}: {self.mode} ({self.reason})",
        ]


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError


def check_recorded(asked: str, recorded: str | None) -> None:
    """Refuse an explicit mode other than the one the shard tree was captured with."""
    if recorded is not None and asked not in ("auto", recorded):
        raise ValueError(
            f"capture.later_epochs={asked}, but the shards under this --out were captured with "
            f"later_epochs={recorded} (shards/later_epochs.json): the layout of a run's epochs cannot change; "
            f"resume with later_epochs={recorded} (or auto), or use another --out"
        )


def capture_flop_s(kernels: str) -> float:
    """The capture rate CAPTURE_RATES gives `kernels` (a capture.kernels value), in FLOP/s."""
    return CAPTURE_RATES[kernels][0] * MATMUL_FLOP_S


def rate_text(kernels: str) -> str:
    """`kernels`' rate as the run plan prints it: the share, the matmul rate and where it was measured."""
    share, source = CAPTURE_RATES[kernels]
    return f"{share:.2f} x {MATMUL_FLOP_S / 1e12:.0f} TFLOP/s, {source}"


def gpu_hours(tokens: int, target_params: int, kernels: str = "eager") -> float:
    """Target GPU-hours of one capture pass over `tokens` on capture.kernels `kernels` (module docstring)."""
    return tokens * 2 * target_params / capture_flop_s(kernels) / 3600


def decide(
    cfg,
    samples: int,
    tokens: int,
    tokens_source: str,
    bytes_per_token: int,
    target_params: int,
    recorded: str | None = None,
) -> LaterEpochs:
    """The estimates and the mode. `recorded`: the mode of an earlier capture in the same shard
    tree (kept: the layout cannot change under a resumed run; another explicit mode is refused
    with ValueError naming both)."""
    c, epochs = cfg.capture, cfg.train.epochs
    set_bytes = tokens * bytes_per_token
    cap = c.max_buffer_bytes
    bound = None if cap is None else cap + c.num_actors * max(1, c.writers) * c.shard_bytes
    store = tokens * STORE_BYTES_PER_TOKEN + samples * STORE_BYTES_PER_SAMPLE
    deletes_one_epoch = cap is not None and c.consumed_shards != "keep"
    keep_disk = min(set_bytes, bound) if epochs == 1 and deletes_one_epoch else set_bytes
    recapture_disk = (epochs * set_bytes if bound is None else min(epochs * set_bytes, bound)) + store
    one_pass = gpu_hours(tokens, target_params, c.kernels)  # target GPU-hours of one capture
    if c.later_epochs != "auto":
        mode, reason = c.later_epochs, "as configured"
    elif epochs > 1 and cap is not None and set_bytes > cap:
        mode, reason = RECAPTURE, f"auto: one epoch's shards ({human_bytes(set_bytes)}) exceed the cap"
    else:
        why = "one epoch" if epochs == 1 else "no cap" if cap is None else "one epoch's shards fit the cap"
        mode, reason = KEEP, f"auto: {why}"
    check_recorded(c.later_epochs, recorded)
    if recorded is not None and recorded != mode:
        mode, reason = recorded, "auto: kept as recorded by the capture that made these shards"
    if mode == KEEP and epochs > 1 and c.consumed_shards == "delete":
        raise ValueError(
            f"capture.consumed_shards=delete with train.epochs={epochs} and later epochs kept "
            f"({reason}): later epochs re-read every shard; use consumed_shards auto"
        )
    return LaterEpochs(
        c.later_epochs,
        mode,
        reason,
        epochs,
        samples,
        tokens,
        tokens_source,
        bytes_per_token,
        cap,
        set_bytes,
        keep_disk,
        recapture_disk,
        target_params,
        one_pass,
        epochs * one_pass,
        c.kernels,
    )
