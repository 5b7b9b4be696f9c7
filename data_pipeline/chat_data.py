"""Chat conversations (OpenAI ``messages`` or ShareGPT ``conversations``) validated and
tokenized for a target.

The loss mask comes from the target tokenizer's own chat template (its ``{% generation %}``
spans), so it marks exactly the tokens the target would emit as the assistant. A bad record is
a user mistake: the error names the file and line (or row), so it can be fixed at the source;
its ``reason`` is the key under which a skipping reader counts it (data_pipeline/ingest.py).
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
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
FORMATS = ("auto", "messages", "sharegpt")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
INGESTED_FROM = "ingested_from"  # key of a normalized line naming the record's original file:line / row


class BadRecord(ValueError):
    """A record that cannot be trained on; ``reason`` is its count key when the policy skips."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


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


def validate_messages(
    messages: object,
    where: str,
    *,
    role_key: str = "role",
    content_key: str = "content",
    roles: dict[str, str] | None = None,
    field: str = "messages",
) -> tuple[Message, ...]:
    """Check a message list; errors start with ``where`` (e.g. "data.jsonl:7") and name the field.
    ``roles`` maps the source's role names to ours (ShareGPT: human -> user, gpt -> assistant)."""
    roles = roles or {r: r for r in ROLES}
    if not isinstance(messages, list) or not messages:
        raise BadRecord(
            "malformed", f"{where}: '{field}' must be a non-empty list of {{{role_key}, {content_key}}} objects"
        )
    parsed = []
    for i, message in enumerate(messages):
        at = f"{where}: {field}[{i}]"
        if not isinstance(message, dict):
            raise BadRecord("malformed", f"{at} must be an object with '{role_key}' and '{content_key}'")
        role, content = message.get(role_key), message.get(content_key)
        if role not in roles:
            raise BadRecord(
                "unknown_role",
                f"{at}.{role_key} is an unknown role {role!r}; expected one of "
                f"{', '.join(roles)} (map or drop that turn at the source)",
            )
        role = roles[role]
        if isinstance(content, bytes):
            try:
                content = content.decode("utf-8")
            except UnicodeDecodeError as err:
                raise BadRecord(
                    "non_utf8",
                    f"{at}.{content_key} has bytes that are not UTF-8 at byte {err.start}: "
                    f"{content[err.start : err.start + 8]!r}; re-encode the source as UTF-8",
                ) from None
        if not isinstance(content, str):
            raise BadRecord("malformed", f"{at} ({role}) needs a string '{content_key}', got {type(content).__name__}")
        if role == "assistant" and not content.strip():
            raise BadRecord(
                "empty_assistant", f"{at}.{content_key} is an empty assistant turn; drop the record or fill it in"
            )
        parsed.append(Message(role=role, content=content))
    if not any(m.role == "assistant" for m in parsed):
        raise BadRecord("no_assistant", f"{where}: conversation has no assistant turn, so nothing would be trained on")
    return tuple(parsed)


def parse_record(obj: object, where: str, fmt: str = "auto") -> ChatRecord:
    """One conversation from a decoded record: OpenAI ``{"messages": [{role, content}]}`` or ShareGPT
    ``{"conversations": [{from, value}]}``; ``fmt`` "auto" decides per record by which key is there."""
    assert fmt in FORMATS, fmt
    if isinstance(obj, dict):
        if fmt == "auto":
            fmt = "messages" if "messages" in obj else "sharegpt" if "conversations" in obj else "auto"
        if fmt == "messages" and "messages" in obj:
            return ChatRecord(messages=validate_messages(obj["messages"], where), where=where)
        if fmt == "sharegpt" and "conversations" in obj:
            messages = validate_messages(
                obj["conversations"],
                where,
                role_key="from",
                content_key="value",
                roles=SHAREGPT_ROLES,
                field="conversations",
            )
            return ChatRecord(messages=messages, where=where)
    wanted = {
        "auto": "a 'messages' list (OpenAI) or a 'conversations' list (ShareGPT)",
        "messages": "a 'messages' list (data.format is messages)",
        "sharegpt": "a 'conversations' list (data.format is sharegpt)",
    }[fmt]
    found = f"keys {sorted(obj)}" if isinstance(obj, dict) else f"a {type(obj).__name__}"
    raise BadRecord("malformed", f"{where}: each record must be an object with {wanted}; found {found}")


