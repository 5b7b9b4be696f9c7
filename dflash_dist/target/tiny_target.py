"""The embedded default target: a tiny Qwen3.5 hybrid LM trained here, once, on stdlib source.

A real target needs a download and a GPU; this one is built on any CPU in about three minutes
from the Python standard library (``stdlib_corpus.py``), cached, and shared by every later run.
It keeps the first-class target's architecture (Gated DeltaNet + full attention layers,
``Qwen3_5ForCausalLM``) and is trained well enough that a drafter has something to learn.

The cache directory appears only complete: the build writes a temp directory and renames it,
and an fcntl lock makes concurrent builders wait for the first one instead of racing it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from data_pipeline.chat_data import ChatEncoder, template_hash
from dflash_dist.model.lr_schedule import warmup_cosine
from dflash_dist.target.gdn_path import route_cpu_to_torch
from dflash_dist.target.stdlib_corpus import StdlibFile, code_chat_samples, corpus_hash, iter_sources, list_stdlib_files
from dflash_dist.target.tiny_tokenizer import ENDOFTEXT, IM_END, train_tokenizer

CACHE_ENV = "DFLASH_CACHE"
CACHE_NAME = "tiny-target-v1"
STAMP_NAME = "dflash_target.json"
STAMP_SCHEMA = 1
LAYER_PATTERN = ("linear_attention", "linear_attention", "linear_attention", "full_attention")


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
TEST_SETTINGS = TinyTargetSettings(
    vocab_size=384,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_head_dim=16,
    seq_len=64,
    batch_size=4,
    steps=12,
    lr=1e-2,
    warmup_steps=2,
    chat_rows=1,
    chat_samples=64,
    eval_windows=4,
    eval_chat_samples=8,
    max_files=12,
)


def default_cache_dir() -> Path:
    """``$DFLASH_CACHE/tiny-target-v1``, else ``~/.cache/dflash-dist/tiny-target-v1``."""
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "dflash-dist") / CACHE_NAME


def read_stamp(target_dir: str | os.PathLike) -> dict:
    """The build record of a cached target (settings, corpus hash, losses, timings)."""
    path = Path(target_dir) / STAMP_NAME
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable tiny-target stamp ({err})") from None


def build_tiny_target(
    cache_dir: str | os.PathLike | None = None,
    settings: TinyTargetSettings = DEFAULT_SETTINGS,
    log: Callable[[str], None] = print,
) -> Path:
    """Return the directory of the cached target, training it first if it is not there yet."""
    target_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if _cached(target_dir, settings):
        return target_dir
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(target_dir.parent / f".{target_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _cached(target_dir, settings):  # another process built it while we waited
            return target_dir
        for stale in target_dir.parent.glob(f".{target_dir.name}.tmp*"):
            shutil.rmtree(stale, ignore_errors=True)  # a crashed build; we hold the lock
        tmp = Path(tempfile.mkdtemp(prefix=f".{target_dir.name}.tmp", dir=target_dir.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            log(f"building tiny target in {target_dir} (about 3 minutes on 2 CPU cores)")
            _build_into(tmp, settings, log)
            os.rename(tmp, target_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target_dir


def load_tiny_target(target_dir: str | os.PathLike) -> tuple[Qwen3_5ForCausalLM, PreTrainedTokenizerFast]:
    """Model (eval mode, fp32, sdpa) and tokenizer of a built target."""
    target_dir = Path(target_dir)
    read_stamp(target_dir)
    route_cpu_to_torch()  # fp32 CPU forwards: torch GDN even where fla + Triton are installed
    model = Qwen3_5ForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), PreTrainedTokenizerFast.from_pretrained(target_dir)


def _cached(target_dir: Path, settings: TinyTargetSettings) -> bool:
    """True if a finished build for these settings is there; a different one is an error."""
    if not target_dir.exists():
        return False
    stamp = read_stamp(target_dir)
    if stamp.get("schema") != STAMP_SCHEMA or stamp.get("settings_digest") != settings.digest():
        raise ValueError(
            f"{target_dir} holds a tiny target built with other settings (schema {stamp.get('schema')}); "
            "delete the directory or pass another cache_dir"
        )
    return True


def tiny_target_config(settings: TinyTargetSettings, tokenizer: PreTrainedTokenizerFast) -> Qwen3_5TextConfig:
    """The Qwen3.5 text config: the real hybrid layout, shrunk."""
    if len(tokenizer) != settings.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, settings.vocab_size is {settings.vocab_size}")
    eos = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    return Qwen3_5TextConfig(
        vocab_size=settings.vocab_size,
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_kv_heads,
        head_dim=settings.head_dim,
        linear_num_key_heads=settings.linear_num_key_heads,
        linear_num_value_heads=settings.linear_num_value_heads,
        linear_key_head_dim=settings.linear_head_dim,
        linear_value_head_dim=settings.linear_head_dim,
        layer_types=list(LAYER_PATTERN) * (settings.num_layers // len(LAYER_PATTERN)),
        max_position_embeddings=settings.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=eos,
        pad_token_id=eos,
        attn_implementation="sdpa",
    )


class _TokenData:
    """Token streams for training and evaluation, all from one tokenizer."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        settings: TinyTargetSettings,
        train_files: list[StdlibFile],
        heldout_files: list[StdlibFile],
    ) -> None:
        self.train_files, self.heldout_files = train_files, heldout_files
        eos = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
        self.source = self._stream(tokenizer, [t for _, t in iter_sources(self.train_files)], eos)
        self.heldout = self._stream(tokenizer, [t for _, t in iter_sources(self.heldout_files)], eos)
        chats = code_chat_samples("train", settings.chat_samples, settings.seed)
        rendered = tokenizer.apply_chat_template([c["messages"] for c in chats], tokenize=False)
        pieces = [np.asarray(e.ids, dtype=np.int64) for e in tokenizer.backend_tokenizer.encode_batch(rendered)]
        self.chat = np.concatenate(pieces)
        self.chat_starts = np.cumsum([0] + [len(p) for p in pieces[:-1]])
        encoder = ChatEncoder(tokenizer)
        held = code_chat_samples("heldout", settings.eval_chat_samples, settings.seed)
        self.heldout_chats = [encoder.encode(c["messages"]) for c in held]

    @staticmethod
    def _stream(tokenizer: PreTrainedTokenizerFast, texts: list[str], eos: int) -> np.ndarray:
        encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        return np.concatenate([np.asarray(e.ids + [eos], dtype=np.int64) for e in encodings])

    def batch(self, settings: TinyTargetSettings, gen: torch.Generator) -> torch.Tensor:
        """[batch, seq_len + 1]: random source windows, plus chat rows that start at a turn."""
        n = settings.seq_len + 1
        rows = []
        for i in range(settings.batch_size):
            if i < settings.chat_rows:
                start = int(self.chat_starts[torch.randint(len(self.chat_starts), (1,), generator=gen)])
                start = min(start, len(self.chat) - n)
                rows.append(self.chat[start : start + n])
            else:
                start = int(torch.randint(len(self.source) - n, (1,), generator=gen))
                rows.append(self.source[start : start + n])
        return torch.from_numpy(np.stack(rows))


