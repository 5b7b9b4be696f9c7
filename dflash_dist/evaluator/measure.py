"""One drafter measured on the held-out prompts: greedy replay (every checkpoint) and live
speculative decoding (eval.mode=live), aggregated the one way (model/replay.aggregate_rounds),
with each prompt's per-round tau kept so replay and live can be compared round by round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_dist.evaluator.live import live_decode
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.replay import ReplayResult, aggregate_rounds, replay_sequence


@dataclass(frozen=True)
class HeldOut:
    """One held-out prompt as the measurements need it; independent of the checkpoint."""

    prompt_len: int
    end: int  # len(prompt) + len(greedy continuation): where the continuation ends
    sequence: tuple[int, ...]  # prompt + continuation (+ the target's greedy tokens past the end, uncapped)
    features: torch.Tensor  # [end, k*H] target features of sequence[:end]

    @property
    def prompt(self) -> list[int]:
        return list(self.sequence[: self.prompt_len])

    @property
    def continuation(self) -> list[int]:
        return list(self.sequence[self.prompt_len : self.end])


@dataclass(frozen=True)
class Measured:
    """One mode's result: the aggregate plus every prompt's rounds (chain and per budget)."""

    result: ReplayResult
    chain_rounds: list[list[int]]
    tree_rounds: dict[int, list[list[int]]]
    tokens_equal: int | None = None  # live: continuations equal to the reference continuation

    def record(self, budgets: tuple[int, ...]) -> dict[str, Any]:
        r = self.result
        return {"tau_chain": r.tau_chain, "tau_ddtree": {b: r.tau_ddtree(b) for b in budgets},
                "accept_hist": list(r.accept_hist), "slot_acceptance": list(r.slot_acceptance), "rounds": r.rounds}

    def rounds_json(self) -> dict[str, Any]:
        return {"chain": self.chain_rounds, "ddtree": {str(b): t for b, t in self.tree_rounds.items()}}


def measure_replay(drafter: DFlashDrafter, refs: list[HeldOut], budgets: tuple[int, ...], count: str,
                   kernel_path: str, stop_ids: tuple[int, ...] = ()) -> Measured:
    chains, trees = [], {b: [] for b in budgets}
    for ref in refs:
        chain, per_budget = replay_sequence(drafter, list(ref.sequence), ref.features, ref.prompt_len, budgets,
                                            end=ref.end, count=count, stop_ids=stop_ids)
        chains.append(chain)
        for b in budgets:
            trees[b].append(per_budget[b])
    return Measured(aggregate_rounds(drafter.config.block_size, chains, trees, kernel_path), chains, trees)


def measure_live(target: nn.Module, drafter: DFlashDrafter, refs: list[HeldOut], budgets: tuple[int, ...],
                 count: str, stop_ids: tuple[int, ...], max_new_tokens: int, kernel_path: str) -> Measured:
    chains, trees, equal = [], {b: [] for b in budgets}, 0
    for ref in refs:
        run = live_decode(target, drafter, ref.prompt, max_new_tokens, stop_ids, None, count)
        chains.append(list(run.taus))
        equal += list(run.tokens) == ref.continuation
        for b in budgets:
            trees[b].append(list(live_decode(target, drafter, ref.prompt, max_new_tokens, stop_ids, b, count).taus))
    return Measured(aggregate_rounds(drafter.config.block_size, chains, trees, kernel_path), chains, trees, equal)


def rounds_agreement(a: Measured, b: Measured) -> tuple[int, int]:
    """(rounds with equal tau at the same index, rounds in all) over the chain and every budget."""
    same = total = 0
    pairs = list(zip(a.chain_rounds, b.chain_rounds))
    for budget in a.tree_rounds:
        pairs += list(zip(a.tree_rounds[budget], b.tree_rounds[budget]))
    for x, y in pairs:
        same += sum(p == q for p, q in zip(x, y))
        total += max(len(x), len(y))
    return same, total
