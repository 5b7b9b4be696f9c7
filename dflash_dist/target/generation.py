"""The one way the target generates: inline regeneration in capture, the `regenerate` stage's
local target, the evaluator's reference continuation and `greedy_continuation` (the demo, the
live check, bench_live, replay_tau's callers) all call `generate_responses`.

Greedy is explicit. transformers fills every generate setting left unset (None) from the
checkpoint's generation_config.json, so a `repetition_penalty`, `no_repeat_ngram_size`,
`temperature`, `top_k`, `min_new_tokens` or `suppress_tokens` there would still shape "greedy"
output (and then training data and replay tau would stop measuring what greedy verification
accepts). Here the config is built from scratch with every logit-shaping field neutral, and the
model's own generation_config is swapped for it during the call, so nothing is filled from the
checkpoint.

The stop rule (one for every caller): a response ends at the first token of
`stop_token_ids(tokenizer)` = the chat turn end `<|im_end|>` when the vocabulary has it, plus the
tokenizer's eos token when it has one; that token is kept at the end of the response; otherwise
the response is `max_new_tokens` long. The checkpoint's generation config plays no part. A
response that is empty once its stop token is removed makes no training sample
(`is_empty_response`, one rule for inline regeneration and the `regenerate` stage).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList

TURN_END_TOKEN = "<|im_end|>"


@dataclass(frozen=True)
class Generated:
    """One prompt's response: its token ids (the stop token, if reached, is the last) and why it ended."""

    tokens: tuple[int, ...]
    stopped: bool  # True: ended at a stop token; False: max_new_tokens reached

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stopped else "length"

    @property
    def content_tokens(self) -> tuple[int, ...]:
        """The response without its stop token (what a chat API returns as text)."""
        return self.tokens[:-1] if self.stopped else self.tokens


def response_text(tokenizer, generated: Generated) -> str:
    """The response as a chat API returns it: its tokens before the stop token, decoded with any
    special token kept."""
    return tokenizer.decode(list(generated.content_tokens), skip_special_tokens=False)


def is_empty_response(text: str) -> bool:
    """The one rule for a response no training sample is made of: nothing but whitespace (the
    target stopped at once). Its only supervised token would be the stop token; the `regenerate`
    stage leaves its record out (`.rejected.jsonl`) and inline regeneration records its sample
    lost (skipped.jsonl, `empty_response`), both counted against data.max_lost_fraction."""
    return not text.strip()


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """The tokens a response ends at (see the module docstring): `<|im_end|>` if in the
    vocabulary, and the tokenizer's eos; sorted, possibly empty."""
    ids = set()
    vocab = tokenizer.get_vocab()
    if TURN_END_TOKEN in vocab:
        ids.add(int(vocab[TURN_END_TOKEN]))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def pad_token_id(tokenizer, stop_ids: tuple[int, ...]) -> int:
    """The id left padding uses: the tokenizer's pad, else the first stop token, else 0."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    return stop_ids[0] if stop_ids else 0


def greedy_generation_config(max_new_tokens: int, stop_ids: tuple[int, ...], pad_id: int) -> GenerationConfig:
    """Plain argmax decoding, every field that could reshape the logits set to its neutral value
    explicitly (None would be filled from the checkpoint)."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_length=0,  # no minimum; min_new_tokens stays unset (both set: transformers warns on every call)
        do_sample=False,
        num_beams=1,
        num_beam_groups=1,
        temperature=1.0,
        top_k=None,  # sampling-only (do_sample is False); None here, and the swap keeps the checkpoint's out
        top_p=1.0,
        min_p=None,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        length_penalty=1.0,
        no_repeat_ngram_size=0,
        encoder_no_repeat_ngram_size=0,
        renormalize_logits=False,
        remove_invalid_values=False,
        use_cache=True,
        num_return_sequences=1,
        eos_token_id=list(stop_ids) if stop_ids else None,
        pad_token_id=pad_id,
        bos_token_id=None,
        decoder_start_token_id=None,
    )


@contextmanager
def _only(model, gen_cfg: GenerationConfig) -> Iterator[None]:
    """The model's generation_config is `gen_cfg` for the call: generate fills unset fields from
    it, so none comes from the checkpoint (bad_words_ids, suppress_tokens, sequence_bias, ...)."""
    saved = model.generation_config
    model.generation_config = gen_cfg
    try:
        yield
    finally:
        model.generation_config = saved


@torch.no_grad()
def generate_responses(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: tuple[int, ...],
    pad_id: int,
    logits_processor: LogitsProcessorList | None = None,
) -> list[Generated]:
    """The target's response to each prompt (token ids), generated in one left-padded batch.

    Greedy unless `logits_processor` reduces each row to one token (the `regenerate` stage's
    seeded sampling does). Rows are independent: padding is masked, and a row's response is cut
    at its first stop token."""
    if not prompts:
        return []
    dev = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attn[i, width - len(p) :] = 1
    gen_cfg = greedy_generation_config(max_new_tokens, stop_ids, pad_id)
    with _only(model, gen_cfg):
        out = model.generate(ids.to(dev), attention_mask=attn.to(dev), generation_config=gen_cfg,
                             logits_processor=logits_processor or LogitsProcessorList())
    stops = set(stop_ids)
    results = []
    for row in out[:, width:].tolist():
        end = next((i for i, t in enumerate(row) if t in stops), None)
        results.append(Generated(tuple(row[: end + 1]) if end is not None else tuple(row), end is not None))
    return results


def generate_in_batches(model, prompts: list[list[int]], max_new_tokens: int, stop_ids: tuple[int, ...], pad_id: int,
                        batch: int) -> list[Generated]:
    """`generate_responses` over many prompts, `batch` at a time, grouped by length so a batch pads
    little (one prompt at a time is launch-bound: 64 held-out prompts took 133 s on the H200);
    the results come back in the prompts' order."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[Generated | None] = [None] * len(prompts)
    for k in range(0, len(order), batch):
        group = order[k : k + batch]
        for i, g in zip(group, generate_responses(model, [prompts[i] for i in group], max_new_tokens, stop_ids,
                                                  pad_id)):  # fmt: skip
            out[i] = g
    return out  # type: ignore[return-value]


def greedy_continuation(model, prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
    """The target's greedy continuation of one prompt (token ids), through `generate_responses`:
    ends after the first of `stop_ids` (kept), else `max_new_tokens` long; the checkpoint's
    generation_config plays no part."""
    (gen,) = generate_responses(model, [list(prompt)], max_new_tokens, tuple(stop_ids), stop_ids[0] if stop_ids else 0)
    return list(gen.tokens)
