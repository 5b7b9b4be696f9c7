"""End to end on CPU: a tiny drafter trained on a tiny Qwen3.5 target's captured features."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash_dist.model.replay import replay_sequence
from dflash_dist.tools.demo import DemoConfig, drafter_for, evaluate, make_data, tiny_qwen35_target, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_training_raises_replay_tau():
    # 6 prompts, 120 steps (was 12, 200): final/first loss 0.39 (asserted < 0.5), tau 1.0 -> 7.8, DDTree(4) 4.8
    cfg = replace(DemoConfig(), num_prompts=6, steps=120, budgets=(4,))
    target = tiny_qwen35_target(cfg)
    drafter = drafter_for(target, cfg)
    prompts, responses, ids, loss_mask, cap = make_data(target, cfg, drafter.config.mask_token_id)
    before = evaluate(target, drafter, prompts, responses, cfg)
    losses = train(drafter, ids, cap.features, loss_mask, cfg, log_every=0)
    after = evaluate(target, drafter, prompts, responses, cfg)
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:20]) / 20
    assert after.tau_chain > 1.5 and after.tau_chain > before.tau_chain + 0.5
    assert 1.0 <= after.tau_ddtree(4) <= 5.0  # budget 4: at most 4 nodes + bonus
    assert after.kernel_path == "torch"
    assert sum(after.accept_hist) == after.rounds


def test_replay_rounds_cover_the_continuation():
    cfg = replace(DemoConfig(), num_prompts=2)
    target = tiny_qwen35_target(cfg)
    drafter = drafter_for(target, cfg)
    prompts, responses, ids, _, cap = make_data(target, cfg, drafter.config.mask_token_id)
    seq = ids[0].tolist()
    chain, trees = replay_sequence(drafter, seq, cap.features[0], cfg.prompt_len, (4,))
    # each round accepts tau-1 drafts plus the bonus token: together they walk to the end
    assert sum(chain) == len(seq) - 1 - cfg.prompt_len
    assert sum(trees[4]) == len(seq) - 1 - cfg.prompt_len
    assert all(1 <= t <= cfg.block_size for t in chain)
    assert torch.equal(torch.tensor(seq[cfg.prompt_len:]), torch.tensor(responses[0]))


def test_the_demo_trains_with_the_trainers_slot_weighting():
    """`dflash-dist demo` weights slots as the trainer does by default (config drift: it trained with
    dflash_loss's own default, decay, after the trainer's became D-PACE); the field reaches the loss."""
    from dflash_dist.config import load_config

    trainers = load_config(None, ["target.kind=tiny_stdlib"]).train.position_weighting
    assert DemoConfig().position_weighting == trainers == "dpace"
    cfg = replace(DemoConfig(), num_prompts=4, steps=2, budgets=(4,))
    target = tiny_qwen35_target(cfg)
    _, _, ids, loss_mask, cap = make_data(target, cfg, drafter_for(target, cfg).config.mask_token_id)
    losses = {w: train(drafter_for(target, cfg), ids, cap.features, loss_mask, replace(cfg, position_weighting=w),
                       log_every=0) for w in ("dpace", "decay")}
    assert losses["dpace"] == train(drafter_for(target, cfg), ids, cap.features, loss_mask, cfg, log_every=0)
    assert losses["dpace"][0] != losses["decay"][0]
