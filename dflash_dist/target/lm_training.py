"""Causal-LM training of the project's own targets (tiny and code LM): token streams, the loop,
held-out losses.

One plain loop (batch -> forward -> backward -> clip -> step -> log) serves both: on CPU in fp32
for the tiny target (exactly as it always trained), on a GPU with bf16 autocast, fused AdamW and
a torch.compile'd loss for the code target (`TrainRuntime`). Rows are random windows of the
source stream plus `chat_rows` windows that start at a rendered chat conversation, so the target
learns the chat format the pipeline prompts it with.

`settings` is any record with the fields used here (seq_len, batch_size, steps, lr,
min_lr_ratio, warmup_steps, weight_decay, grad_clip, chat_rows, eval_windows, seed): each
target keeps its own frozen settings class, whose digest guards its cache.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerFast

from data_pipeline.chat_data import ChatEncoder
from dflash_dist.model.lr_schedule import warmup_cosine
from dflash_dist.target.tiny_tokenizer import ENDOFTEXT

log = logging.getLogger(__name__)

# The training side of the project's own targets at test size (lm_config.TEST_SHAPE is the model's).
TEST_RUN = dict(
    seq_len=64,
    batch_size=4,
    lr=1e-2,
    warmup_steps=2,
    chat_rows=1,
    chat_samples=64,
    eval_windows=4,
    eval_chat_samples=8,
    max_files=12,
)


@dataclass(frozen=True)
class TrainRuntime:
    """How (not what) a target trains: device and kernels. The CPU default is the tiny target's."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    autocast: torch.dtype | None = None  # e.g. torch.bfloat16 on a GPU (fp32 master weights)
    fused_adamw: bool = False
    compile: bool = False  # torch.compile the forward + loss; a failing compile falls back to eager, recorded
    log_every: int = 25

    def autocast_ctx(self):
        if self.autocast is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)


