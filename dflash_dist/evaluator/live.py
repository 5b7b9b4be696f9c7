"""Live speculative decoding with the target (SPEC 4, the cross-check of greedy replay).

Each round: the drafter proposes a block from the target features of the accepted tokens; the
target verifies it in one forward through its cache; the longest matching prefix plus the
target's bonus token is accepted; the cache is rolled back exactly to the accepted tokens,
Gated DeltaNet state included (target_cache.py owns that: snapshot/restore, then the accepted
tokens are fed again, which also yields their features for the next draft). A target whose cache
is plain attention KV (a dense Qwen3, say) instead keeps the verify forward's accepted positions
and drops the rest, as the authors' loops crop theirs: one target forward a round, not two.

DDTree: the tree is verified without touching the cache (plain KV: through the cache itself, then
only the accepted root-to-node path is kept; its positions are start, start+1, ... as fed). On a
target with GDN layers a tree attention mask is not enough (those layers ignore it, so a node's
recurrent state would fold in its siblings); `verify_tree_rows` runs each root-to-leaf path as its
own batch row of a copy of the cache, so every node's state comes from its ancestors only. A
pure-attention target uses the one-row tree-masked pass (`verify_tree_masked`), exact there and
cheaper.

Counting (eval.count): "capped" stops a round at the continuation's end (a stop token or
max_new_tokens), as greedy replay does; "uncapped" is the authors' loop (z-lab's
`while start < max_length`, DDTree's the same): every accepted draft counts, a round also runs
when the previous bonus token landed on the last position, and a stop token ends decoding after
the round that produced it (a stop from the prefill still gets that one round). tau_round =
accepted + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash_dist.evaluator.target_cache import TargetCache
from dflash_dist.model.ddtree import DraftTree, build_ddtree, chain_acceptance, follow_verified_tree
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.replay import COUNTS


@dataclass(frozen=True)
class LiveRun:
    """One prompt decoded live: the generated tokens (the first from the prompt's prefill, the
    stop token kept) and each round's tau."""

    tokens: tuple[int, ...]
    taus: tuple[int, ...]


def tree_paths(tree: DraftTree) -> list[list[int]]:
    """Flat indices of every root-to-leaf path (root 0 first), leaves in pop order."""
    paths = []
    for leaf in range(len(tree.parents)):
        if tree.child_maps[leaf]:
            continue
        path, i = [], leaf
        while i >= 0:
            path.append(i)
            i = tree.parents[i]
        paths.append(path[::-1])
    return paths


def _tokens(tree: DraftTree, anchor: int, path: list[int]) -> list[int]:
    return [anchor if i == 0 else tree.node_token_ids[i - 1] for i in path]


@torch.no_grad()
def verify_tree_rows(cache: TargetCache, tree: DraftTree, anchor: int) -> list[int]:
    """Exact on any target: the target's argmax after each flat index, every root-to-leaf path
    verified as its own batch row (right-padded; a causal row never sees its padding)."""
    paths = tree_paths(tree)
    width = max(len(p) for p in paths)
    rows = [_tokens(tree, anchor, p) for p in paths]
    ids = torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows])
    argmax = cache.rows(len(paths)).step(ids).logits.argmax(-1).tolist()
    posterior: list[int | None] = [None] * len(tree.parents)
    for r, path in enumerate(paths):
        for depth, i in enumerate(path):
            if posterior[i] is None:
                posterior[i] = argmax[r][depth]
    return posterior  # type: ignore[return-value]


@torch.no_grad()
def _tree_pass(cache: TargetCache, tree: DraftTree, anchor: int):
    """The tree in flat order through `cache` with a tree attention mask (node at start + depth
    sees the context, its ancestors and itself)."""
    n = len(tree.parents)
    past = cache.length
    dev = cache.device
    mask = torch.ones((1, 1, n, past + n), dtype=torch.bool, device=dev)
    mask[0, 0, :, past:] = tree.visibility().to(dev)
    positions = torch.tensor([past + d for d in tree.position_offsets()], device=dev)[None]
    ids = [anchor, *tree.node_token_ids]
    return cache.step(ids, position_ids=positions, attention_mask={"full_attention": mask, "linear_attention": None})


@torch.no_grad()
def verify_tree_masked(cache: TargetCache, tree: DraftTree, anchor: int) -> list[int]:
    """One row in flat order with a tree attention mask, on a copy of the cache. Exact on a
    pure-attention target; on a hybrid target the GDN layers ignore the mask and siblings leak
    into each other, so its logits are wrong there."""
    return _tree_pass(cache.rows(1), tree, anchor).logits[0].argmax(-1).tolist()


