"""Greedy replay tau (SPEC 4): exact acceptance length for greedy decoding, cheaply.

For each prompt: generate the target's greedy continuation y once; run the target once over
prompt + y for the features; then walk rounds: the drafter proposes a block from the features
of positions < p with anchor = the token at p; acceptance = longest match against y (chain) or
the DDTree walk following y. tau_round = accepted + 1. For greedy decoding this equals live
speculative decoding up to kernel numerics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dflash_dist.model.capture import capture_features
from dflash_dist.model.ddtree import chain_acceptance, ddtree_from_top, top_logprobs, walk_tree_against_reference
from dflash_dist.model.drafter import DFlashDrafter

COUNTS = ("capped", "uncapped")


@dataclass
class ReplayResult:
    """Per-prompt mean tau for the chain and each DDTree budget, plus round statistics.

    Built by `aggregate_rounds` from per-prompt round lists (replay, live decoding and the
    evaluator all aggregate this one way). A prompt with no round (a one-token continuation) is
    left out instead of contributing NaN.
    """

    block_size: int
    tau_chain_per_prompt: list[float] = field(default_factory=list)
    tau_ddtree_per_prompt: dict[int, list[float]] = field(default_factory=dict)
    accept_hist: list[int] = field(default_factory=list)  # chain rounds by accepted drafts 0..B-1
    rounds: int = 0
    kernel_path: str = ""
    chain_rounds: list[list[int]] = field(default_factory=list)  # per prompt: tau of each chain round

    @property
    def tau_chain(self) -> float:
        """Paper convention: mean over prompts of each prompt's mean tau_round."""
        return _mean(self.tau_chain_per_prompt)

    def tau_ddtree(self, budget: int) -> float:
        return _mean(self.tau_ddtree_per_prompt[budget])

    @property
    def slot_acceptance(self) -> list[float]:
        """Share of chain rounds in which draft slot j (1..B-1) was accepted."""
        total = max(sum(self.accept_hist), 1)
        return [sum(self.accept_hist[j:]) / total for j in range(1, self.block_size)]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def aggregate_rounds(block_size: int, chain: list[list[int]], trees: dict[int, list[list[int]]] | None = None,
                     kernel_path: str = "") -> ReplayResult:
    """The one aggregation of tau: `chain[i]` (and `trees[b][i]`) are prompt i's tau_round values.

    Prompts without rounds are skipped in every list alike, so chain and trees average over the
    same prompts; tau of a round above `block_size` (a chain) is an internal error."""
    trees = trees or {}
    res = ReplayResult(block_size=block_size, accept_hist=[0] * block_size, kernel_path=kernel_path)
    res.tau_ddtree_per_prompt = {b: [] for b in trees}
    for i, rounds in enumerate(chain):
        if not rounds:
            continue
        assert all(1 <= t <= block_size for t in rounds), rounds
        res.chain_rounds.append(list(rounds))
        res.tau_chain_per_prompt.append(_mean(rounds))
        res.rounds += len(rounds)
        for t in rounds:
            res.accept_hist[t - 1] += 1
        for b, per_prompt in trees.items():
            res.tau_ddtree_per_prompt[b].append(_mean(per_prompt[i]))
    return res


@dataclass(frozen=True)
class BlockDraft:
    """What a replay round needs of one drafted block: the chain's tokens (argmax per slot) and,
    per DDTree budget b, each slot's top-b log-probs and token ids (ddtree.top_logprobs)."""

    tokens: list[int]
    tops: dict[int, tuple[list[list[float]], list[list[int]]]]


def block_drafts(logits: torch.Tensor, budgets: tuple[int, ...]) -> list[BlockDraft]:
    """BlockDraft of each of n rounds' logits [n, B-1, V], computed where the logits are (one
    argmax, one top-k per budget, one copy to the host for all n): build_ddtree(logits[i], b) and
    logits[i].argmax(-1) of each round, without n host copies of [B-1, V]."""
    if any(b < 0 for b in budgets):
        raise ValueError(f"DDTree budgets must be >= 0, got {budgets}")
    tokens = logits.argmax(-1).cpu().tolist()
    vocab = logits.shape[-1]
    tops = {b: top_logprobs(logits, min(b, vocab)) for b in budgets if b > 0}
    return [BlockDraft(tokens[i], {b: (t[0][i], t[1][i]) for b, t in tops.items()}) for i in range(len(tokens))]


def _tree_accept(draft: BlockDraft, budget: int, reference: list[int]) -> int:
    if budget not in draft.tops:  # budget 0: an empty tree accepts nothing
        return 0
    logq, ids = draft.tops[budget]
    return walk_tree_against_reference(ddtree_from_top(logq, ids, budget), reference)


