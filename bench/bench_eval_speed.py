"""The evaluator's two slow parts at the mid target's shape, through the evaluator itself: the
held-out references (greedy continuations, one prompt at a time vs eval.reference_batch) and live
speculative decoding (one process vs eval.live_workers; and the feed-again rollback against keeping
the verify's positions, which plain attention KV caches do since 2026-12-04). On the H200 the mid run's evaluator took
133 s for 64 references and 503 s for one live measurement (docs/BENCHMARKS.md).

    python bench/bench_eval_speed.py                          # GPU: code_lm's qwen3 shape, 64 prompts
    python bench/bench_eval_speed.py --device cpu --small     # CPU smoke run

The target is the code_lm preset's architecture with random weights and the drafter is the mid
config's shape, also random: an untrained drafter's tau is ~1, so every prompt takes the most
rounds (the worst case for live time). Prints seconds per setting and the speed-ups; --json
writes them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_dist.config import load_config  # noqa: E402
from dflash_dist.evaluator.evaluator import Evaluator  # noqa: E402
from dflash_dist.evaluator.live import live_decode  # noqa: E402
from dflash_dist.model.config import DrafterConfig, build_target_layer_ids  # noqa: E402
from dflash_dist.model.drafter import DFlashDrafter  # noqa: E402
from dflash_dist.model.export import export_drafter  # noqa: E402
from dflash_dist.target.build_cache import save_target  # noqa: E402
from dflash_dist.target.code_target import PRESETS  # noqa: E402
from dflash_dist.target.lm_config import causal_lm, text_config  # noqa: E402
from dflash_dist.target.stdlib_corpus import iter_sources, list_stdlib_files  # noqa: E402
from dflash_dist.target.tiny_tokenizer import ENDOFTEXT, train_tokenizer  # noqa: E402


def live_rounds(measured) -> int:
    """Rounds a live measurement ran: the chain's and every budget's."""
    return sum(len(r) for r in measured.chain_rounds) + sum(len(r) for t in measured.tree_rounds.values() for r in t)


def tokenizer_texts(limit: int) -> list[str]:
    """The stdlib corpus's first files (stdlib_corpus's listing and reading) up to `limit` characters: text for
    a random-weight target's BPE, whose prompts here are random ids anyway."""
    texts, size = [], 0
    for _, text in iter_sources(list_stdlib_files()):
        if size > limit:
            break
        texts.append(text)
        size += len(text)
    return texts


def make_target(root: Path, preset: str, seed: int) -> tuple[Path, int, int]:
    """A random-weight target of the preset's shape saved as an HF directory; (dir, vocab, layers)."""
    settings = PRESETS[preset]
    tokenizer = train_tokenizer(tokenizer_texts(4_000_000), settings.vocab_size)  # a few MB of source for the BPE
    torch.manual_seed(seed)
    model = causal_lm(text_config(settings.arch, settings, tokenizer.convert_tokens_to_ids(ENDOFTEXT)))
    save_target(root / "target", model, tokenizer)
    return root / "target", settings.vocab_size, settings.num_layers


