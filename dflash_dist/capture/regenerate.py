"""Response regeneration as its own stage: the paper trains on target-generated responses.

Each ingested conversation keeps its turns before the last assistant turn; the target answers
them, greedily or sampled (temperature, top_p, a seed per record so a record's sample does not
depend on its batch), either locally through transformers ``generate`` (batched, left-padded; fla
on GPU) or through any OpenAI-compatible server (SGLang, vLLM) at a URL. The output is a new
``messages`` JSONL, one line per record id, appended a whole chunk at a time in input order; a
rerun skips the ids already there (an interrupted last line is cut), so records are never
duplicated or lost. ``<output>.provenance.json`` records the model, the sampling and the counts;
a rerun with other settings is refused. Responses that come back empty go to
``<output>.rejected.jsonl`` instead (the dataset must stay trainable), and are not retried.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from data_pipeline.chat_data import ChatEncoder, ChatRecord, template_hash
from data_pipeline.durable_files import append_lines, write_text_atomic
from data_pipeline.ingest import DataError, IngestPolicy, ingest
from data_pipeline.provenance import hash_weight_files
from data_pipeline.records import EMPTY_RESPONSE
from dflash_dist.capture.data_prep import data_sources, prepare_data
from dflash_dist.config import Config, ConfigError
from dflash_dist.logging_setup import progress
from dflash_dist.model.capture import check_kernel_path
from dflash_dist.target.generation import (
    generate_responses,
    is_empty_response,
    pad_token_id,
    response_text,
    stop_token_ids,
)
from dflash_dist.target.loading import load_target, resolve_target_dir, target_id

PROVENANCE_SCHEMA = 1
log = logging.getLogger(__name__)
ID_SCHEME = "sha256 of the prompt turns (JSON), 16 hex; -N for the N-th repeat"


class RegenError(RuntimeError):
    """Regeneration cannot go on; the message names the record, file or setting and what to do."""


@dataclass(frozen=True)
class Sampling:
    temperature: float  # 0: greedy
    top_p: float
    max_new_tokens: int
    seed: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Job:
    """One record to answer: its id, its per-record sampling seed, and the prompt turns."""

    id: str
    seed: int
    record: ChatRecord
    prompt: tuple[dict, ...]


@dataclass(frozen=True)
class Result:
    id: str
    content: str
    finish_reason: str  # "stop" (an end token) or "length" (max_new_tokens)


# A generator answers a chunk of jobs, yielding results in the jobs' order as they complete.
Generate = Callable[[list[Job]], Iterator[Result]]


def prompt_turns(record: ChatRecord) -> tuple[dict, ...]:
    """The turns before the last assistant turn: what the target answers afresh."""
    messages = record.as_dicts()
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return tuple(messages[:last])


def record_seed(seed: int, record_id: str) -> int:
    """A 31-bit seed per (run seed, record id): the same record samples the same on any rerun."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{record_id}".encode()).digest()[:4], "big") & 0x7FFFFFFF


def make_jobs(records: list[ChatRecord], seed: int, skip_bad: bool) -> tuple[list[Job], int]:
    """(jobs, records skipped for having no prompt turn). Ids come from the prompt's content, so
    they survive edits elsewhere in the input; a repeated prompt gets -2, -3, ..."""
    jobs, seen, skipped = [], Counter(), 0
    for record in records:
        prompt = prompt_turns(record)
        if not prompt:
            if skip_bad:
                skipped += 1
                continue
            raise RegenError(
                f"{record.where}: no turn before the last assistant turn, so there is nothing to answer; "
                "drop the record or set data.on_bad_record=skip"
            )
        digest = hashlib.sha256(json.dumps(prompt, ensure_ascii=False, sort_keys=True).encode()).hexdigest()[:16]
        seen[digest] += 1
        rid = digest if seen[digest] == 1 else f"{digest}-{seen[digest]}"
        jobs.append(Job(id=rid, seed=record_seed(seed, rid), record=record, prompt=prompt))
    return jobs, skipped


