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
from dflash_dist.model.ddtree import build_ddtree, chain_acceptance, walk_tree_against_reference
from dflash_dist.model.drafter import DFlashDrafter


@dataclass
class ReplayResult:
    """Per-prompt mean tau for the chain and each DDTree budget, plus round statistics."""

    block_size: int
    tau_chain_per_prompt: list[float] = field(default_factory=list)
    tau_ddtree_per_prompt: dict[int, list[float]] = field(default_factory=dict)
    accept_hist: list[int] = field(default_factory=list)  # chain rounds by accepted drafts 0..B-1
    rounds: int = 0
    kernel_path: str = ""

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

    def to_json(self) -> dict:
        return {
            "tau_chain": self.tau_chain,
            "tau_ddtree": {str(b): self.tau_ddtree(b) for b in sorted(self.tau_ddtree_per_prompt)},
            "tau_chain_per_prompt": self.tau_chain_per_prompt,
            "accept_hist": self.accept_hist,
            "slot_acceptance": self.slot_acceptance,
            "rounds": self.rounds,
            "prompts": len(self.tau_chain_per_prompt),
            "kernel_path": self.kernel_path,
        }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


@torch.no_grad()
def greedy_continuation(target: nn.Module, prompt: list[int], max_new_tokens: int,
                        eos_token_id: int | None = None) -> list[int]:
    """The target's greedy continuation of `prompt` (stops after eos, which is kept)."""
    dev = next(target.parameters()).device
    ids = torch.tensor([prompt], device=dev)
    out = target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=eos_token_id, pad_token_id=eos_token_id if eos_token_id is not None else 0,
        temperature=None, top_p=None, top_k=None,
    )
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def replay_sequence(drafter: DFlashDrafter, sequence: list[int], features: torch.Tensor, start: int,
                    budgets: tuple[int, ...] = ()) -> tuple[list[int], dict[int, list[int]]]:
    """Rounds over one sequence (prompt + greedy continuation) starting at anchor position `start`.

    features [T, k*H] are the target's features of the whole sequence. Returns the chain's
    tau_round list and, per budget, the DDTree's.
    """
    blk = drafter.config.block_size
    context = drafter.fuse_context(features[None].to(drafter.fc.weight.device))
    cache: dict[int, torch.Tensor] = {}

    def logits_at(p: int) -> torch.Tensor:
        if p not in cache:
            cache[p] = drafter.draft_block(None, sequence[p], p, context=context[:, :p])
        return cache[p]

    def walk(accept_fn) -> list[int]:
        taus, p = [], start
        while p < len(sequence) - 1:
            ref = sequence[p + 1 : p + blk]
            acc = accept_fn(logits_at(p), ref)
            taus.append(acc + 1)
            p += acc + 1
        return taus

    chain = walk(lambda lg, ref: chain_acceptance(lg.argmax(-1).tolist(), ref))
    trees = {b: walk(lambda lg, ref, b=b: walk_tree_against_reference(build_ddtree(lg, b), ref)) for b in budgets}
    return chain, trees


@torch.no_grad()
def replay_tau(
    target: nn.Module,
    drafter: DFlashDrafter,
    prompts: list[list[int]],
    max_new_tokens: int,
    budgets: tuple[int, ...] = (),
    eos_token_id: int | None = None,
    continuations: list[list[int]] | None = None,
    allow_torch_gdn_on_cuda: bool = False,
) -> ReplayResult:
    """Greedy-replay tau of `drafter` against `target` on `prompts` (token id lists)."""
    layer_ids = drafter.config.target_layer_ids
    dev = next(target.parameters()).device
    res = ReplayResult(block_size=drafter.config.block_size, accept_hist=[0] * drafter.config.block_size)
    res.tau_ddtree_per_prompt = {b: [] for b in budgets}
    for i, prompt in enumerate(prompts):
        y = continuations[i] if continuations is not None else greedy_continuation(
            target, prompt, max_new_tokens, eos_token_id)
        if not y:
            continue
        seq = list(prompt) + list(y)
        cap = capture_features(target, torch.tensor([seq], device=dev), layer_ids, with_argmax=False,
                               allow_torch_gdn_on_cuda=allow_torch_gdn_on_cuda)
        res.kernel_path = cap.kernel_path
        chain, trees = replay_sequence(drafter, seq, cap.features[0], len(prompt), budgets)
        res.tau_chain_per_prompt.append(_mean(chain))
        res.rounds += len(chain)
        for t in chain:
            res.accept_hist[t - 1] += 1
        for b, taus in trees.items():
            res.tau_ddtree_per_prompt[b].append(_mean(taus))
    return res
