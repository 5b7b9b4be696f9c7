"""Greedy replay of many held-out prompts at once, through the evaluator's own replay code.

`measure_replay` (measure.py) walks the prompts one after another, one drafter forward per round
and prompt: on a GPU a small drafter's round is launch-bound (a few hundred small kernels), so a
checkpoint of 64 prompts x 256 tokens costs tens of seconds. Here every prompt's walk is still
`model/replay.replay_sequence` (rounds, DDTree construction and acceptance unchanged), each in a
thread of its own, but the drafter they see is a stand-in whose `draft_summary` waits until every
walk still running has asked for its next block, then runs them as one padded forward: one
forward per round for all prompts instead of one per prompt. What each walk gets back is the
round's BlockDraft (argmax tokens, top-b log-probs per budget: model/replay.block_drafts),
computed for all rows on the device with one copy to the host: the walks' threads share one GIL,
and a [B-1, V] argmax + top-k + logsumexp per round and walk on the host (about 1 ms) made a
checkpoint of 64 prompts cost ~20 s on the H200, most of it waiting for the GIL. The padded forward is the drafter's
own forward with a key mask (context entries at or past a row's anchor are hidden; sliding layers
also get their window, attention.inference_sliding_mask), so a row sees exactly what the
one-prompt forward sees; only kernel numerics differ (bit-equal rounds on the CPU, tested).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from dflash_dist.evaluator.measure import HeldOut, Measured
from dflash_dist.model.attention import FULL, SLIDING, inference_sliding_mask
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.replay import BlockDraft, aggregate_rounds, block_drafts, replay_sequence


@dataclass
class _Request:
    token: int
    start: int
    context: torch.Tensor  # [1, start, H] fused context before the anchor
    budgets: tuple[int, ...] = ()
    draft: BlockDraft | None = None
    error: BaseException | None = None
    done: bool = field(default=False)


class BatchingDrafter:
    """What replay_sequence needs of a drafter (`config`, `fc`, `fuse_context`, `draft_summary`),
    with `draft_summary` calls from `walks` threads gathered into one forward. Every walk calls
    `finished()` when it ends (also on error), so the others never wait for it."""

    def __init__(self, drafter: DFlashDrafter, walks: int) -> None:
        self.drafter = drafter
        self.config = drafter.config
        self.fc = drafter.fc
        self._cv = threading.Condition()
        self._pending: list[_Request] = []
        self._active = walks
        self.forwards = 0  # batched forwards run (diagnostics)

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        return self.drafter.fuse_context(features)

    def draft_summary(
        self, anchor_token: int, start: int, context: torch.Tensor, budgets: tuple[int, ...]
    ) -> BlockDraft:
        """The round's BlockDraft, as block_drafts(draft_block(...)) would give it, from the next
        batched forward."""
        req = _Request(int(anchor_token), int(start), context, tuple(budgets))
        with self._cv:
            self._pending.append(req)
            self._maybe_run()
            while not req.done:
                self._cv.wait()
        if req.error is not None:
            raise RuntimeError("the batched drafter forward failed") from req.error
        return req.draft

    def finished(self) -> None:
        with self._cv:
            self._active -= 1
            self._maybe_run()

    def _maybe_run(self) -> None:
        """With the lock held: once every running walk waits for a block, run them all."""
        if not self._pending or len(self._pending) < self._active:
            return
        batch, self._pending = self._pending, []
        try:
            budgets = batch[0].budgets
            if any(r.budgets != budgets for r in batch):
                raise ValueError(f"batched walks asked for different DDTree budgets: {[r.budgets for r in batch]}")
            drafts = block_drafts(self._forward(batch), budgets)
            for req, draft in zip(batch, drafts):
                req.draft = draft
        except BaseException as e:  # handed to every waiting walk
            for req in batch:
                req.error = e
        for req in batch:
            req.done = True
        self.forwards += 1
        self._cv.notify_all()

    @torch.no_grad()
    def _forward(self, batch: list[_Request]) -> torch.Tensor:
        """[n, B-1, V] logits on the drafter's device, row i as draft_block would return it for
        request i, in the lm_head's dtype (draft_block's `.float()` of bf16 logits adds no
        information: block_drafts upcasts for the top-k)."""
        d, cfg = self.drafter, self.config
        blk, dev = cfg.block_size, self.fc.weight.device
        n, width = len(batch), max(r.start for r in batch)
        context = batch[0].context.new_zeros(n, width, batch[0].context.shape[-1])
        for i, r in enumerate(batch):
            context[i, : r.start] = r.context[0, : r.start]
        starts = torch.tensor([r.start for r in batch], device=dev)
        ids = torch.full((n, blk), cfg.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = torch.tensor([r.token for r in batch], device=dev)
        pos = starts[:, None] + torch.arange(blk, device=dev)
        ctx_pos = torch.arange(width, device=dev)[None].expand(n, width)
        seen = torch.cat(
            [
                (ctx_pos < starts[:, None])[:, None, :].expand(n, blk, width),
                torch.ones(n, blk, blk, dtype=torch.bool, device=dev),
            ],
            dim=-1,
        )  # [n, Q, S+Q]
        mask = seen
        if cfg.has_sliding_layers:
            mask = {FULL: seen, SLIDING: seen & inference_sliding_mask(blk, ctx_pos, pos, cfg.sliding_window)}
        hidden = d(ids, pos, context, ctx_pos, mask)
        return d.lm_head(hidden[:, 1:])


def measure_replay_batched(
    drafter: DFlashDrafter,
    refs: list[HeldOut],
    budgets: tuple[int, ...],
    count: str,
    kernel_path: str,
    stop_ids: tuple[int, ...] = (),
    max_walks: int = 64,
) -> Measured:
    """measure_replay's result (same rounds, same aggregation) with up to `max_walks` prompts'
    rounds in one drafter forward (and bounds the padded forward's memory)."""
    if max_walks < 1:
        raise ValueError(f"max_walks must be >= 1, got {max_walks}")
    chains: list[list[int] | None] = [None] * len(refs)
    trees: dict[int, list[list[int] | None]] = {b: [None] * len(refs) for b in budgets}
    for lo in range(0, len(refs), max_walks):
        group = list(range(lo, min(lo + max_walks, len(refs))))
        proxy = BatchingDrafter(drafter, len(group))
        errors: list[BaseException] = []

        def walk(i: int, proxy: BatchingDrafter = proxy, errors: list = errors) -> None:
            ref = refs[i]
            try:
                chain, per_budget = replay_sequence(
                    proxy,
                    list(ref.sequence),
                    ref.features,
                    ref.prompt_len,
                    budgets,
                    end=ref.end,
                    count=count,
                    stop_ids=stop_ids,
                )
                chains[i] = chain
                for b in budgets:
                    trees[b][i] = per_budget[b]
            except BaseException as e:
                errors.append(e)
            finally:
                proxy.finished()

        threads = [threading.Thread(target=walk, args=(i,), name=f"replay-{i}", daemon=True) for i in group]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    return Measured(aggregate_rounds(drafter.config.block_size, chains, trees, kernel_path), chains, trees)
