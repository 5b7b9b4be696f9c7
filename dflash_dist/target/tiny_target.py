"""The embedded default target: a tiny Qwen3.5 hybrid LM trained here, once, on stdlib source.

A real target needs a download and a GPU; this one is built on any CPU in about three minutes
from the Python standard library (``stdlib_corpus.py``), cached, and shared by every later run.
It keeps the first-class target's architecture (Gated DeltaNet + full attention layers,
``Qwen3_5ForCausalLM``) and is trained well enough that a drafter has something to learn.

The cache (``build_cache.py``) and the training loop (``lm_training.py``) are shared with the
mid-size code target (``code_target.py``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from dflash_dist.target.build_cache import (  # noqa: F401 (CACHE_ENV, STAMP_NAME: its callers read them here)
    CACHE_ENV,
    STAMP_NAME,
    build_cached,
    cache_root,
    read_stamp,
    save_target,
    stamp_basics,
    write_stamp,
)
from dflash_dist.target.gdn_path import route_cpu_to_torch
from dflash_dist.target.lm_config import HYBRID_PATTERN, TEST_SHAPE, text_config
from dflash_dist.target.lm_training import TEST_RUN, TokenData, evaluate, train
from dflash_dist.target.stdlib_corpus import code_chat_samples, corpus_hash, iter_sources, list_stdlib_files
from dflash_dist.target.tiny_tokenizer import ENDOFTEXT, train_tokenizer

CACHE_NAME = "tiny-target-v1"
STAMP_SCHEMA = 1
LAYER_PATTERN = HYBRID_PATTERN


@dataclass(frozen=True)
class TinyTargetSettings:
    """Everything that determines the built target; its hash guards the cache."""

    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 8  # LAYER_PATTERN repeated: [lin, lin, lin, full] x 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 2  # 4 costs ~35% more time per step on the torch GDN path
    linear_head_dim: int = 32
    max_position_embeddings: int = 4096
    # Many short rows learned faster per second than fewer long ones; 192 still holds a whole
    # typical chat sample (mean ~155 tokens), so positions used at generation time are trained.
    seq_len: int = 192
    batch_size: int = 12
    steps: int = 280  # ~160 s on 2 idle cores
    lr: float = 5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 15
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    chat_rows: int = 3  # rows per batch drawn from rendered chat conversations
    chat_samples: int = 4000
    eval_windows: int = 32
    eval_chat_samples: int = 64
    max_files: int | None = None  # None = the whole split (tests use a few files)
    max_threads: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_layers % len(LAYER_PATTERN):
            raise ValueError(f"num_layers must be a multiple of {len(LAYER_PATTERN)}, got {self.num_layers}")
        if not 0 <= self.chat_rows <= self.batch_size:
            raise ValueError(f"chat_rows must be in [0, batch_size={self.batch_size}], got {self.chat_rows}")
        if self.steps < 1 or self.warmup_steps >= self.steps:
            raise ValueError(f"need steps >= 1 and warmup_steps < steps, got {self.steps}, {self.warmup_steps}")

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


DEFAULT_SETTINGS = TinyTargetSettings()
# Same code at test size: seconds instead of minutes, still a real (if poor) model.
TEST_SETTINGS = TinyTargetSettings(**TEST_SHAPE, **TEST_RUN, steps=12)


def default_cache_dir() -> Path:
    """``$DFLASH_CACHE/tiny-target-v1``, else ``~/.cache/dflash-dist/tiny-target-v1``."""
    return cache_root() / CACHE_NAME


def build_tiny_target(
    cache_dir: str | os.PathLike | None = None,
    settings: TinyTargetSettings = DEFAULT_SETTINGS,
    log: Callable[[str], None] = print,
) -> Path:
    """Return the directory of the cached target, training it first if it is not there yet."""
    target_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_cached(
        target_dir,
        STAMP_SCHEMA,
        settings.digest(),
        "tiny target",
        lambda tmp: _build_into(tmp, settings, log),
        log,
        "about 3 minutes on 2 CPU cores",
    )


def load_tiny_target(target_dir: str | os.PathLike) -> tuple[Qwen3_5ForCausalLM, PreTrainedTokenizerFast]:
    """Model (eval mode, fp32, sdpa) and tokenizer of a built target."""
    target_dir = Path(target_dir)
    read_stamp(target_dir)
    route_cpu_to_torch()  # fp32 CPU forwards: torch GDN even where fla + Triton are installed
    model = Qwen3_5ForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), PreTrainedTokenizerFast.from_pretrained(target_dir)


def tiny_target_config(settings: TinyTargetSettings, tokenizer: PreTrainedTokenizerFast) -> Qwen3_5TextConfig:
    """The Qwen3.5 text config: the real hybrid layout, shrunk."""
    if len(tokenizer) != settings.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, settings.vocab_size is {settings.vocab_size}")
    return text_config("qwen3_5", settings, tokenizer.convert_tokens_to_ids(ENDOFTEXT))


def _build_into(out_dir: Path, settings: TinyTargetSettings, log: Callable[[str], None]) -> None:
    """Train tokenizer and model and write them plus the stamp (last) into ``out_dir``."""
    began = time.perf_counter()
    # Built on CPU: where fla + Triton are installed transformers picked fla, which cannot run CPU tensors.
    route_cpu_to_torch()
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(os.cpu_count() or 1, settings.max_threads)))
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left as it was
            train_files = list_stdlib_files(split="train")[: settings.max_files]
            heldout_files = list_stdlib_files(split="heldout")[: settings.max_files]
            tokenizer = train_tokenizer((t for _, t in iter_sources(train_files)), settings.vocab_size)
            data = TokenData(
                tokenizer,
                [t for _, t in iter_sources(train_files)],
                [t for _, t in iter_sources(heldout_files)],
                code_chat_samples("train", settings.chat_samples, settings.seed),
                code_chat_samples("heldout", settings.eval_chat_samples, settings.seed),
            )
            torch.manual_seed(settings.seed)
            model = Qwen3_5ForCausalLM(tiny_target_config(settings, tokenizer))
            num_params = sum(p.numel() for p in model.parameters())
            log(f"{num_params / 1e6:.2f}M params, {len(data.source)} train tokens")
            stats = train(model, data, settings, log)
            stats.update(evaluate(model, data, settings))
        log(f"held-out loss {stats['heldout_loss']:.3f}, held-out chat loss {stats['heldout_chat_loss']:.3f}")
    finally:
        torch.set_num_threads(threads)
    save_target(out_dir, model, tokenizer)
    stamp = {
        "schema": STAMP_SCHEMA,
        "settings": {f.name: getattr(settings, f.name) for f in fields(settings)},
        "settings_digest": settings.digest(),
        "corpus_hash": corpus_hash(train_files + heldout_files),
        "corpus_files": {"train": len(train_files), "heldout": len(heldout_files)},
        "train_tokens": len(data.source),
        "steps": settings.steps,
        "tokens_seen": settings.steps * settings.batch_size * settings.seq_len,
        "uniform_loss": math.log(settings.vocab_size),
        **stats,
        "build_time_s": round(time.perf_counter() - began, 1),
        "num_params": num_params,
        **stamp_basics(tokenizer),
    }
    write_stamp(out_dir, stamp)
