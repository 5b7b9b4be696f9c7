"""The one learning-rate shape every training loop of the project uses: linear warmup, then a
cosine decay to a floor. The DeepSpeed trainer (trainer/ds_config.WarmupCosine), the tiny
target's pretraining (target/tiny_target.py) and the demo's plain loop (tools/demo.py) all call
`warmup_cosine`, so a change to the shape reaches them all."""

from __future__ import annotations

import math


def warmup_cosine(at: float, total: int, warmup: int, peak: float = 1.0, floor: float = 0.0) -> float:
    """The learning rate at position `at` (a step, or samples trained) of a schedule `total` long:
    `peak * (at + 1) / warmup` for the first `warmup` positions, then a cosine from `peak` down to
    `floor * peak` at `total` (held there after). With peak 1 it is the multiplier LambdaLR takes."""
    if at < warmup:
        return peak * (at + 1) / warmup
    progress = min(1.0, (at - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))
