"""The numerics gate: a 2-rank gloo ZeRO-2 run of the tiny trainer (fixed seed, gradient
accumulation 2, 25 optimizer steps over 5 epochs) logs exactly the stored per-step losses and LRs.

A refactor or a speed-up must pass this unchanged. A change of reduction order, anchor draw,
sample order, loss weighting or LR schedule moves these numbers and fails it; a deliberate
numerics change regenerates the file (`DFLASH_UPDATE_LOSS_CURVE=1 pytest tests/test_loss_curve.py`)
in a commit of its own that says why.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from dflash_dist.trainer.loop import TRAIN_LOG
from tests.helpers.loss_curve import NUM, PINNED, RTOL, STEPS  # the pinned run's file, size, tolerance
from tests.helpers.tiny import make_cfg, write_shards

pytestmark = pytest.mark.slow


def test_zero2_loss_curve_matches_the_pinned_values(tiny, ray_cluster, tmp_path):
    from dflash_dist.actors.trainer_group import start_trainer_group

    shards = tmp_path / "shards"
    write_shards(shards, tiny["prov"], tiny["samples"][:NUM], done=True)
    cfg = make_cfg(tmp_path / "run", tiny["target_dir"], epochs=5, micro_batch_size=1, grad_accum=2,
                   checkpoint_every=10, warmup_frac=0.1)
    group = start_trainer_group(cfg, tiny["target_dir"], shards, tiny["prov"], tiny["drafter"], num_samples=NUM,
                                resume="never")
    results = group.wait(timeout_s=600)
    assert [r.steps for r in results] == [STEPS, STEPS]
    rows = [json.loads(line) for line in (cfg.out / TRAIN_LOG).read_text().splitlines()]
    got = [{"step": r["step"], "epoch": r["epoch"], "loss": r["loss"], "lr": r["lr"]} for r in rows]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    if os.environ.get("DFLASH_UPDATE_LOSS_CURVE") == "1":
        PINNED.parent.mkdir(exist_ok=True)
        PINNED.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(PINNED.read_text())
    assert len(want) == STEPS
    for g, w in zip(got, want):
        assert (g["step"], g["epoch"]) == (w["step"], w["epoch"])
        assert math.isclose(g["lr"], w["lr"], rel_tol=1e-12, abs_tol=1e-15), f"step {g['step']}: lr {g} vs {w}"
        assert math.isclose(g["loss"], w["loss"], rel_tol=RTOL), f"step {g['step']}: loss {g['loss']} vs {w['loss']}"
    # the curve is a learning curve, not a constant: the pinned run's loss falls
    assert want[-1]["loss"] < 0.8 * want[0]["loss"]