class TargetGenerator:
    """The local target through target/generation.py (the one generation path): left-padded
    batches; greedy, or a draw per row from that record's own generator (SeededSampling)."""

    def __init__(self, model, tokenizer, encoder: ChatEncoder, sampling: Sampling, batch_size: int) -> None:
        self.model, self.tokenizer, self.encoder = model, tokenizer, encoder
        self.sampling, self.chunk_size = sampling, batch_size
        self.eos_ids = list(stop_token_ids(tokenizer))
        if not self.eos_ids:
            raise RegenError(f"{tokenizer.name_or_path}: its vocabulary has no <|im_end|> and its tokenizer no eos")
        self.pad_id = pad_token_id(tokenizer, tuple(self.eos_ids))

    def __call__(self, jobs: list[Job]) -> Iterator[Result]:
        for start in range(0, len(jobs), self.chunk_size):
            yield from self._batch(jobs[start : start + self.chunk_size])

    def _batch(self, jobs: list[Job]) -> list[Result]:
        dev = next(self.model.parameters()).device
        prompts = [self.encoder.prompt_ids(j.record).tolist() for j in jobs]
        processors = LogitsProcessorList()
        if not self.sampling.greedy:
            processors.append(SeededSampling([j.seed for j in jobs], self.sampling, dev))
        generated = generate_responses(self.model, prompts, self.sampling.max_new_tokens, tuple(self.eos_ids),
                                       self.pad_id, logits_processor=processors)
        return [Result(job.id, response_text(self.tokenizer, g), g.finish_reason) for job, g in zip(jobs, generated)]


class SeededSampling:
    """A logits processor that draws each row's next token from its own torch generator
    (temperature and top_p by transformers' warpers) and leaves only that token for generate's
    greedy step: a record's sample is the same whatever batch it is in."""

    def __init__(self, seeds: list[int], sampling: Sampling, device) -> None:
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.warpers = LogitsProcessorList([TemperatureLogitsWarper(sampling.temperature)])
        if sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(sampling.top_p))

    def __call__(self, input_ids, scores):
        probs = self.warpers(input_ids, scores).float().softmax(-1)
        picks = torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(self.generators)])
        only = torch.full_like(scores, float("-inf"))
        only[torch.arange(len(picks), device=scores.device), picks] = 0.0
        return only


class ServerGenerator:
    """An OpenAI-compatible server (chat.completions): at most ``concurrency`` requests in flight;
    the openai client retries 5xx, 429, timeouts and lost connections with exponential backoff;
    a 4xx (or retries run out) is an error naming the record. openai is imported here, not at the module's
    top: regenerating with the local target needs no client (offline GPU machines carry it apart)."""

    def __init__(
        self,
        url: str,
        model: str,
        sampling: Sampling,
        concurrency: int,
        max_retries: int,
        timeout_s: float,
        api_key: str | None,
        template_kwargs: dict,
    ) -> None:
        self.url, self.model, self.sampling = url, model, sampling
        self.concurrency, self.max_retries, self.template_kwargs = concurrency, max_retries, template_kwargs
        self.chunk_size = 4 * concurrency
        try:
            import openai
        except ImportError:
            raise RegenError(
                f"regen.url={url}: regenerating against a server needs the openai client, which this Python lacks: "
                "pip install openai==3.57.0 (setup.py's pin; on a machine without a registry, the wheels of "
                "launcher/offline_wheels.sh's .whl-regen/), or regenerate with the local target (no regen.url)"
            ) from None
        self.openai = openai
        self.client = openai.OpenAI(base_url=url, api_key=api_key or "none", max_retries=max_retries, timeout=timeout_s)

    def __call__(self, jobs: list[Job]) -> Iterator[Result]:
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="regen") as pool:
            futures = [pool.submit(self._one, job) for job in jobs]
            try:
                for future in futures:
                    yield future.result()
            finally:  # an error: requests not yet sent are dropped; those in flight finish first
                for future in futures:
                    future.cancel()

    def _one(self, job: Job) -> Result:
        extra: dict = {
            "max_tokens": self.sampling.max_new_tokens,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
        }
        if not self.sampling.greedy:
            extra["seed"] = job.seed
        where = f"{job.record.where} (record {job.id})"
        try:
            response = self.client.chat.completions.create(
                model=self.model,
                messages=list(job.prompt),
                n=1,
                **extra,
                extra_body={"chat_template_kwargs": self.template_kwargs} if self.template_kwargs else None,
            )
        except self.openai.APIStatusError as err:
            if err.status_code < 500 and err.status_code not in (408, 409, 429):
                raise RegenError(
                    f"{where}: {self.url} refused the request with HTTP {err.status_code}: {err.message}; "
                    "fix or drop this record, or the regen.* settings the server rejects"
                ) from None
            raise RegenError(
                f"{where}: {self.url} kept failing (HTTP {err.status_code}) after {self.max_retries} retries: "
                f"{err.message}; check the server, or raise regen.max_retries"
            ) from None
        except (self.openai.APITimeoutError, self.openai.APIConnectionError) as err:
            raise RegenError(
                f"{where}: no answer from {self.url} after {self.max_retries} retries ({type(err).__name__}: {err}); "
                "check that the server runs at regen.url, or raise regen.timeout_s / regen.max_retries"
            ) from None
        if not response.choices:
            raise RegenError(f"{where}: {self.url} answered with no choices")
        choice = response.choices[0]
        return Result(job.id, choice.message.content or "", choice.finish_reason or "stop")


