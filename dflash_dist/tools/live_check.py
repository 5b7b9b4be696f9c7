"""Live speculative decoding vs greedy replay on the tiny Qwen3.5 hybrid target, on any device:
what tests/test_live.py's gpu-marked test asserts on and bench/bench_live.py prints."""

from __future__ import annotations

import torch

from dflash_dist.evaluator.live import live_decode
from dflash_dist.model.capture import capture_features
from dflash_dist.model.replay import aggregate_rounds, replay_sequence
from dflash_dist.target.generation import greedy_continuation
from dflash_dist.tools.demo import DemoConfig, drafter_for, tiny_qwen35_target, train


def trained_on_device(device: str, cfg: DemoConfig):
    """The tiny target on `device` and a drafter trained on its features there. Only the drafter
    trains on the CPU: with fla installed a CPU forward of the target would go to fla and crash."""
    target = tiny_qwen35_target(cfg)
    drafter = drafter_for(target, cfg)  # copies the embedding and lm_head while both are on the CPU
    target = target.to(device)
    g = torch.Generator().manual_seed(cfg.seed + 2)
    prompts = [torch.randint(0, drafter.config.mask_token_id, (cfg.prompt_len,), generator=g).tolist()
               for _ in range(cfg.num_prompts)]
    responses = [greedy_continuation(target, p, cfg.new_tokens) for p in prompts]
    ids = torch.tensor([p + r for p, r in zip(prompts, responses)])
    loss_mask = torch.zeros_like(ids, dtype=torch.float32)
    loss_mask[:, cfg.prompt_len:] = 1.0
    cap = capture_features(target, ids.to(device), drafter.config.target_layer_ids, with_argmax=False)
    train(drafter, ids, cap.features.float().cpu(), loss_mask, cfg, log_every=0)
    return target, drafter.to(device), prompts, responses, cap.kernel_path


@torch.no_grad()
def live_vs_replay(target, drafter, prompts, new_tokens: int, budgets: tuple[int, ...] = (4, 8)) -> dict:
    """tau of replay and live decoding over `prompts`, and how many rounds/continuations agree.

    "replay": over the target's greedy continuation from `generate` (token by token through its
    cache). "own": replay over the sequence each live run produced itself, so the two see the same
    tokens; on a GPU the cached (chunked) and full forwards round differently, and where the
    target's top two logits nearly tie, live decoding can take the other token and go on from
    there. "divergences": (prompt, position, top-2 margin of a full forward there, live's token's
    distance to the top) wherever a live run leaves the `generate` continuation."""
    dev = next(target.parameters()).device
    blk = drafter.config.block_size
    chains, lives, same, total, equal = [], [], 0, 0, 0
    trees, live_trees = {b: [] for b in budgets}, {b: [] for b in budgets}
    own_chains, own_trees, divergences = [], {b: [] for b in budgets}, []

    def features(seq):
        return capture_features(target, torch.tensor([seq], device=dev), drafter.config.target_layer_ids,
                                with_argmax=False).features[0]

    def diverged(i, prompt, y, tokens):
        first = next((j for j, (a, b) in enumerate(zip(y, tokens)) if a != b), None)
        if first is not None:
            logits = target(torch.tensor([prompt + y[:first]], device=dev)).logits[0, -1].float()
            top = logits.topk(2).values
            divergences.append((i, first, float(top[0] - top[1]), float(logits.max() - logits[tokens[first]])))

    for i, prompt in enumerate(prompts):
        y = greedy_continuation(target, prompt, new_tokens)
        seq = prompt + y
        chain, replay_trees = replay_sequence(drafter, seq, features(seq), len(prompt), budgets)
        run = live_decode(target, drafter, prompt, new_tokens)
        diverged(i, prompt, y, list(run.tokens))
        own = prompt + list(run.tokens)
        own_chain, _ = replay_sequence(drafter, own, features(own), len(prompt))
        own_chains.append(own_chain)
        pairs = [(chain, list(run.taus))]
        for b in budgets:
            tree_run = live_decode(target, drafter, prompt, new_tokens, budget=b)
            diverged(i, prompt, y, list(tree_run.tokens))
            own = prompt + list(tree_run.tokens)
            own_trees[b].append(replay_sequence(drafter, own, features(own), len(prompt), (b,))[1][b])
            trees[b].append(replay_trees[b])
            live_trees[b].append(list(tree_run.taus))
            pairs.append((replay_trees[b], list(tree_run.taus)))
        chains.append(chain)
        lives.append(list(run.taus))
        equal += list(run.tokens) == y
        for a, b in pairs:
            same += sum(x == z for x, z in zip(a, b))
            total += max(len(a), len(b))
    return {"replay": aggregate_rounds(blk, chains, trees), "live": aggregate_rounds(blk, lives, live_trees),
            "own": aggregate_rounds(blk, own_chains, own_trees), "divergences": divergences,
            "rounds_equal": same, "rounds": total, "continuations_equal": equal, "prompts": len(prompts)}
