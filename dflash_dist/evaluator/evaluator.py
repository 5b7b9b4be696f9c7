"""The evaluator: tau (SPEC 4) of each drafter export the trainer writes, three ways.

eval.mode: `replay` (greedy replay, every checkpoint; always measured), `live` (also real
speculative decoding through the target's cache, chain and DDTree, every eval.live_every-th
checkpoint; live.py), `server` (also the serving engine's own count from eval.server_url;
server.py). eval.count picks how a round at the continuation's end counts. eval.reference_drafter
is measured once on the same prompts and modes; each checkpoint's tau is shown against it.

Plain Python (the Ray actor in actors/evaluator_actor.py only runs it in a thread). The target
is loaded once, the way capture loads it, so its Provenance (target, layers, dtype, GDN kernel
path, template) is computed, not assumed: a drafter trained on features of another origin is
refused instead of scored. The weight files it loads must hash to the run's recorded target_hash
(target/weights_check.py: hashed once per process; the live workers reuse that check while the
files are unchanged, and refuse other weights too). The target's greedy continuation of every held-out prompt and the
target features of prompt+continuation do not depend on the checkpoint, so they are computed
once (while the evaluator waits for the first export) and reused; each checkpoint then costs only
drafter forwards.

Files under the run directory `<out>`:
  export/step_N/{config.json, model.safetensors}  read: written atomically by the trainer
  eval/step_N.json                                 written atomically, one EvalResult each
  eval/rounds/step_N.json                          every prompt's per-round tau, replay and live
  eval/reference.json                              the reference drafter's tau (measured once)
  tb/eval/                                         scalars and images at global step N (tb_log.py)
The eval/step_N.json files are the evaluator's progress: a restarted evaluator reads them and
continues after the last checkpoint it finished. A checkpoint whose result lacks what eval.mode
asks (live or server tau; `dflash-dist eval ... eval.mode=live` on a run evaluated by replay) is
measured again for that mode, keeping the result's replay tau and its other modes; results of
another eval.count are refused (one count per run directory).

A resume from an earlier checkpoint (trainer/discard.py) moves the results and exports of the
steps after it into <out>/discarded/; the trainer then writes those exports again. A result is
trusted only while its eval/step_N.json is still there and export/step_N holds the files it
measured (their checksums are in the result): the evaluator checks this before each choice of
export, since it may have read the results before the trainer moved them, or measured an old
export the trainer moved meanwhile (that result is moved aside too: at once if the export is gone
or replaced once the result is written; rank 0 lists the results again after moving the exports,
so none written meanwhile stays either). Dropped steps are measured again (one below the newest
measured too, e.g. an export replaced by `dflash-dist export --force`), and the TensorBoard writer
is reopened with purge_step at the lowest dropped step (the trusted results after it are logged
again), so the discarded points are no longer shown. Every opening purges past the newest trusted
result: a point with no result file behind it is a crashed attempt's or a discarded one's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from data_pipeline.durable_files import write_text_atomic
from data_pipeline.provenance import Provenance, check_compatible
from data_pipeline.shard_reader import read_manifest
from dflash_dist.capture.fused_target import features_provenance
from dflash_dist.config import Config
from dflash_dist.evaluator.batched_replay import measure_replay_batched
from dflash_dist.evaluator.measure import HeldOut, loop_free, measure_live, measure_live_workers, rounds_agreement
from dflash_dist.evaluator.policy import (
    EvalRequest,
    EvalResult,
    lacks_mode,
    live_checkpoint,
    loop_free_text,
    pending_steps,
    should_stop,
    tau_record_from_json,
)
from dflash_dist.evaluator.server import ServerError, server_tau
from dflash_dist.evaluator.tb_log import log_result, logged_tags
from dflash_dist.model.capture import capture_features
from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.export import load_drafter, recorded_checksums
from dflash_dist.target.generation import generate_in_batches, generate_responses, pad_token_id, stop_token_ids
from dflash_dist.target.loading import TargetIdentity, load_verified_target, require_target_dir, target_identity
from dflash_dist.target.weights_check import VerifiedWeights
from dflash_dist.trainer.discard import move_aside
from dflash_dist.trainer.metrics import Metrics

log = logging.getLogger(__name__)

EXPORT_NAME_RE = re.compile(r"step_(\d+)")
RESULT_NAME_RE = re.compile(r"step_(\d+)\.json")
EXPORT_FILES = ("config.json", "model.safetensors")
_STATE_VERSION = 2
_READS_STATE = (1, 2)  # 1: steps alone (their exports unknown: trusted as they are)
REFERENCE_VERSION = 1


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


class Evaluator:
    """Evaluates drafter exports of one run against one target (see the module docstring).

    `eval_prompts` are token-id lists (the first cfg.eval.num_prompts are used). `expected`,
    when given, is the provenance of the training shards: the evaluator refuses to start if its
    own target, as loaded here, would produce other features. `shard_dir`, when given, is
    re-checked record by record before every evaluation (shards may be added while training).
    """

    def __init__(self, cfg: Config, out_dir: str | os.PathLike[str], target_dir: str | os.PathLike[str],
                 eval_prompts: list[list[int]], expected: Provenance | None,
                 shard_dir: str | os.PathLike[str] | None = None, identity: TargetIdentity | None = None,
                 weights: VerifiedWeights | None = None) -> None:
        """identity: the run plan's (the weight files loaded here must hash to its target_hash: checked
        once per process, weights_check.py); None: computed here. weights: the run plan's check of
        them (made in the driver), which spares the hash while the files carry its stamp."""
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
        self.target_dir = target_dir
        require_target_dir(target_dir, "the evaluator")  # on this node: else an error naming it and the fix
        self.identity = identity if identity is not None else target_identity(cfg, target_dir)
        # the weights loaded here (and by every live worker: self.weights) are those the identity's
        # hash names, i.e. the features' target: checked once per process, refused otherwise
        self.model, self.tokenizer, self.weights = load_verified_target(
            cfg, target_dir, self.identity.target_hash, f"the evaluator's target {target_dir}", weights)
        # its own target's features, computed here (never read from shards: as serving does), on the
        # kernels capture ran (capture.kernels); the encoding names how the training shards store
        # theirs, so the checks compare like for like
        self.provenance, self._gdn_path = features_provenance(cfg, self.identity, self.model, self.tokenizer)
        if expected is not None:
            check_compatible(expected, self.provenance, f"the evaluator's target {target_dir} as loaded here")
        self.stop_ids = stop_token_ids(self.tokenizer)  # target/generation.py: the one stop rule
        self.pad_id = pad_token_id(self.tokenizer, self.stop_ids)
        self.device = next(self.model.parameters()).device

        self._refs: list[HeldOut] | None = None
        self._reference: dict | None = None  # the reference drafter's tau, measured on first use
        self._metrics: Metrics | None = None  # opened on the first result
        self._claims: dict[int, dict | None] = {}  # steps load_state_dict added: their exports' checksums
        self._ids: dict[int, tuple[tuple[int, int], dict | None]] = {}  # export step -> (its stat, checksums)
        self._redo: frozenset[int] = frozenset()  # steps whose results were moved aside: measured again
        self._purge_at: int | None = None  # the lowest of them: the writer is reopened purging from there
        # Replaced, never mutated, so another thread (the actor's status()) reads a consistent copy.
        self.results: dict[int, EvalResult] = self._read_results()
        self._check_count()
        # done: holds what eval.mode asks; the others are measured again for the missing mode
        self.done: frozenset[int] = frozenset(s for s, r in self.results.items() if not lacks_mode(r, cfg.eval.mode))
        missing = sorted(set(self.results) - self.done)
        if missing:
            log.info("evaluator: steps %s have no %s tau yet: measuring it (their replay tau and other modes are "
                     "kept)", missing, cfg.eval.mode)

    # ---- progress -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The steps done, with the checksums of the export each measured (None: unknown)."""
        exports = {str(s): self.results[s].export if s in self.results else self._claims.get(s) for s in self.done}
        return {"version": _STATE_VERSION, "evaluated": sorted(self.done), "exports": exports}

    def load_state_dict(self, state: dict) -> None:
        """Steps evaluated by a previous run; merged with those whose eval/step_N.json exists. A step
        whose export holds other files now than it measured is dropped again (next_request)."""
        if state.get("version") not in _READS_STATE:
            raise ValueError(f"evaluator state version {state.get('version')!r}, this code reads {list(_READS_STATE)}")
        exports = state.get("exports") or {}
        added = {int(s) for s in state["evaluated"]} - self.done
        self._claims = {**self._claims, **{s: exports.get(str(s)) for s in added}}
        self.done = frozenset(self.done | added)

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

    def _check_count(self) -> None:
        """One eval.count per run directory: a result file holds one count, and a curve mixing
        two would not compare."""
        want = self.cfg.eval.count
        other = sorted(s for s, r in self.results.items() if r.count != want)
        if other:
            got = self.results[other[0]].count
            raise ValueError(
                f"{self.eval_dir}/step_{other[0]}.json (and {len(other) - 1} more) counts tau with eval.count={got}, "
                f"this run asks eval.count={want}: pass eval.count={got} to add modes to those results, or move "
                f"{self.eval_dir} and {self.tb_dir} aside to measure every export again with eval.count={want}"
            )

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

    def references(self) -> list[HeldOut]:
        """Greedy continuations and target features of the eval prompts, computed on first use."""
        if self._refs is None:
            t0 = time.time()
            # greedy continuations in left-padded batches; features one sequence at a time, unpadded
            gens = generate_in_batches(self.model, self.eval_prompts, self.cfg.eval.max_new_tokens, self.stop_ids,
                                       self.pad_id, self.cfg.eval.reference_batch)  # fmt: skip
            refs = [self._held_out(prompt, g.tokens) for prompt, g in zip(self.eval_prompts, gens)]
            log.info("evaluator: %d reference continuations (%d tokens) in %.1fs", len(refs),
                     sum(len(r.sequence) - r.prompt_len for r in refs), time.time() - t0)
            self._refs = refs
        return self._refs

    def _held_out(self, prompt: list[int], continuation: list[int]) -> HeldOut:
        """prompt + continuation with the target's features of it, computed here (one unpadded sequence)."""
        seq = prompt + list(continuation)
        cap = capture_features(self.model, torch.tensor([seq], device=self.device), self.identity.layer_ids,
                               with_argmax=False, allow_torch_gdn_on_cuda=self.cfg.target.allow_torch_gdn_on_cuda)
        assert cap.kernel_path == self._gdn_path, (cap.kernel_path, self.provenance)  # GDN's: fla under fla_fused too
        return HeldOut(len(prompt), len(seq), tuple(seq), cap.features[0])

    def _usable(self, refs: list[HeldOut]) -> list[HeldOut]:
        """The references that have a round under eval.count: capped, a continuation of 2+ tokens
        (the first comes from the prompt itself); uncapped, every one (the authors' loop runs a
        round at a one-token continuation too)."""
        if self.cfg.eval.count == "uncapped":
            return refs
        usable = [r for r in refs if r.end - r.prompt_len >= 2]
        if not usable:
            raise ValueError(
                f"none of the {len(self.eval_prompts)} eval prompts got a greedy continuation of 2+ tokens "
                f"(a stop token {list(self.stop_ids)} right away?): check the eval prompts and eval.max_new_tokens"
            )
        return usable

    def _counted(self, refs: list[HeldOut], block_size: int) -> list[HeldOut]:
        """The references as eval.count needs them (`_usable`): uncapped rounds look past the
        continuation's end, so each gets the target's greedy tokens beyond it (stop tokens
        ignored, as a decoding loop that counts every accepted draft sees them)."""
        refs = self._usable(refs)
        if self.cfg.eval.count == "capped":
            return refs
        need = block_size - 1
        out = []
        for ref in refs:
            if len(ref.sequence) - ref.end < need:
                head = list(ref.sequence[: ref.end])
                (ext,) = generate_responses(self.model, [head], need, (), self.pad_id)
                ref = HeldOut(ref.prompt_len, ref.end, tuple(head + list(ext.tokens)), ref.features)
            out.append(ref)
        self._refs = out
        return out

    def _replay_own(self, drafter, refs: list[HeldOut], measured) -> dict | None:
        """Greedy replay over live decoding's own continuations (their features computed here as
        the references' are): live tau against it separates the decoding loop from any drift
        between the references' and live's sequences (bf16 near-ties, batched generation).
        Capped counting only (uncapped would need the target's tokens past each end)."""
        if self.cfg.eval.count != "capped" or measured.sequences is None:
            return None
        # a continuation of fewer than 2 tokens has no round to replay (as _usable drops such references)
        own = [self._held_out(ref.prompt, tokens) for ref, tokens in zip(refs, measured.sequences) if len(tokens) >= 2]
        if not own:
            return None
        res = self._replay(drafter, own, "capped").result
        return {"tau_chain": res.tau_chain, "tau_ddtree": {b: res.tau_ddtree(b) for b in self.budgets},
                "prompts": len(own)}

    def _replay(self, drafter, refs: list[HeldOut], count: str):
        """Greedy replay of every reference, all prompts' rounds in one drafter forward
        (batched_replay: measure_replay's rounds, prompt for prompt; on the H200 one checkpoint of
        the mid run's 64 prompts took 24-26 s one prompt at a time)."""
        return measure_replay_batched(drafter, refs, self.budgets, count, self.provenance.kernel_path, self.stop_ids)

    def _load_drafter(self, export_dir: Path, own: bool = True):
        """An export of this run (`own`: its checksum record required and verified) or another drafter."""
        drafter = load_drafter(export_dir, self.model.get_input_embeddings().weight,
                               self.model.get_output_embeddings().weight, device=self.device, require_record=own)
        self._check_drafter(drafter.config, export_dir)
        return drafter

    def _live_now(self, step: int) -> bool:
        """live/server at this checkpoint (policy.live_checkpoint: the first, every eval.live_every-th
        after, the run's last)."""
        e = self.cfg.eval
        return e.mode != "replay" and live_checkpoint(len(self.done), step, e.live_every, e.live_first, e.live_last,
                                                      self.cfg.train.max_steps)  # fmt: skip

    def _measure_live(self, drafter, refs, export_dir: Path, own: bool = True):
        """Live tau of `drafter`, loaded from `export_dir` (again, by each live worker: `own` as _load_drafter's)."""
        e = self.cfg.eval
        if e.live_workers > 1:
            return measure_live_workers(e.live_workers, self.cfg.to_dict(), self.weights, export_dir, refs,
                                        self.budgets, e.count, self.stop_ids, e.max_new_tokens,
                                        self.provenance.kernel_path, drafter.config.block_size, own)  # fmt: skip
        return measure_live(self.model, drafter, refs, self.budgets, e.count, self.stop_ids, e.max_new_tokens,
                            self.provenance.kernel_path)

    def _measure_server(self, step: int, refs: list[HeldOut], block_size: int) -> dict:
        """The engine's tau as ServerResult JSON; a failed server is recorded as {"engine", "url",
        "error"} instead, so the checkpoint's replay tau is still written and logged."""
        e = self.cfg.eval
        try:
            return server_tau(e.server_url, e.server_engine, [r.prompt for r in refs], e.max_new_tokens, block_size,
                              e.server_model, e.server_concurrency, e.server_max_retries, e.server_timeout_s).to_json()
        except ServerError as err:
            log.warning("evaluator: step %d: no server tau (%s); the replay tau is recorded with the failure", step,
                        err)
            return {"engine": e.server_engine, "url": e.server_url, "error": str(err)}

    def reference_tau(self) -> dict | None:
        """The reference drafter's tau on the same prompts and modes (replay; live in live mode),
        measured once: kept in eval/reference.json, re-measured only if its settings changed."""
        e = self.cfg.eval
        if e.reference_drafter is None:
            return None
        if self._reference is None:
            path = self.eval_dir / "reference.json"
            key = {"version": REFERENCE_VERSION, "dir": str(Path(e.reference_drafter).resolve()), "count": e.count,
                   "live": e.mode == "live", "prompts": [r.prompt for r in self._usable(self.references())],
                   "budgets": list(self.budgets)}
            if path.is_file():
                saved = json.loads(path.read_text())
                if saved.get("key") == key:
                    self._reference = tau_record_from_json(saved["reference"])
                    return self._reference
            t0 = time.time()
            drafter = self._load_drafter(Path(e.reference_drafter), own=False)
            refs = self._counted(self.references(), drafter.config.block_size)
            replay = self._replay(drafter, refs, e.count)
            ref = {"dir": key["dir"], "tau_chain": replay.result.tau_chain,
                   "tau_ddtree": {b: replay.result.tau_ddtree(b) for b in self.budgets}}
            if e.mode == "live":
                live = self._measure_live(drafter, refs, Path(e.reference_drafter), own=False).result
                ref.update(live_tau_chain=live.tau_chain,
                           live_tau_ddtree={b: live.tau_ddtree(b) for b in self.budgets})
            del drafter
            self.eval_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps({"key": key, "reference": ref}, indent=2) + "\n")
            log.info("evaluator: reference drafter %s tau chain=%.3f (%.1fs)", e.reference_drafter, ref["tau_chain"],
                     time.time() - t0)
            self._reference = tau_record_from_json(json.loads(json.dumps(ref)))
        return self._reference

    def evaluate(self, step: int, export_dir: str | os.PathLike[str]) -> EvalResult:
        """tau of one export; writes eval/step_N.json (+ its rounds) and the eval/ TensorBoard data at step N."""
        t0 = time.time()
        e = self.cfg.eval
        export_dir = Path(export_dir)
        exported = self._export_id(step, export_dir)  # read first: a replaced export is at worst measured again
        drafter = self._load_drafter(export_dir)
        refs = self._counted(self.references(), drafter.config.block_size)
        kernel_path = self.provenance.kernel_path
        replay = self._replay(drafter, refs, e.count)
        rounds: dict = {"step": step, "count": e.count, "replay": replay.rounds_json()}
        live = server = None
        if self._live_now(step) and e.mode == "live":
            measured = self._measure_live(drafter, refs, export_dir)
            same, total = rounds_agreement(replay, measured)
            live = {**measured.record(self.budgets), "rounds_equal": same, "rounds_compared": total,
                    "continuations_equal": measured.tokens_equal, "prompts": len(refs),
                    "replay_own": self._replay_own(drafter, refs, measured)}
            rounds["live"] = measured.rounds_json()
        elif self._live_now(step) and e.mode == "server":
            server = self._measure_server(step, refs, drafter.config.block_size)
        del drafter
        res = replay.result
        earlier = self.results.get(step)  # lacks the asked mode: its replay tau and other modes are kept
        result = EvalResult(
            step=step, tau_chain=res.tau_chain, tau_ddtree={b: res.tau_ddtree(b) for b in self.budgets},
            accept_hist=tuple(res.accept_hist), slot_acceptance=tuple(res.slot_acceptance),
            prompts=len(res.tau_chain_per_prompt), rounds=res.rounds, kernel_path=kernel_path,
            seconds=time.time() - t0, mode=e.mode, count=e.count, live=live, server=server,
            reference=self.reference_tau(), loop_free=loop_free(replay, refs, self.budgets), export=exported,
        )
        rounds_path = self.eval_dir / "rounds" / f"step_{step}.json"
        if earlier is not None:
            result = replace(earlier, mode=e.mode, live=live if live is not None else earlier.live,
                             loop_free=earlier.loop_free if earlier.loop_free is not None else result.loop_free,
                             server=server if server is not None else earlier.server, reference=result.reference,
                             seconds=earlier.seconds + result.seconds, export=exported)
            if rounds_path.is_file():  # the earlier replay rounds stay, the new mode's are added
                rounds = {**json.loads(rounds_path.read_text()), **{k: v for k, v in rounds.items() if k != "replay"}}
        # TensorBoard and the rounds first, then the result file that marks the step done: a crash in
        # between re-evaluates the step after a restart (a repeated point) instead of losing the point.
        self._log_scalars(result, earlier)
        rounds_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(rounds_path, json.dumps(rounds) + "\n")
        self._write_result(result)
        self.results = {**self.results, step: result}
        self.done = self.done | {step}
        if not export_dir.is_dir() or self._export_id(step, export_dir) != exported:  # moved while measured
            self._forget({step: f"{export_dir} was moved or written again while it was measured (a resume from "
                                "an earlier checkpoint)"})  # fmt: skip
            return result
        trees = " ".join(f"ddtree{b}={t:.3f}" for b, t in result.tau_ddtree.items())
        extra = f" live chain={live['tau_chain']:.3f}" if live else ""
        extra += f" server={server['tau']:.3f}" if server and "error" not in server else ""
        extra += " server=FAILED" if server and "error" in server else ""
        extra += f" vs reference x{result.tau_chain_vs_reference:.3f}" if result.reference else ""
        lf = result.loop_free
        if lf and lf["loops"]:  # "n/a (0 loop-free prompts)" when every continuation loops
            extra += f" loop-free chain={loop_free_text(lf, 3)}"
            extra += f" ({lf['prompts']} prompts)" if lf["prompts"] else ""
        log.info("evaluator: step %d tau chain=%.3f %s%s (%d prompts, %.1fs)", step, result.tau_chain, trees, extra,
                 result.prompts, result.seconds)
        return result

    # ---- results of a discarded future ----------------------------------------------------

    def _export_id(self, step: int, export_dir: Path) -> dict | None:
        """The checksums export_dir's record holds (None: no readable record), cached while the
        directory is the same (a new export is renamed in: another inode)."""
        try:
            st = export_dir.stat()
        except OSError:
            return None
        key = (st.st_ino, st.st_mtime_ns)
        cached = self._ids.get(step)
        if cached is not None and cached[0] == key:
            return cached[1]
        ident = recorded_checksums(export_dir)
        self._ids[step] = (key, ident)
        return ident

    def _drop_stale(self, available: dict[int, Path]) -> None:
        """Forget the done steps that are no longer what they say (module docstring): the result file
        is gone (moved aside by a rewind), or export/step_N holds other files than it measured (that
        result file, if any, is moved aside). Their points leave TensorBoard when it is reopened."""
        stale: dict[int, str] = {}
        for step in sorted(self.done):
            result = self.results.get(step)
            if result is not None and not (self.eval_dir / f"step_{step}.json").is_file():
                stale[step] = "its result file was moved or removed (a resume from an earlier checkpoint)"
                continue
            measured = result.export if result is not None else self._claims.get(step)
            if step in available and measured is not None and self._export_id(step, available[step]) != measured:
                stale[step] = f"{available[step]} holds other files than it measured (written again since)"
        if stale:
            self._forget(stale)

    def _forget(self, stale: dict[int, str]) -> None:
        """Move the results of `stale` (step: why) aside and measure those steps again."""
        for step, why in stale.items():
            log.warning("evaluator: step %d is measured again: %s", step, why)
        names = [f"step_{s}.json" for s in stale]
        files = [p for n in names for p in (self.eval_dir / n, self.eval_dir / "rounds" / n) if p.is_file()]
        move_aside(self.out, files, f"the evaluator's results of steps {sorted(stale)} measured exports that are gone",
                   "stale-results")  # fmt: skip
        self.results = {s: r for s, r in self.results.items() if s not in stale}
        self.done = self.done - set(stale)
        self._claims = {s: c for s, c in self._claims.items() if s not in stale}
        self._redo = self._redo | set(stale)
        self._purge_at = min(self._purge_at if self._purge_at is not None else min(stale), min(stale))
        self.close()  # reopened purging from the lowest of them (_log_scalars): their points go

    def _write_result(self, result: EvalResult) -> None:
        self.eval_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.eval_dir / f"step_{result.step}.json", json.dumps(result.to_json(), indent=2) + "\n")

    def _log_scalars(self, result: EvalResult, earlier: EvalResult | None = None) -> None:
        """`earlier`: the step's result logged before; only what it lacked is logged now (each point once)."""
        history = [*(r for r in self.results.values() if r.step != result.step), result]
        again: list[EvalResult] = []
        if self._metrics is None:  # points after the newest trusted result have no result file behind them
            purge = min(max(self.results, default=-1) + 1, self._purge_at if self._purge_at is not None else 1 << 62)
            self._metrics = Metrics(self.tb_dir, purge_step=purge)
            self._purge_at = None
            # trusted results past a moved-aside step lost their points to the purge too: logged again, in step order
            again = sorted((r for r in self.results.values() if r.step >= purge), key=lambda r: r.step)
        for r in (r for r in again if r.step <= result.step):  # (`earlier` among them: before its added mode)
            log_result(self._metrics, r, [h for h in history if h.step <= r.step])
        log_result(self._metrics, result, history, skip=logged_tags(earlier) if earlier is not None else frozenset())
        for r in (r for r in again if r.step > result.step):
            log_result(self._metrics, r, [h for h in history if h.step <= r.step])

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    # ---- the loop -------------------------------------------------------------------------

    def next_request(self, max_backlog: int = 4, stride: int = 2) -> EvalRequest | None:
        """The export to evaluate now (policy.pending_steps over what is on disk), if any."""
        available = list_exports(self.export_root)
        self._drop_stale(available)
        newest = max(self.done, default=-1)  # a step below it that was moved aside: pending_steps passes over it
        redo = sorted(s for s in self._redo if s < newest and s in available and s not in self.done)
        todo = redo or pending_steps(list(available), set(self.done), max_backlog, stride)
        return EvalRequest(todo[0], str(available[todo[0]])) if todo else None

    def run_until(self, stop: Callable[[], tuple[bool, int | None]], poll_s: float = 5.0, max_backlog: int = 4,
                  stride: int = 2, final_export_timeout_s: float = 600.0,
                  wake: threading.Event | None = None) -> list[EvalResult]:
        """Evaluate exports as they appear until policy.should_stop; returns this call's results.

        `stop()` returns (trainer finished, its final step). The trainer reports its final step
        only after that export exists; if it is still missing `final_export_timeout_s` later,
        this raises instead of waiting forever. `wake`, set when the trainer's end is reported,
        ends a wait between looks at once: the final export is evaluated then, not up to `poll_s`
        later (every run's end waited out the poll).
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
            if not finished and self._refs is None:
                self.references()  # idle before the first export: the work no checkpoint changes, now
                continue
            if finished and final_step is not None:
                missing_since = missing_since or time.time()
                if time.time() - missing_since > final_export_timeout_s:
                    raise FileNotFoundError(
                        f"the trainer finished at step {final_step} but {self.export_root}/step_{final_step} "
                        f"(with {' and '.join(EXPORT_FILES)}) did not appear within {final_export_timeout_s:.0f}s"
                    )
            if wake is None:
                time.sleep(poll_s)
            elif wake.wait(poll_s):
                wake.clear()  # stop() is read again before the next wait: a later set is not lost
