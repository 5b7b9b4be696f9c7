"""The one warmup-cosine shape (model/lr_schedule.py) and its callers: the DeepSpeed trainer's
LambdaLR multiplier, the tiny target's pretraining LR and the demo's loop all follow it."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_dist.model.lr_schedule import warmup_cosine


def test_warmup_then_cosine_to_the_floor_and_held() -> None:
    assert [warmup_cosine(s, 10, 4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert warmup_cosine(4, 10, 4) == 1.0  # the cosine starts at the peak
    assert warmup_cosine(7, 10, 4) == pytest.approx(0.5)  # half way down
    assert warmup_cosine(10, 10, 4) == pytest.approx(0.0, abs=1e-15)
    assert warmup_cosine(99, 10, 4) == warmup_cosine(10, 10, 4)  # held at the floor after the end
    assert warmup_cosine(0, 10, 0) == 1.0  # no warmup
    assert warmup_cosine(10, 10, 2, peak=3e-3, floor=0.1) == pytest.approx(3e-4)
    assert warmup_cosine(0, 10, 2, peak=3e-3) == 3e-3 * 1 / 2


def test_every_training_loop_follows_it() -> None:
    from dflash_dist.target.lm_training import lr_at as _lr_at
    from dflash_dist.target.tiny_target import DEFAULT_SETTINGS
    from dflash_dist.tools import demo
    from dflash_dist.trainer.ds_config import WarmupCosine

    steps = 40
    sched = WarmupCosine(steps, math.ceil(0.1 * steps))
    assert [sched(s) for s in range(steps + 2)] == [warmup_cosine(s, steps, 4) for s in range(steps + 2)]
    per_sample = WarmupCosine(steps, 4, unit="sample")
    per_sample.done = 9
    assert per_sample(0) == warmup_cosine(9, steps, 4)
    s = DEFAULT_SETTINGS
    assert [_lr_at(i, s) for i in range(0, s.steps, 7)] == [
        warmup_cosine(i, s.steps, s.warmup_steps, s.lr, s.min_lr_ratio) for i in range(0, s.steps, 7)
    ]
    # the demo's loop: the LR its optimizer held at each step
    cfg = demo.DemoConfig(
        target_layers=4, num_prompts=4, prompt_len=8, new_tokens=8, steps=6, batch_size=2, num_anchors=2
    )
    target = demo.tiny_qwen35_target(cfg)
    drafter = demo.drafter_for(target, cfg)
    seen = []
    real_step = torch.optim.AdamW.step

    def step(self, *a, **kw):
        seen.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **kw)

    _, _, ids, loss_mask, cap = demo.make_data(target, cfg, mask_token_id=cfg.vocab_size - 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.optim.AdamW, "step", step)
        demo.train(drafter, ids, cap.features, loss_mask, cfg, log_every=100)
    assert seen == pytest.approx([cfg.lr * warmup_cosine(i, 6, 1) for i in range(6)], rel=1e-12)
