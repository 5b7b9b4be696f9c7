"""Batched greedy replay (evaluator/batched_replay.py): the walks are replay_sequence's own, so the
rounds must equal measure_replay's prompt by prompt; the padded forward must give every row the
logits of its own one-prompt draft_block (full and sliding layers)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash_dist.evaluator.batched_replay import BatchingDrafter, _Request, measure_replay_batched
from dflash_dist.evaluator.measure import HeldOut, measure_replay
from dflash_dist.model.capture import capture_features
from dflash_dist.target.generation import greedy_continuation
from dflash_dist.tools.demo import DemoConfig, drafter_for, make_data, tiny_qwen35_target, train
from tests.helpers.drafter import small_drafter

DEMO = replace(DemoConfig(), target_layers=4, k=2, num_prompts=7, prompt_len=12, new_tokens=24, steps=60)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def trained_refs():
    """A drafter trained on a tiny hybrid target (tau well above 1) and held-out references of
    several prompt lengths, with the target's greedy tokens past the end (uncapped counting)."""
    target = tiny_qwen35_target(DEMO)
    drafter = drafter_for(target, DEMO)
    prompts, _, ids, loss_mask, cap = make_data(target, DEMO, drafter.config.mask_token_id)
    train(drafter, ids, cap.features, loss_mask, DEMO, log_every=0)
    refs = []
    for i, prompt in enumerate(prompts):
        prompt = prompt[: 6 + i]  # different lengths: rows of different context widths in a batch
        y = greedy_continuation(target, prompt, DEMO.new_tokens + drafter.config.block_size)
        seq = list(prompt) + y
        end = len(prompt) + DEMO.new_tokens
        feats = capture_features(target, torch.tensor([seq[:end]]), drafter.config.target_layer_ids).features[0]
        refs.append(HeldOut(len(prompt), end, tuple(seq), feats))
    return drafter.eval(), refs


@pytest.mark.parametrize("count", ["capped", "uncapped"])
def test_batched_rounds_equal_sequential(trained_refs, count):
    drafter, refs = trained_refs
    stops = (int(refs[2].sequence[refs[2].end - 1]),)  # a token the continuations hold: uncapped stops after it
    one = measure_replay(drafter, refs, (4, 8), count, "torch", stops)
    many = measure_replay_batched(drafter, refs, (4, 8), count, "torch", stops, max_walks=3)  # 3 groups, the last of 1
    assert many.chain_rounds == one.chain_rounds
    assert many.tree_rounds == one.tree_rounds
    assert many.result.tau_chain == one.result.tau_chain and many.result.tau_chain > 1.3  # a drafter that drafts
    assert many.result.tau_ddtree(8) == one.result.tau_ddtree(8)
    assert many.result.accept_hist == one.result.accept_hist


@pytest.mark.parametrize("layer_types,window", [((), None), (("sliding_attention", "full_attention"), 5)])
def test_padded_forward_gives_each_row_its_own_block(layer_types, window):
    drafter = small_drafter(k=3, block=4, layer_types=layer_types, sliding_window=window)
    feats = torch.randn(30, drafter.fc.in_features)
    context = drafter.fuse_context(feats[None])
    starts, tokens = [3, 17, 9, 28], [5, 11, 2, 40]
    proxy = BatchingDrafter(drafter, walks=len(starts))
    batch = [_Request(t, s, context[:, :s]) for t, s in zip(tokens, starts)]
    logits = proxy._forward(batch)
    for row, (t, s) in zip(logits, zip(tokens, starts)):
        alone = drafter.draft_block(None, t, s, context=context[:, :s])
        torch.testing.assert_close(row, alone, rtol=1e-5, atol=1e-5)
    # a window shorter than the context must matter, or the sliding case tests nothing
    if window is not None:
        full = small_drafter(k=3, block=4, layer_types=("full_attention", "full_attention"))
        assert not torch.allclose(full.draft_block(None, 11, 17, context=context[:, :17]), logits[1], atol=1e-3)


def test_a_failing_walk_does_not_hang_the_others(trained_refs):
    drafter, refs = trained_refs
    bad = [refs[0], HeldOut(refs[1].prompt_len, refs[1].end, refs[1].sequence, refs[1].features[:, :3]), refs[2]]
    with pytest.raises(ValueError, match="fc expects"):
        measure_replay_batched(drafter, bad, (4,), "capped", "torch")


def test_block_drafts_equal_each_rounds_own_argmax_and_tree():
    """block_drafts summarises n rounds at once (one top-k for all); each row's chain tokens and
    DDTree must be what argmax and build_ddtree give for that round's logits alone, ties included:
    bf16 logits rounded to a coarse grid so that many slots hold exact ties inside the top-b."""
    from dflash_dist.model.ddtree import build_ddtree, ddtree_from_top
    from dflash_dist.model.replay import block_drafts

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 7, 50, generator=g) * 2).round().to(torch.bfloat16)  # integer logits: ties
    assert (logits.float().topk(8, dim=-1).values.diff(dim=-1) == 0).any()  # ties inside the top 8
    drafts = block_drafts(logits, (1, 4, 8, 0))
    for row, d in zip(logits, drafts):
        assert d.tokens == row.float().argmax(-1).tolist()
        for b in (1, 4, 8):
            mine, alone = ddtree_from_top(*d.tops[b], b), build_ddtree(row.float(), b)
            assert mine.node_token_ids == alone.node_token_ids and mine.parents == alone.parents
            assert mine.node_logprobs == alone.node_logprobs
        assert 0 not in d.tops  # budget 0: an empty tree, nothing to rank
    with pytest.raises(ValueError, match="budgets must be >= 0"):
        block_drafts(logits, (-1,))
