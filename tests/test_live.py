"""Live speculative decoding on a tiny Qwen3.5 hybrid target: exact GDN rollback, live vs greedy
replay round by round, and exact tree verification on a hybrid target."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash_dist.evaluator.live import (
    live_decode,
    tree_paths,
    verify_tree,
    verify_tree_masked,
    verify_tree_rows,
)
from dflash_dist.evaluator.target_cache import TargetCache
from dflash_dist.model.capture import capture_features
from dflash_dist.model.ddtree import build_ddtree, follow_verified_tree
from dflash_dist.model.replay import aggregate_rounds, replay_sequence
from dflash_dist.target.generation import greedy_continuation
from dflash_dist.tools.demo import DemoConfig, drafter_for, make_data, tiny_qwen35_target, train
from dflash_dist.tools.live_check import live_vs_replay, trained_on_device
from tests.helpers.authors_loop import authors_loop

DEMO = replace(DemoConfig(), target_layers=4, k=2, num_prompts=6, prompt_len=12, new_tokens=24, steps=60)
BUDGETS = (4, 8)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def trained():
    target = tiny_qwen35_target(DEMO)
    drafter = drafter_for(target, DEMO)
    prompts, responses, ids, loss_mask, cap = make_data(target, DEMO, drafter.config.mask_token_id)
    train(drafter, ids, cap.features, loss_mask, DEMO, log_every=0)
    return target, drafter, prompts, responses


@pytest.fixture(scope="module")
def trained_dense():
    """A tiny dense Qwen3 target (plain attention KV cache: live keeps the verify's accepted
    positions instead of feeding them again) and a drafter trained on its responses."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(DEMO.seed)
    config = Qwen3Config(vocab_size=DEMO.vocab_size, hidden_size=DEMO.target_hidden,
                         intermediate_size=2 * DEMO.target_hidden, num_hidden_layers=DEMO.target_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                         initializer_range=DEMO.init_std, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    config._attn_implementation = "sdpa"
    target = Qwen3ForCausalLM(config).eval()
    drafter = drafter_for(target, DEMO)
    prompts, responses, ids, loss_mask, cap = make_data(target, DEMO, drafter.config.mask_token_id)
    train(drafter, ids, cap.features, loss_mask, DEMO, log_every=0)
    return target, drafter, prompts


def test_a_plain_kv_target_keeps_the_verifys_positions_and_equals_the_authors_loop(trained_dense, trained):
    """On a dense target the verify forward is also the accepted tokens' forward (their KV kept,
    the rest dropped; DDTree: the accepted path gathered out of the tree pass). Every round equals
    the authors' loop (full forwards, no cache) and the feed-again rollback, chain and DDTree, with
    partial accepts among them; the hybrid target's cache is not plain KV and keeps the rollback."""
    target, drafter, prompts = trained_dense
    cache = TargetCache(target, tuple(drafter.config.target_layer_ids))
    cache.step(prompts[0])
    assert cache.plain_kv
    hybrid = TargetCache(trained[0], tuple(trained[1].config.target_layer_ids))
    hybrid.step(prompts[0])
    assert not hybrid.plain_kv
    with pytest.raises(ValueError, match="plain attention KV"):
        hybrid.keep(3, [0])
    partial = 0
    for prompt in prompts[:2]:  # 17 partial accepts and a whole block accepted (prompts[:4]: 38)
        for budget in (None, 4):
            want, tokens = authors_loop(target, drafter, prompt, 20, (), budget)
            fast = live_decode(target, drafter, prompt, 20, (), budget, count="uncapped")
            slow = live_decode(target, drafter, prompt, 20, (), budget, count="uncapped", rollback="refeed")
            assert list(fast.taus) == want == list(slow.taus), (budget, fast.taus, slow.taus, want)
            assert list(fast.tokens) == tokens == list(slow.tokens)
            partial += sum(1 < t < drafter.config.block_size for t in want)
    assert partial >= 4  # rounds that accepted some drafts and rejected the rest: the kept prefix/path matters


def _gdn(cache: TargetCache):
    return cache.gdn_states()


def test_rollback_after_a_partial_accept_equals_a_fresh_prefill():
    target = tiny_qwen35_target(DEMO)
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, DEMO.vocab_size - 1, (40,), generator=g).tolist()
    cache = TargetCache(target, (1, 2))
    cache.step(seq[:20])
    snap = cache.snapshot()
    rejected = cache.step(seq[20:28])  # a block of 8 verified, of which 3 are accepted
    assert cache.length == 28
    cache.restore(snap)
    cache.step(seq[20:23])
    later = cache.step(seq[23:30])  # more decoding after the rollback
    fresh = TargetCache(target, (1, 2))
    full = fresh.step(seq[:30])
    assert cache.length == fresh.length == 30
    assert cache.cache.get_seq_length(3) == 30  # the attention layer's KV was cut too
    torch.testing.assert_close(later.logits[0], full.logits[0, 23:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(later.features[0], full.features[0, 23:], rtol=1e-4, atol=1e-4)
    mine, want = _gdn(cache), _gdn(fresh)
    assert sorted(mine) == [(0, 0), (1, 0), (2, 0)]  # the three Gated DeltaNet layers
    for key in want:
        for a, b in zip(mine[key], want[key]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    # without the restore the recurrent state still holds the 5 rejected tokens: logits differ
    stale = TargetCache(target, (1, 2))
    stale.step(seq[:20])
    stale.step(seq[20:28])
    for layer in stale.cache.layers[3:]:
        layer.crop(-5)  # the attention KV alone, as a KV-only rollback would do
    stale.length = 23
    off = stale.step(seq[23:30])
    assert (off.logits[0] - full.logits[0, 23:]).abs().max() > 1e-2
    assert (rejected.logits[0, :3] - full.logits[0, 20:23]).abs().max() < 1e-4  # accepted part was right


def test_rows_are_independent_copies():
    target = tiny_qwen35_target(DEMO)
    cache = TargetCache(target)
    cache.step(list(range(10)))
    before = _gdn(cache)
    copy = cache.rows(3)
    out = copy.step(torch.tensor([[5, 6], [7, 8], [5, 6]]))
    torch.testing.assert_close(out.logits[0], out.logits[2])
    assert copy.length == 12 and cache.length == 10
    for key, (conv, rec) in _gdn(cache).items():
        assert torch.equal(conv, before[key][0]) and torch.equal(rec, before[key][1])
    one = cache.step([5, 6])
    torch.testing.assert_close(one.logits[0], out.logits[0], rtol=1e-4, atol=1e-4)


def test_live_decoding_matches_replay_round_by_round(trained):
    target, drafter, prompts, responses = trained
    chains, lives, trees, live_trees = [], [], {b: [] for b in BUDGETS}, {b: [] for b in BUDGETS}
    for prompt, y in zip(prompts, responses):
        seq = prompt + y
        cap = capture_features(target, torch.tensor([seq]), drafter.config.target_layer_ids, with_argmax=False)
        chain, replay_trees = replay_sequence(drafter, seq, cap.features[0], len(prompt), BUDGETS)
        run = live_decode(target, drafter, prompt, DEMO.new_tokens)
        assert list(run.tokens) == y  # live greedy decoding produces the target's greedy continuation
        assert list(run.taus) == chain, (run.taus, chain)
        chains.append(chain)
        lives.append(list(run.taus))
        for b in BUDGETS:
            tree_run = live_decode(target, drafter, prompt, DEMO.new_tokens, budget=b)
            assert list(tree_run.tokens) == y
            assert list(tree_run.taus) == replay_trees[b], (b, tree_run.taus, replay_trees[b])
            trees[b].append(replay_trees[b])
            live_trees[b].append(list(tree_run.taus))
    replay = aggregate_rounds(drafter.config.block_size, chains, trees)
    live = aggregate_rounds(drafter.config.block_size, lives, live_trees)
    assert replay.tau_chain > 2.0  # a trained drafter: multi-token rounds, rollbacks exercised
    assert any(t < drafter.config.block_size for c in lives for t in c[:-1])  # partial accepts happened
    assert live.tau_chain == pytest.approx(replay.tau_chain, rel=0.02)
    for b in BUDGETS:
        assert live.tau_ddtree(b) == pytest.approx(replay.tau_ddtree(b), rel=0.02)


def test_uncapped_count_counts_past_the_end(trained):
    target, drafter, prompts, _ = trained
    short = 6  # ends mid-block, so the last round is cut by the cap
    for prompt in prompts:
        capped = live_decode(target, drafter, prompt, short)
        uncapped = live_decode(target, drafter, prompt, short, count="uncapped")
        assert capped.tokens == uncapped.tokens and len(capped.tokens) == short
        assert capped.taus[:-1] == uncapped.taus[:-1] and capped.taus[-1] <= uncapped.taus[-1]
        assert sum(capped.taus) <= short  # capped: the rounds cover the continuation, bonus at most once past it

        # replay of the same count over the target's greedy tokens past the end agrees
        y = greedy_continuation(target, prompt, short + drafter.config.block_size)
        seq = prompt + y
        cap = capture_features(target, torch.tensor([seq]), drafter.config.target_layer_ids, with_argmax=False)
        end = len(prompt) + short
        for count, run in (("capped", capped), ("uncapped", uncapped)):
            chain, _ = replay_sequence(drafter, seq, cap.features[0], len(prompt), (), end=end, count=count)
            assert list(run.taus) == chain, (count, run.taus, chain)
    assert any(
        sum(live_decode(target, drafter, p, short, count="uncapped").taus)
        > sum(live_decode(target, drafter, p, short).taus) for p in prompts
    )


def test_uncapped_rounds_equal_the_authors_loop(trained):
    """eval.count=uncapped, replay and live, chain and DDTree, equal the reference loop round for
    round over several continuation lengths and stop tokens, including the edge case the loops
    used to miss: the previous bonus token landing on the last position (one more round there),
    and a stop token from the prefill itself (one round, as the authors check after it)."""
    target, drafter, prompts, _ = trained
    blk, budget = drafter.config.block_size, 4
    edge = prefill_stop = mid_stop = 0
    for prompt in prompts[:2]:  # (edge, prefill_stop, mid_stop) here (3, 2, 2); over prompts[:4] (5, 4, 4)
        full = greedy_continuation(target, prompt, 14 + blk)
        cases = [(m, ()) for m in (3, 5, 7, 9, 11)] + [(12, (full[0],)), (12, (full[6],))]
        for max_new, stops in cases:
            y = greedy_continuation(target, prompt, max_new, stops)
            end = len(prompt) + len(y)
            seq = prompt + y + greedy_continuation(target, prompt + y, blk - 1)  # past the end, stops ignored
            feats = capture_features(target, torch.tensor([prompt + y]), drafter.config.target_layer_ids,
                                     with_argmax=False).features[0]
            chain, trees = replay_sequence(drafter, seq, feats, len(prompt), (budget,), end=end, count="uncapped",
                                           stop_ids=stops)
            for b, replayed in ((None, chain), (budget, trees[budget])):
                want, tokens = authors_loop(target, drafter, prompt, max_new, stops, b)
                assert tokens == y
                assert replayed == want, (max_new, stops, b, replayed, want)
                run = live_decode(target, drafter, prompt, max_new, stops, b, count="uncapped")
                assert list(run.taus) == want and list(run.tokens) == y, (max_new, stops, b, run, want)
                edge += not stops and sum(want[:-1]) == max_new - 1  # the last round anchored on the last position
            prefill_stop += bool(stops) and len(y) == 1
            mid_stop += bool(stops) and 1 < len(y) < max_new
    assert edge >= 2 and prefill_stop >= 1 and mid_stop >= 1, (edge, prefill_stop, mid_stop)


def _path_by_path(cache: TargetCache, tree, anchor: int) -> list[int]:
    """The reference: each root-to-leaf path in its own forward from a fresh copy of the cache."""
    posterior = [None] * len(tree.parents)
    for path in tree_paths(tree):
        tokens = [anchor if i == 0 else tree.node_token_ids[i - 1] for i in path]
        argmax = cache.rows(1).step(tokens).logits[0].argmax(-1).tolist()
        for depth, i in enumerate(path):
            posterior[i] = argmax[depth] if posterior[i] is None else posterior[i]
    return posterior


def _sibling_tree(greedy: list[int], distractor: int, vocab: int):
    """A tree whose first branch is a wrong token and whose second branch is the greedy path:
    in flat order the greedy path's nodes come after the distractor's subtree."""
    logits = torch.full((3, vocab), -20.0)
    logits[0, distractor], logits[0, greedy[0]] = 10.0, 9.0
    logits[1, greedy[1]], logits[2, greedy[2]] = 10.0, 9.0
    return build_ddtree(logits, 6)


def test_exact_tree_verification_on_a_hybrid_target():
    target = tiny_qwen35_target(DEMO)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, DEMO.vocab_size - 1, (16,), generator=g).tolist()
    y = greedy_continuation(target, prompt, 4)
    cache = TargetCache(target)
    cache.step(prompt)
    anchor, greedy = y[0], y[1:4]
    assert cache.has_gdn
    differs = 0
    for distractor in range(40):
        if distractor in greedy:
            continue
        tree = _sibling_tree(greedy, distractor, DEMO.vocab_size)
        assert len(tree_paths(tree)) >= 2 and tree.node_token_ids[0] == distractor
        exact = verify_tree_rows(cache, tree, anchor)
        assert exact == _path_by_path(cache, tree, anchor) == verify_tree(cache, tree, anchor)
        accepted, bonus = follow_verified_tree(tree.child_maps, exact)
        drafted = [tree.node_token_ids[i - 1] for i in accepted[1:]]
        assert len(drafted) >= 2 and drafted == greedy[: len(drafted)]  # the greedy branch, below the distractor
        masked_acc, masked_bonus = follow_verified_tree(tree.child_maps, verify_tree_masked(cache, tree, anchor))
        differs += (masked_acc, masked_bonus) != (accepted, bonus)
        assert cache.length == len(prompt)  # verification never moves the cache
    assert differs > 0  # the tree-masked pass leaks siblings through the GDN state


def test_tree_mask_is_exact_on_a_pure_attention_target():
    from transformers import Qwen3_5ForCausalLM

    hybrid = tiny_qwen35_target(DEMO)
    config = hybrid.config
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    target = Qwen3_5ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, DEMO.vocab_size - 1, (16,), generator=g).tolist()
    y = greedy_continuation(target, prompt, 4)
    cache = TargetCache(target)
    cache.step(prompt)
    assert not cache.has_gdn
    for distractor in range(10):
        if distractor in y:
            continue
        tree = _sibling_tree(y[1:4], distractor, DEMO.vocab_size)
        assert verify_tree_masked(cache, tree, y[0]) == _path_by_path(cache, tree, y[0])


@pytest.mark.gpu
def test_live_matches_replay_on_cuda_with_fla():
    """On the GPU, fla's kernels: live decoding through the cache vs greedy replay (one forward
    over prompt + continuation) on the tiny target; prints the figure for docs/BENCHMARKS.md.
    Cached (chunked) and full forwards round differently on the GPU, so live decoding may leave
    `generate`'s greedy continuation, but only where the target's top two logits nearly tie (a
    rollback error would move logits by O(1) and show anywhere); over the sequences it produced
    itself, replay counts the same tau."""
    from dflash_dist.model.capture import gdn_kernel_path

    target, drafter, prompts, _, kernel_path = trained_on_device("cuda", DEMO)
    assert gdn_kernel_path(target) == "fla" and kernel_path == "fla"
    r = live_vs_replay(target, drafter, prompts, DEMO.new_tokens, BUDGETS)
    replay, live = r["replay"], r["live"]
    own = r["own"]
    print(f"fla tiny target: replay tau {replay.tau_chain:.4f} live tau {live.tau_chain:.4f} "
          + " ".join(f"DDTree-{b} {replay.tau_ddtree(b):.4f}/{live.tau_ddtree(b):.4f}" for b in BUDGETS)
          + f" rounds equal {r['rounds_equal']}/{r['rounds']} continuations equal "
          f"{r['continuations_equal']}/{r['prompts']}; replay over live's own sequences: chain {own.tau_chain:.4f} "
          + " ".join(f"DDTree-{b} {own.tau_ddtree(b):.4f}" for b in BUDGETS)
          + f"; divergences (prompt, position, top-2 margin, live token's margin) {r['divergences']}")
    for _, _, top2, gap in r["divergences"]:
        assert top2 < 2e-2 and gap < 2e-2  # a near-tie (logit std ~0.8): numerics, not the decoding loop
    assert r["continuations_equal"] >= len(prompts) // 2
    assert live.tau_chain == pytest.approx(own.tau_chain, rel=0.02)
    for b in BUDGETS:
        assert live.tau_ddtree(b) == pytest.approx(own.tau_ddtree(b), rel=0.02)


def test_replay_tau_is_finite_with_a_one_token_continuation(trained):
    import math

    from dflash_dist.model.replay import replay_tau

    target, drafter, prompts, responses = trained
    continuations = [responses[0][:1], *responses[1:3]]  # the first has no drafting round
    res = replay_tau(target, drafter, prompts[:3], continuations, (4,))
    assert math.isfinite(res.tau_chain) and math.isfinite(res.tau_ddtree(4))
    rest = replay_tau(target, drafter, prompts[1:3], responses[1:3], (4,))
    assert res.tau_chain == rest.tau_chain and res.tau_ddtree(4) == rest.tau_ddtree(4)
    assert len(res.tau_chain_per_prompt) == 2 and sum(res.accept_hist) == res.rounds
    assert aggregate_rounds(8, [[], [3, 1]], {4: [[], [2, 2]]}).tau_ddtree(4) == 2.0


# hostile sampling/penalty fields a checkpoint's generation_config.json may carry (as in test_regenerate)
HOSTILE = {"repetition_penalty": 2.0, "no_repeat_ngram_size": 2, "temperature": 0.3, "top_k": 3, "do_sample": True,
           "min_new_tokens": 20, "suppress_tokens": [5, 6]}


def test_greedy_continuation_ignores_a_hostile_generation_config(tmp_path):
    """greedy_continuation (replay_tau's, the demo's, live_check's and bench_live's continuations)
    is plain argmax decoding whatever the checkpoint's generation_config.json says: equal on a
    clean and a hostile copy of the same weights, and equal to an argmax loop written here."""
    import json

    from transformers import AutoModelForCausalLM

    cfg = replace(DemoConfig(), target_layers=4, prompt_len=10)
    tiny_qwen35_target(cfg).save_pretrained(tmp_path / "clean")
    gen = json.loads((tmp_path / "clean" / "generation_config.json").read_text())
    (tmp_path / "hostile").mkdir()
    for f in (tmp_path / "clean").iterdir():
        (tmp_path / "hostile" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "hostile" / "generation_config.json").write_text(json.dumps({**gen, **HOSTILE}))
    clean, hostile = (AutoModelForCausalLM.from_pretrained(tmp_path / d, dtype=torch.float32).eval()
                      for d in ("clean", "hostile"))
    assert hostile.generation_config.repetition_penalty == 2.0
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, cfg.vocab_size - 1, (cfg.prompt_len,), generator=g).tolist() for _ in range(4)]
    n = 16
    with torch.no_grad():  # the config bites: a plain greedy generate on the hostile copy answers otherwise
        plain = [[m.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)[0, len(p):].tolist() for p in prompts]
                 for m in (clean, hostile)]
    assert plain[0] != plain[1]
    for p in prompts:
        seq = list(p)
        with torch.no_grad():
            for _ in range(n):  # the reference: argmax of a full forward, token by token
                seq.append(int(clean(torch.tensor([seq])).logits[0, -1].argmax()))
        expected = seq[len(p):]
        assert greedy_continuation(clean, p, n) == expected
        assert greedy_continuation(hostile, p, n) == expected
        stop = expected[5]  # a stop token ends it there, kept; min_new_tokens does not delay it
        assert greedy_continuation(hostile, p, n, (stop,)) == expected[: expected.index(stop) + 1]
