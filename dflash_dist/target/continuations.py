"""How often a target's greedy continuations of held-out prompts are degenerate (loops).

A small LM's greedy output often falls into a loop, and a loop is trivial to draft: tau measured
on loops says little about a drafter. The build record of the code target therefore reports the
share of held-out chat prompts whose greedy continuation is degenerate, defined concretely as:
within the first `max_new_tokens` (128) tokens of the continuation (the stop token excluded),
some token 4-gram occurs 4 or more times (occurrences may overlap). The same measure over the
held-out chats' own (human-written) responses is reported beside it: code repeats itself
legitimately (`self.x = x` lines), and that share is the floor a good target would show.

A stricter measure of the loops themselves is reported too: the share of continuations whose
last 32 tokens repeat with a period of at most 16 tokens (the model going round the same segment,
which varying identifiers in legitimately repetitive code break).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from data_pipeline.chat_data import ChatEncoder
from dflash_dist.target.generation import generate_responses, pad_token_id, stop_token_ids

NGRAM = 4
REPEATS = 4
DEFINITION = f"some token {NGRAM}-gram occurs >= {REPEATS} times in the first N tokens (stop token excluded)"
LOOP_WINDOW = 32
LOOP_MAX_PERIOD = 16
LOOP_DEFINITION = f"the last {LOOP_WINDOW} tokens repeat with a period of at most {LOOP_MAX_PERIOD} tokens"


def max_ngram_count(tokens: Sequence[int], n: int = NGRAM) -> int:
    """How often the most frequent n-gram of `tokens` occurs (0 if shorter than n)."""
    grams = Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
    return max(grams.values(), default=0)


def is_degenerate(tokens: Sequence[int], n: int = NGRAM, repeats: int = REPEATS) -> bool:
    return max_ngram_count(tokens, n) >= repeats


def ends_in_loop(tokens: Sequence[int], window: int = LOOP_WINDOW, max_period: int = LOOP_MAX_PERIOD) -> bool:
    """The last `window` tokens are periodic with some period p <= max_period (t[i] == t[i + p])."""
    if len(tokens) < window:
        return False
    tail = list(tokens[-window:])
    return any(tail[:-p] == tail[p:] for p in range(1, max_period + 1))


@dataclass(frozen=True)
class ContinuationReport:
    """The build record's degenerate-continuation fields."""

    definition: str
    max_new_tokens: int
    prompts: int
    degenerate_share: float  # the target's greedy continuations
    reference_degenerate_share: float  # the held-out chats' own responses, cut the same way
    loop_definition: str
    loop_share: float  # the target's continuations that end in a loop
    reference_loop_share: float
    mean_tokens: float  # continuation length (stop token excluded)
    stopped_share: float  # continuations that ended with a stop token before max_new_tokens

    def to_json(self) -> dict:
        return asdict(self)


@torch.no_grad()
def greedy_report(
    model, tokenizer, chats: list[dict], max_new_tokens: int, batch_size: int = 64, autocast: torch.dtype | None = None
) -> tuple[ContinuationReport, list[dict]]:
    """Greedy continuations (the pipeline's one generation path) of the held-out `chats`'
    prompts; returns the report and one row per chat (prompt source, continuation, flags)."""
    if not chats:
        raise ValueError("greedy_report needs at least one held-out chat")
    encoder = ChatEncoder(tokenizer)
    stops = stop_token_ids(tokenizer)
    pad = pad_token_id(tokenizer, stops)
    prompts = [encoder.prompt_ids(c["messages"]).tolist() for c in chats]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    generated = []
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        for i in range(0, len(prompts), batch_size):
            generated += generate_responses(model, prompts[i : i + batch_size], max_new_tokens, stops, pad)
    model.train(was_training)
    rows = []
    for chat, gen in zip(chats, generated):
        reference = tokenizer(chat["messages"][-1]["content"], add_special_tokens=False)["input_ids"]
        tokens = list(gen.content_tokens)[:max_new_tokens]
        rows.append(
            {
                "source": chat.get("source"),
                "start_line": chat.get("start_line"),
                "continuation": tokenizer.decode(tokens),
                "tokens": len(tokens),
                "stopped": gen.stopped,
                "degenerate": is_degenerate(tokens),
                "reference_degenerate": is_degenerate(reference[:max_new_tokens]),
                "loop": ends_in_loop(tokens),
                "reference_loop": ends_in_loop(reference[:max_new_tokens]),
            }
        )
    n = len(rows)
    report = ContinuationReport(
        definition=DEFINITION.replace("N tokens", f"{max_new_tokens} tokens"),
        max_new_tokens=max_new_tokens,
        prompts=n,
        degenerate_share=sum(r["degenerate"] for r in rows) / n,
        reference_degenerate_share=sum(r["reference_degenerate"] for r in rows) / n,
        loop_definition=LOOP_DEFINITION,
        loop_share=sum(r["loop"] for r in rows) / n,
        reference_loop_share=sum(r["reference_loop"] for r in rows) / n,
        mean_tokens=sum(r["tokens"] for r in rows) / n,
        stopped_share=sum(r["stopped"] for r in rows) / n,
    )
    return report, rows
