"""Response regeneration: the local target (greedy equals a direct generate; seeded sampling is
the same whatever the batch), resume after a limit, a torn write and a failed request, and an
OpenAI-compatible server: a real HTTP server on 127.0.0.1 that answers /v1/chat/completions by
running the same tiny target (retries on 500, a clear error on 400). An empty response makes no
sample, in the stage and in inline regeneration (capture.regenerate) alike."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from data_pipeline.chat_data import read_chat_jsonl
from data_pipeline.provenance import hash_weight_files
from dflash_dist.capture.regenerate import RegenError, prompt_turns, record_seed, regen_output_path, run_regenerate
from dflash_dist.config import ConfigError, load_config
from dflash_dist.target.stdlib_corpus import iter_sources, list_stdlib_files
from dflash_dist.target.tiny_tokenizer import ENDOFTEXT, IM_END, train_tokenizer
from launcher.cli import main as cli_main

MAX_NEW = 10
USER = [
    "def add(a, b):",
    "import os\n\ndef walk(path):",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
    "with open(path) as f:",
]


def conversations(*extra_users: str) -> list[dict]:
    """Single-turn, system + user, multi-turn, and a repeated prompt (its id gets -2)."""
    convs = [{"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": "pass"}]} for u in USER]
    convs[1]["messages"].insert(0, {"role": "system", "content": "You write Python."})
    convs.append(
        {
            "messages": [
                {"role": "user", "content": "x = 1"},
                {"role": "assistant", "content": "y = 2"},
                {"role": "user", "content": "return x"},
                {"role": "assistant", "content": "ok"},
            ]
        }
    )
    convs.append(json.loads(json.dumps(convs[0])))
    for u in extra_users:
        convs.insert(4, {"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": "pass"}]})
    return convs


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return build_target(tmp_path_factory.mktemp("regen") / "target")


def build_target(out: Path, eos_boost: float = 2.0) -> Path:
    """A saved random tiny Qwen3.5 hybrid (3 Gated DeltaNet layers + 1 attention layer) with the
    project's ChatML tokenizer; end tokens <|im_end|> and <|endoftext|> as a Qwen chat model."""
    tokenizer = train_tokenizer([t for _, t in iter_sources(list_stdlib_files(split="train")[:12])], vocab_size=384)
    im_end, endoftext = tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        tie_word_embeddings=False,
        initializer_range=0.1,
        eos_token_id=im_end,
        pad_token_id=endoftext,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():  # point <|im_end|> at the mean last hidden state, so some responses stop early
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": "\n".join(USER)}], tokenize=True, return_dict=True, add_generation_prompt=True
        )["input_ids"]
        mean = model.model(torch.tensor([ids])).last_hidden_state[0].mean(0)
        model.lm_head.weight[im_end] = eos_boost * mean / mean.norm() * model.lm_head.weight.norm(dim=1).mean()
    model.generation_config = GenerationConfig(eos_token_id=[im_end, endoftext], pad_token_id=endoftext)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_cfg(target_dir: Path, tmp_path: Path, data: Path, *overrides: str):
    return load_config(
        None,
        [
            "target.kind=hf",
            f"target.path={target_dir}",
            "target.dtype=float32",
            "target.device=cpu",
            f"data.train_path={data}",
            f"regen.max_new_tokens={MAX_NEW}",
            "regen.batch_size=3",
            *overrides,
        ],
        out_dir=str(tmp_path / "run"),
    )


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def direct_greedy(model, tokenizer, messages: list[dict]) -> tuple[str, str]:
    """(text, finish reason) of a plain, unbatched model.generate on one prompt."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    prompt = torch.tensor([ids["input_ids"]])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_NEW, do_sample=False)
    row = out[0, prompt.shape[1] :].tolist()
    eos = model.generation_config.eos_token_id
    end = next((i for i, t in enumerate(row) if t in eos), None)
    return tokenizer.decode(row[:end]), "stop" if end is not None else "length"


@pytest.fixture(scope="module")
def reference(target_dir: Path) -> dict[str, tuple[str, str]]:
    """Greedy answer per first-user-message, by direct generate on the saved model."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    out = {}
    for conv in conversations("REFUSE this", "FLAKY one", "SILENT please"):
        prompt = conv["messages"][:-1]
        out[json.dumps(prompt)] = direct_greedy(model, tokenizer, prompt)
    return out