@dataclass
class RegenOutput:
    """The output JSONL, its rejected-records file and its provenance; what is already done.

    Lines are appended a chunk per write and fsynced (durable_files.append_lines); an incomplete
    last line (a write cut by a crash) is cut off when the file is opened for append, which open()
    does first, so every line left is a whole record."""

    path: Path
    done: set[str] = field(default_factory=set)
    finish_reasons: Counter = field(default_factory=Counter)
    written: int = 0
    rejected: int = 0

    @property
    def rejected_path(self) -> Path:
        return self.path.with_name(self.path.name.removesuffix(".jsonl") + ".rejected.jsonl")

    @property
    def provenance_path(self) -> Path:
        return self.path.with_name(self.path.name.removesuffix(".jsonl") + ".provenance.json")

    def open(self, settings: dict) -> None:
        """Check a previous run's settings against ours, then load what it finished."""
        if self.provenance_path.exists():
            before = json.loads(self.provenance_path.read_text()).get("settings")
            if before != settings:
                diffs = sorted(_diff(before or {}, settings))
                raise RegenError(
                    f"{self.path} was made with other settings ({'; '.join(diffs)}); finishing it now would mix "
                    "two kinds of responses: set regen.output to a new path, or delete the old output"
                )
        elif self.path.exists() or self.rejected_path.exists():
            raise RegenError(
                f"{self.path} exists but has no {self.provenance_path.name}, so it is not a regeneration output; "
                "set regen.output to a new path"
            )
        for path, is_output in ((self.path, True), (self.rejected_path, False)):
            if path.exists():
                append_lines(path, b"")  # opened for append: a torn last line is cut off
            for where, obj in _complete_lines(path):
                rid = obj.get("id") if isinstance(obj, dict) else None
                if not isinstance(rid, str) or rid in self.done:
                    problem = "has no string 'id'" if not isinstance(rid, str) else f"repeats id {rid}"
                    raise RegenError(f"{where}: {problem}; this file was edited, regenerate into a new regen.output")
                self.done.add(rid)
                self.written += is_output
                self.rejected += not is_output
                self.finish_reasons[obj.get("finish_reason", "?")] += is_output

    def append(self, jobs: dict[str, Job], results: list[Result]) -> None:
        kept, dropped = [], []
        for r in results:
            job = jobs[r.id]
            if not is_empty_response(r.content):
                messages = [*job.prompt, {"role": "assistant", "content": r.content}]
                line = {"id": r.id, "messages": messages, "source": job.record.where, "finish_reason": r.finish_reason}
                kept.append(line)
                self.finish_reasons[r.finish_reason] += 1
            else:
                dropped.append(
                    {
                        "id": r.id,
                        "source": job.record.where,
                        "reason": EMPTY_RESPONSE,
                        "finish_reason": r.finish_reason,
                    }
                )
            self.done.add(r.id)
        _append_records(self.rejected_path, dropped)
        _append_records(self.path, kept)
        self.written += len(kept)
        self.rejected += len(dropped)


