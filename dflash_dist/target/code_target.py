"""The mid-size learned target (`target.kind: code_lm`): a ~88M-parameter Qwen3 code LM (or a
Qwen3.5 hybrid) trained here, once, on the stdlib plus the pinned packages' sources, cached.

The tiny target is too weak for drafter quality to show (held-out loss ~3.5 nats: its features carry
little). This one is built on one GPU in 4.3-5 minutes (H200, 2026-12-04) from what the machine already has
(`code_corpus.py`), so a bare GPU machine can build it inside the run that uses it: its own 8k
byte-level BPE with ChatML and `<|mask|>` (`tiny_tokenizer.py`), a fixed budget of 100M training
tokens (a quarter of the rows start at code-continuation chats, the format the pipeline prompts
it with), bf16 autocast, fused AdamW and a torch.compile'd forward + loss. Its build record
(`dflash_target.json`) holds the corpus record and hash, token counts, held-out losses, times per
phase, tokens/s and the share of held-out greedy continuations that are degenerate
(`continuations.py`).

Build: `dflash-dist build-target CONFIG` (a config with `target.kind: code_lm`), or
`python -m dflash_dist.target.code_target [--preset P] [--out DIR]`; every run whose config names
the kind builds it first if it is not cached (`DFLASH_CACHE`, else ~/.cache/dflash-dist).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from dflash_dist.target.build_cache import build_cached, cache_root, read_stamp, save_target, stamp_basics, write_stamp
from dflash_dist.target.code_corpus import MID_CHAT, CodeCorpus, load_code_corpus
from dflash_dist.target.continuations import greedy_report
from dflash_dist.target.gdn_path import fla_gdn_backward_error, route_cpu_to_torch, torch_gdn_kernels
from dflash_dist.target.lm_config import ARCHS, TEST_SHAPE, causal_lm, hybrid_layer_types, text_config
from dflash_dist.target.lm_training import TEST_RUN, TokenData, TrainRuntime, evaluate, train
from dflash_dist.target.stdlib_corpus import chat_samples
from dflash_dist.target.tiny_tokenizer import ENDOFTEXT, train_tokenizer

STAMP_SCHEMA = 1
CONTINUATIONS_NAME = "heldout_continuations.jsonl"  # the build's held-out prompts, greedy continuations, flags


@dataclass(frozen=True)
class CodeTargetSettings:
    """Everything that determines the built target; its digest guards the cache."""

    arch: str = "qwen3"  # qwen3 (dense) | qwen3_5 (hybrid: 3 Gated DeltaNet layers, then 1 attention)
    vocab_size: int = 8192  # BPE incl. <|endoftext|>, <|im_start|>, <|im_end|>, <|mask|>
    hidden_size: int = 768
    intermediate_size: int = 2048
    num_layers: int = 12
    num_heads: int = 12
    num_kv_heads: int = 4
    head_dim: int = 64
    linear_num_key_heads: int = 6  # qwen3_5 only
    linear_num_value_heads: int = 12
    linear_head_dim: int = 64
    max_position_embeddings: int = 4096
    seq_len: int = 1024
    batch_size: int = 64
    train_tokens: int = 100_000_000  # the fixed budget: steps = ceil(train_tokens / (batch_size x seq_len))
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    chat_rows: int = 16  # rows per batch that start at a rendered code-continuation chat
    chat_samples: int = 40_000
    eval_windows: int = 64
    eval_chat_samples: int = 64  # held-out chats: chat loss and greedy continuations
    continuation_tokens: int = 128  # greedy tokens per held-out prompt for the degenerate share
    tokenizer_bytes: int = 25_000_000  # BPE trained on this much train-split source (3 s on 16 cores)
    max_files: int | None = None  # files per split (spread over the corpus); None: all
    device: str = "auto"  # auto: cuda when available
    compile: bool = True  # torch.compile'd forward + loss (CUDA only)
    gdn_kernels: str = "auto"  # qwen3_5 on CUDA: fla | torch | auto (fla if its backward runs here, else torch)
    max_threads: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if self.arch == "qwen3_5":
            hybrid_layer_types(self.num_layers)  # raises unless a multiple of the pattern
        if self.device not in ("auto", "cpu", "cuda") or self.gdn_kernels not in ("auto", "fla", "torch"):
            raise ValueError(
                f"device must be auto|cpu|cuda and gdn_kernels auto|fla|torch, got {self.device!r}, "
                f"{self.gdn_kernels!r}"
            )
        if not 0 <= self.chat_rows <= self.batch_size:
            raise ValueError(f"chat_rows must be in [0, batch_size={self.batch_size}], got {self.chat_rows}")
        if self.warmup_steps >= self.steps:
            raise ValueError(f"need warmup_steps < steps ({self.steps} from train_tokens), got {self.warmup_steps}")

    @property
    def steps(self) -> int:
        return math.ceil(self.train_tokens / (self.batch_size * self.seq_len))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


# The presets `target.preset` names. qwen3: the default (88.1M params). qwen3_5: the hybrid at the
# same width (97.2M); its GDN trains through transformers' torch code on the H200 (fla refuses the
# backward there), measured at 94k tokens/s, so its budget is 32M tokens to stay near six minutes.
# test / test_qwen3_5: the same code at test size, built on CPU in seconds.
PRESETS: dict[str, CodeTargetSettings] = {"qwen3": CodeTargetSettings()}
PRESETS["qwen3_5"] = replace(PRESETS["qwen3"], arch="qwen3_5", train_tokens=32_000_000, compile=False)
PRESETS["test"] = CodeTargetSettings(
    **TEST_SHAPE,
    **TEST_RUN,
    train_tokens=12 * TEST_RUN["batch_size"] * TEST_RUN["seq_len"],  # 12 steps
    continuation_tokens=24,
    tokenizer_bytes=2_000_000,
    device="cpu",
    compile=False,
    max_threads=1,  # a tiny model gains nothing from threads; on a loaded 2-core machine 2 threads ran 200x slower
)
PRESETS["test_qwen3_5"] = replace(PRESETS["test"], arch="qwen3_5")


def default_cache_dir(preset: str = "qwen3") -> Path:
    """``$DFLASH_CACHE/code-lm-<preset>-v1``, else under ``~/.cache/dflash-dist``."""
    return cache_root() / f"code-lm-{preset}-v1"


def preset_settings(preset: str) -> CodeTargetSettings:
    if preset not in PRESETS:
        raise ValueError(f"unknown code_lm preset {preset!r}; known: {sorted(PRESETS)}")
    return PRESETS[preset]


def build_code_target(
    cache_dir: str | os.PathLike | None = None,
    preset: str = "qwen3",
    settings: CodeTargetSettings | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """The directory of the cached target, trained first if it is not there yet."""
    settings = settings or preset_settings(preset)
    target_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(preset)
    return build_cached(
        target_dir,
        STAMP_SCHEMA,
        settings.digest(),
        "code_lm target",
        lambda tmp: _build_into(tmp, settings, log),
        log,
        f"{settings.train_tokens / 1e6:g}M tokens; about 6 minutes on one H200",
    )


def load_code_target(target_dir: str | os.PathLike, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer) of a built target (the pipeline loads it as any HF model)."""
    read_stamp(target_dir)
    route_cpu_to_torch()
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, attn_implementation="sdpa",
                                                 trust_remote_code=False)  # never code from the cache (loading.py)
    return model.to(device).eval(), PreTrainedTokenizerFast.from_pretrained(target_dir)


