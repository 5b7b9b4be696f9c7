"""Chat JSONL validation, loss masks from the chat template, prompt prefixes, template hash."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.chat_data import ChatEncoder, iter_chat_jsonl, read_chat_jsonl, template_hash
from dflash_dist.target.stdlib_corpus import code_chat_samples, iter_sources, list_stdlib_files, write_chat_jsonl
from dflash_dist.target.tiny_tokenizer import CHAT_TEMPLATE, IM_END, train_tokenizer

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f():\n    pass"}]}


@pytest.fixture(scope="module")
def tokenizer():
    texts = [text for _, text in iter_sources(list_stdlib_files(split="train")[:20])]
    return train_tokenizer(texts, vocab_size=512)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ('{"messages": [', "unparsable JSON"),
        ('["not", "an", "object"]', "'messages'"),
        ('{"conversation": []}', "'messages'"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}', "unknown role"),
        ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  "}]}', "empty assistant"),
        ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}', "string 'content'"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
        ('{"messages": ["hello"]}', "must be an object"),
    ],
)
def test_bad_record_names_file_and_line(tmp_path: Path, bad_line: str, problem: str) -> None:
    path = _write(tmp_path / "chats.jsonl", [json.dumps(GOOD), "", bad_line, json.dumps(GOOD)])
    with pytest.raises(ValueError, match=rf"chats\.jsonl:3: .*{problem}"):
        read_chat_jsonl(path)


def test_good_file_streams_records_with_their_lines(tmp_path: Path) -> None:
    system = {"role": "system", "content": "be brief"}
    path = _write(tmp_path / "ok.jsonl", [json.dumps(GOOD), "", json.dumps({"messages": [system, *GOOD["messages"]]})])
    records = list(iter_chat_jsonl(path))
    assert [r.where for r in records] == [f"{path}:1", f"{path}:3"]
    assert records[1].messages[0].role == "system"
    assert records[0].as_dicts() == GOOD["messages"]


def _mask_spans(ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    spans, current = [], []
    for token, m in zip(ids.tolist(), mask.tolist()):
        if m:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


def test_loss_mask_is_exactly_assistant_content_plus_end_token(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You continue code."},
        {"role": "user", "content": "Continue:\nimport os"},
        {"role": "assistant", "content": "import sys\n\n\ndef main():"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "\n    return 0  # café"},
    ]
    out = ChatEncoder(tokenizer).encode(messages)
    assert out.input_ids.dtype == np.int64 and out.loss_mask.shape == out.input_ids.shape
    spans = _mask_spans(out.input_ids, out.loss_mask)
    assert [tokenizer.decode(s) for s in spans] == [m["content"] + IM_END for m in messages if m["role"] == "assistant"]
    end_id = tokenizer.convert_tokens_to_ids(IM_END)
    assert all(span[-1] == end_id for span in spans)
    # every masked token belongs to an assistant turn, and nothing else is masked
    assert int(out.loss_mask.sum()) == sum(len(s) for s in spans)


@pytest.mark.parametrize("content", ["x = 1", "\n\nx = 1", "    indented()", "  \n\t tab", "# é ü"])
def test_prompt_ids_is_a_prefix_of_the_full_tokenization(tokenizer, content: str) -> None:
    messages = [{"role": "user", "content": "Continue this:\n    pass\n"}, {"role": "assistant", "content": content}]
    encoder = ChatEncoder(tokenizer)
    full = encoder.encode(messages)
    prompt = encoder.prompt_ids(messages)
    assert np.array_equal(full.input_ids[: len(prompt)], prompt)
    # the assistant span starts right after the generation prompt
    assert full.loss_mask[: len(prompt)].sum() == 0 and full.loss_mask[len(prompt)] == 1
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")


def test_prompt_ids_on_corpus_samples(tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "heldout.jsonl"
    assert write_chat_jsonl(path, "heldout", max_samples=30, seed=3) == 30
    encoder = ChatEncoder(tokenizer)
    for record in read_chat_jsonl(path):
        full, prompt = encoder.encode(record), encoder.prompt_ids(record)
        assert np.array_equal(full.input_ids[: len(prompt)], prompt)
        assert tokenizer.decode(full.input_ids[full.loss_mask == 1]) == record.messages[-1].content + IM_END


def test_prompt_ids_uses_the_last_assistant_turn(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    encoder = ChatEncoder(tokenizer)
    prompt = encoder.prompt_ids(messages)
    assert tokenizer.decode(prompt).endswith("c<|im_end|>\n<|im_start|>assistant\n")
    assert "b<|im_end|>" in tokenizer.decode(prompt)


def test_template_without_generation_span_is_rejected(tokenizer) -> None:
    plain = CHAT_TEMPLATE.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    with pytest.raises(ValueError, match="generation"):
        ChatEncoder(tokenizer, chat_template=plain)


def test_template_hash_tracks_template_and_vocab(tokenizer) -> None:
    first = template_hash(tokenizer)
    assert first == template_hash(tokenizer) and len(first) == 64
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = original.replace("\\n", "\\n\\n", 1)
        assert template_hash(tokenizer) != first
    finally:
        tokenizer.chat_template = original
    other = train_tokenizer([text for _, text in iter_sources(list_stdlib_files(split="train")[20:30])], 512)
    assert template_hash(other) != first
    # the thinking switch changes the tokenization of every conversation: its setting is hashed
    on, off = template_hash(tokenizer, True), template_hash(tokenizer, False)
    assert len({first, on, off}) == 3 and template_hash(tokenizer, None) == first


def test_code_chat_samples_are_deterministic_and_validate() -> None:
    first = code_chat_samples("heldout", 20, seed=5)
    assert first == code_chat_samples("heldout", 20, seed=5)
    assert first != code_chat_samples("heldout", 20, seed=6)
    for sample in first:
        assert sample["messages"][0]["content"].startswith(f"Continue this code from {sample['source']}:\n")
        assert sample["messages"][1]["content"].strip()