def _diff(before: dict, now: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(before) | set(now)):
        a, b = before.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} was {a!r}, now {b!r}")
    return out


def _complete_lines(path: Path) -> Iterator[tuple[str, object]]:
    """(path:line, decoded JSON) of each whole line (a torn last line is not a record)."""
    if not path.exists():
        return
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                break
            try:
                yield f"{path}:{lineno}", json.loads(raw)
            except json.JSONDecodeError as err:
                raise RegenError(f"{path}:{lineno}: not JSON ({err.msg}); regenerate into a new regen.output") from None


def _append_records(path: Path, records: list[dict]) -> None:
    if records:
        append_lines(path, b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records))


@dataclass(frozen=True)
class RegenReport:
    output: str
    total: int  # jobs in the input
    written: int  # lines in the output (this run and earlier ones)
    rejected: int
    remaining: int
    this_run: int
    seconds: float


def regen_loss_problem(report: RegenReport, max_lost_fraction: float) -> str | None:
    """Why a regeneration left out more records than data.max_lost_fraction allows (empty responses,
    in <output>.rejected.jsonl and never retried), naming the file and the fix; None within it. The
    training run ingests the regenerated file and so never sees them: without this the command
    exited 0 whatever share of the dataset it dropped."""
    allowed = math.floor(max_lost_fraction * report.total)
    if report.rejected <= allowed:
        return None
    rejected = RegenOutput(Path(report.output)).rejected_path
    return (f"{report.rejected} of {report.total} record(s) got an empty response and are left out of {report.output} "
            f"(see {rejected}), more than data.max_lost_fraction={max_lost_fraction} allows ({allowed}): check the "
            "model or server (chat template, stop tokens, regen.max_new_tokens), or raise data.max_lost_fraction; a "
            f"rerun keeps them out (move {rejected.name} aside to answer them again)")  # fmt: skip


def regenerate(
    jobs: list[Job],
    generate: Generate,
    chunk_size: int,
    output: RegenOutput,
    provenance: dict,
    limit: int | None = None,
) -> RegenReport:
    """Answer every job not yet in ``output`` (at most ``limit`` this run), a chunk at a time;
    on an error, the results completed before it are kept, then the error is raised."""
    by_id = {j.id: j for j in jobs}
    foreign = output.done - by_id.keys()
    if foreign:
        raise RegenError(
            f"{output.path} holds {len(foreign)} records whose prompts are not in this input (e.g. id "
            f"{min(foreign)}): the input changed; set regen.output to a new path"
        )
    todo = [j for j in jobs if j.id not in output.done]
    todo = todo if limit is None else todo[:limit]
    started, done_before, last_log = time.monotonic(), len(output.done), 0.0
    _write_provenance(output, provenance, len(jobs))
    with progress(total=len(todo), desc="regenerate", unit="record") as bar:
        for start in range(0, len(todo), chunk_size):
            results: list[Result] = []
            try:
                for result in generate(todo[start : start + chunk_size]):
                    results.append(result)
                    bar.update(1)
            finally:
                output.append(by_id, results)
                _write_provenance(output, provenance, len(jobs))
            if time.monotonic() - last_log > 30:
                last_log = time.monotonic()
                rate = (len(output.done) - done_before) / max(last_log - started, 1e-9)
                log.info("%d/%d done (%.2f records/s)", len(output.done), len(jobs), rate)
    return RegenReport(
        str(output.path),
        len(jobs),
        output.written,
        output.rejected,
        len(jobs) - len(output.done),
        len(output.done) - done_before,
        time.monotonic() - started,
    )


def _write_provenance(output: RegenOutput, provenance: dict, total: int) -> None:
    counts = {
        "input_records": total,
        "written": output.written,
        "rejected": output.rejected,
        "remaining": total - len(output.done),
        "finish_reasons": dict(sorted(output.finish_reasons.items())),
    }
    record = {**provenance, "counts": counts, "complete": counts["remaining"] == 0}
    write_text_atomic(output.provenance_path, json.dumps(record, indent=1) + "\n")