def make_export(root: Path, hidden: int, vocab: int, layers: int, k: int, seed: int) -> Path:
    """The mid config's drafter shape (3 layers, 12 heads, 4 KV heads, block 16), random weights."""
    ids = tuple(build_target_layer_ids(layers, k))
    cfg = DrafterConfig(hidden_size=hidden, num_hidden_layers=3, num_attention_heads=12, num_key_value_heads=4,
                        head_dim=64, intermediate_size=2048, vocab_size=vocab, target_layer_ids=ids,
                        num_target_layers=layers, block_size=16, mask_token_id=vocab - 1)  # fmt: skip
    torch.manual_seed(seed)
    export_drafter(DFlashDrafter(cfg), root / "export" / "step_1")
    return root / "export" / "step_1"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="the test preset's shape, 4 prompts, 16 tokens")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=240)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--live-prompts", type=int, default=16, help="prompts decoded live in each setting")
    ap.add_argument("--workers", default="1,8", help="eval.live_workers settings, comma-separated")
    ap.add_argument("--reference-batch", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    preset = "test" if args.small else "qwen3"
    if args.small:
        args.prompts, args.prompt_len, args.new_tokens, args.live_prompts = 4, 24, 16, 4
    on_gpu = args.device == "cuda"
    out: dict = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "preset": preset,
                 "prompts": args.prompts, "new_tokens": args.new_tokens, "torch": torch.__version__}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target_dir, vocab, layers = make_target(root, preset, 0)
        hidden = PRESETS[preset].hidden_size
        k = 2 if args.small else 5
        export = make_export(root, hidden, vocab, layers, k, 1)
        gen = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, vocab - 8, (args.prompt_len + (i % 16) * 4,), generator=gen).tolist()
                   for i in range(args.prompts)]  # fmt: skip

        def evaluator(run: str, **eval_fields) -> Evaluator:
            overrides = [f"target.path={target_dir}", f"target.dtype={'bfloat16' if on_gpu else 'float32'}",
                         f"target.device={args.device}", "data.train_path=unread.jsonl", f"capture.num_layers={k}",
                         f"eval.num_prompts={args.prompts}", f"eval.max_new_tokens={args.new_tokens}",
                         "eval.budgets=[8]", "eval.mode=live"]  # fmt: skip
            overrides += [f"eval.{k}={v}" for k, v in eval_fields.items()]
            cfg = load_config(None, overrides, check_files=False)
            return Evaluator(cfg, root / run, target_dir, prompts, expected=None)

        refs = {}
        for batch in (1, args.reference_batch):
            ev = evaluator(f"refs{batch}", reference_batch=batch)
            t0 = time.perf_counter()
            refs[batch] = ev.references()
            out[f"references_batch_{batch}_s"] = round(time.perf_counter() - t0, 2)
            print(f"references, batch {batch}: {out[f'references_batch_{batch}_s']} s for {args.prompts} prompts",
                  flush=True)  # fmt: skip
        same = sum(a.sequence == b.sequence for a, b in zip(refs[1], refs[args.reference_batch]))
        out["references_equal"] = same
        print(f"references equal to one-at-a-time: {same}/{args.prompts}")
        live_refs = refs[args.reference_batch][: args.live_prompts]
        for workers in (int(w) for w in args.workers.split(",")):
            ev = evaluator(f"live{workers}", live_workers=workers)
            ev._refs = refs[args.reference_batch]
            drafter = ev._load_drafter(export)
            t0 = time.perf_counter()
            measured = ev._measure_live(drafter, live_refs, export)
            dt = time.perf_counter() - t0
            rounds = live_rounds(measured)
            out[f"live_workers_{workers}"] = {"s": round(dt, 2), "rounds": rounds,
                                              "ms_per_round": round(1e3 * dt / rounds, 2),
                                              "tau_chain": measured.result.tau_chain}  # fmt: skip
            print(f"live, {workers} worker(s): {dt:.1f} s for {len(live_refs)} prompts, {rounds} rounds "
                  f"({1e3 * dt / rounds:.1f} ms a round), tau chain {measured.result.tau_chain:.3f}", flush=True)
        # one process, the rollback live used before plain-KV targets kept the verify's positions
        ev = evaluator("refeed")
        drafter = ev._load_drafter(export)
        t0, rounds = time.perf_counter(), 0
        for ref in live_refs:
            for budget in (None, 8):
                run = live_decode(ev.model, drafter, ref.prompt, args.new_tokens, ev.stop_ids, budget,
                                  rollback="refeed")  # fmt: skip
                rounds += len(run.taus)
        dt = time.perf_counter() - t0
        out["live_refeed_1"] = {"s": round(dt, 2), "rounds": rounds, "ms_per_round": round(1e3 * dt / rounds, 2)}
        print(f"live, 1 process, feed-again rollback: {dt:.1f} s, {rounds} rounds ({1e3 * dt / rounds:.1f} ms a round)")
    ws = [int(w) for w in args.workers.split(",")]
    if len(ws) > 1:
        base, best = out[f"live_workers_{ws[0]}"]["s"], out[f"live_workers_{ws[-1]}"]["s"]
        print(f"live speed-up {ws[-1]} vs {ws[0]} worker(s): {base / best:.2f}x")
    b = out["references_batch_1_s"] / out[f"references_batch_{args.reference_batch}_s"]
    print(f"references speed-up batch {args.reference_batch} vs 1: {b:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
