"""CaptureJob on a saved target: conversations to capture, a tiny target with a ChatML tokenizer,
the capture config, and one capture run."""

from __future__ import annotations

import torch

from dflash_dist.tools.demo import DemoConfig, tiny_qwen35_target
from tests.helpers.config import config_from


def write_conversations(path, n: int, seed: int = 0) -> None:
    """`n` code-continuation conversations of varied lengths, cut from a few stdlib files."""
    import json
    import random

    from dflash_dist.target.stdlib_corpus import iter_sources, list_stdlib_files

    files = list_stdlib_files(split="train")[:20]
    lines = [ln[:60] for _, text in iter_sources(files) for ln in text.splitlines() if ln.strip()]
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a = rng.randrange(len(lines) - 60)
            b = a + rng.randint(1, 8)
            c = b + rng.randint(1, 10)
            msgs = [
                {"role": "user", "content": "Continue:\n" + "\n".join(lines[a:b])},
                {"role": "assistant", "content": "\n".join(lines[b:c]) or "pass"},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")


def make_capture_target(root, poison_token: int | None = None, hidden: int = 64, intermediate: int | None = None):
    """A tiny random Qwen3.5 target (4 layers, H=`hidden`) saved with a ChatML BPE tokenizer. With
    `poison_token`, that token's embedding row is NaN: every sequence holding it captures NaN. With
    `intermediate`, its MLPs are that wide instead of 2H (a wide H whose forward stays cheap on CPU)."""
    from dflash_dist.target.stdlib_corpus import iter_sources, list_stdlib_files
    from dflash_dist.target.tiny_tokenizer import train_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    model = tiny_qwen35_target(DemoConfig(vocab_size=384, target_layers=4, target_hidden=hidden))
    if intermediate is not None:
        model.config.intermediate_size = intermediate
        torch.manual_seed(0)
        model = type(model)(model.config).eval()
    if poison_token is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight[poison_token] = float("nan")
    model.save_pretrained(root)
    texts = [text for _, text in iter_sources(list_stdlib_files(split="train")[:20])]
    train_tokenizer(texts, vocab_size=384).save_pretrained(root)
    return root


def capture_config(out, target_dir, train_jsonl, *overrides: str, **capture):
    """The capture config over a saved target and a conversations file (both must exist);
    `capture` sets capture.* fields by name, `overrides` (`a.b=value`) any other."""
    tree = {
        "run": {"out_dir": str(out)},
        "target": {"kind": "hf", "path": str(target_dir), "dtype": "float32", "device": "cpu"},
        "data": {"train_path": str(train_jsonl), "max_length": 256},
        "capture": {"layer_ids": [1, 2], "regenerate": False, "batch_size": 4, "shard_bytes": 300_000, **capture},
    }
    return config_from(tree, *overrides, check_files=True)


def run_capture(cfg, actor_index: int = 0, num_actors: int = 1):
    from dflash_dist.capture.capture_job import CaptureJob
    from dflash_dist.capture.data_prep import capture_data
    from dflash_dist.target.loading import target_identity

    target_dir = cfg.target.path
    job = CaptureJob.load(
        cfg, target_dir, target_identity(cfg, target_dir), cfg.out / "shards", actor_index, num_actors
    )
    return job.run(cfg.data.train_path, capture_data(cfg, cfg.data.train_path))


def make_silent_target(target_dir, out_dir, prompts: list[list[int]], silent: set[int], margin: float = 30.0):
    """A copy of a saved target whose first greedy token after prompt i is `<|im_end|>`, its stop
    token, exactly for i in `silent` (an empty response) and never for the others: that token's
    lm_head row solved (least squares, exact for fewer prompts than the hidden size) so its logit
    is +margin on those prompts' last hidden states and -margin on the others'. The embeddings
    are untied: the prompts' own `<|im_end|>` tokens keep their embedding."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(target_dir, out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    assert not model.config.tie_word_embeddings
    stop = AutoTokenizer.from_pretrained(out_dir).convert_tokens_to_ids("<|im_end|>")
    last: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, args, _out: last.append(args[0][0, -1].clone()))
    with torch.no_grad():
        for p in prompts:
            model(torch.tensor([p]))
        hook.remove()
        h = torch.stack(last).double()
        want = torch.tensor([margin if i in silent else -margin for i in range(len(prompts))], dtype=torch.double)
        model.lm_head.weight[stop] = (torch.linalg.pinv(h) @ want).float()
    model.save_pretrained(out_dir)
    return out_dir