def verify_tree(cache: TargetCache, tree: DraftTree, anchor: int) -> list[int]:
    """The exact verification for this target: path rows with GDN layers, else the tree mask."""
    return verify_tree_rows(cache, tree, anchor) if cache.has_gdn else verify_tree_masked(cache, tree, anchor)


ROLLBACKS = ("auto", "refeed")


@torch.no_grad()
def live_decode(target: nn.Module, drafter: DFlashDrafter, prompt: list[int], max_new_tokens: int,
                stop_ids: tuple[int, ...] = (), budget: int | None = None, count: str = "capped",
                rollback: str = "auto") -> LiveRun:
    """Decode `prompt` greedily with speculative rounds: the chain (budget None) or DDTree-`budget`.

    rollback "auto": on a plain attention KV cache the verify forward is also the accepted
    tokens' forward (the rejected positions are dropped from the cache, the accepted ones' features
    taken from it: the authors' crop; one target forward a round instead of two); elsewhere, and
    with "refeed", the cache is restored and the accepted tokens fed again (exact for GDN state)."""
    if count not in COUNTS:
        raise ValueError(f"count must be one of {COUNTS}, got {count!r}")
    if rollback not in ROLLBACKS:
        raise ValueError(f"rollback must be one of {ROLLBACKS}, got {rollback!r}")
    cache = TargetCache(target, tuple(drafter.config.target_layer_ids))
    dev = drafter.fc.weight.device
    out = cache.step(list(prompt), last_logits_only=True)
    in_place = rollback == "auto" and cache.plain_kv
    context = [drafter.fuse_context(out.features.to(dev))]
    anchor = int(out.logits[0, -1].argmax())
    tokens, taus = [anchor], []
    stops = set(stop_ids)
    p, end_max = len(prompt), len(prompt) + max_new_tokens
    first_stops = anchor in stops
    if first_stops and count == "capped":
        return LiveRun(tuple(tokens), ())
    last = end_max if count == "uncapped" else end_max - 1  # rounds anchor at p < last
    while p < last:
        logits = drafter.draft_block(None, anchor, p, context=torch.cat(context, dim=1))
        if budget is None:
            drafts = logits.argmax(-1).tolist()
            snap = cache.snapshot()
            verified = cache.step([anchor, *drafts])
            posterior = verified.logits[0].argmax(-1).tolist()
            acc = chain_acceptance(drafts, posterior)
            accepted, bonus = drafts[:acc], posterior[acc]
            if acc == len(drafts):
                features = verified.features
            elif in_place:  # drop the rejected positions; the accepted ones' features are the verify's
                cache.keep(p, list(range(acc + 1)))
                features = verified.features[:, : acc + 1]
            else:  # roll back to the accepted tokens and feed them again
                cache.restore(snap)
                features = cache.step([anchor, *accepted]).features
        else:
            tree = build_ddtree(logits, budget)
            if in_place:  # the tree through the cache itself, then only the accepted path kept
                verified = _tree_pass(cache, tree, anchor)
                path, bonus = follow_verified_tree(tree.child_maps, verified.logits[0].argmax(-1).tolist())
                cache.keep(p, list(path))
                features = verified.features[:, list(path)]
            else:
                path, bonus = follow_verified_tree(tree.child_maps, verify_tree(cache, tree, anchor))
                features = cache.step([anchor, *(tree.node_token_ids[i - 1] for i in path[1:])]).features
            accepted = [tree.node_token_ids[i - 1] for i in path[1:]]
            acc = len(accepted)
        if first_stops:  # uncapped: the one round the authors' loop runs on a stop from the prefill
            taus.append(acc + 1)
            break
        new = [*accepted, bonus]
        stop_at = next((j for j, t in enumerate(new) if t in stops), None)
        end = end_max if stop_at is None else min(end_max, p + stop_at + 2)  # one past the last counted token
        taus.append(acc + 1 if count == "uncapped" else min(acc, end - 1 - p) + 1)
        tokens += new if stop_at is None else new[: stop_at + 1]
        context.append(drafter.fuse_context(features.to(dev)))
        p, anchor = p + acc + 1, bonus
        if stop_at is not None:
            break
    return LiveRun(tuple(tokens[:max_new_tokens]), tuple(taus))
