"""The code_lm target: its corpus (stdlib + the pinned packages, found in either install layout),
the degenerate-continuation measure, and the cached build at test size on CPU."""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM

import dflash_dist.target.code_target as code_target
from data_pipeline.chat_data import ChatEncoder, template_hash
from dflash_dist.config import ConfigError, TargetSection, load_config
from dflash_dist.target import gdn_path
from dflash_dist.target.build_cache import STAMP_NAME, read_stamp
from dflash_dist.target.code_corpus import (
    MAX_FILE_BYTES,
    MID_CHAT,
    PACKAGES,
    list_code_files,
    load_code_corpus,
    package_dirs,
)
from dflash_dist.target.code_target import CONTINUATIONS_NAME, PRESETS, build_code_target, load_code_target
from dflash_dist.target.continuations import ends_in_loop, is_degenerate, max_ngram_count
from dflash_dist.target.lm_config import causal_lm, text_config
from dflash_dist.target.lm_training import TokenData, TrainRuntime, train
from dflash_dist.target.stdlib_corpus import chat_samples, split_of
from dflash_dist.target.tiny_tokenizer import ENDOFTEXT, IM_END, IM_START, MASK, SPECIAL_TOKENS
from tests.conftest import REPO

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TEST = PRESETS["test"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_code_target(tmp_path_factory.mktemp("cache") / "code", "test", log=lambda _: None)


# ---- the degenerate-continuation measure ---------------------------------------------------------


def test_degenerate_means_some_4gram_four_times() -> None:
    loop = [11, 12, 13, 14]
    assert is_degenerate(loop * 4) and max_ngram_count(loop * 4) == 4
    assert not is_degenerate(loop * 3 + [15]) and max_ngram_count(loop * 3 + [15]) == 3
    assert is_degenerate([7] * 7) and not is_degenerate([7] * 6)  # overlapping occurrences count
    assert is_degenerate([1, 2] + loop * 4 + [3, 4, 5])  # a loop anywhere in the continuation
    assert not is_degenerate(list(range(128)))
    assert max_ngram_count([1, 2, 3]) == 0 and not is_degenerate([])
    # lines that share a 4-gram prefix but differ after it: 3 of them are not degenerate, 4 are
    line = [[20, 21, 22, 23, 30 + i] for i in range(4)]
    assert not is_degenerate(sum(line[:3], [])) and is_degenerate(sum(line, []))


def test_a_loop_is_a_periodic_tail() -> None:
    lines = sum(([20, 21, 22, 23, 30 + i] for i in range(8)), [])  # repetitive, not a loop: the last token varies
    assert is_degenerate(lines) and not ends_in_loop(lines)
    stuck = list(range(100, 140)) + [5, 6, 7] * 11  # period 3 over the last 33 tokens
    assert ends_in_loop(stuck) and not ends_in_loop(stuck[:-2] + [9, 9])
    assert ends_in_loop([1] * 32) and not ends_in_loop([1] * 31)  # a window of 32 tokens at least
    period_16 = list(range(16)) * 2
    assert ends_in_loop(period_16) and not ends_in_loop(list(range(17)) * 2)  # periods above 16 are not loops


# ---- the corpus --------------------------------------------------------------------------------


def test_packages_are_the_pins_of_setup_py() -> None:
    tree = ast.parse((REPO / "setup.py").read_text())
    pins = next(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "INSTALL_REQUIRES"
    )
    pinned = {re.split(r"[\[=<>]", ast.literal_eval(e))[0].lower().replace("_", "-") for e in pins.elts}
    dists_of = importlib.metadata.packages_distributions()
    covered = {d.lower().replace("_", "-") for name in PACKAGES for d in dists_of.get(name, [])}
    assert pinned <= covered, pinned - covered
    assert all(dists_of.get(name) for name in PACKAGES)  # each import name is installed here


def _fake_package(root: Path, name: str, marker: str) -> Path:
    pkg = root / name
    (pkg / "sub").mkdir(parents=True)
    (pkg / "tests").mkdir()
    (pkg / "__init__.py").write_text(f"WHERE = {marker!r}\n")
    (pkg / "sub" / "mod.py").write_text(f"def f():\n    return {marker!r}\n")
    (pkg / "sub" / "copy.py").write_text(f"def f():\n    return {marker!r}\n")  # the same bytes as mod.py
    (pkg / "sub" / "test_mod.py").write_text("def test(): pass\n")
    (pkg / "tests" / "t.py").write_text("x = 1\n")
    (pkg / "sub" / "blank.py").write_text("\n")
    (pkg / "sub" / "latin.py").write_bytes(b"x = '\xe9'\n")
    (pkg / "sub" / "table.py").write_text("T = [\n" + "    0,\n" * (MAX_FILE_BYTES // 6) + "]\n")
    return pkg


def test_packages_are_found_where_the_interpreter_imports_them(tmp_path: Path, monkeypatch) -> None:
    """A `pip install --target DIR` directory first on the path (the GPU machine's wheel set) is
    where the package is read from, not an older copy in site-packages behind it."""
    target, site = tmp_path / "target_site", tmp_path / "site_packages"
    _fake_package(site, "dflash_fakepkg", "site-packages")
    _fake_package(target, "dflash_fakepkg", "target")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(target))
    assert package_dirs(("dflash_fakepkg", "dflash_missing_pkg")) == {"dflash_fakepkg": target / "dflash_fakepkg"}
    files, record = list_code_files(("dflash_fakepkg", "dflash_missing_pkg"))
    ours = {f.relpath for f in files if f.relpath.startswith("dflash_fakepkg/")}
    assert ours == {
        f"dflash_fakepkg/{p}"
        for p in ("__init__.py", "sub/mod.py", "sub/copy.py", "sub/blank.py", "sub/latin.py", "sub/table.py")
    }  # no tests, no test_*.py
    assert all(f.path.is_relative_to(target) for f in files if f.relpath in ours)
    assert record.missing == ["dflash_missing_pkg"] and [p.name for p in record.packages] == ["dflash_fakepkg"]
    assert [f.relpath for f in files] == sorted(f.relpath for f in files)
    corpus, stdlib_only = load_code_corpus(packages=("dflash_fakepkg",)), load_code_corpus(packages=())
    kept = {r for r, _ in corpus.train + corpus.heldout if r.startswith("dflash_fakepkg/")}
    assert kept == {"dflash_fakepkg/__init__.py", "dflash_fakepkg/sub/copy.py"}  # copy.py sorts before mod.py
    assert dict(corpus.record.skipped) == {  # each left-out file counted by why, none silently
        k: n + 1 for k, n in stdlib_only.record.skipped.items()
    }
    assert dict(zip(("__init__.py", "sub/copy.py"), ("WHERE = 'target'\n", "def f():\n    return 'target'\n"))) == {
        r.removeprefix("dflash_fakepkg/"): t for r, t in corpus.train + corpus.heldout if r in kept
    }


def test_real_packages_are_found_and_the_split_is_by_file() -> None:
    dirs = package_dirs()
    assert {"torch", "transformers", "deepspeed", "ray", "webdataset"} <= set(dirs)
    assert (dirs["transformers"] / "models" / "qwen3").is_dir()
    corpus = load_code_corpus(max_files=40)
    train = {r for r, _ in corpus.train}
    heldout = {r for r, _ in corpus.heldout}
    assert train and heldout and not train & heldout
    assert all(split_of(r) == "train" for r in train) and all(split_of(r) == "heldout" for r in heldout)
    tops = {r.split("/")[0] for r in train | heldout}
    assert tops & set(PACKAGES) and any("/" not in r or r.split("/")[0] not in PACKAGES for r in train)
    again = load_code_corpus(max_files=40)
    assert again.record.hash == corpus.record.hash and len(corpus.record.hash) == 64
    assert corpus.record.files == {"train": len(train), "heldout": len(heldout)}


# ---- the build at test size ------------------------------------------------------------------------


def test_build_record(built: Path) -> None:
    stamp = read_stamp(built)
    assert stamp["kind"] == "code_lm" and stamp["settings_digest"] == TEST.digest()
    assert len(stamp["corpus_hash"]) == 64 and stamp["corpus"]["hash"] == stamp["corpus_hash"]
    assert stamp["corpus"]["files"]["train"] > 0 and stamp["corpus"]["files"]["heldout"] > 0
    assert stamp["corpus"]["bytes"]["train"] > 0 and stamp["corpus"]["packages"]
    assert stamp["tokens"]["train"] > 1000 and stamp["tokens"]["heldout"] > 0 and stamp["tokens"]["train_chats"] > 0
    assert stamp["steps"] == TEST.steps == 12
    assert stamp["tokens_trained"] == TEST.steps * TEST.batch_size * TEST.seq_len >= TEST.train_tokens
    assert stamp["final_train_loss"] < stamp["initial_loss"] - 0.3
    assert stamp["heldout_loss"] < stamp["uniform_loss"] and stamp["heldout_chat_loss"] < stamp["uniform_loss"]
    assert set(stamp["times_s"]) == {"corpus_s", "tokenizer_s", "encode_s", "train_s", "eval_s", "build_s"}
    assert stamp["build_time_s"] >= stamp["times_s"]["train_s"] > 0 and stamp["tokens_per_s"] > 0
    assert stamp["compiled"] is False and stamp["gdn_train_kernels"] == "none" and stamp["device"] == "cpu"
    rows = [json.loads(line) for line in (built / CONTINUATIONS_NAME).read_text().splitlines()]
    cont = stamp["continuations"]
    assert cont["prompts"] == len(rows) == TEST.eval_chat_samples and cont["max_new_tokens"] == 24
    assert stamp["degenerate_share"] == cont["degenerate_share"] == sum(r["degenerate"] for r in rows) / len(rows)
    assert cont["loop_share"] == sum(r["loop"] for r in rows) / len(rows) and "period" in cont["loop_definition"]
    assert all(split_of(r["source"]) == "heldout" for r in rows)  # prompts from held-out files only
    model, tokenizer = load_code_target(built)
    assert isinstance(model, Qwen3ForCausalLM) and model.config.num_hidden_layers == TEST.num_layers
    assert stamp["num_params"] == sum(p.numel() for p in model.parameters())
    assert stamp["template_hash"] == template_hash(tokenizer)


def test_tokenizer_has_the_mask_and_chatml_tokens(built: Path) -> None:
    _, tokenizer = load_code_target(built)
    v = TEST.vocab_size
    assert len(tokenizer) == v and tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(v - 4, v))
    assert tokenizer.mask_token == MASK and read_stamp(built)["mask_token_id"] == v - 1
    chat = [{"role": "user", "content": "x = 1"}, {"role": "assistant", "content": "y = 2"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == (
        f"{IM_START}user\nx = 1{IM_END}\n{IM_START}assistant\ny = 2{IM_END}\n"
    )
    assert tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id) == ENDOFTEXT
    prompt = ChatEncoder(tokenizer).prompt_ids(chat)
    assert tokenizer.decode(prompt).endswith(f"{IM_START}assistant\n")


def test_second_call_reuses_the_cache(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = (built / STAMP_NAME).stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a cached target")

    monkeypatch.setattr(code_target, "_build_into", fail)
    assert build_code_target(built, "test") == built
    assert (built / STAMP_NAME).stat().st_mtime_ns == before
    with pytest.raises(ValueError, match="other settings"):
        build_code_target(built, settings=dataclasses.replace(TEST, seed=1))
    assert not list(built.parent.glob(f".{built.name}.tmp*"))


def test_a_failing_compile_trains_eagerly_and_says_so(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU runtime's options on CPU (bf16 autocast, fused AdamW) with a torch.compile whose
    graph fails at the first step, as a compiler error would: training goes on eagerly, recorded."""
    _, tokenizer = load_code_target(built)
    corpus = load_code_corpus(max_files=6)
    chats = chat_samples(corpus.train, 8, 0, MID_CHAT)
    data = TokenData(tokenizer, [t for _, t in corpus.train], [t for _, t in corpus.heldout], chats, chats[:2])

    def broken_compile(fn):
        def compiled(*args):
            raise RuntimeError("inductor: simulated compiler failure")

        return compiled

    monkeypatch.setattr(torch, "compile", broken_compile)
    settings = dataclasses.replace(TEST, train_tokens=4 * TEST.batch_size * TEST.seq_len, warmup_steps=1)
    torch.manual_seed(0)
    model = causal_lm(text_config("qwen3", settings, tokenizer.eos_token_id))
    runtime = TrainRuntime(autocast=torch.bfloat16, fused_adamw=True, compile=True)
    logged: list[str] = []
    stats = train(model, data, settings, logged.append, runtime)
    assert stats["compiled"] is False and "simulated compiler failure" in stats["compile_error"]
    assert any("training eagerly" in line for line in logged)
    assert len(stats["loss_curve"]) == settings.steps == 4 and all(math.isfinite(x) for x in stats["loss_curve"])
    assert stats["tokens_per_s"] > 0


# ---- settings, presets, config -------------------------------------------------------------------


def test_presets_sizes_and_settings_checks() -> None:
    with torch.device("meta"):
        dense = causal_lm(text_config("qwen3", PRESETS["qwen3"], 0))
        hybrid = causal_lm(text_config("qwen3_5", PRESETS["qwen3_5"], 0))
    assert isinstance(dense, Qwen3ForCausalLM) and isinstance(hybrid, Qwen3_5ForCausalLM)
    assert sum(p.numel() for p in dense.parameters()) == 88_101_120  # the default: 88.1M
    assert 90e6 < sum(p.numel() for p in hybrid.parameters()) < 105e6
    assert hybrid.config.layer_types.count("full_attention") == 3
    assert PRESETS["qwen3"].train_tokens >= 100_000_000 and PRESETS["qwen3"].vocab_size >= 8192
    assert PRESETS["qwen3"].steps * PRESETS["qwen3"].batch_size * PRESETS["qwen3"].seq_len >= 100_000_000
    assert set(PRESETS) == set(TargetSection.model_fields["preset"].annotation.__args__)
    with pytest.raises(ValueError, match="arch"):
        dataclasses.replace(TEST, arch="llama")
    with pytest.raises(ValueError, match="multiple of 4"):
        dataclasses.replace(TEST, arch="qwen3_5", num_layers=6)
    with pytest.raises(ValueError, match="warmup_steps"):
        dataclasses.replace(TEST, train_tokens=64)


def test_preset_only_with_code_lm() -> None:
    cfg = load_config(None, ["target.kind=code_lm", "target.preset=test_qwen3_5"])
    assert cfg.target.preset == "test_qwen3_5"
    with pytest.raises(ConfigError, match="target.preset"):
        load_config(None, ["target.kind=tiny_stdlib", "target.preset=qwen3_5"])
    with pytest.raises(ConfigError, match="preset"):
        load_config(None, ["target.kind=code_lm", "target.preset=big"])


def test_gdn_training_swap_is_scoped() -> None:
    """Inside `torch_gdn_kernels` the hybrid's modeling module calls transformers' own torch
    functions (what training on a GPU must use where fla refuses its backward); after, the
    selected ones again."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    before = m.torch_chunk_gated_delta_rule
    with gdn_path.torch_gdn_kernels() as swapped:
        inside = m.torch_chunk_gated_delta_rule
        assert f"{m.__name__}.torch_chunk_gated_delta_rule" in swapped
        assert inside is not before and not hasattr(inside, "__wrapped__")
        assert inside.__module__ == m.__name__
    assert m.torch_chunk_gated_delta_rule is before
    assert isinstance(gdn_path.fla_gdn_backward_error("cpu"), str)  # fla's kernels need CUDA + Triton


def test_hybrid_preset_builds_at_test_size(tmp_path: Path) -> None:
    target = build_code_target(tmp_path / "hybrid", "test_qwen3_5", log=lambda _: None)
    stamp = read_stamp(target)
    assert stamp["gdn_train_kernels"] == "torch" and stamp["final_train_loss"] < stamp["initial_loss"]
    model, _ = load_code_target(target)
    assert isinstance(model, Qwen3_5ForCausalLM) and "linear_attention" in model.config.layer_types
