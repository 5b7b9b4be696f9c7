"""The evaluator: greedy-replay tau (SPEC 4) of each drafter export the trainer writes.

Plain Python (the Ray actor in actors/evaluator_actor.py only runs it in a thread). The target
is loaded once, the way capture loads it, so its Provenance (target, layers, dtype, GDN kernel
path, template) is computed, not assumed: a drafter trained on features of another origin is
refused instead of scored. The target's greedy continuation of every held-out prompt and the
target features of prompt+continuation do not depend on the checkpoint, so they are computed
once and reused; each checkpoint then costs only drafter forwards.

Files under the run directory `<out>`:
  export/step_N/{config.json, model.safetensors}  read: written atomically by the trainer
  eval/step_N.json                                 written atomically, one EvalResult each
  tb/eval/                                         eval/tau_chain, eval/tau_ddtree_<b>,
                                                   eval/slot_acceptance_<j> at global step N
The eval/step_N.json files are the evaluator's progress: a restarted evaluator reads them and
continues after the last checkpoint it finished.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from data_pipeline.chat_data import template_hash
from data_pipeline.durable_files import write_text_atomic
from data_pipeline.provenance import Provenance, check_compatible
from data_pipeline.shard_reader import read_manifest
from dflash_dist.config import Config
from dflash_dist.evaluator.policy import EvalRequest, EvalResult, pending_steps, should_stop
from dflash_dist.model.capture import capture_features, check_kernel_path
from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.export import load_drafter
from dflash_dist.model.replay import ReplayResult, replay_sequence
from dflash_dist.target.generation import generate_responses, pad_token_id, stop_token_ids
from dflash_dist.target.loading import load_target, provenance_for, target_identity
from dflash_dist.trainer.metrics import Metrics

log = logging.getLogger(__name__)

EXPORT_NAME_RE = re.compile(r"step_(\d+)")
RESULT_NAME_RE = re.compile(r"step_(\d+)\.json")
EXPORT_FILES = ("config.json", "model.safetensors")
_STATE_VERSION = 1


def list_exports(export_root: str | os.PathLike[str]) -> dict[int, Path]:
    """Complete exports by step: `step_<int>/` directories holding both export files.

    The trainer renames an export into place only when it is whole, so `.tmp-*` directories
    (and anything else not named `step_<int>`) are never looked at.
    """
    root = Path(export_root)
    if not root.is_dir():
        return {}
    found = {}
    for d in root.iterdir():
        m = EXPORT_NAME_RE.fullmatch(d.name)
        if m and d.is_dir() and all((d / f).is_file() for f in EXPORT_FILES):
            found[int(m.group(1))] = d
    return dict(sorted(found.items()))


@dataclass(frozen=True)
class _Reference:
    """One held-out prompt as replay needs it; independent of the checkpoint."""

    prompt_len: int
    sequence: tuple[int, ...]  # prompt + the target's greedy continuation
    features: torch.Tensor  # [T, k*H] target features of `sequence`


class Evaluator:
    """Evaluates drafter exports of one run against one target (see the module docstring).

    `eval_prompts` are token-id lists (the first cfg.eval.num_prompts are used). `expected`,
    when given, is the provenance of the training shards: the evaluator refuses to start if its
    own target, as loaded here, would produce other features. `shard_dir`, when given, is
    re-checked record by record before every evaluation (shards may be added while training).
    """

    def __init__(self, cfg: Config, out_dir: str | os.PathLike[str], target_dir: str | os.PathLike[str],
                 eval_prompts: list[list[int]], expected: Provenance | None,
                 shard_dir: str | os.PathLike[str] | None = None) -> None:
        prompts = [[int(t) for t in p] for p in eval_prompts[: cfg.eval.num_prompts]]
        if not prompts or not all(prompts):
            raise ValueError("Evaluator needs at least one non-empty eval prompt (data.eval_path, eval.num_prompts)")
        self.cfg = cfg
        self.out = Path(out_dir)
        self.export_root = self.out / "export"
        self.eval_dir = self.out / "eval"
        self.tb_dir = self.out / "tb" / "eval"
        self.shard_dir = Path(shard_dir) if shard_dir is not None else None
        self.eval_prompts = prompts
        self.budgets = tuple(int(b) for b in cfg.eval.budgets)

        target_dir = Path(target_dir)
        self.identity = target_identity(cfg, target_dir)
        self.model, self.tokenizer = load_target(cfg, target_dir)
        check_kernel_path(self.model, cfg.target.allow_torch_gdn_on_cuda)
        self.provenance = provenance_for(
            self.identity, self.model, template_hash(self.tokenizer, cfg.data.enable_thinking)
        )
        if expected is not None:
            check_compatible(expected, self.provenance, f"the evaluator's target {target_dir} as loaded here")
        self.stop_ids = stop_token_ids(self.tokenizer)  # target/generation.py: the one stop rule
        self.pad_id = pad_token_id(self.tokenizer, self.stop_ids)
        self.device = next(self.model.parameters()).device

        self._refs: list[_Reference] | None = None
        self._metrics: Metrics | None = None  # opened on the first result
        # Replaced, never mutated, so another thread (the actor's status()) reads a consistent copy.
        self.results: dict[int, EvalResult] = self._read_results()
        self.done: frozenset[int] = frozenset(self.results)

    # ---- progress -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"version": _STATE_VERSION, "evaluated": sorted(self.done)}

    def load_state_dict(self, state: dict) -> None:
        """Steps evaluated by a previous run; merged with those whose eval/step_N.json exists."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"evaluator state version {state.get('version')!r}, this code reads {_STATE_VERSION}")
        self.done = frozenset(self.done | {int(s) for s in state["evaluated"]})

    def _read_results(self) -> dict[int, EvalResult]:
        results = {}
        if self.eval_dir.is_dir():
            for f in self.eval_dir.iterdir():
                m = RESULT_NAME_RE.fullmatch(f.name)
                if m:
                    result = EvalResult.from_json(json.loads(f.read_text()), str(f))
                    if result.step != int(m.group(1)):
                        raise ValueError(f"{f}: holds step {result.step}; delete or rename the file")
                    results[result.step] = result
        return dict(sorted(results.items()))

    # ---- checks ---------------------------------------------------------------------------

    def check_shards(self, shard_dir: str | os.PathLike[str]) -> int:
        """Refuse shards captured differently from this evaluator's target: ProvenanceMismatch
        naming the shard and the fields. Returns the number of shards checked."""
        records = read_manifest(shard_dir)
        for record in records:
            check_compatible(self.provenance, record.provenance, str(Path(shard_dir) / record.name))
        return len(records)

    def _check_drafter(self, config: DrafterConfig, export_dir: Path) -> None:
        if tuple(config.target_layer_ids) != self.identity.layer_ids:
            raise ValueError(
                f"{export_dir}/config.json: the drafter reads target layers {list(config.target_layer_ids)}, this "
                f"evaluator captures {list(self.identity.layer_ids)}: set capture.layer_ids (or capture.num_layers) "
                "to what the drafter was trained with"
            )
        if config.hidden_size != self.identity.hidden_size:
            raise ValueError(f"{export_dir}/config.json: hidden_size {config.hidden_size} is not the target's "
                             f"{self.identity.hidden_size}: this export belongs to another target")

    # ---- evaluation -----------------------------------------------------------------------

    def references(self) -> list[_Reference]:
        """Greedy continuations and target features of the eval prompts, computed on first use."""
        if self._refs is None:
            t0 = time.time()
            refs = []
            for prompt in self.eval_prompts:
                (gen,) = generate_responses(self.model, [prompt], self.cfg.eval.max_new_tokens, self.stop_ids,
                                            self.pad_id)
                y = list(gen.tokens)
                if len(y) < 2:  # the first token comes from the prompt itself: no drafting round
                    continue
                seq = prompt + y
                ids = torch.tensor([seq], device=self.device)
                cap = capture_features(self.model, ids, self.identity.layer_ids, with_argmax=False,
                                       allow_torch_gdn_on_cuda=self.cfg.target.allow_torch_gdn_on_cuda)
                assert cap.kernel_path == self.provenance.kernel_path, (cap.kernel_path, self.provenance)
                refs.append(_Reference(len(prompt), tuple(seq), cap.features[0]))
            if not refs:
                raise ValueError(
                    f"none of the {len(self.eval_prompts)} eval prompts got a greedy continuation of 2+ tokens "
                    f"(a stop token {list(self.stop_ids)} right away?): check the eval prompts and eval.max_new_tokens"
                )
            log.info("evaluator: %d reference continuations (%d tokens) in %.1fs", len(refs),
                     sum(len(r.sequence) - r.prompt_len for r in refs), time.time() - t0)
            self._refs = refs
        return self._refs

    def evaluate(self, step: int, export_dir: str | os.PathLike[str]) -> EvalResult:
        """Replay tau of one export; writes eval/step_N.json and the eval/ scalars at step N."""
        t0 = time.time()
        export_dir = Path(export_dir)
        refs = self.references()
        drafter = load_drafter(export_dir, self.model.get_input_embeddings().weight,
                               self.model.get_output_embeddings().weight, device=self.device)
        self._check_drafter(drafter.config, export_dir)
        blk = drafter.config.block_size
        res = ReplayResult(block_size=blk, accept_hist=[0] * blk, kernel_path=self.provenance.kernel_path)
        res.tau_ddtree_per_prompt = {b: [] for b in self.budgets}
        for ref in refs:  # aggregated as replay_tau does: mean over prompts of per-prompt means
            chain, trees = replay_sequence(drafter, list(ref.sequence), ref.features, ref.prompt_len, self.budgets)
            res.tau_chain_per_prompt.append(sum(chain) / len(chain))
            res.rounds += len(chain)
            for t in chain:
                res.accept_hist[t - 1] += 1
            for b, taus in trees.items():
                res.tau_ddtree_per_prompt[b].append(sum(taus) / len(taus))
        del drafter
        result = EvalResult(
            step=step, tau_chain=res.tau_chain, tau_ddtree={b: res.tau_ddtree(b) for b in self.budgets},
            accept_hist=tuple(res.accept_hist), slot_acceptance=tuple(res.slot_acceptance),
            prompts=len(refs), rounds=res.rounds, kernel_path=res.kernel_path, seconds=time.time() - t0,
        )
        # Scalars first, then the result file that marks the step done: a crash in between
        # re-evaluates the step after a restart (a repeated point) instead of losing the point.
        self._log_scalars(result)
        self._write_result(result)
        self.results = {**self.results, step: result}
        self.done = self.done | {step}
        trees = " ".join(f"ddtree{b}={t:.3f}" for b, t in result.tau_ddtree.items())
        log.info("evaluator: step %d tau chain=%.3f %s (%d prompts, %.1fs)", step, result.tau_chain, trees,
                 result.prompts, result.seconds)
        return result

    def _write_result(self, result: EvalResult) -> None:
        self.eval_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.eval_dir / f"step_{result.step}.json", json.dumps(result.to_json(), indent=2) + "\n")

    def _log_scalars(self, result: EvalResult) -> None:
        if self._metrics is None:
            self._metrics = Metrics(self.tb_dir)
        scalars = {"eval/tau_chain": result.tau_chain}
        scalars.update({f"eval/tau_ddtree_{b}": tau for b, tau in result.tau_ddtree.items()})
        scalars.update({f"eval/slot_acceptance_{j}": a for j, a in enumerate(result.slot_acceptance, start=1)})
        self._metrics.log(result.step, scalars)
        self._metrics.flush()

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    # ---- the loop -------------------------------------------------------------------------

    def next_request(self, max_backlog: int = 4, stride: int = 2) -> EvalRequest | None:
        """The export to evaluate now (policy.pending_steps over what is on disk), if any."""
        available = list_exports(self.export_root)
        todo = pending_steps(list(available), set(self.done), max_backlog, stride)
        return EvalRequest(todo[0], str(available[todo[0]])) if todo else None

    def run_until(self, stop: Callable[[], tuple[bool, int | None]], poll_s: float = 5.0, max_backlog: int = 4,
                  stride: int = 2, final_export_timeout_s: float = 600.0) -> list[EvalResult]:
        """Evaluate exports as they appear until policy.should_stop; returns this call's results.

        `stop()` returns (trainer finished, its final step). The trainer reports its final step
        only after that export exists; if it is still missing `final_export_timeout_s` later,
        this raises instead of waiting forever.
        """
        evaluated: list[EvalResult] = []
        missing_since: float | None = None
        while True:
            finished, final_step = stop()  # read before listing: an export reported final is on disk
            request = self.next_request(max_backlog, stride)
            if request is not None:
                if self.shard_dir is not None:
                    self.check_shards(self.shard_dir)
                try:
                    evaluated.append(self.evaluate(request.step, request.path))
                except FileNotFoundError:
                    if request.path.exists():
                        raise
                    log.warning("evaluator: export %s was removed before it was evaluated", request.path)
                continue
            if should_stop(finished, final_step, set(self.done)):
                return evaluated
            if finished and final_step is not None:
                missing_since = missing_since or time.time()
                if time.time() - missing_since > final_export_timeout_s:
                    raise FileNotFoundError(
                        f"the trainer finished at step {final_step} but {self.export_root}/step_{final_step} "
                        f"(with {' and '.join(EXPORT_FILES)}) did not appear within {final_export_timeout_s:.0f}s"
                    )
            time.sleep(poll_s)
