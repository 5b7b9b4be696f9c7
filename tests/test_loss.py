"""Anchor sampling, labels, weights and the loss formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_dist.model import loss as loss_module
from dflash_dist.model.loss import (
    Anchors,
    decay_weights,
    dflash_loss,
    dpace_weights,
    label_targets,
    loss_weights,
    sample_anchors,
    supervised_rows,
)
from dflash_dist.model.vocab_loss import lm_head_cross_entropy
from tests.helpers.drafter import small_drafter


def test_sample_anchors_rules():
    lm = torch.zeros(3, 40)
    lm[0, 10:30] = 1
    lm[1, 35:] = 1
    lm[2, 39] = 1  # only the last position: no room for a label -> no anchor
    a = sample_anchors(lm, 8, torch.Generator().manual_seed(0))
    assert a.positions.shape == (3, 8)
    assert a.keep[0].all() and a.keep[1].sum() == 4 and not a.keep[2].any()
    for b in range(3):
        pos = a.positions[b][a.keep[b]]
        assert torch.all(lm[b, pos] == 1) and torch.all(pos < 39)
        assert torch.equal(pos, pos.sort().values) and pos.unique().numel() == pos.numel()
    assert torch.all(a.positions[~a.keep] == 0)


def test_sample_anchors_seeded_and_fresh():
    lm = torch.ones(1, 600)
    a1 = sample_anchors(lm, 512, torch.Generator().manual_seed(5))
    a2 = sample_anchors(lm, 512, torch.Generator().manual_seed(5))
    a3 = sample_anchors(lm, 512, torch.Generator().manual_seed(6))
    assert a1.positions.shape[1] == 512  # capped at 512 per sequence
    assert torch.equal(a1.positions, a2.positions) and not torch.equal(a1.positions, a3.positions)


def test_decay_weights():
    w = decay_weights(16, 7.0)
    assert w[0] == 1 and w[1] == 1 and math.isclose(w[2].item(), math.exp(-1 / 7), rel_tol=1e-6)


def test_labels_from_data_and_from_target_argmax():
    ids = torch.arange(20)[None]
    argmax = (torch.arange(20)[None] + 100)  # argmax[p] predicts the token at p + 1
    lm = torch.ones(1, 20)
    a = Anchors(torch.tensor([[3, 17]]), torch.tensor([[True, True]]))
    labels, binary = label_targets(ids, lm, a, 4)
    assert labels[0, 0].tolist() == [3, 4, 5, 6]
    assert binary[0, 1].tolist() == [0, 1, 1, 0]  # slot 0 never; 17+3 = 20 is past the end
    t_labels, _ = label_targets(ids, lm, a, 4, target_argmax=argmax, label_source="target")
    assert t_labels[0, 0, 1:].tolist() == [103, 104, 105]
    with pytest.raises(ValueError, match="target argmax"):
        label_targets(ids, lm, a, 4, label_source="target")


def test_loss_formula_matches_manual():
    d = small_drafter(block=4)
    ids = torch.randint(0, 60, (2, 18))
    f = torch.randn(2, 18, 96)
    lm = torch.ones(2, 18)
    lm[0, 12:14] = 0
    a = sample_anchors(lm, 5, torch.Generator().manual_seed(2))
    out = dflash_loss(d, ids, f, lm, a, gamma=3.0, return_logits=True)
    labels, binary = label_targets(ids, lm, a, 4)
    w = binary * decay_weights(4, 3.0)
    ce = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(w)
    assert torch.allclose(out.loss, (w * ce).sum() / (w.sum() + 1e-6), atol=1e-6)
    correct = (out.logits.argmax(-1).view_as(labels) == labels).float() * binary
    assert torch.allclose(out.accuracy, correct.sum() / (binary.sum() + 1e-6))
    assert torch.equal(out.slot_count, binary.sum((0, 1))) and out.slot_count[0] == 0


def test_per_sample_statistics_match_manual_and_both_vocab_paths():
    d = small_drafter(block=4)
    ids = torch.randint(0, 60, (3, 18))
    f = torch.randn(3, 18, 96)
    lm = torch.ones(3, 18)
    lm[1, :10] = 0
    lm[2] = 0  # a sample with nothing supervised: loss 0, count 0
    a = sample_anchors(lm, 5, torch.Generator().manual_seed(3))
    full = dflash_loss(d, ids, f, lm, a, gamma=3.0, return_logits=True)
    chunked = dflash_loss(d, ids, f, lm, a, gamma=3.0, vocab_chunk_rows=7)
    labels, binary = label_targets(ids, lm, a, 4)
    w = binary * decay_weights(4, 3.0)
    ce = F.cross_entropy(full.logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(w)
    want = (w * ce).sum((1, 2)) / (w.sum((1, 2)) + 1e-6)
    correct = ((full.logits.argmax(-1).view_as(labels) == labels).float() * binary).sum((1, 2))
    for out in (full, chunked):
        assert torch.allclose(out.sample_loss, want, atol=1e-5)
        assert torch.equal(out.sample_correct, correct) and torch.equal(out.sample_count, binary.sum((1, 2)))
    assert chunked.sample_count[2] == 0 and chunked.sample_loss[2] == 0
    # the batch loss is the weight-averaged per-sample loss
    assert torch.allclose((want * w.sum((1, 2))).sum() / w.sum(), full.loss, atol=1e-5)


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_rows_found_on_the_host_give_the_same_loss_and_gradients_bitwise(weighting, packed):
    """dflash_loss(rows=supervised_rows(host batch)) (the trainer's form: no nonzero on the device) is the
    loss without them: the same supervised slots (ascending, as the nonzero finds them), the same loss,
    statistics and every gradient bit for bit; a sample with nothing supervised and a dropped anchor
    included, and a packed row's document ends."""
    d = small_drafter(block=4)
    ids = torch.randint(0, 60, (3, 18))
    f = torch.randn(3, 18, 96)
    lm = torch.ones(3, 18)
    lm[1, :10] = 0
    lm[2] = 0
    a = sample_anchors(lm, 5, torch.Generator().manual_seed(3))
    a = Anchors(a.positions, a.keep.clone())
    a.keep[0, 1] = False
    if packed:  # two documents in row 0: [0, 9) and [9, 18)
        ends = torch.where(a.positions < 9, 9, 18)
        a = Anchors(a.positions, a.keep, torch.where(a.positions < 9, 0, 9), ends)
    _, binary = label_targets(ids, lm, a, 4)
    rows = supervised_rows(ids, lm, a, 4)
    assert torch.equal(rows, binary.reshape(-1).nonzero().squeeze(1)) and rows.numel() > 0
    outs, grads = [], []
    for given in (None, rows):
        d.zero_grad()
        out = dflash_loss(d, ids, f, lm, a, gamma=3.0, vocab_chunk_rows=7, position_weighting=weighting, rows=given)
        out.loss.backward()
        outs.append(out)
        grads.append([p.grad.clone() for p in d.parameters() if p.grad is not None])
    ref, host = outs
    for name in ("loss", "accuracy", "slot_correct", "slot_count", "sample_loss", "sample_correct", "num_blocks"):
        assert torch.equal(getattr(host, name), getattr(ref, name)), name
    assert int(ref.num_blocks) == int(a.keep.sum())
    assert len(grads[0]) == len(grads[1]) > 0 and all(torch.equal(x, y) for x, y in zip(*grads))


# --- recipe options (issue 13) ---


def test_anchor_rule_mask_next_needs_the_next_token_supervised():
    lm = torch.zeros(2, 30)
    lm[0, 5:10] = 1  # one turn: 9 is its last supervised token
    lm[0, 12] = 1  # an isolated supervised token
    lm[0, 20:30] = 1  # the last turn runs to the end
    lm[1, 3] = 1
    g = torch.Generator().manual_seed(0)
    old = sample_anchors(lm, 64, torch.Generator().manual_seed(0))
    new = sample_anchors(lm, 64, g, rule="mask_next")
    assert old.positions[0][old.keep[0]].tolist() == [5, 6, 7, 8, 9, 12, *range(20, 29)]
    assert new.positions[0][new.keep[0]].tolist() == [5, 6, 7, 8, *range(20, 29)]
    assert not new.keep[1].any()  # an isolated token is no anchor; under "mask" it is
    assert old.keep[1].sum() == 1
    # "mask" stays the default and unchanged (the pinned loss curve samples with it)
    same = sample_anchors(lm, 4, torch.Generator().manual_seed(3))
    assert torch.equal(same.positions, sample_anchors(lm, 4, torch.Generator().manual_seed(3), rule="mask").positions)
    with pytest.raises(ValueError, match="train.anchor_rule"):
        sample_anchors(lm, 4, rule="next")


def test_mask_next_anchor_always_supervises_slot_one():
    torch.manual_seed(0)
    lm = (torch.rand(4, 50) < 0.6).float()
    a = sample_anchors(lm, 50, torch.Generator().manual_seed(1), rule="mask_next")
    _, binary = label_targets(torch.zeros(4, 50, dtype=torch.long), lm, a, 4)
    assert torch.all(binary[:, :, 1][a.keep] == 1)
    a_old = sample_anchors(lm, 50, torch.Generator().manual_seed(1))
    _, b_old = label_targets(torch.zeros(4, 50, dtype=torch.long), lm, a_old, 4)
    assert (b_old[:, :, 1][a_old.keep] == 0).any()  # the old rule has blocks starting dead


def test_dpace_weights_closed_form():
    # one block of B = 4, slots 1..3 supervised: w_j = sum_{m >= j} prod_{i <= m} q~_i
    q = torch.tensor([[[0.9, 0.8, 0.4, 0.2]]])
    binary = torch.tensor([[[0.0, 1.0, 1.0, 1.0]]])
    qs = 0.5 * q + 0.5
    p1, p2, p3 = qs[0, 0, 1], qs[0, 0, 1] * qs[0, 0, 2], qs[0, 0, 1] * qs[0, 0, 2] * qs[0, 0, 3]
    w = dpace_weights(q, binary, 0.5) * binary
    assert torch.allclose(w[0, 0], torch.stack([torch.tensor(0.0), p1 + p2 + p3, p2 + p3, p3]), atol=1e-6)
    assert torch.all(w[0, 0, 1:-1] >= w[0, 0, 2:])  # non-increasing along the block
    # an unsupervised slot inside the block is a no-op in the products and absent from the sums
    hole = torch.tensor([[[0.0, 1.0, 0.0, 1.0]]])
    wh = dpace_weights(q, hole, 0.5) * hole
    assert torch.allclose(wh[0, 0], torch.stack([torch.tensor(0.0), qs[0, 0, 1] + qs[0, 0, 1] * qs[0, 0, 3],
                                                 torch.tensor(0.0), qs[0, 0, 1] * qs[0, 0, 3]]), atol=1e-6)
    # alpha = 1: every confidence counts 1, w_j = number of supervised slots from j on
    assert torch.allclose(dpace_weights(q, binary, 1.0) * binary, torch.tensor([[[0.0, 3.0, 2.0, 1.0]]]))
    with pytest.raises(ValueError, match="alpha"):
        dpace_weights(q, binary, 1.5)


def test_dpace_loss_matches_manual_on_both_vocab_paths():
    d = small_drafter(block=4)
    ids = torch.randint(0, 60, (2, 18))
    f = torch.randn(2, 18, 96)
    lm = torch.ones(2, 18)
    lm[1, 10:12] = 0
    a = sample_anchors(lm, 5, torch.Generator().manual_seed(2))
    full = dflash_loss(d, ids, f, lm, a, gamma=3.0, return_logits=True, position_weighting="dpace")
    labels, binary = label_targets(ids, lm, a, 4)
    ce = F.cross_entropy(full.logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(binary)
    w = binary * dpace_weights(torch.exp(-ce.detach()), binary, 0.5)
    want = (w * ce).sum() / (binary.sum() + 1e-6)  # normalised per supervised slot
    assert torch.allclose(full.loss, want, atol=1e-6)
    assert torch.allclose(full.weight_sum, binary.sum())
    decay = dflash_loss(d, ids, f, lm, a, gamma=3.0, return_logits=True)
    assert not torch.allclose(decay.loss, full.loss)
    chunked = dflash_loss(d, ids, f, lm, a, gamma=3.0, vocab_chunk_rows=5, position_weighting="dpace")
    assert torch.allclose(chunked.loss, full.loss, atol=1e-5)
    # the weights are detached: the gradient is that of sum(w * CE) with w constant
    d.zero_grad()
    chunked.loss.backward()
    g_chunked = [p.grad.clone() for p in d.parameters() if p.grad is not None]
    d.zero_grad()
    full.loss.backward()
    g_full = [p.grad.clone() for p in d.parameters() if p.grad is not None]
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(g_chunked, g_full))
    # one head pass: bitwise what the former form gave, a no-grad pass for the confidences and then
    # the weighted pass with the weights as a tensor (loss and every gradient)
    def two_pass(hidden, weight, labels, row_weights, chunk_rows=None, kernels="torch"):
        assert callable(row_weights)
        with torch.no_grad():
            _, ce0, _ = lm_head_cross_entropy(hidden, weight, labels, torch.zeros(labels.numel()), chunk_rows, kernels)
        return lm_head_cross_entropy(hidden, weight, labels, row_weights(ce0), chunk_rows, kernels)

    d.zero_grad()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loss_module, "lm_head_cross_entropy", two_pass)
        former = dflash_loss(d, ids, f, lm, a, gamma=3.0, vocab_chunk_rows=5, position_weighting="dpace")
    former.loss.backward()
    assert torch.equal(former.loss, chunked.loss) and torch.equal(former.sample_loss, chunked.sample_loss)
    assert all(torch.equal(p.grad, g) for p, g in zip((p for p in d.parameters() if p.grad is not None), g_chunked))
    with pytest.raises(ValueError, match="train.position_weighting"):
        dflash_loss(d, ids, f, lm, a, position_weighting="exp")