def iter_chat_jsonl(path: str | os.PathLike) -> Iterator[ChatRecord]:
    """Stream validated ``messages`` records from a JSONL file; blank lines are allowed and skipped.
    A line's ``ingested_from`` (written by data_pipeline/ingest.py) becomes its ``where``."""
    path = Path(path)
    with path.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
            where = f"{path}:{lineno}"
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise BadRecord("unparsable", f"{where}: unparsable JSON ({err.msg} at column {err.colno})") from None
            if isinstance(obj, dict) and isinstance(obj.get(INGESTED_FROM), str):
                where = obj[INGESTED_FROM]
            yield parse_record(obj, where, "messages")


def read_chat_jsonl(path: str | os.PathLike) -> list[ChatRecord]:
    """All records of a file (validated up front, so a bad line fails before any work)."""
    return list(iter_chat_jsonl(path))


def template_hash(tokenizer: PreTrainedTokenizerBase, enable_thinking: bool | None = None) -> str:
    """sha256 of chat template + vocabulary (+ the thinking switch when set): shards from
    different tokenizations never mix."""
    template = tokenizer.chat_template or ""
    if not isinstance(template, str):  # a dict of named templates
        template = json.dumps(template, sort_keys=True)
    vocab = json.dumps(tokenizer.get_vocab(), sort_keys=True, ensure_ascii=False)
    switch = "" if enable_thinking is None else f"\0enable_thinking={enable_thinking}"
    return hashlib.sha256((template + "\0" + vocab + switch).encode("utf-8")).hexdigest()


class ChatEncoder:
    """Tokenizes conversations with one tokenizer's chat template (optionally overridden).

    ``enable_thinking`` (True/False) is passed to templates that have that switch (Qwen3-style
    thinking on/off); None leaves the template's default. Setting it for a template without the
    switch is an error rather than a silently ignored setting."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None, enable_thinking: bool | None = None
    ) -> None:
        template = chat_template or tokenizer.chat_template
        if not isinstance(template, str) or not GENERATION_TAG.search(template):
            raise ValueError(
                f"tokenizer {tokenizer.name_or_path!r}: its chat template has no {{% generation %}} span, "
                "so assistant tokens cannot be found; pass a chat_template that wraps assistant content in one"
            )
        if enable_thinking is not None and "enable_thinking" not in template:
            raise ValueError(
                f"tokenizer {tokenizer.name_or_path!r}: data.enable_thinking is {enable_thinking} but its chat "
                "template has no enable_thinking switch; leave data.enable_thinking unset for this target"
            )
        self.tokenizer = tokenizer
        self.chat_template = template
        self.template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}

    def encode(self, record: ChatRecord | list[dict[str, str]]) -> TokenizedChat:
        """input_ids and loss_mask of the whole conversation."""
        messages, where = _messages_and_where(record)
        enc = self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **self.template_kwargs,
        )
        input_ids = np.asarray(enc["input_ids"], dtype=np.int64)
        loss_mask = np.asarray(enc["assistant_masks"], dtype=np.uint8)
        if input_ids.shape != loss_mask.shape or not loss_mask.any():
            raise BadRecord(
                "no_assistant_tokens",
                f"{where}: the chat template marked no assistant tokens; check its generation span",
            )
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
            **self.template_kwargs,
        )
        return np.asarray(enc["input_ids"], dtype=np.int64)


def _messages_and_where(record: ChatRecord | list[dict[str, str]]) -> tuple[list[dict[str, str]], str]:
    if isinstance(record, ChatRecord):
        return record.as_dicts(), record.where
    where = "<messages>"
    return [{"role": m.role, "content": m.content} for m in validate_messages(record, where)], where