def test_target_greedy_equals_direct_generate(target_dir, reference, tmp_path) -> None:
    data = write_jsonl(tmp_path / "chats.jsonl", conversations())
    cfg = make_cfg(target_dir, tmp_path, data)
    report = run_regenerate(cfg)
    out = regen_output_path(cfg)
    lines = read_lines(out)
    records = read_chat_jsonl(data)
    assert report.written == len(lines) == len(records) == 7 and report.remaining == 0
    assert [line["source"] for line in lines] == [r.where for r in records]  # input order
    assert len({line["id"] for line in lines}) == 7 and lines[6]["id"] == lines[0]["id"] + "-2"
    for line, record in zip(lines, records):
        prompt = list(prompt_turns(record))
        assert line["messages"][:-1] == prompt and line["messages"][-1]["role"] == "assistant"
        text, finish = reference[json.dumps(prompt)]
        assert (line["messages"][-1]["content"], line["finish_reason"]) == (text, finish)
    assert {line["finish_reason"] for line in lines} == {"stop", "length"}  # both end conditions occur
    assert read_chat_jsonl(out)  # the output is itself a valid conversations file
    prov = json.loads(out.with_name("train.regenerated.provenance.json").read_text())
    assert prov["complete"] and prov["counts"]["written"] == 7 and prov["counts"]["remaining"] == 0
    assert prov["settings"]["target"]["weights_sha256"] == hash_weight_files(target_dir)
    assert prov["settings"]["sampling"] == {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": MAX_NEW, "seed": 0}
    assert prov["runtime"]["kernel_path"] == "torch"


PENALTIES = {"repetition_penalty": 2.0, "no_repeat_ngram_size": 2, "temperature": 0.3, "top_k": 3, "do_sample": True,
             "min_new_tokens": 4, "suppress_tokens": [5, 6]}


def penalised_copy(target_dir: Path, out: Path) -> Path:
    """The same weights and tokenizer, with a generation_config.json that reshapes "greedy" output."""
    shutil.copytree(target_dir, out)
    gen = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**gen, **PENALTIES}))
    return out


def test_the_checkpoints_generation_config_does_not_shape_greedy_output(target_dir, tmp_path) -> None:
    """Regenerated responses, inline-capture regeneration and the evaluator's reference continuation
    are the same with a generation_config.json holding penalties and sampling fields as without."""
    from dflash_dist.capture.capture_job import CaptureJob
    from dflash_dist.evaluator.evaluator import Evaluator
    from dflash_dist.target.generation import pad_token_id, stop_token_ids
    from dflash_dist.target.loading import target_identity

    bad_dir = penalised_copy(target_dir, tmp_path / "penalised")
    # the config bites: a plain generate (do_sample off) on the penalised checkpoint answers otherwise
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": u}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for u in USER]
    plain = []
    for d in (target_dir, bad_dir):
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        assert (model.generation_config.repetition_penalty == 2.0) == (d == bad_dir)
        with torch.no_grad():
            plain.append([model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                         max_new_tokens=MAX_NEW, do_sample=False)[0, len(p) :].tolist()
                          for p in prompts])
    assert plain[0] != plain[1]

    data = write_jsonl(tmp_path / "chats.jsonl", conversations())
    regenerated, inline, references = [], [], []
    for name, d in (("clean", target_dir), ("penalised", bad_dir)):
        cfg = make_cfg(d, tmp_path / name, data, "capture.layer_ids=[1,2]", "eval.num_prompts=5",
                       f"eval.max_new_tokens={MAX_NEW}", f"capture.max_new_tokens={MAX_NEW}")
        run_regenerate(cfg)
        regenerated.append(contents(cfg))
        job = CaptureJob.load(cfg, d, target_identity(cfg, d), tmp_path / name / "shards", 0, 1)
        inline.append(job._sequences(read_chat_jsonl(data)))
        ev = Evaluator(cfg, tmp_path / name, d, prompts, expected=None)
        references.append([r.sequence for r in ev.references()])
        ev.close()
    assert regenerated[0] == regenerated[1] and inline[0] == inline[1] and references[0] == references[1]
    # and greedy it is: the clean checkpoint's plain generate, cut at the first stop token
    stops = stop_token_ids(tokenizer)
    assert pad_token_id(tokenizer, stops) == tokenizer.pad_token_id
    for p, y, ref in zip(prompts, plain[0], references[0]):
        end = next((i + 1 for i, t in enumerate(y) if t in stops), len(y))
        assert list(ref) == p + y[:end]