def test_loss_weights_before_forward_and_denominator():
    d = small_drafter(block=4)
    ids = torch.randint(0, 60, (2, 18))
    f = torch.randn(2, 18, 96)
    lm = torch.ones(2, 18)
    lm[0, 14:] = 0
    a = sample_anchors(lm, 5, torch.Generator().manual_seed(4))
    w = loss_weights(ids, lm, a, 4, 3.0)
    _, binary = label_targets(ids, lm, a, 4)
    assert torch.equal(w, binary * decay_weights(4, 3.0))
    assert torch.equal(loss_weights(ids, lm, a, 4, 3.0, "dpace"), binary)
    base = dflash_loss(d, ids, f, lm, a, gamma=3.0)
    assert torch.allclose(base.weight_sum, w.sum()) and not base.weight_sum.requires_grad
    # given a denominator the loss is sum(w*CE) / D: base.loss * (sum(w) + 1e-6) / D
    den = torch.tensor(123.0)
    out = dflash_loss(d, ids, f, lm, a, gamma=3.0, loss_denominator=den)
    assert torch.allclose(out.loss, base.loss * (w.sum() + 1e-6) / den, rtol=1e-5)
    full = dflash_loss(d, ids, f, lm, a, gamma=3.0, loss_denominator=den, return_logits=True)
    assert torch.allclose(full.loss, out.loss, atol=1e-6)
    # the default is bitwise today's formula
    again = dflash_loss(d, ids, f, lm, a, gamma=3.0, loss_denominator=None)
    assert torch.equal(again.loss, base.loss)
