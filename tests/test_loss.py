"""Anchor sampling, labels, weights and the loss formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_dist.model.loss import Anchors, decay_weights, dflash_loss, label_targets, sample_anchors
from tests.test_drafter import small_drafter


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