def test_greedy_generation_sets_no_conflicting_length_fields(target_dir) -> None:
    """generate_responses's config sets one minimum-length field, so transformers' `Both
    min_new_tokens and min_length seem to have been set` warning (once per call) never comes."""
    import logging

    from dflash_dist.target.generation import generate_responses, pad_token_id, stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": u}], add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        for u in USER[:2]
    ]  # fmt: skip
    stops = stop_token_ids(tokenizer)
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    logging.getLogger("transformers").addHandler(handler)  # transformers' own loggers do not propagate to root
    try:
        out = generate_responses(model, prompts, MAX_NEW, stops, pad_token_id(tokenizer, stops))
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert len(out) == 2 and all(g.tokens for g in out)
    assert not [m for m in seen if "min_length" in m or "min_new_tokens" in m], seen


def contents(cfg) -> list[str]:
    return [line["messages"][-1]["content"] for line in read_lines(regen_output_path(cfg))]


def test_sampling_is_seeded_per_record_whatever_the_batch(target_dir, tmp_path) -> None:
    data = write_jsonl(tmp_path / "chats.jsonl", conversations())
    sampled = ("regen.temperature=1.5", "regen.top_p=0.95")
    runs = {}
    for name, extra in {
        "b1": ("regen.batch_size=1",),
        "b4": ("regen.batch_size=4",),
        "seed1": ("regen.batch_size=4", "run.seed=1"),
        "greedy": ("regen.temperature=0",),
    }.items():
        cfg = make_cfg(target_dir, tmp_path / name, data, *sampled, *extra)
        run_regenerate(cfg)
        runs[name] = contents(cfg)
    assert runs["b1"] == runs["b4"]  # a record's draws come from its own generator, not the batch's
    assert runs["b1"] != runs["greedy"] and runs["b1"] != runs["seed1"]
    assert runs["b1"][0] != runs["b1"][6]  # the repeated prompt is another record with its own seed


def test_resume_after_limit_and_torn_write_matches_an_uninterrupted_run(target_dir, tmp_path) -> None:
    data = write_jsonl(tmp_path / "chats.jsonl", conversations())
    sampled = ("regen.temperature=0.8", "regen.top_p=0.9")
    whole = make_cfg(target_dir, tmp_path / "whole", data, *sampled)
    run_regenerate(whole)
    cfg = make_cfg(target_dir, tmp_path / "parts", data, *sampled)
    assert run_regenerate(cfg, limit=2).remaining == 5
    out = regen_output_path(cfg)
    assert len(read_lines(out)) == 2
    assert not json.loads(out.with_name("train.regenerated.provenance.json").read_text())["complete"]
    with open(out, "ab") as f:  # a write cut short by a crash: half a line, no newline
        f.write(b'{"id": "0000", "messages": [{"role": "user", "cont')
    report = run_regenerate(make_cfg(target_dir, tmp_path / "parts", data, *sampled, "regen.batch_size=2"))
    assert (report.this_run, report.written, report.remaining) == (5, 7, 0)
    assert out.read_bytes() == regen_output_path(whole).read_bytes()  # same lines, same order, none twice
    assert run_regenerate(cfg).this_run == 0 and out.read_bytes() == regen_output_path(whole).read_bytes()
    with pytest.raises(RegenError, match=r"other settings \(sampling\.temperature was 0\.8, now 0\.5\)"):
        run_regenerate(make_cfg(target_dir, tmp_path / "parts", data, "regen.temperature=0.5", "regen.top_p=0.9"))


