"""Live speculative decoding vs greedy replay on the tiny Qwen3.5 hybrid target (issue 16).

    python bench/bench_live.py --device cuda        # on the GPU: fla's kernels in both
    python bench/bench_live.py --device cpu --small  # CPU smoke run (torch path)

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="only the test's setting")
    args = ap.parse_args()
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
