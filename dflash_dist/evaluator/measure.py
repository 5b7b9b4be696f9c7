"""One drafter measured on the held-out prompts: greedy replay (every checkpoint) and live
speculative decoding (eval.mode=live), aggregated the one way (model/replay.aggregate_rounds),
with each prompt's per-round tau kept so replay and live can be compared round by round.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_dist.evaluator.live import live_decode
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.replay import ReplayResult, aggregate_rounds, replay_sequence
from dflash_dist.target.continuations import LOOP_DEFINITION, ends_in_loop
from dflash_dist.target.weights_check import VerifiedWeights


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
    sequences: list[list[int]] | None = None  # live: each prompt's own continuation (the chain's)

    def record(self, budgets: tuple[int, ...]) -> dict[str, Any]:
        r = self.result
        return {"tau_chain": r.tau_chain, "tau_ddtree": {b: r.tau_ddtree(b) for b in budgets},
                "accept_hist": list(r.accept_hist), "slot_acceptance": list(r.slot_acceptance), "rounds": r.rounds}

    def rounds_json(self) -> dict[str, Any]:
        return {"chain": self.chain_rounds, "ddtree": {str(b): t for b, t in self.tree_rounds.items()}}


def loop_free(measured: Measured, refs: list[HeldOut], budgets: tuple[int, ...]) -> dict[str, Any]:
    """tau over the prompts whose reference continuation does not end in a loop (the target going
    round the same segment: target/continuations.ends_in_loop). A loop is trivial to draft, so a
    small target's loops lift tau; this is the tau the drafter earns on the rest. Same rounds, same
    aggregation, fewer prompts. With no loop-free prompt left ("prompts": 0: every continuation
    loops) the taus are None, not the NaN of an empty mean: tables say "n/a (0 loop-free prompts)"
    (policy.loop_free_text), JSON holds null, TensorBoard gets no loop-free scalar."""
    keep = [i for i, ref in enumerate(refs) if not ends_in_loop(ref.continuation)]
    res = aggregate_rounds(measured.result.block_size, [measured.chain_rounds[i] for i in keep],
                           {b: [measured.tree_rounds[b][i] for i in keep] for b in budgets})
    n = len(res.tau_chain_per_prompt)
    return {"definition": LOOP_DEFINITION, "prompts": n, "loops": len(refs) - len(keep),
            "tau_chain": res.tau_chain if n else None,
            "tau_ddtree": {b: res.tau_ddtree(b) if n else None for b in budgets}}


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


def decode_prompt(target: nn.Module, drafter: DFlashDrafter, prompt: list[int], budgets: tuple[int, ...], count: str,
                  stop_ids: tuple[int, ...], max_new_tokens: int) -> tuple[list[int], list[int], dict[int, list[int]]]:
    """One prompt decoded live: (the chain's tokens, the chain's taus, taus per DDTree budget)."""
    run = live_decode(target, drafter, prompt, max_new_tokens, stop_ids, None, count)
    trees = {b: list(live_decode(target, drafter, prompt, max_new_tokens, stop_ids, b, count).taus) for b in budgets}
    return list(run.tokens), list(run.taus), trees


def _live_measured(done: list[tuple[list[int], list[int], dict[int, list[int]]]], refs: list[HeldOut],
                   budgets: tuple[int, ...], block_size: int, kernel_path: str) -> Measured:
    """decode_prompt's results for `refs`, in their order, as one Measured."""
    chains = [taus for _, taus, _ in done]
    trees = {b: [t[b] for _, _, t in done] for b in budgets}
    equal = sum(tokens == ref.continuation for (tokens, _, _), ref in zip(done, refs))
    return Measured(aggregate_rounds(block_size, chains, trees, kernel_path), chains, trees, equal,
                    [tokens for tokens, _, _ in done])


def measure_live(target: nn.Module, drafter: DFlashDrafter, refs: list[HeldOut], budgets: tuple[int, ...],
                 count: str, stop_ids: tuple[int, ...], max_new_tokens: int, kernel_path: str) -> Measured:
    done = [decode_prompt(target, drafter, ref.prompt, budgets, count, stop_ids, max_new_tokens) for ref in refs]
    return _live_measured(done, refs, budgets, drafter.config.block_size, kernel_path)


