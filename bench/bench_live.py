"""Live speculative decoding vs greedy replay on the tiny Qwen3.5 hybrid target (issue 16).

    python bench/bench_live.py --device cuda        # on the GPU: fla's kernels in both
    python bench/bench_live.py --device cpu --small  # CPU smoke run (torch path)
    python bench/bench_live.py --device cuda --gdn torch  # GPU, transformers' torch GDN code instead of fla
    python bench/bench_live.py --device cuda --small --diagnose  # rollback error and where live leaves greedy

Prints, per setting: tau of replay and of live decoding (chain and DDTree-4/8), how many rounds
have the same tau in both, how many live continuations equal the target's greedy continuation,
and live decoding's wall time. Uses dflash_dist/tools/live_check.py (the same code tests/test_live.py's gpu-marked
test runs), so the figure in docs/BENCHMARKS.md is what that test asserts on.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_dist.tools.demo import DemoConfig  # noqa: E402
from dflash_dist.tools.live_check import live_vs_replay, trained_on_device  # noqa: E402

BUDGETS = (4, 8)
DEMO = replace(DemoConfig(), target_layers=4, k=2, num_prompts=6, prompt_len=12, new_tokens=24, steps=60)  # the test's


def torch_gdn_everywhere() -> list[str]:
    """Replace the GDN/conv kernels transformers selected (fla on a GPU) by its own torch code."""
    import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401  (loads the module to patch)

    from dflash_dist.target.gdn_path import ROUTED_NAMES, _reference_of

    done = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("transformers.models.") or ".modeling_" not in mod_name:
            continue
        for name in ROUTED_NAMES:
            fn = mod.__dict__.get(name)
            if callable(fn) and (ref := _reference_of(fn)) is not None and ref is not fn:
                setattr(mod, name, ref)
                done.append(f"{mod_name.rsplit('.', 1)[1]}.{name}")
    return done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="only the test's setting")
    ap.add_argument("--gdn", choices=("auto", "torch"), default="auto",
                    help="torch: the Gated DeltaNet layers and conv run transformers' torch reference on every "
                         "device (separates the decoding loop from fla's kernel numerics)")
    ap.add_argument("--diagnose", action="store_true",
                    help="also: the rollback's logit error against a full forward, next to a plain chunked "
                         "continuation's, and the target's top-1/top-2 logit margin where live decoding first "
                         "leaves the greedy continuation")
    args = ap.parse_args()
    if args.gdn == "torch":
        import dflash_dist.model.capture as capture

        print("GDN on transformers' torch reference:", ", ".join(torch_gdn_everywhere()))
        capture.check_kernel_path = lambda model, allow=False: "torch"  # accept torch GDN on CUDA (a diagnostic)
    settings = {"test (4 layers, 6 prompts x 24 tokens)": DEMO}
    if not args.small:
        settings["demo (8 layers, 24 prompts x 48 tokens, 300 steps)"] = DemoConfig()
        settings["long (8 layers, 8 prompts x 256 tokens)"] = replace(DemoConfig(), num_prompts=8, new_tokens=256)
    for name, cfg in settings.items():
        t0 = time.time()
        target, drafter, prompts, _, kernel_path = trained_on_device(args.device, cfg)
        t1 = time.time()
        r = live_vs_replay(target, drafter, prompts, cfg.new_tokens, BUDGETS)
        replay, live = r["replay"], r["live"]
        trees = "  ".join(f"DDTree-{b} {replay.tau_ddtree(b):.3f}/{live.tau_ddtree(b):.3f}" for b in BUDGETS)
        print(f"{name} [{args.device}, kernel {kernel_path}]: tau replay/live chain "
              f"{replay.tau_chain:.3f}/{live.tau_chain:.3f} ({(live.tau_chain / replay.tau_chain - 1) * 100:+.2f}%)  "
              f"{trees}  rounds equal {r['rounds_equal']}/{r['rounds']}  continuations equal "
              f"{r['continuations_equal']}/{r['prompts']}  train {t1 - t0:.0f}s, measure {time.time() - t1:.1f}s",
              flush=True)
        own = r["own"]
        print(f"  replay over live's own sequences: chain {own.tau_chain:.3f}  "
              + "  ".join(f"DDTree-{b} {own.tau_ddtree(b):.3f}" for b in BUDGETS)
              + f"; live leaves generate's greedy at {len(r['divergences'])} places, top-2 margin there max "
              f"{max((d[2] for d in r['divergences']), default=0):.2e}, live token's max "
              f"{max((d[3] for d in r['divergences']), default=0):.2e}", flush=True)
        if args.diagnose:
            diagnose(target, drafter, prompts, cfg)
    return 0


@torch.no_grad()
def diagnose(target, drafter, prompts, cfg) -> None:
    """Separate a rollback error from kernel numerics (chunked vs full forward)."""
    from dflash_dist.evaluator.live import live_decode
    from dflash_dist.evaluator.target_cache import TargetCache
    from dflash_dist.target.generation import greedy_continuation

    dev = next(target.parameters()).device
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, cfg.vocab_size - 1, (40,), generator=g).tolist()
    full = target(torch.tensor([seq[:30]], device=dev)).logits[0].float()
    cache = TargetCache(target)
    cache.step(seq[:20])
    snap = cache.snapshot()
    cache.step(seq[20:28])  # a block of 8 verified, 3 accepted
    cache.restore(snap)
    cache.step(seq[20:23])
    rolled = cache.step(seq[23:30]).logits[0]
    plain = TargetCache(target)
    plain.step(seq[:23])
    chunked = plain.step(seq[23:30]).logits[0]
    scale = full[23:30].abs().max().item()
    print(f"  rollback vs full forward: max|d| {(rolled - full[23:30]).abs().max().item():.3e}; plain chunked "
          f"continuation vs full: {(chunked - full[23:30]).abs().max().item():.3e}; rollback vs plain chunked: "
          f"{(rolled - chunked).abs().max().item():.3e} (logit scale {scale:.2f})", flush=True)
    for i, prompt in enumerate(prompts):
        y = greedy_continuation(target, prompt, cfg.new_tokens)
        run = list(live_decode(target, drafter, prompt, cfg.new_tokens).tokens)
        first = next((j for j, (a, b) in enumerate(zip(y, run)) if a != b), None)
        if first is None:
            print(f"  prompt {i}: live == greedy ({len(y)} tokens)")
            continue
        logits = target(torch.tensor([prompt + y[:first]], device=dev)).logits[0, -1].float()
        top = logits.topk(2)
        print(f"  prompt {i}: live leaves greedy at token {first}: greedy {y[first]} live {run[first]}; "
              f"full-forward top-2 margin {float(top.values[0] - top.values[1]):.3e}, margin of live's token "
              f"{float(logits.max() - logits[run[first]]):.3e} (logit std {float(logits.std()):.3f})", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
