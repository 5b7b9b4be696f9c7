"""Recipe options (issue 13): the step_slots normalisation over gradient accumulation and the
anchor rule reaching the trainer's batches."""

from __future__ import annotations

import pytest
import torch

from data_pipeline.records import Sample
from dflash_dist.config import ConfigError, load_config
from dflash_dist.model.loss import dflash_loss, label_targets, loss_weights, sample_anchors
from dflash_dist.trainer.batching import make_micro_batch
from tests.conftest import REPO
from tests.helpers.drafter import small_drafter

TINY = REPO / "configs" / "tiny.yaml"


def _batch(b: int, s: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 60, (b, s), generator=g)
    f = torch.randn(b, s, 96, generator=g)
    lm = torch.ones(b, s)
    return ids, f, lm


def _grads(d):
    return torch.cat([p.grad.flatten() for p in d.parameters() if p.grad is not None])


def test_step_slots_accumulated_equals_one_batch_per_slot_mean():
    """A short and a long micro-batch of one step: with the step's summed weights as denominator
    the accumulated gradient is that of one loss over all slots (each slot counts the same);
    with per-micro-batch means the short one weighs as much as the long one."""
    d = small_drafter(block=4)
    short, long_ = _batch(1, 8, 0), _batch(1, 40, 1)
    anchors = [sample_anchors(lm, 64, torch.Generator().manual_seed(i)) for i, (_, _, lm) in enumerate((short, long_))]
    ws = [loss_weights(ids, lm, a, 4, 3.0) for (ids, _, lm), a in zip((short, long_), anchors)]
    denom = sum(w.sum() for w in ws)  # all-reduced over ranks in the trainer

    d.zero_grad()
    total_num = 0.0
    for (ids, f, lm), a in zip((short, long_), anchors):
        out = dflash_loss(d, ids, f, lm, a, gamma=3.0, loss_denominator=denom)
        out.loss.backward()
        total_num += float(out.loss) * float(denom)
    g_step = _grads(d)

    # the reference: sum(w*CE) over both micro-batches / sum(w), from per-slot CE
    d.zero_grad()
    ref = 0.0
    for (ids, f, lm), a in zip((short, long_), anchors):
        out = dflash_loss(d, ids, f, lm, a, gamma=3.0, return_logits=True)
        ref = ref + (out.extras["weights"] * out.extras["ce"]).sum()
    (ref / denom).backward()
    assert torch.allclose(g_step, _grads(d), atol=1e-6)
    assert abs(total_num - float(ref)) < 1e-3

    d.zero_grad()
    for (ids, f, lm), a in zip((short, long_), anchors):
        (dflash_loss(d, ids, f, lm, a, gamma=3.0).loss / 2).backward()
    assert not torch.allclose(_grads(d), g_step, atol=1e-4)  # micro_batch: a different objective


def test_step_slots_weight_sum_matches_loss_weights():
    d = small_drafter(block=4)
    ids, f, lm = _batch(2, 20, 3)
    lm[1, 12:] = 0
    a = sample_anchors(lm, 64, torch.Generator().manual_seed(0), rule="mask_next")
    for pw in ("decay", "dpace"):
        out = dflash_loss(d, ids, f, lm, a, gamma=3.0, position_weighting=pw)
        assert torch.allclose(out.weight_sum, loss_weights(ids, lm, a, 4, 3.0, pw).sum())


def _sample(key: str, lm: list[int]) -> Sample:
    t = len(lm)
    return Sample(key, torch.arange(t, dtype=torch.int32), torch.tensor(lm, dtype=torch.uint8),
                  torch.zeros(t, 8), torch.zeros(t, dtype=torch.int32))


def test_micro_batch_anchor_rule_passes_through():
    lm = [0, 0, 1, 1, 1, 0, 0, 1, 0, 1, 1, 0]  # 4 and 7 end a turn; 7 is isolated
    s = [_sample("a", lm)]
    kw = dict(dtype=torch.float32, num_anchors=64, seed=0, epoch=0)
    old = make_micro_batch(s, {}, **kw)
    new = make_micro_batch(s, {}, **kw, anchor_rule="mask_next")
    assert old.anchors.positions[0][old.anchors.keep[0]].tolist() == [2, 3, 4, 7, 9, 10]
    assert new.anchors.positions[0][new.anchors.keep[0]].tolist() == [2, 3, 9]
    _, binary = label_targets(new.input_ids, new.loss_mask, new.anchors, 4)
    assert torch.all(binary[0, new.anchors.keep[0], 1] == 1)


def test_recipe_config_fields_default_to_the_pinned_behaviour():
    t = load_config(TINY).train
    assert (t.anchor_rule, t.position_weighting, t.loss_norm) == ("mask", "dpace", "micro_batch")
    t = load_config(TINY, ["train.anchor_rule=mask_next", "train.position_weighting=decay",
                           "train.loss_norm=step_slots"]).train
    assert (t.anchor_rule, t.position_weighting, t.loss_norm) == ("mask_next", "decay", "step_slots")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.anchor_rule=next", "train.anchor_rule: 'next' is not one of"),
        ("train.position_weighting=exp", "train.position_weighting: 'exp' is not one of"),
        ("train.loss_norm=global", "train.loss_norm: 'global' is not one of"),
    ],
)
def test_recipe_config_rejects_unknown_choices(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, [override])
