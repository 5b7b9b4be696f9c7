"""Chat conversations (OpenAI ``messages`` JSONL) read, validated and tokenized for a target.

The loss mask comes from the target tokenizer's own chat template (its ``{% generation %}``
spans), so it marks exactly the tokens the target would emit as the assistant. A bad record is
a user mistake: the error names the file and line, so it can be fixed at the source.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class ChatRecord:
    """One validated conversation; ``where`` ("file:line") follows it into later errors."""

    messages: tuple[Message, ...]
    where: str

    def as_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]


@dataclass(frozen=True)
class TokenizedChat:
    """Token ids and the 0/1 loss mask (1 = assistant token, including its end token)."""

    input_ids: np.ndarray  # [T] int64
    loss_mask: np.ndarray  # [T] uint8


def validate_messages(messages: object, where: str) -> tuple[Message, ...]:
    """Check an OpenAI-style message list; errors start with ``where`` (e.g. "data.jsonl:7")."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: messages[{i}] must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}: messages[{i}] has unknown role {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: messages[{i}] ({role}) needs a string 'content', got {type(content).__name__}")
        if role == "assistant" and not content.strip():
            raise ValueError(f"{where}: messages[{i}] is an empty assistant turn; drop the record or fill it in")
        parsed.append(Message(role=role, content=content))
    if not any(m.role == "assistant" for m in parsed):
        raise ValueError(f"{where}: conversation has no assistant turn, so nothing would be trained on")
    return tuple(parsed)


def iter_chat_jsonl(path: str | os.PathLike) -> Iterator[ChatRecord]:
    """Stream validated records from a JSONL file; blank lines are allowed and skipped."""
    path = Path(path)
    with path.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
            where = f"{path}:{lineno}"
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: unparsable JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(obj, dict) or "messages" not in obj:
                raise ValueError(f"{where}: each line must be a JSON object with a 'messages' list")
            yield ChatRecord(messages=validate_messages(obj["messages"], where), where=where)


def read_chat_jsonl(path: str | os.PathLike) -> list[ChatRecord]:
    """All records of a file (validated up front, so a bad line fails before any work)."""
    return list(iter_chat_jsonl(path))


def template_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of chat template + vocabulary: shards from different tokenizations never mix."""
    template = tokenizer.chat_template or ""
    if not isinstance(template, str):  # a dict of named templates
        template = json.dumps(template, sort_keys=True)
    vocab = json.dumps(tokenizer.get_vocab(), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256((template + "\0" + vocab).encode("utf-8")).hexdigest()


class ChatEncoder:
    """Tokenizes conversations with one tokenizer's chat template (optionally overridden)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None) -> None:
        template = chat_template or tokenizer.chat_template
        if not isinstance(template, str) or not GENERATION_TAG.search(template):
            raise ValueError(
                f"tokenizer {tokenizer.name_or_path!r}: its chat template has no {{% generation %}} span, "
                "so assistant tokens cannot be found; pass a chat_template that wraps assistant content in one"
            )
        self.tokenizer = tokenizer
        self.chat_template = template

    def encode(self, record: ChatRecord | list[dict[str, str]]) -> TokenizedChat:
        """input_ids and loss_mask of the whole conversation."""
        messages, where = _messages_and_where(record)
        enc = self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        input_ids = np.asarray(enc["input_ids"], dtype=np.int64)
        loss_mask = np.asarray(enc["assistant_masks"], dtype=np.uint8)
        if input_ids.shape != loss_mask.shape or not loss_mask.any():
            raise ValueError(f"{where}: the chat template marked no assistant tokens; check its generation span")
        return TokenizedChat(input_ids=input_ids, loss_mask=loss_mask)

    def prompt_ids(self, record: ChatRecord | list[dict[str, str]]) -> np.ndarray:
        """Tokens before the last assistant turn plus the generation prompt: what the target
        continues when its own greedy response replaces the recorded one."""
        messages, where = _messages_and_where(record)
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            raise ValueError(f"{where}: conversation has no assistant turn to regenerate")
        enc = self.tokenizer.apply_chat_template(
            messages[:last],
            chat_template=self.chat_template,
            tokenize=True,
            return_dict=True,
            add_generation_prompt=True,
        )
        return np.asarray(enc["input_ids"], dtype=np.int64)


def _messages_and_where(record: ChatRecord | list[dict[str, str]]) -> tuple[list[dict[str, str]], str]:
    if isinstance(record, ChatRecord):
        return record.as_dicts(), record.where
    where = "<messages>"
    return [{"role": m.role, "content": m.content} for m in validate_messages(record, where)], where
