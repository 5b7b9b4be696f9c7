"""Ingestion: JSONL / Parquet / saved HF datasets, OpenAI and ShareGPT formats, thinking on/off,
and every bad input under both policies (error naming file:line or row; counted skip)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_pipeline.chat_data import ChatEncoder, parse_record, read_chat_jsonl
from data_pipeline.ingest import DataError, IngestPolicy, ingest
from dflash_dist.capture.data_prep import ingested_paths, prepare_data
from dflash_dist.config import ConfigError, load_config
from dflash_dist.orchestration.run_lock import LOCK_NAME
from dflash_dist.target.stdlib_corpus import iter_sources, list_stdlib_files
from dflash_dist.target.tiny_tokenizer import CHAT_TEMPLATE, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
CONVERSATION = [
    {"role": "system", "content": "You continue code."},
    {"role": "user", "content": "Continue:\nimport os"},
    {"role": "assistant", "content": "import sys\n\n\ndef main():"},
    {"role": "user", "content": "more, café"},
    {"role": "assistant", "content": "\n    return 0"},
]
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}
GOOD = {"messages": CONVERSATION}
SHORT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x = 1"}]}
BAD_LINES = {  # reason -> (raw line bytes, expected words in the message)
    "unparsable": (b'{"messages": [', "unparsable JSON"),
    "non_utf8": (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not UTF-8 at byte 46 of the line"),
    "no_assistant": (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), "no assistant turn"),
    "empty_assistant": (
        json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " \n"}]}).encode(),
        r"messages\[1\]\.content is an empty assistant turn",
    ),
    "unknown_role": (
        json.dumps({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}).encode(),
        r"messages\[0\]\.role is an unknown role 'tool'",
    ),
    "malformed": (b'{"conversation": []}', "'messages' list"),
}


@pytest.fixture(scope="module")
def tokenizer():
    texts = [text for _, text in iter_sources(list_stdlib_files(split="train")[:20])]
    return train_tokenizer(texts, vocab_size=512)


def _jsonl(path: Path, lines: list[bytes | dict]) -> Path:
    raw = [line if isinstance(line, bytes) else json.dumps(line, ensure_ascii=False).encode() for line in lines]
    path.write_bytes(b"".join(line + b"\n" for line in raw))
    return path


def _tokenized(tokenizer, records) -> list[tuple[list[int], list[int]]]:
    encoder = ChatEncoder(tokenizer)
    return [(e.input_ids.tolist(), e.loss_mask.tolist()) for e in map(encoder.encode, records)]


def _cfg(tmp_path: Path, *overrides: str):
    train = tmp_path / "train.jsonl"
    if not train.exists():
        _jsonl(train, [GOOD])
    return load_config(
        None,
        [
            "target.kind=tiny_stdlib",
            f"data.train_path={train}",
            f"data.eval_path={train}",
            "capture.regenerate=false",
            *overrides,
        ],
        out_dir=str(tmp_path / "out"),
    )


# --- bad input, JSONL -------------------------------------------------------------------------


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_bad_line_is_an_error_naming_file_and_line(tmp_path: Path, reason: str) -> None:
    bad, words = BAD_LINES[reason]
    path = _jsonl(tmp_path / "chats.jsonl", [GOOD, b"", bad, SHORT])
    with pytest.raises(DataError, match=rf"chats\.jsonl:3: .*{words}.*data\.on_bad_record=skip"):
        ingest(path, IngestPolicy())


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_bad_line_is_skipped_and_counted_under_skip(tmp_path: Path, reason: str) -> None:
    bad, _ = BAD_LINES[reason]
    path = _jsonl(tmp_path / "chats.jsonl", [GOOD, bad, SHORT, bad])
    records, report = ingest(path, IngestPolicy(on_bad_record="skip"))
    assert [r.where for r in records] == [f"{path}:1", f"{path}:3"]
    assert records[1].as_dicts() == SHORT["messages"]
    assert (report.read, report.kept, dict(report.skipped)) == (4, 2, {reason: 2})
    assert report.first_skip[reason].startswith(f"{path}:2: ")
    assert f"skipped 2 ({reason} 2)" in report.summary_line()


def test_non_utf8_names_the_byte_offset_in_line_and_file(tmp_path: Path) -> None:
    bad = b'{"messages": [{"role": "user", "content": "ok \xff\xfe"}]}'
    path = _jsonl(tmp_path / "latin.jsonl", [SHORT, bad])
    first = len(json.dumps(SHORT).encode()) + 1
    column = bad.index(b"\xff")
    with pytest.raises(
        DataError,
        match=rf"latin\.jsonl:2: .* at byte {column} of the line \(file offset "
        rf"{first + column}\): b'\\xff\\xfe.*re-encode",
    ):
        ingest(path, IngestPolicy())


def test_a_source_with_nothing_usable_is_an_error_even_when_skipping(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "all_bad.jsonl", [BAD_LINES["unparsable"][0], BAD_LINES["unknown_role"][0]])
    expected = r"no usable conversation .*unknown_role 1, unparsable 1.*all_bad\.jsonl:1: unparsable JSON \(Expecting"
    with pytest.raises(DataError, match=expected + r" value at column 15\)"):
        ingest(path, IngestPolicy(on_bad_record="skip"))


# --- over-long samples ------------------------------------------------------------------------


def _lengths(tokenizer, record: dict) -> tuple[int, int]:
    enc = ChatEncoder(tokenizer).encode(parse_record(record, "x"))
    return len(enc.input_ids), int(enc.loss_mask.argmax())


def test_overlong_truncate_counts_and_keeps(tmp_path: Path, tokenizer) -> None:
    total, _ = _lengths(tokenizer, GOOD)
    short_total, _ = _lengths(tokenizer, SHORT)
    _jsonl(tmp_path / "train.jsonl", [GOOD, SHORT])
    cfg = _cfg(tmp_path, f"data.max_length={total - 1}", "data.on_overlong=truncate")
    assert short_total < total - 1
    train, _ = prepare_data(cfg, tokenizer)
    assert len(read_chat_jsonl(train)) == 2
    counts = json.loads(ingested_paths(cfg, "train")[1].read_text())
    assert (counts["kept"], counts["truncated"], counts["skipped"]) == (2, 1, {})


def test_overlong_skip_counts_without_an_error(tmp_path: Path, tokenizer, caplog) -> None:
    caplog.set_level("INFO", logger="dflash_dist")
    total, _ = _lengths(tokenizer, GOOD)
    _jsonl(tmp_path / "train.jsonl", [GOOD, SHORT])
    cfg = _cfg(tmp_path, f"data.max_length={total - 1}", "data.on_overlong=skip")  # on_bad_record stays error
    train, _ = prepare_data(cfg, tokenizer)
    assert [r.as_dicts() for r in read_chat_jsonl(train)] == [SHORT["messages"]]
    counts = json.loads(ingested_paths(cfg, "train")[1].read_text())
    assert counts["skipped"] == {"overlong": 1} and counts["truncated"] == 0
    assert "train.jsonl:1: " in counts["first_skip"]["overlong"]
    assert "skipped 1 (overlong 1)" in caplog.text  # logged by the data step


def test_overlong_error_and_prompt_longer_than_max_length(tmp_path: Path, tokenizer) -> None:
    total, untrained = _lengths(tokenizer, GOOD)
    _jsonl(tmp_path / "train.jsonl", [SHORT, GOOD])
    cfg = _cfg(tmp_path, f"data.max_length={total - 1}", "data.on_overlong=error")
    with pytest.raises(ConfigError, match=rf"train\.jsonl:2: {total} tokens is over data\.max_length={total - 1}"):
        prepare_data(cfg, tokenizer)
    # truncating cannot help when the tokens before the first assistant turn fill max_length
    cfg = _cfg(tmp_path, f"data.max_length={untrained}")
    with pytest.raises(ConfigError, match=r"train\.jsonl:2: .*leave no assistant token.*data\.on_bad_record=skip"):
        prepare_data(cfg, tokenizer)
    assert not ingested_paths(cfg, "train")[0].exists() and not ingested_paths(cfg, "train")[1].exists()
    prepare_data(_cfg(tmp_path, f"data.max_length={untrained}", "data.on_bad_record=skip"), tokenizer)
    counts = json.loads(ingested_paths(cfg, "train")[1].read_text())
    assert counts["skipped"] == {"overlong_prompt": 1}


def test_regenerate_measures_prompt_plus_max_new_tokens(tmp_path: Path, tokenizer) -> None:
    prompt = len(ChatEncoder(tokenizer).prompt_ids(SHORT["messages"]))
    _jsonl(tmp_path / "train.jsonl", [SHORT])
    base = ("capture.regenerate=true", "data.on_overlong=skip", f"data.max_length={prompt + 10}")
    prepare_data(_cfg(tmp_path, *base, "capture.max_new_tokens=10"), tokenizer)
    with pytest.raises(ConfigError, match="no usable conversation.*overlong 1"):
        prepare_data(_cfg(tmp_path, *base, "capture.max_new_tokens=11"), tokenizer)


# --- sources and formats ----------------------------------------------------------------------


def _sharegpt(messages: list[dict]) -> dict:
    return {"conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in messages]}


def test_sharegpt_equals_messages(tmp_path: Path, tokenizer) -> None:
    path = _jsonl(tmp_path / "mixed.jsonl", [GOOD, _sharegpt(CONVERSATION), _sharegpt(SHORT["messages"])])
    records, report = ingest(path, IngestPolicy())  # auto: per record
    assert report.kept == 3 and records[0].messages == records[1].messages
    assert records[2].as_dicts() == SHORT["messages"]
    first, second, _ = _tokenized(tokenizer, records)
    assert first == second and sum(first[1]) > 0
    with pytest.raises(DataError, match=r"mixed\.jsonl:1: .*'conversations' list \(data\.format is sharegpt\)"):
        ingest(path, IngestPolicy(fmt="sharegpt"))
    with pytest.raises(DataError, match=r"mixed\.jsonl:2: .*'messages' list \(data\.format is messages\)"):
        ingest(path, IngestPolicy(fmt="messages"))


def test_sharegpt_unknown_and_empty_turns_name_the_field(tmp_path: Path) -> None:
    tool = {
        "conversations": [
            {"from": "human", "value": "x"},
            {"from": "function_call", "value": "f()"},
            {"from": "gpt", "value": "y"},
        ]
    }
    empty = {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": ""}]}
    path = _jsonl(tmp_path / "sg.jsonl", [tool, empty])
    with pytest.raises(DataError, match=r"sg\.jsonl:1: conversations\[1\]\.from is an unknown role 'function_call'"):
        ingest(path, IngestPolicy())
    _, report = ingest(_jsonl(tmp_path / "sg2.jsonl", [tool, empty, SHORT]), IngestPolicy(on_bad_record="skip"))
    assert dict(report.skipped) == {"unknown_role": 1, "empty_assistant": 1}


def _rows() -> list[dict]:
    return [
        GOOD,
        SHORT,
        {
            "messages": [
                *SHORT["messages"],
                {"role": "user", "content": "again"},
                {"role": "assistant", "content": "y = 2"},
            ]
        },
    ]


def test_parquet_and_saved_dataset_match_jsonl(tmp_path: Path, tokenizer) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _rows()
    from_jsonl, _ = ingest(_jsonl(tmp_path / "d.jsonl", rows), IngestPolicy())
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    from_parquet, report = ingest(tmp_path / "d.parquet", IngestPolicy())
    assert report.kind == "parquet" and from_parquet[2].where == f"{tmp_path / 'd.parquet'} row 2"
    datasets.Dataset.from_list([_sharegpt(r["messages"]) for r in rows]).save_to_disk(str(tmp_path / "ds"))
    from_disk, report = ingest(tmp_path / "ds", IngestPolicy())
    assert report.kind == "hf_disk" and from_disk[1].where == f"{tmp_path / 'ds'} row 1"
    expected = _tokenized(tokenizer, from_jsonl)
    assert _tokenized(tokenizer, from_parquet) == expected
    assert _tokenized(tokenizer, from_disk) == expected
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"is a DatasetDict; point the data path at one split .*dd/train"):
        ingest(tmp_path / "dd", IngestPolicy())


def test_parquet_bad_rows_name_the_row_index(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _rows()
    rows[1] = {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]}
    rows.append({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]})
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=rf"{path} row 1: messages\[0\]\.role is an unknown role 'narrator'"):
        ingest(path, IngestPolicy())
    records, report = ingest(path, IngestPolicy(on_bad_record="skip"))
    assert [r.where for r in records] == [f"{path} row 0", f"{path} row 2"]
    assert dict(report.skipped) == {"unknown_role": 1, "empty_assistant": 1}
    assert report.first_skip["empty_assistant"].startswith(f"{path} row 3: ")


def test_parquet_binary_content_that_is_not_utf8(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    turn = pa.struct([("role", pa.string()), ("content", pa.binary())])
    table = pa.table(
        {
            "messages": pa.array(
                [[{"role": "user", "content": b"ok"}, {"role": "assistant", "content": b"caf\xe9"}]], pa.list_(turn)
            )
        }
    )
    pq.write_table(table, tmp_path / "bin.parquet")
    with pytest.raises(
        DataError,
        match=r"bin\.parquet row 0: messages\[1\]\.content has bytes that are not UTF-8 "
        r"at byte 3",
    ):
        ingest(tmp_path / "bin.parquet", IngestPolicy())


def test_max_records_stops_reading(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [GOOD, SHORT, BAD_LINES["unparsable"][0]])
    records, report = ingest(path, IngestPolicy(max_records=2))
    assert len(records) == 2 and report.read == 2


# --- thinking on/off --------------------------------------------------------------------------

THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}",
)


def test_enable_thinking_switches_the_prompt_where_the_template_has_it(tokenizer) -> None:
    assert THINKING_TEMPLATE != CHAT_TEMPLATE
    prompts = {
        flag: tokenizer.decode(
            ChatEncoder(tokenizer, THINKING_TEMPLATE, enable_thinking=flag).prompt_ids(SHORT["messages"])
        )
        for flag in (None, True, False)
    }
    assert prompts[False].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompts[True] == prompts[None] and prompts[True].endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="no enable_thinking switch"):
        ChatEncoder(tokenizer, enable_thinking=False)  # the tiny template has no such switch


def test_enable_thinking_on_a_template_without_it_is_a_config_error(tmp_path: Path, tokenizer) -> None:
    with pytest.raises(ConfigError, match="data.enable_thinking is True but .* no enable_thinking switch"):
        prepare_data(_cfg(tmp_path, "data.enable_thinking=true"), tokenizer)


# --- prepare_data outputs ---------------------------------------------------------------------


def test_prepare_data_writes_normalized_messages_keeping_the_origin(tmp_path: Path, tokenizer) -> None:
    src = _jsonl(tmp_path / "train.jsonl", [_sharegpt(CONVERSATION), BAD_LINES["non_utf8"][0], SHORT])
    cfg = _cfg(tmp_path, "data.on_bad_record=skip", "eval.num_prompts=1")
    train, heldout = prepare_data(cfg, tokenizer)
    records = read_chat_jsonl(train)
    assert [r.where for r in records] == [f"{src}:1", f"{src}:3"]
    assert records[0].as_dicts() == CONVERSATION
    assert len(read_chat_jsonl(heldout)) == 1  # eval keeps only the prompts the evaluator uses
    counts = json.loads(ingested_paths(cfg, "train")[1].read_text())
    assert (counts["read"], counts["kept"], counts["skipped"]) == (3, 2, {"non_utf8": 1})


def test_bad_eval_source_leaves_nothing_written(tmp_path: Path, tokenizer) -> None:
    bad = _jsonl(tmp_path / "heldout.jsonl", [SHORT, BAD_LINES["unparsable"][0]])
    cfg = _cfg(tmp_path, f"data.eval_path={bad}")
    with pytest.raises(ConfigError, match=r"heldout\.jsonl:2: unparsable JSON"):
        prepare_data(cfg, tokenizer)
    assert not (cfg.out / "data").exists()  # train was fine, but neither split is written


# --- the command line -------------------------------------------------------------------------


def test_cli_extract_exits_nonzero_on_a_bad_line_and_writes_no_data(tmp_path: Path, tokenizer) -> None:
    target = tmp_path / "target"
    tokenizer.save_pretrained(target)  # ingestion needs only the tokenizer; it fails before the model loads
    src = _jsonl(tmp_path / "chats.jsonl", [GOOD, SHORT, BAD_LINES["unknown_role"][0]])
    config = tmp_path / "run.yaml"
    config.write_text(
        json.dumps(
            {
                "target": {"kind": "hf", "path": str(target)},
                "data": {"train_path": str(src)},
                "eval": {"enabled": False},
            }
        )
    )
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "extract", str(config), "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert f"{src}:3: messages[0].role is an unknown role 'tool'" in proc.stderr
    assert "data.on_bad_record=skip" in proc.stderr and "Traceback" not in proc.stderr
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != LOCK_NAME)
    assert written in ([], ["config.yaml"])  # no shard, manifest, or ingested data (the run lock aside)
