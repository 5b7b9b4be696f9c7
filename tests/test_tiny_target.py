"""The stdlib corpus, the tiny tokenizer and the cached tiny-target build (at test size)."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM

import dflash_dist.target.tiny_target as tiny_target
from data_pipeline.chat_data import ChatEncoder, template_hash
from dflash_dist.target.stdlib_corpus import (
    EXCLUDED_DIRS,
    code_chat_samples,
    corpus_hash,
    iter_sources,
    list_stdlib_files,
    split_of,
)
from dflash_dist.target.tiny_target import (
    DEFAULT_SETTINGS,
    STAMP_NAME,
    TEST_SETTINGS,
    build_tiny_target,
    default_cache_dir,
    load_tiny_target,
    read_stamp,
)
from dflash_dist.target.tiny_tokenizer import ENDOFTEXT, IM_END, IM_START, MASK, SPECIAL_TOKENS, train_tokenizer
from tests.conftest import REPO
from tests.readme_run import shim_env


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    texts = [text for _, text in iter_sources(list_stdlib_files(split="train")[:30])]
    return train_tokenizer(texts, vocab_size=512)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("cache") / "tiny", TEST_SETTINGS, log=lambda _: None)


def test_corpus_listing_is_sorted_split_and_free_of_tests() -> None:
    files = list_stdlib_files()
    relpaths = [f.relpath for f in files]
    assert relpaths == sorted(relpaths) and len(relpaths) > 100
    assert not any(part in EXCLUDED_DIRS for r in relpaths for part in r.split("/")[:-1])
    train, heldout = list_stdlib_files(split="train"), list_stdlib_files(split="heldout")
    assert {f.relpath for f in train} | {f.relpath for f in heldout} == set(relpaths)
    assert not {f.relpath for f in train} & {f.relpath for f in heldout}
    assert 0.04 < len(heldout) / len(files) < 0.2
    assert split_of("json/decoder.py") == split_of("json/decoder.py")
    assert corpus_hash(heldout) == corpus_hash(list_stdlib_files(split="heldout"))
    with pytest.raises(ValueError, match="split"):
        list_stdlib_files(split="validation")  # type: ignore[arg-type]


def test_tokenizer_specials_come_last_and_text_round_trips(tokenizer) -> None:
    assert len(tokenizer) == 512
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(512 - len(SPECIAL_TOKENS), 512))
    assert tokenizer.eos_token == ENDOFTEXT and tokenizer.pad_token == ENDOFTEXT
    assert tokenizer.mask_token == MASK and tokenizer.mask_token_id == 511
    for _, text in iter_sources(list_stdlib_files(split="heldout")[:10]):
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    odd = "x = 'ünïcödé ✓ \t\r\n'\n\n\n    \n# end"
    assert tokenizer.decode(tokenizer(odd)["input_ids"]) == odd
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    assert text == f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\nok{IM_END}\n"
    generation = tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert generation.endswith(f"{IM_START}assistant\n")


def test_mask_token_never_appears_in_corpus_text(tokenizer) -> None:
    texts = [text for _, text in iter_sources(list_stdlib_files())]
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    mask_id = tokenizer.mask_token_id
    assert sum(len(e.ids) for e in encodings) > 100_000
    assert not any(mask_id in e.ids for e in encodings)
    encoder = ChatEncoder(tokenizer)
    for sample in code_chat_samples("train", 50, seed=0):
        assert mask_id not in encoder.encode(sample["messages"]).input_ids


def test_build_gives_a_loadable_model_that_learned(built: Path) -> None:
    stamp = read_stamp(built)
    assert stamp["settings_digest"] == TEST_SETTINGS.digest()
    assert stamp["steps"] == TEST_SETTINGS.steps
    assert stamp["final_train_loss"] < stamp["initial_loss"] - 0.3
    assert stamp["heldout_loss"] < stamp["uniform_loss"]
    assert len(stamp["corpus_hash"]) == 64 and stamp["train_time_s"] > 0
    model, tokenizer = load_tiny_target(built)
    assert isinstance(model, Qwen3_5ForCausalLM)
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert model.config.vocab_size == len(tokenizer) == TEST_SETTINGS.vocab_size
    assert stamp["mask_token_id"] == tokenizer.mask_token_id
    assert stamp["template_hash"] == template_hash(tokenizer)
    assert (built / "model.safetensors").is_file()
    assert not list(built.parent.glob(".tiny.tmp*"))
    prompt = ChatEncoder(tokenizer).prompt_ids(code_chat_samples("heldout", 1, seed=0)[0]["messages"])
    with torch.no_grad():
        out = model.generate(torch.from_numpy(prompt)[None], max_new_tokens=8, do_sample=False)
    assert out.shape[1] > len(prompt)
    assert set(model.generation_config.eos_token_id) == set(tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT]))


def test_second_call_reuses_the_cache(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = (built / STAMP_NAME).stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a cached target")

    monkeypatch.setattr(tiny_target, "_build_into", fail)
    assert build_tiny_target(built, TEST_SETTINGS) == built
    assert (built / STAMP_NAME).stat().st_mtime_ns == before


def test_cache_built_with_other_settings_is_an_error(built: Path) -> None:
    other = dataclasses.replace(TEST_SETTINGS, steps=TEST_SETTINGS.steps + 1)
    with pytest.raises(ValueError, match="other settings"):
        build_tiny_target(built, other)


def test_concurrent_builders_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = dataclasses.replace(TEST_SETTINGS, steps=3, warmup_steps=1)
    real, calls = tiny_target._build_into, []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(tiny_target, "_build_into", counting)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(build_tiny_target(tmp_path / "t", settings, log=lambda _: None)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [tmp_path / "t"] * 2 and len(calls) == 1


def test_default_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "tiny-target-v1"
    monkeypatch.delenv("DFLASH_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "dflash-dist" / "tiny-target-v1"


def test_invalid_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_layers"):
        dataclasses.replace(DEFAULT_SETTINGS, num_layers=6)
    with pytest.raises(ValueError, match="chat_rows"):
        dataclasses.replace(DEFAULT_SETTINGS, chat_rows=99)


@pytest.mark.slow
def test_default_build_is_meaningfully_trained() -> None:
    """The real default target (built once, ~3 min, into the shared cache; reused afterwards)."""
    target = build_tiny_target()
    stamp = read_stamp(target)
    assert stamp["settings"] == json.loads(json.dumps(dataclasses.asdict(DEFAULT_SETTINGS)))
    # uniform is ln(1024) = 6.93; the default build reaches ~3.55 on held-out files
    assert stamp["heldout_loss"] < 0.6 * stamp["uniform_loss"]
    assert stamp["heldout_chat_loss"] < 0.6 * stamp["uniform_loss"]
    model, tokenizer = load_tiny_target(target)
    assert 1.5e6 < sum(p.numel() for p in model.parameters()) < 4e6
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"
    ]
    prompt = ChatEncoder(tokenizer).prompt_ids(code_chat_samples("heldout", 1, seed=0)[0]["messages"])
    with torch.no_grad():
        out = model.generate(torch.from_numpy(prompt)[None], max_new_tokens=40, do_sample=False)
    text = tokenizer.decode(out[0, len(prompt) :])
    assert text.startswith("    ") and any(token in text for token in ("self", " = ", "(", "def ", "return"))


# ---- a machine with fla + Triton: transformers picks fla for every forward, CPU ones too ----

_PICKED_FLA_BUILD = r"""
import os, sys, torch
from transformers import Qwen3_5ForCausalLM
from transformers.models.qwen3_5 import modeling_qwen3_5 as m
from dflash_dist.target.gdn_path import selected_implementation
picked = selected_implementation(m)
assert picked.startswith("fla"), picked  # transformers believes fla is usable, as it decides it
# first unrouted, as transformers left it: a CPU forward goes to fla and fails there
unrouted = Qwen3_5ForCausalLM.from_pretrained(sys.argv[3]).eval()
try:
    unrouted(input_ids=torch.arange(8)[None])