def regen_output_path(cfg: Config) -> Path:
    return Path(cfg.regen.output) if cfg.regen.output else cfg.out / "data" / "train.regenerated.jsonl"


def run_regenerate(cfg: Config, limit: int | None = None) -> RegenReport:
    """The `dflash-dist regenerate` stage: ingest the input, answer each record, write the dataset."""
    r = cfg.regen
    source = _input_path(cfg)
    policy = IngestPolicy(
        fmt=cfg.data.format, on_bad_record=cfg.data.on_bad_record, max_records=cfg.data.max_train_samples
    )
    try:
        records, report = ingest(source, policy)
    except DataError as err:
        raise ConfigError(f"regen input: {err}") from None
    log.info("input %s", report.summary_line())
    sampling = Sampling(r.temperature, r.top_p, r.max_new_tokens, cfg.run.seed)
    jobs, no_prompt = make_jobs(records, cfg.run.seed, skip_bad=cfg.data.on_bad_record == "skip")
    template_kwargs = {} if cfg.data.enable_thinking is None else {"enable_thinking": cfg.data.enable_thinking}
    settings: dict = {
        "source": r.source,
        "sampling": asdict(sampling),
        "template_kwargs": template_kwargs,
        "id_scheme": ID_SCHEME,
    }
    runtime: dict = {}
    if r.source == "server":
        settings["server"] = {"url": r.url, "model": r.model}
        generate = ServerGenerator(
            r.url,
            r.model,
            sampling,
            r.concurrency,
            r.max_retries,
            r.timeout_s,
            os.environ.get(r.api_key_env),
            template_kwargs,
        )
    else:
        generate, settings["target"], runtime = _target_generator(cfg, sampling)
    output = RegenOutput(regen_output_path(cfg))
    output.path.parent.mkdir(parents=True, exist_ok=True)
    output.open(settings)
    provenance = {
        "schema": PROVENANCE_SCHEMA,
        "settings": settings,
        "runtime": runtime,
        "input": str(source),
        "ingest": json.loads(report.to_json()),
        "skipped_no_prompt": no_prompt,
    }
    result = regenerate(jobs, generate, generate.chunk_size, output, provenance, limit)
    log.info("%s: %d written, %d rejected (empty), %d remaining; %d this run in %.0f s", result.output,
             result.written, result.rejected, result.remaining, result.this_run, result.seconds)
    return result


def _input_path(cfg: Config) -> Path:
    if cfg.regen.input:
        return Path(cfg.regen.input)
    train, _ = data_sources(cfg)
    if train is not None:
        return train
    if cfg.target.kind != "hf":  # the project's own code conversations, made and ingested once
        return prepare_data(cfg)[0]
    raise ConfigError("regen.input (or data.train_path) is not set: which conversations to regenerate")


def _target_generator(cfg: Config, sampling: Sampling) -> tuple[TargetGenerator, dict, dict]:
    """(generator, what identifies its answers, how it ran) for the run's target; fla on GPU, and
    the torch Gated DeltaNet path on CUDA refused as for capture."""
    target_dir = resolve_target_dir(cfg)
    model, tokenizer = load_target(cfg, target_dir)
    try:
        kernel_path = check_kernel_path(model, cfg.target.allow_torch_gdn_on_cuda)
        encoder = ChatEncoder(tokenizer, enable_thinking=cfg.data.enable_thinking)
    except (RuntimeError, ValueError) as err:
        raise RegenError(f"target {target_dir}: {err}") from None
    generator = TargetGenerator(model, tokenizer, encoder, sampling, cfg.regen.batch_size)
    identity = {
        "id": target_id(cfg, target_dir),
        "weights_sha256": hash_weight_files(target_dir),
        "template_hash": template_hash(tokenizer, cfg.data.enable_thinking),
        "eos_token_ids": generator.eos_ids,
    }
    runtime = {"dtype": cfg.target.dtype, "device": str(next(model.parameters()).device), "kernel_path": kernel_path}
    return generator, identity, runtime