class ChatServer:
    """An OpenAI-compatible /v1/chat/completions on 127.0.0.1 answering greedily with the tiny
    target. A prompt containing FLAKY gets HTTP 500 the first time, REFUSE always gets 400,
    SILENT gets an empty answer."""

    def __init__(self, target_dir: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.lock, self.requests, self.flaky_failed = threading.Lock(), [], False
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, payload = server.answer(self.path, body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, path: str, body: dict) -> tuple[int, dict]:
        with self.lock:
            self.requests.append(body)
            text = json.dumps(body["messages"])
            if path != "/v1/chat/completions" or body.get("model") != "tiny":
                return 404, {"error": {"message": f"no route {path} for model {body.get('model')}"}}
            if "REFUSE" in text:
                return 400, {"error": {"message": "this prompt is not allowed", "type": "invalid_request_error"}}
            if "FLAKY" in text and not self.flaky_failed:
                self.flaky_failed = True
                return 500, {"error": {"message": "worker crashed", "type": "server_error"}}
            content, finish = ("", "stop") if "SILENT" in text else self._generate(body)
        return 200, {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "tiny",
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}],
        }

    def _generate(self, body: dict) -> tuple[str, str]:
        assert body["max_tokens"] == MAX_NEW
        return direct_greedy(self.model, self.tokenizer, body["messages"])

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture
def server(target_dir):
    s = ChatServer(target_dir)
    yield s
    s.close()


def server_cfg(target_dir, tmp_path, data, url, *extra):
    return make_cfg(
        target_dir,
        tmp_path,
        data,
        "regen.source=server",
        f"regen.url={url}",
        "regen.model=tiny",
        "regen.concurrency=3",
        "regen.max_retries=2",
        "regen.timeout_s=60",
        *extra,
    )


def test_server_matches_target_and_retries_a_500(target_dir, reference, server, tmp_path) -> None:
    data = write_jsonl(tmp_path / "chats.jsonl", conversations("FLAKY one", "SILENT please"))
    cfg = server_cfg(target_dir, tmp_path, data, server.url)
    report = run_regenerate(cfg)
    assert (report.written, report.rejected, report.remaining) == (8, 1, 0)
    lines = read_lines(regen_output_path(cfg))
    for line in lines:  # the server ran the same target: its greedy answers are the direct ones
        assert (line["messages"][-1]["content"], line["finish_reason"]) == reference[json.dumps(line["messages"][:-1])]
    assert sum("FLAKY" in json.dumps(r["messages"]) for r in server.requests) == 2  # a 500, then the retry
    assert all("seed" not in r and r["temperature"] == 0.0 for r in server.requests)
    rejected = read_lines(regen_output_path(cfg).with_name("train.regenerated.rejected.jsonl"))
    assert [(r["reason"], r["source"].endswith(":5")) for r in rejected] == [("empty_response", True)]
    sent = len(server.requests)
    assert run_regenerate(cfg).this_run == 0 and len(server.requests) == sent  # nothing asked twice
    prov = json.loads(regen_output_path(cfg).with_name("train.regenerated.provenance.json").read_text())
    assert prov["settings"]["server"] == {"url": server.url, "model": "tiny"} and prov["counts"]["rejected"] == 1


def test_the_cli_fails_when_empty_responses_exceed_max_lost_fraction(target_dir, server, tmp_path, capsys) -> None:
    """An empty response leaves its record out of the regenerated dataset (in .rejected.jsonl, never
    retried); the training run ingests that dataset and never sees it. `dflash-dist regenerate`
    exited 0 whatever share it dropped: now it prints the counts, and exits 1 naming the file, the
    setting and the fix when data.max_lost_fraction does not allow them (0 within it)."""
    data = write_jsonl(tmp_path / "chats.jsonl", conversations("SILENT please"))  # 8 records, one answered empty
    yaml_path = tmp_path / "regen.yaml"
    yaml_path.write_text("{}")
    args = ["regenerate", str(yaml_path), "--out", str(tmp_path / "run"), f"target.path={target_dir}",
            "target.dtype=float32", "target.device=cpu", "regen.source=server", f"regen.url={server.url}",
            "regen.model=tiny", f"regen.max_new_tokens={MAX_NEW}", f"data.train_path={data}"]  # fmt: skip
    assert cli_main(args) == 1
    captured = capsys.readouterr()
    rejected = tmp_path / "run" / "data" / "train.regenerated.rejected.jsonl"
    assert "7 written, 1 rejected (empty responses), 0 remaining of 8" in captured.out
    output = rejected.with_name("train.regenerated.jsonl")
    assert (f"1 of 8 record(s) got an empty response and are left out of {output} (see {rejected}), more than "
            "data.max_lost_fraction=0.0 allows (0)") in captured.err  # fmt: skip
    assert "move train.regenerated.rejected.jsonl aside to answer them again" in captured.err
    assert cli_main([*args, "data.max_lost_fraction=0.125"]) == 0  # within it: the count, exit 0
    assert "7 written, 1 rejected (empty responses)" in capsys.readouterr().out