except Exception as e:
    print("unrouted failed:", e)
else:
    print("unrouted ran")
calls = os.environ["DFLASH_FLA_SHIM_CALLS"]
print("fla calls:", open(calls).read().splitlines() if os.path.exists(calls) else [])
if os.path.exists(calls):
    os.unlink(calls)
from dflash_dist.target.tiny_target import TEST_SETTINGS, build_tiny_target, load_tiny_target
out = build_tiny_target(sys.argv[1], TEST_SETTINGS, log=lambda _: None)
model, _ = load_tiny_target(out)
with torch.no_grad():
    logits = model(input_ids=torch.arange(40)[None] % TEST_SETTINGS.vocab_size).logits
torch.save(logits, sys.argv[2])
print("picked", picked)
"""


def _shim_env(tmp_path: Path) -> dict:
    return shim_env(tmp_path / "fla_calls.txt")


def test_cpu_build_runs_torch_gdn_where_transformers_picked_fla(tmp_path: Path, built: Path) -> None:
    """With fla.ops.gated_delta_rule importable (what transformers tests before sending GDN layers
    to fla), an unrouted CPU forward hits fla and fails as fla's Triton kernels do on CPU tensors;
    the tiny target's build and load still run, on the torch path, with the same logits as a
    process where transformers picked torch."""
    import subprocess
    import sys

    env = _shim_env(tmp_path)
    script = tmp_path / "build.py"
    script.write_text(_PICKED_FLA_BUILD)
    # one process (its imports once): the unrouted forward first, then the build, load and forward
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "tiny"), str(tmp_path / "logits.pt"),
                           str(built)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "unrouted failed: Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)" in proc.stdout, (
        proc.stdout
    )
    assert "fla calls: ['chunk_gated_delta_rule'" in proc.stdout, proc.stdout  # the first call reached "fla"
    assert "picked fla.ops.gated_delta_rule" in proc.stdout
    assert not (tmp_path / "fla_calls.txt").exists()  # no CPU call reached "fla"
    assert read_stamp(tmp_path / "tiny")["settings_digest"] == TEST_SETTINGS.digest()
    model, _ = load_tiny_target(built)  # this process: no fla, transformers' torch path
    with torch.no_grad():
        ref = model(input_ids=torch.arange(40)[None] % TEST_SETTINGS.vocab_size).logits
    reloaded, _ = load_tiny_target(tmp_path / "tiny")
    with torch.no_grad():
        same_build = reloaded(input_ids=torch.arange(40)[None] % TEST_SETTINGS.vocab_size).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), same_build, rtol=0, atol=0)
    assert ref.shape == same_build.shape


@pytest.mark.slow
def test_readme_command_completes_where_transformers_picked_fla(readme_run) -> None:
    """`dflash-dist run configs/tiny.yaml` in processes that all see fla as usable (the Ray head,
    the job's driver, the target actor, trainers and the evaluator inherit the shim: the session's
    one run of the README's command, tests/readme_run.py): the CPU target is built (or reused from
    the shared cache), captured and evaluated on the torch path."""
    from data_pipeline.shard_reader import read_manifest

    out, proc = readme_run.out, readme_run.proc
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    # transformers picked fla in the target actor and the evaluator (their CPU calls were routed)
    routed = [line for line in proc.stdout.splitlines() if "go to transformers' torch reference" in line]
    assert any("[target 0]" in line for line in routed) and any("[evaluator 0]" in line for line in routed), routed
    assert not readme_run.calls.exists()  # nothing reached "fla"
    records = read_manifest(out / "shards")
    assert records and {r.provenance.kernel_path for r in records} == {"torch"}
    assert (out / "eval").is_dir() and any((out / "eval").iterdir())
