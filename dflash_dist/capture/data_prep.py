"""Resolve and ingest the run's conversations before anything else runs: the user's source
(JSONL, Parquet or a saved HF dataset; OpenAI `messages` or ShareGPT `conversations`), or for
the project's own targets their code conversations (tiny_stdlib: from the stdlib; code_lm: from
its corpus, cut longer). Each split is validated, length-checked with the target's tokenizer
under the data.* policies, and written as a normalized `messages` JSONL plus a counts file under
<out>/data/; a bad input stops the run here (a ConfigError naming file and line or row) before
any shard is written."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from data_pipeline.ledger import CaptureData
from dflash_dist.config import Config, ConfigError

DEFAULT_OWN_TRAIN_SAMPLES = 400  # the project's own targets' chats when data.max_train_samples is unset

log = logging.getLogger(__name__)


def data_sources(cfg: Config) -> tuple[Path | None, Path | None]:
    """(train source, eval source) from data.train_path / data.eval_path."""
    train, heldout = cfg.data.train_path, cfg.data.eval_path
    return (Path(train) if train else None), (Path(heldout) if heldout else None)


def capture_data(cfg: Config, train: Path | list) -> CaptureData:
    """The identity of the conversations capture reads: `train` the ingested JSONL or its records
    (the run plan derives it once; the ledger records it as capture_data.json): source,
    data.max_train_samples, how many records, and the content hash of their keys."""
    from data_pipeline.chat_data import read_chat_jsonl
    from data_pipeline.ingest import content_hash, sample_keys

    records = read_chat_jsonl(train) if isinstance(train, (str, Path)) else list(train)
    if cfg.data.max_train_samples is not None:
        records = records[: cfg.data.max_train_samples]
    source, _ = data_sources(cfg)
    return CaptureData(str(source) if source else None, cfg.data.max_train_samples, len(records),
                       content_hash(sample_keys(records)))


def ingested_paths(cfg: Config, split: str) -> tuple[Path, Path]:
    """(normalized JSONL, counts JSON) of a split under <out>/data/."""
    data_dir = cfg.out / "data"
    return data_dir / f"{split}.ingested.jsonl", data_dir / f"{split}.ingest.json"


def prepare_data(cfg: Config, tokenizer=None) -> tuple[Path, Path | None]:
    """(normalized train JSONL, normalized eval JSONL or None): `ingest_data`, then `write_data`."""
    return write_data(cfg, ingest_data(cfg, tokenizer))


def ingest_data(cfg: Config, tokenizer=None) -> dict[str, tuple[list, Any]]:
    """Both splits read and checked, nothing written yet: split -> (records, IngestReport), so a
    caller can refuse the run (another dataset than the shards', a checkpoint it cannot resume)
    before the ingested files of an earlier run are replaced. `tokenizer`: the target's (loaded
    from the target when None)."""
    from data_pipeline.chat_data import ChatEncoder
    from data_pipeline.ingest import DataError, IngestPolicy, ingest

    train, heldout = data_sources(cfg)
    if cfg.target.kind != "hf":
        train, heldout = _generated_sources(cfg, train, heldout)
    if train is None:
        raise ConfigError("data.train_path is not set")
    if cfg.eval.enabled and heldout is None:
        raise ConfigError("eval.enabled is true but data.eval_path is not set (held-out prompts for tau)")
    if tokenizer is None:
        tokenizer = _load_tokenizer(cfg)
    try:
        encoder = ChatEncoder(tokenizer, enable_thinking=cfg.data.enable_thinking)
    except ValueError as e:  # a template without a generation span or without the thinking switch
        raise ConfigError(f"data: {e}") from None
    try:
        policy = IngestPolicy(
            fmt=cfg.data.format,
            on_bad_record=cfg.data.on_bad_record,
            on_overlong=cfg.data.on_overlong,
            max_length=cfg.data.max_length,
            max_records=cfg.data.max_train_samples,
        )
        splits = {"train": ingest(train, policy, _measure(cfg, encoder))}
        if heldout is not None:  # prompts only: no length policy; as many as the evaluator uses
            eval_policy = IngestPolicy(
                fmt=cfg.data.format, on_bad_record=cfg.data.on_bad_record, max_records=cfg.eval.num_prompts
            )
            splits["eval"] = ingest(heldout, eval_policy)
    except DataError as e:
        raise ConfigError(f"data: {e}") from None
    return splits


def write_data(cfg: Config, splits: dict[str, tuple[list, Any]]) -> tuple[Path, Path | None]:
    """Write what `ingest_data` read under <out>/data/ (each file atomically)."""
    from data_pipeline.ingest import write_ingested

    outputs: dict[str, Path] = {}
    for split, (records, report) in splits.items():
        jsonl_path, report_path = ingested_paths(cfg, split)
        write_ingested(records, report, jsonl_path, report_path)
        outputs[split] = jsonl_path
        log.info("data %s: %s; counts in %s", split, report.summary_line(), report_path)
    return outputs["train"], outputs.get("eval")


def _generated_sources(cfg: Config, train: Path | None, heldout: Path | None) -> tuple[Path, Path]:
    """The project's generated code conversations where the config gives none (written once):
    train from the target corpus' train split, held-out prompts from its held-out files."""
    if cfg.target.kind == "code_lm":
        from dflash_dist.target.code_corpus import corpus_chat_writer
        from dflash_dist.target.code_target import preset_settings

        write_chat_jsonl = corpus_chat_writer(preset_settings(cfg.target.preset).max_files)
    else:
        from dflash_dist.target.stdlib_corpus import write_chat_jsonl

    data_dir = cfg.out / "data"
    if train is None:
        train = data_dir / "train.jsonl"
        if not train.exists():
            write_chat_jsonl(train, "train", cfg.data.max_train_samples or DEFAULT_OWN_TRAIN_SAMPLES, cfg.run.seed)
    if heldout is None:
        heldout = data_dir / "eval.jsonl"
        if not heldout.exists():
            write_chat_jsonl(heldout, "heldout", cfg.eval.num_prompts, cfg.run.seed + 1)
    return train, heldout


def _load_tokenizer(cfg: Config):
    from dflash_dist.target.loading import load_tokenizer, resolve_target_dir

    return load_tokenizer(resolve_target_dir(cfg))


def _measure(cfg: Config, encoder):
    """(length, tokens before the first trained one) of a record as capture will build it: with
    regeneration the prompt plus up to capture.max_new_tokens of the target's own response."""
    if cfg.capture.regenerate:

        def measure(record):
            prompt = len(encoder.prompt_ids(record))
            return prompt + cfg.capture.max_new_tokens, prompt
    else:

        def measure(record):
            enc = encoder.encode(record)
            return len(enc.input_ids), int(enc.loss_mask.argmax())

    return measure


def eval_prompt_ids(eval_jsonl: Path, tokenizer, limit: int, enable_thinking: bool | None = None) -> list[list[int]]:
    """Held-out prompts as token ids: everything before the last assistant turn + generation prompt."""
    from data_pipeline.chat_data import ChatEncoder, read_chat_jsonl

    enc = ChatEncoder(tokenizer, enable_thinking=enable_thinking)
    return [enc.prompt_ids(r).tolist() for r in read_chat_jsonl(eval_jsonl)[:limit]]