@torch.no_grad()
def replay_sequence(drafter: DFlashDrafter, sequence: list[int], features: torch.Tensor, start: int,
                    budgets: tuple[int, ...] = (), end: int | None = None, count: str = "capped",
                    stop_ids: tuple[int, ...] = ()) -> tuple[list[int], dict[int, list[int]]]:
    """Rounds over one sequence (prompt + greedy continuation) starting at anchor position `start`.

    features [T, k*H] are the target's features of the sequence (at least up to `end`). Returns the
    chain's tau_round list and, per budget, the DDTree's. The continuation ends at `end` (default:
    the whole sequence), at a stop token (`stop_ids`) or at max_new_tokens.

    count "capped": rounds run while the anchor is before the continuation's last token, and a
    round is matched only against tokens before `end` (the last round stops at the end).
    "uncapped": the authors' loop (z-lab's `while start < max_length`, DDTree's the same): a round
    runs at every anchor before `end`, the last token included when the continuation was cut by
    length (a bonus token landing on the last position still gets its round), and decoding stops
    after the round that produced a stop token (a stop from the prefill itself still gets its one
    round, as the authors check after the round); a round is matched against whatever `sequence`
    holds past `end` (the target's greedy tokens there, stop tokens ignored).
    """
    if count not in COUNTS:
        raise ValueError(f"count must be one of {COUNTS}, got {count!r}")
    end = len(sequence) if end is None else end
    limit = len(sequence) if count == "uncapped" else end
    blk = drafter.config.block_size
    stops = set(stop_ids)
    context = drafter.fuse_context(features[None].to(drafter.fc.weight.device))
    cache: dict[int, BlockDraft] = {}
    batched = getattr(drafter, "draft_summary", None)  # evaluator/batched_replay.BatchingDrafter

    def draft_at(p: int) -> BlockDraft:
        if p not in cache:
            if batched is not None:
                cache[p] = batched(sequence[p], p, context[:, :p], budgets)
            else:
                cache[p] = block_drafts(drafter.draft_block(None, sequence[p], p, context=context[:, :p])[None],
                                        budgets)[0]
        return cache[p]

    def round_at(p: int) -> bool:
        if p < end - 1:
            return True
        return count == "uncapped" and p == end - 1 and (p == start or sequence[p] not in stops)

    def walk(accept_fn) -> list[int]:
        taus, p = [], start
        while round_at(p):
            ref = sequence[p + 1 : min(p + blk, limit)]
            acc = accept_fn(draft_at(p), ref)
            taus.append(acc + 1)
            p += acc + 1
        return taus

    chain = walk(lambda d, ref: chain_acceptance(d.tokens, ref))
    trees = {b: walk(lambda d, ref, b=b: _tree_accept(d, b, ref)) for b in budgets}
    return chain, trees


@torch.no_grad()
def replay_tau(
    target: nn.Module,
    drafter: DFlashDrafter,
    prompts: list[list[int]],
    continuations: list[list[int]],
    budgets: tuple[int, ...] = (),
    allow_torch_gdn_on_cuda: bool = False,
) -> ReplayResult:
    """Greedy-replay tau of `drafter` against `target` on `prompts` (token id lists), given the
    target's greedy `continuations` of them (target/generation.greedy_continuation: the one
    generation path, which no checkpoint generation_config can reshape)."""
    if len(continuations) != len(prompts):
        raise ValueError(f"replay_tau: {len(prompts)} prompts but {len(continuations)} continuations")
    layer_ids = drafter.config.target_layer_ids
    dev = next(target.parameters()).device
    chains: list[list[int]] = []
    tree_rounds: dict[int, list[list[int]]] = {b: [] for b in budgets}
    kernel_path = ""
    for prompt, y in zip(prompts, continuations):
        if len(y) < 2:  # the first token comes from the prompt itself: no drafting round
            continue
        seq = list(prompt) + list(y)
        cap = capture_features(target, torch.tensor([seq], device=dev), layer_ids, with_argmax=False,
                               allow_torch_gdn_on_cuda=allow_torch_gdn_on_cuda)
        kernel_path = cap.kernel_path
        chain, trees = replay_sequence(drafter, seq, cap.features[0], len(prompt), budgets)
        chains.append(chain)
        for b, taus in trees.items():
            tree_rounds[b].append(taus)
    return aggregate_rounds(drafter.config.block_size, chains, tree_rounds, kernel_path)