def test_inline_regeneration_records_an_empty_response_lost_as_the_stage_rejects_it(tmp_path, monkeypatch) -> None:
    """A target that answers 4 of 12 prompts with its stop token at once. The `regenerate` stage
    leaves those records out (.rejected.jsonl); inline regeneration (capture.regenerate) captured
    them, each a sample whose only supervised token was the stop token, and counted nothing lost.
    Now it records the same 4 lost in skipped.jsonl (empty_response), captures the other 8, and
    data.max_lost_fraction, the summary and a rerun (nothing generated again) see them."""
    import dflash_dist.capture.capture_job as capture_job
    from data_pipeline.chat_data import ChatEncoder
    from data_pipeline.ingest import sample_keys
    from data_pipeline.ledger import capture_loss_problem, captured_keys, read_skipped
    from data_pipeline.shard_reader import iter_shard_samples, read_manifest
    from dflash_dist.orchestration.pipeline import _capture_lines
    from tests.helpers.capture import (
        capture_config,
        make_capture_target,
        make_silent_target,
        run_capture,
        write_conversations,
    )

    data = tmp_path / "train.jsonl"
    write_conversations(data, 12, seed=2)
    records, silent = read_chat_jsonl(data), {0, 3, 7, 10}
    plain = make_capture_target(tmp_path / "plain")
    tok = AutoTokenizer.from_pretrained(plain)
    prompts = [ChatEncoder(tok).prompt_ids(r).tolist() for r in records]
    target = make_silent_target(plain, tmp_path / "silent", prompts, silent)
    cfg = capture_config(tmp_path / "run", target, data, "data.max_length=1024", "regen.max_new_tokens=6",
                         "regen.batch_size=4", regenerate=True, max_new_tokens=6)  # fmt: skip
    report = run_regenerate(cfg)  # the stage's verdict on the same target
    rejected = read_lines(regen_output_path(cfg).with_name("train.regenerated.rejected.jsonl"))
    assert (report.written, report.rejected) == (8, 4)
    assert sorted(r["source"] for r in rejected) == sorted(f"{data}:{i + 1}" for i in silent)

    result = run_capture(cfg)
    keys, shards = sample_keys(records), cfg.out / "shards"
    empty = {keys[i] for i in silent}
    assert (result.samples, result.skipped) == (8, 4)
    assert sorted((r["key"], r["reason"]) for r in read_skipped(shards)) == sorted((k, "empty_response") for k in empty)
    written = {s.key: s for r in read_manifest(shards) for s in iter_shard_samples(shards / r.name)}
    assert written.keys() == set(keys) - empty and captured_keys(shards) == set(keys)
    stop = tok.convert_tokens_to_ids(IM_END)
    assert all(s.loss_mask.sum() > 0 and int(s.input_ids[int(s.loss_mask.argmax())]) != stop for s in written.values())

    problem = capture_loss_problem(shards, 0.0)
    assert problem is not None and problem.startswith(
        "capture: 4 of 12 sample(s) got an empty regenerated response and were not written"), problem
    assert "data.max_lost_fraction=0.0 allows (0)" in problem and "capture.max_new_tokens" in problem
    assert capture_loss_problem(shards, 4 / 12) is None
    (line,) = _capture_lines(cfg, [shards])
    assert line.endswith(f"8 samples in {len(read_manifest(shards))} shards, 4 skipped (empty_response 4; see "
                         f"{shards / 'skipped.jsonl'}; data.max_lost_fraction=0.0)"), line  # fmt: skip

    real, asked = capture_job.generate_responses, []
    monkeypatch.setattr(capture_job, "generate_responses", lambda m, p, *a: asked.extend(p) or real(m, p, *a))
    again = run_capture(cfg)  # settled, lost ones included: nothing is generated again
    assert (again.samples, again.skipped, again.resumed, asked) == (0, 0, 12, [])


