"""The reference decoding loop the evaluator's eval.count=uncapped rounds must equal (test_live,
test_evaluator)."""

from __future__ import annotations

import torch

from dflash_dist.evaluator.live import tree_paths
from dflash_dist.model.capture import capture_features
from dflash_dist.model.ddtree import build_ddtree, follow_verified_tree


@torch.no_grad()
def authors_loop(
    target, drafter, prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = (), budget: int | None = None
) -> tuple[list[int], list[int]]:
    """The reference for eval.count=uncapped, written after the authors' generate loops (z-lab's
    dflash `dflash_generate` in its benchmark form, DDTree's `ddtree_generate`), greedy, with full
    forwards instead of a cache. Returns (acceptance lengths, output tokens).

        max_length = n + max_new_tokens; output[n] = argmax of the prefill; start = n
        while start < max_length:
            draft from output[start] and the target features of positions < start
            verify: the target's argmax after each drafted position; accepted = matching prefix
            output[start+1 ..] = accepted drafts + bonus; start += accepted + 1
            acceptance_lengths.append(accepted + 1)
            if a stop token is anywhere in output[n : start + 1]: break
    """
    n, layers, blk = len(prompt), drafter.config.target_layer_ids, drafter.config.block_size
    out = list(prompt) + [int(target(torch.tensor([prompt])).logits[0, -1].argmax())]
    max_length, start, lengths = n + max_new_tokens, n, []
    while start < max_length:
        feats = capture_features(target, torch.tensor([out[:start]]), layers, with_argmax=False).features[0]
        logits = drafter.draft_block(None, out[start], start, context=drafter.fuse_context(feats[None]))
        if budget is None:
            drafts = logits.argmax(-1).tolist()
            posterior = target(torch.tensor([out[:start] + [out[start], *drafts]])).logits[0, start:].argmax(-1)
            acc = next((i for i in range(blk - 1) if drafts[i] != int(posterior[i])), blk - 1)
            new = [*drafts[:acc], int(posterior[acc])]
        else:
            tree = build_ddtree(logits, budget)
            posterior = [0] * len(tree.parents)
            for path in tree_paths(tree):  # each root-to-leaf path in one full forward
                ids = [out[start] if i == 0 else tree.node_token_ids[i - 1] for i in path]
                row = target(torch.tensor([out[:start] + ids])).logits[0, start:].argmax(-1).tolist()
                for depth, i in enumerate(path):
                    posterior[i] = row[depth]
            accepted, bonus = follow_verified_tree(tree.child_maps, posterior)
            acc = len(accepted) - 1
            new = [*(tree.node_token_ids[i - 1] for i in accepted[1:]), bonus]
        out = out[: start + 1] + new
        start += acc + 1
        lengths.append(acc + 1)
        if any(t in stop_ids for t in out[n : start + 1]):
            break
    tokens = out[n:max_length]
    first_stop = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
    return lengths, tokens if first_stop is None else tokens[: first_stop + 1]