@contextmanager
def _tokenizers_parallel() -> Iterator[None]:
    """Rust-side parallel BPE training and encoding (30x faster than serial on 16 cores), the
    caller's setting restored after: Ray workers and forked writers must not inherit it."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _tokenizer_texts(corpus: CodeCorpus, limit: int) -> list[str]:
    """Train-split texts up to `limit` bytes, in a content-independent spread order (every file
    has its place by the hash of its name, so the sample does not favour one package)."""
    texts, used = [], 0
    for _, text in sorted(corpus.train, key=lambda rt: hashlib.sha256(rt[0].encode()).digest()):
        if used >= limit:
            break
        texts.append(text)
        used += len(text.encode("utf-8"))
    return texts


def _device(settings: CodeTargetSettings) -> torch.device:
    if settings.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(settings.device)


def _gdn_path(settings: CodeTargetSettings, device: torch.device) -> tuple[str, str | None]:
    """(kernels GDN trains with, why not fla) for this build: none for a dense target."""
    if settings.arch != "qwen3_5":
        return "none", None
    if device.type != "cuda":
        return "torch", "CPU: fla needs CUDA"
    if settings.gdn_kernels != "auto":
        return settings.gdn_kernels, None
    refusal = fla_gdn_backward_error(device)
    return ("torch", refusal) if refusal else ("fla", None)


def _build_into(out_dir: Path, settings: CodeTargetSettings, log: Callable[[str], None]) -> None:
    """Corpus, tokenizer, data, model, training, evaluation; files and the stamp (last) into out_dir."""
    times: dict[str, float] = {}
    began = mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        times[name] = round(now - mark, 1)
        mark = now

    device = _device(settings)
    route_cpu_to_torch()
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(os.cpu_count() or 1, settings.max_threads)))
    try:
        with torch.random.fork_rng(devices=[]), _tokenizers_parallel():
            corpus = load_code_corpus(settings.max_files)
            lap("corpus_s")
            log(
                f"corpus: {corpus.record.files} files, {corpus.record.bytes} bytes, missing packages "
                f"{corpus.record.missing or 'none'}"
            )
            tokenizer = train_tokenizer(_tokenizer_texts(corpus, settings.tokenizer_bytes), settings.vocab_size)
            lap("tokenizer_s")
            heldout_chats = chat_samples(corpus.heldout, settings.eval_chat_samples, settings.seed, MID_CHAT)
            data = TokenData(
                tokenizer,
                [t for _, t in corpus.train],
                [t for _, t in corpus.heldout],
                chat_samples(corpus.train, settings.chat_samples, settings.seed, MID_CHAT),
                heldout_chats,
            )
            lap("encode_s")
            log(f"tokens: train {len(data.source)}, held-out {len(data.heldout)}, train chats {len(data.chat)}")
            torch.manual_seed(settings.seed)
            model = causal_lm(text_config(settings.arch, settings, tokenizer.convert_tokens_to_ids(ENDOFTEXT)))
            model.to(device)
            num_params = sum(p.numel() for p in model.parameters())
            gdn, gdn_why = _gdn_path(settings, device)
            on_gpu = device.type == "cuda"
            runtime = TrainRuntime(
                device=device,
                autocast=torch.bfloat16 if on_gpu else None,
                fused_adamw=on_gpu,
                compile=settings.compile and on_gpu,
                log_every=100 if on_gpu else 25,
            )
            log(
                f"{num_params / 1e6:.2f}M params ({settings.arch}), {settings.steps} steps of "
                f"{settings.batch_size}x{settings.seq_len} on {device}; GDN training kernels: {gdn}"
                + (f" ({gdn_why})" if gdn_why else "")
            )
            with torch_gdn_kernels() if (gdn == "torch" and on_gpu) else nullcontext():
                stats = train(model, data, settings, log, runtime)
            torch._dynamo.reset()  # the compiled graphs hold the model; nothing else runs them
            lap("train_s")
            stats.update(evaluate(model, data, settings, runtime))
            report, rows = greedy_report(
                model, tokenizer, heldout_chats, settings.continuation_tokens, autocast=runtime.autocast
            )
            lap("eval_s")
        log(
            f"held-out loss {stats['heldout_loss']:.3f}, chat loss {stats['heldout_chat_loss']:.3f}, degenerate "
            f"continuations {report.degenerate_share:.2f} (the held-out responses' own: "
            f"{report.reference_degenerate_share:.2f}), ending in a loop {report.loop_share:.2f}"
        )
    finally:
        torch.set_num_threads(threads)
    save_target(out_dir, model.to("cpu"), tokenizer)
    (out_dir / CONTINUATIONS_NAME).write_text("".join(json.dumps(r) + "\n" for r in rows))
    stamp = {
        "schema": STAMP_SCHEMA,
        "kind": "code_lm",
        "settings": {f.name: getattr(settings, f.name) for f in fields(settings)},
        "settings_digest": settings.digest(),
        "steps": settings.steps,
        "corpus": corpus.record.to_json(),
        "corpus_hash": corpus.record.hash,
        "tokens": {"train": len(data.source), "heldout": len(data.heldout), "train_chats": len(data.chat)},
        "tokens_trained": settings.steps * settings.batch_size * settings.seq_len,
        "uniform_loss": math.log(settings.vocab_size),
        **stats,
        "continuations": report.to_json(),
        "degenerate_share": report.degenerate_share,
        "times_s": {**times, "build_s": round(time.perf_counter() - began, 1)},
        "build_time_s": round(time.perf_counter() - began, 1),
        "num_params": num_params,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "gdn_train_kernels": gdn,
        "gdn_not_fla_because": gdn_why,
        **stamp_basics(tokenizer),
    }
    write_stamp(out_dir, stamp)
    del model, data
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the run that built it goes on in this process


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dflash_dist.target.code_target",
        description="Build (or find cached) the code_lm target and print its build record.",
    )
    ap.add_argument("--preset", default="qwen3", choices=sorted(PRESETS))
    ap.add_argument("--out", default=None, help="target directory (default: the cache, see default_cache_dir)")
    args = ap.parse_args(argv)
    target_dir = build_code_target(args.out, args.preset, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps({"target_dir": str(target_dir), **read_stamp(target_dir)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