_WORKER: dict[str, Any] = {}  # a live worker process's target and drafter, or why it has none (live_worker_init)


def live_worker_init(cfg_dict: dict, export_dir: str, kernel_path: str, threads: int,
                     verified: VerifiedWeights, own: bool = True) -> None:
    """A live worker: its own copy of the target (the weights the evaluator verified, `verified`, from
    its target_dir: other weight files are refused; on the kernels the evaluator checked and capture.kernels
    applied: the same path is required) and of the drafter export (`own`, one of the run's: its checksum
    record required and verified, as the evaluator requires it; else a drafter from elsewhere). A refusal
    is kept and raised by every prompt's call, so the evaluator gets the error itself (an initializer
    that raises only breaks the pool)."""
    try:
        _WORKER.update(_load_worker(cfg_dict, export_dir, kernel_path, threads, verified, own), error=None)
    except Exception as e:
        _WORKER.clear()
        _WORKER["error"] = e


def _load_worker(cfg_dict: dict, export_dir: str, kernel_path: str, threads: int,
                 verified: VerifiedWeights, own: bool) -> dict[str, Any]:
    from dflash_dist.capture.fused_target import apply_capture_kernels
    from dflash_dist.config import load_config_dict
    from dflash_dist.model.capture import check_kernel_path
    from dflash_dist.model.export import load_drafter
    from dflash_dist.target.loading import load_verified_target

    torch.set_num_threads(threads)
    cfg = load_config_dict(cfg_dict)
    model, _, _ = load_verified_target(cfg, Path(verified.target_dir), verified.target_hash,
                                       f"live worker (pid {os.getpid()})", verified)
    path = check_kernel_path(model, cfg.target.allow_torch_gdn_on_cuda)
    path = apply_capture_kernels(cfg.capture.kernels, model, path)
    if path != kernel_path:
        raise RuntimeError(f"live worker: the target in {verified.target_dir} loaded on kernel path {path!r}, the "
                           f"evaluator's is {kernel_path!r}")
    dev = next(model.parameters()).device
    drafter = load_drafter(export_dir, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                           device=dev, require_record=own)
    return {"model": model, "drafter": drafter}


def live_worker_prompt(prompt: list[int], budgets: tuple[int, ...], count: str, stop_ids: tuple[int, ...],
                       max_new_tokens: int) -> tuple[list[int], list[int], dict[int, list[int]]]:
    """decode_prompt in a worker, on its own target and drafter."""
    if _WORKER.get("error") is not None:
        raise _WORKER["error"]
    return decode_prompt(_WORKER["model"], _WORKER["drafter"], prompt, budgets, count, stop_ids, max_new_tokens)


def measure_live_workers(workers: int, cfg_dict: dict, weights: VerifiedWeights, export_dir: str | Path,
                         refs: list[HeldOut], budgets: tuple[int, ...], count: str, stop_ids: tuple[int, ...],
                         max_new_tokens: int, kernel_path: str, block_size: int, own: bool = True) -> Measured:
    """measure_live with the prompts spread over `workers` spawned processes (eval.live_workers),
    each decoding one prompt at a time as measure_live does; the per-prompt rounds come back in
    prompt order, so the result is measure_live's. `weights`: the evaluator's verified target
    (weights_check.py), loaded by every worker without hashing it again while its files are unchanged.
    `own`: the export is one of the run's (its checksum record required, as live_worker_init says)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    threads = max(1, (os.cpu_count() or 1) // workers)
    ctx = multiprocessing.get_context("spawn")
    initargs = (cfg_dict, str(export_dir), kernel_path, threads, weights, own)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=live_worker_init, initargs=initargs) as pool:
        futures = [pool.submit(live_worker_prompt, ref.prompt, budgets, count, stop_ids, max_new_tokens)
                   for ref in refs]  # fmt: skip
        done = [f.result() for f in futures]
    return _live_measured(done, refs, budgets, block_size, kernel_path)


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