def test_server_400_names_the_record_keeps_done_ones_and_resumes(target_dir, server, tmp_path, capsys) -> None:
    bad = write_jsonl(tmp_path / "with_bad.jsonl", conversations("REFUSE this"))
    yaml_path = tmp_path / "regen.yaml"
    yaml_path.write_text(json.dumps({"regen": {"temperature": 0.7, "top_p": 0.9}}))  # JSON is YAML
    args = ["regenerate", str(yaml_path), "--out", str(tmp_path / "run")]
    overrides = [
        f"target.path={target_dir}",
        "target.dtype=float32",
        "target.device=cpu",
        "regen.source=server",
        f"regen.url={server.url}",
        "regen.model=tiny",
        "regen.concurrency=3",
        "regen.max_retries=2",
        f"regen.max_new_tokens={MAX_NEW}",
    ]
    assert cli_main([*args, *overrides, f"data.train_path={bad}"]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:5 (record " in err and "HTTP 400" in err and "this prompt is not allowed" in err
    cfg = load_config(yaml_path, [*overrides, f"data.train_path={bad}"], out_dir=str(tmp_path / "run"))
    out = regen_output_path(cfg)
    assert [line["source"] for line in read_lines(out)] == [f"{bad}:{i}" for i in range(1, 5)]  # the prefix
    # the same input without the refused record: the done four are kept, the rest are added
    clean = write_jsonl(tmp_path / "clean.jsonl", conversations())
    assert cli_main([*args, *overrides, f"data.train_path={clean}"]) == 0
    lines = read_lines(out)
    assert len(lines) == len({line["id"] for line in lines}) == 7
    seeds = {r["seed"] for r in server.requests}
    assert {record_seed(0, line["id"]) for line in lines} <= seeds and all(
        r["temperature"] == 0.7 and r["top_p"] == 0.9 for r in server.requests
    )
    whole_out = tmp_path / "whole.jsonl"
    assert cli_main([*args, *overrides, f"data.train_path={clean}", f"regen.output={whole_out}"]) == 0
    assert [line["id"] for line in read_lines(whole_out)] == [line["id"] for line in lines]


def test_regen_config_errors_name_the_field(target_dir, tmp_path, capsys) -> None:
    data = write_jsonl(tmp_path / "chats.jsonl", conversations())
    with pytest.raises(ConfigError, match=r"regen\.url is required when regen\.source is 'server'"):
        make_cfg(target_dir, tmp_path, data, "regen.source=server", "regen.model=m")
    with pytest.raises(ConfigError, match=r"regen\.top_p must be > 0"):
        make_cfg(target_dir, tmp_path, data, "regen.top_p=0")
    with pytest.raises(ConfigError, match=r"regen\.source: 'vllm' is not one of"):
        make_cfg(target_dir, tmp_path, data, "regen.source=vllm")
    assert cli_main(["regenerate", "nope.yaml"]) == 2 and "config file nope.yaml not found" in capsys.readouterr().err


def test_the_local_target_path_imports_without_the_openai_client() -> None:
    """Regenerating with the local target needs no server client: an offline GPU machine carries
    openai apart (.whl-regen/); only a regen.url run imports it, and then names it and the fix if it is missing."""
    probe = (
        "import sys; sys.modules['openai'] = None\n"  # an import of openai now raises ImportError
        "import dflash_dist.capture.regenerate as r, launcher.cli\n"
        "try:\n"
        "    r.ServerGenerator('http://127.0.0.1:1/v1', 'm', None, 1, 0, 1.0, None, {})\n"
        "except r.RegenError as err:\n"
        "    print('server path:', err)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "server path: regen.url=http://127.0.0.1:1/v1" in done.stdout, done.stdout
    assert "pip install openai==3.57.0" in done.stdout and ".whl-regen/" in done.stdout, done.stdout
