"""The evaluator tests' tiny setting: a tiny random Qwen3.5 target saved with a word-level
tokenizer, two exports of its drafter (random, and trained on the eval prompts), the eval config
over them (the `tiny_eval` fixture, tests/conftest.py), and exports published as the trainer does."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from dflash_dist.model.export import export_drafter
from dflash_dist.tools.demo import DemoConfig, drafter_for, make_data, tiny_qwen35_target, train
from tests.helpers.config import UNREAD_TRAIN_PATH, config_from

DEMO = replace(DemoConfig(), target_layers=4, k=2, num_prompts=6, prompt_len=12, new_tokens=24, steps=60)
BUDGETS = [4, 8]
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")  # ids 252..255; the mask is vocab-1


def word_tokenizer(tokens: list[str], **specials) -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(tokens)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token=tokens[0])), **specials)


def make_tiny_eval(root: Path) -> dict:
    """A tiny random Qwen3.5 target saved as an HF directory (with a word-level tokenizer), and
    two exports of its drafter: random, and trained on the target's responses to the prompts
    that are also the eval prompts (so a few dozen steps raise tau clearly)."""
    target = tiny_qwen35_target(DEMO)
    target.save_pretrained(root / "target")
    words = [f"t{i}" for i in range(DEMO.vocab_size - len(SPECIALS))] + list(SPECIALS)
    word_tokenizer(words, eos_token="<|endoftext|>", mask_token="<|mask|>").save_pretrained(root / "target")
    drafter = drafter_for(target, DEMO)
    export_drafter(drafter, root / "random")
    prompts, _, ids, loss_mask, cap = make_data(target, DEMO, drafter.config.mask_token_id)
    train(drafter, ids, cap.features, loss_mask, DEMO, log_every=0)
    export_drafter(drafter, root / "trained")
    cfg = config_from(
        {
            "target": {"path": str(root / "target"), "dtype": "float32", "device": "cpu"},
            "data": {"train_path": UNREAD_TRAIN_PATH},
            "capture": {"num_layers": DEMO.k},
            "eval": {"num_prompts": 3, "max_new_tokens": DEMO.new_tokens, "budgets": BUDGETS},
        }
    )
    return {"root": root, "target_dir": root / "target", "cfg": cfg, "prompts": prompts[:3]}


def publish(tiny_eval: dict, out: Path, which: str, step: int) -> None:
    """Like the trainer: a complete copy under a temp name, renamed into place."""
    tmp = out / "export" / f".tmp-step_{step}-x"
    shutil.copytree(tiny_eval["root"] / which, tmp)
    os.rename(tmp, out / "export" / f"step_{step}")
