"""A small byte-level BPE tokenizer for the tiny default target, trained on stdlib source.

It mirrors the parts of a Qwen tokenizer that the pipeline relies on: ChatML special tokens,
a chat template whose assistant turns are wrapped in ``{% generation %}`` (so
``return_assistant_tokens_mask`` gives the loss mask), and a dedicated ``<|mask|>`` token that
is the drafter's MASK id and never comes out of ordinary text.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
# Appended after the learned vocabulary, in this order (like Qwen, specials come last).
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK)
DEFAULT_VOCAB_SIZE = 1024

# Qwen2's pre-tokenizer pattern with one change: a newline ends its pre-token and is never
# merged with the next newline. The template's "assistant\n" therefore always ends a
# pre-token, so the generation prompt is a token prefix of every full conversation.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|[^\S\r\n]*(?:\r\n|[\r\n])|\s+(?!\S)|\s+"
)

# ChatML as in Qwen's templates, minus tools and thinking. The assistant content and its
# <|im_end|> are the generation span (the loss mask); the newline after it is not.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on ``texts``; ``vocab_size`` counts the special tokens too."""
    if vocab_size < 256 + 64 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must cover 256 bytes, some merges and the specials, got {vocab_size}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if backend.get_vocab_size() != vocab_size:
        raise ValueError(f"BPE learned too few merges: vocabulary {backend.get_vocab_size()} < {vocab_size}")
    return wrap_tokenizer(backend)


def wrap_tokenizer(backend: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers view of ``backend``: named specials, chat template, no BOS."""
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        mask_token=MASK,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