def _lr_at(step: int, settings: TinyTargetSettings) -> float:
    """Linear warmup, then cosine from lr down to min_lr_ratio * lr (model/lr_schedule.py)."""
    return warmup_cosine(step, settings.steps, settings.warmup_steps, settings.lr, settings.min_lr_ratio)


def _lm_loss(model: Qwen3_5ForCausalLM, rows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=rows[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())


@torch.no_grad()
def _evaluate(model: Qwen3_5ForCausalLM, data: _TokenData, settings: TinyTargetSettings) -> dict[str, float]:
    """Held-out source loss (evenly spaced windows) and loss on held-out assistant tokens."""
    model.eval()
    n = settings.seq_len + 1
    starts = np.linspace(0, len(data.heldout) - n, settings.eval_windows).astype(np.int64)
    windows = torch.from_numpy(np.stack([data.heldout[s : s + n] for s in starts]))
    source_loss = sum(float(_lm_loss(model, w)) for w in windows.split(settings.batch_size)) / math.ceil(
        len(windows) / settings.batch_size
    )
    total, count = 0.0, 0
    for chat in data.heldout_chats:
        ids = torch.from_numpy(chat.input_ids)[None]
        logits = model(input_ids=ids[:, :-1]).logits[0]
        mask = torch.from_numpy(chat.loss_mask[1:]).bool()
        total += float(F.cross_entropy(logits[mask], ids[0, 1:][mask], reduction="sum"))
        count += int(mask.sum())
    model.train()
    return {"heldout_loss": source_loss, "heldout_chat_loss": total / max(count, 1)}


def _train(
    model: Qwen3_5ForCausalLM, data: _TokenData, settings: TinyTargetSettings, log: Callable[[str], None]
) -> dict:
    """Plain LM training: batch -> forward -> backward -> clip -> step -> log."""
    gen = torch.Generator().manual_seed(settings.seed)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(0.9, 0.95),
    )
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(settings.steps):
        rows = data.batch(settings, gen)
        loss = _lm_loss(model, rows)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, settings)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 25 == 0 or step == settings.steps - 1:
            log(f"step {step:4d}  loss {losses[-1]:.3f}  {time.perf_counter() - start:.0f}s")
    tail = losses[-max(1, settings.steps // 10) :]
    return {
        "initial_loss": losses[0],
        "final_train_loss": sum(tail) / len(tail),
        "loss_curve": [round(x, 4) for x in losses[:: max(1, settings.steps // 40)]],
        "train_time_s": round(time.perf_counter() - start, 1),
    }


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
            data = _TokenData(tokenizer, settings, train_files, heldout_files)
            torch.manual_seed(settings.seed)
            model = Qwen3_5ForCausalLM(tiny_target_config(settings, tokenizer))
            num_params = sum(p.numel() for p in model.parameters())
            log(f"{num_params / 1e6:.2f}M params, {len(data.source)} train tokens")
            stats = _train(model, data, settings, log)
            stats.update(_evaluate(model, data, settings))
        log(f"held-out loss {stats['heldout_loss']:.3f}, held-out chat loss {stats['heldout_chat_loss']:.3f}")
    finally:
        torch.set_num_threads(threads)
    stop_ids = tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    model.generation_config = GenerationConfig(eos_token_id=stop_ids, pad_token_id=stop_ids[1], do_sample=False)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    stamp = {
        "schema": STAMP_SCHEMA,
        "settings": {f.name: getattr(settings, f.name) for f in fields(settings)},
        "settings_digest": settings.digest(),
        "corpus_hash": corpus_hash(data.train_files + data.heldout_files),
        "corpus_files": {"train": len(data.train_files), "heldout": len(data.heldout_files)},
        "train_tokens": len(data.source),
        "steps": settings.steps,
        "tokens_seen": settings.steps * settings.batch_size * settings.seq_len,
        "uniform_loss": math.log(settings.vocab_size),
        **stats,
        "build_time_s": round(time.perf_counter() - began, 1),
        "num_params": num_params,
        "mask_token_id": tokenizer.mask_token_id,
        "template_hash": template_hash(tokenizer),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
    tmp_stamp = out_dir / f".{STAMP_NAME}.tmp"
    tmp_stamp.write_text(json.dumps(stamp, indent=2) + "\n")
    os.replace(tmp_stamp, out_dir / STAMP_NAME)