class TokenData:
    """Token streams for training and evaluation, all from one tokenizer: the train and held-out
    source texts (each followed by eos), the train chats rendered back to back, and the held-out
    chats encoded with their assistant loss masks."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        train_texts: list[str],
        heldout_texts: list[str],
        train_chats: list[dict],
        heldout_chats: list[dict],
    ) -> None:
        eos = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
        self.source = self._stream(tokenizer, train_texts, eos)
        self.heldout = self._stream(tokenizer, heldout_texts, eos)
        rendered = tokenizer.apply_chat_template([c["messages"] for c in train_chats], tokenize=False)
        pieces = [np.asarray(e.ids, dtype=np.int64) for e in tokenizer.backend_tokenizer.encode_batch(rendered)]
        self.chat = np.concatenate(pieces)
        self.chat_starts = np.cumsum([0] + [len(p) for p in pieces[:-1]])
        encoder = ChatEncoder(tokenizer)
        self.heldout_chats = [encoder.encode(c["messages"]) for c in heldout_chats]

    @staticmethod
    def _stream(tokenizer: PreTrainedTokenizerFast, texts: list[str], eos: int) -> np.ndarray:
        encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        return np.concatenate([np.asarray(e.ids + [eos], dtype=np.int64) for e in encodings])

    def batch(self, settings, gen: torch.Generator) -> torch.Tensor:
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


def lr_at(step: int, settings) -> float:
    """Linear warmup, then cosine from lr down to min_lr_ratio * lr (the project's one shape)."""
    return warmup_cosine(step, settings.steps, settings.warmup_steps, settings.lr, settings.min_lr_ratio)


def lm_loss(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=rows[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: TokenData, settings, runtime: TrainRuntime = TrainRuntime()) -> dict:
    """Held-out source loss (evenly spaced windows) and loss on held-out assistant tokens."""
    model.eval()
    n = settings.seq_len + 1
    starts = np.linspace(0, len(data.heldout) - n, settings.eval_windows).astype(np.int64)
    windows = torch.from_numpy(np.stack([data.heldout[s : s + n] for s in starts])).to(runtime.device)
    with runtime.autocast_ctx():
        source_loss = sum(float(lm_loss(model, w)) for w in windows.split(settings.batch_size)) / math.ceil(
            len(windows) / settings.batch_size
        )
        total, count = 0.0, 0
        for chat in data.heldout_chats:
            ids = torch.from_numpy(chat.input_ids)[None].to(runtime.device)
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits[0].float()
            mask = torch.from_numpy(chat.loss_mask[1:]).bool().to(runtime.device)
            total += float(F.cross_entropy(logits[mask], ids[0, 1:][mask], reduction="sum"))
            count += int(mask.sum())
    model.train()
    return {"heldout_loss": source_loss, "heldout_chat_loss": total / max(count, 1)}


def _optimizer(model: torch.nn.Module, settings, runtime: TrainRuntime) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(0.9, 0.95),
        fused=True if runtime.fused_adamw else None,
    )


def train(
    model: torch.nn.Module,
    data: TokenData,
    settings,
    log_fn: Callable[[str], None],
    runtime: TrainRuntime = TrainRuntime(),
) -> dict:
    """Plain LM training: batch -> forward -> backward -> clip -> step -> log.

    Losses stay on the device between log lines (no host sync per step). Returns the losses,
    wall times and tokens/s after the first step (which holds any compile)."""
    gen = torch.Generator().manual_seed(settings.seed)
    optimizer = _optimizer(model, settings, runtime)
    model.train()
    loss_fn: Callable[[torch.Tensor], torch.Tensor] = lambda rows: lm_loss(model, rows)  # noqa: E731
    compiled, compile_error = False, None
    if runtime.compile:
        loss_fn, compiled = torch.compile(loss_fn), True
    losses: list[torch.Tensor] = []
    start = time.perf_counter()
    first_step_s = 0.0
    for step in range(settings.steps):
        rows = data.batch(settings, gen)
        if runtime.device.type == "cuda":
            rows = rows.pin_memory().to(runtime.device, non_blocking=True)
        try:
            with runtime.autocast_ctx():
                loss = loss_fn(rows)
            loss.backward()
        except Exception as err:  # noqa: BLE001 (a compiler failure of any kind: train eagerly, say so)
            if not compiled or step > 0:
                raise
            compile_error = f"{type(err).__name__}: {err}"[:2000]
            log_fn(f"torch.compile failed, training eagerly instead: {compile_error[:300]}")
            optimizer.zero_grad(set_to_none=True)
            loss_fn, compiled = (lambda rows: lm_loss(model, rows)), False
            with runtime.autocast_ctx():
                loss = loss_fn(rows)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step == 0:
            first_step_s = _synced_time(runtime) - start
        if step % runtime.log_every == 0 or step == settings.steps - 1:
            log_fn(f"step {step:4d}  loss {losses[-1].item():.3f}  {time.perf_counter() - start:.0f}s")
    train_s = _synced_time(runtime) - start
    curve = torch.stack(losses).float().cpu().tolist()
    tail = curve[-max(1, settings.steps // 10) :]
    tokens_per_step = settings.batch_size * settings.seq_len
    warm_s = train_s - first_step_s
    return {
        "initial_loss": curve[0],
        "final_train_loss": sum(tail) / len(tail),
        "loss_curve": [round(x, 4) for x in curve[:: max(1, settings.steps // 40)]],
        "train_time_s": round(train_s, 1),
        "first_step_s": round(first_step_s, 1),
        "tokens_per_s": round(tokens_per_step * (settings.steps - 1) / warm_s) if settings.steps > 1 else None,
        "compiled": compiled,
        "compile_error": compile_error,
    }


def _synced_time(runtime: TrainRuntime) -> float:
    if runtime.device.type == "cuda":
        torch.cuda.synchronize(runtime.device)
    return time.perf_counter()
