"""Resolve the run's conversation files: the user's JSONL, or for the tiny_stdlib target the
project's own stdlib-code conversations (train split for training, held-out files for eval)."""

from __future__ import annotations

from pathlib import Path

from dflash_dist.config import Config, ConfigError

DEFAULT_TINY_TRAIN_SAMPLES = 400


def prepare_data(cfg: Config) -> tuple[Path, Path | None]:
    """(train.jsonl, eval.jsonl or None). Generated files go to <out>/data/ once."""
    train = Path(cfg.data.train_jsonl) if cfg.data.train_jsonl else None
    heldout = Path(cfg.data.eval_jsonl) if cfg.data.eval_jsonl else None
    if cfg.target.kind == "tiny_stdlib":
        from data_pipeline.stdlib_corpus import write_chat_jsonl

        data_dir = cfg.out / "data"
        if train is None:
            train = data_dir / "train.jsonl"
            if not train.exists():
                write_chat_jsonl(train, "train", cfg.data.max_train_samples or DEFAULT_TINY_TRAIN_SAMPLES,
                                 cfg.run.seed)
        if heldout is None:
            heldout = data_dir / "eval.jsonl"
            if not heldout.exists():
                write_chat_jsonl(heldout, "heldout", cfg.eval.num_prompts, cfg.run.seed + 1)
    if train is None:
        raise ConfigError("data.train_jsonl is not set")
    if cfg.eval.enabled and heldout is None:
        raise ConfigError("eval.enabled is true but data.eval_jsonl is not set (held-out prompts for tau)")
    return train, heldout


def eval_prompt_ids(eval_jsonl: Path, tokenizer, limit: int) -> list[list[int]]:
    """Held-out prompts as token ids: everything before the last assistant turn + generation prompt."""
    from data_pipeline.chat_data import ChatEncoder, read_chat_jsonl

    enc = ChatEncoder(tokenizer)
    return [enc.prompt_ids(r).tolist() for r in read_chat_jsonl(eval_jsonl)[:limit]]
