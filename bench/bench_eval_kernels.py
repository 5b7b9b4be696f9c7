"""The evaluator on each capture kernel path at the Qwen3.5-27B widths, through the evaluator itself, with
configs/qwen3.6-27b.yaml's settings (its eval and drafter sections): what the recipe must show before its
`capture.kernels` leaves eager, since the evaluator runs the kernels capture ran (non-negotiable 4).

    python bench/bench_eval_kernels.py                        # GPU: 8 layers of the 27B shape (6 GDN, 2 attention)
    python bench/bench_eval_kernels.py --layers 64            # the whole 27B depth (54 GB: one target at a time)
    python bench/bench_eval_kernels.py --device cpu --small   # CPU smoke run: a tiny shape, eager only

Per kernel setting (in the order given, one process): the evaluator's start (load, weight hash, kernels
applied), the greedy references (batched generation through the cache, then one capture forward per
sequence: fused2's rewritten forwards run there), greedy replay, live decoding of --live-prompts of them (chain
and each budget, in this process: eval.live_workers=1 keeps the compiles visible here) and replay over live's own
sequences.
Each phase prints its seconds and the graphs torch.compile built in it; the end prints, per compiled
function, how many times it recompiled (TORCH_LOGS=recompiles' records) against the capture kernels' limit,
past which a capture kernel raises instead of running eagerly under its kernel path.

The target (random weights, the 27B text config cut to --layers, 3 Gated DeltaNet layers per attention layer)
and the drafter (the recipe's shape, random) are built here: an untrained drafter's tau is ~1, so every
prompt takes the most rounds (live's worst case). Depth changes no compile: one graph serves every layer of a
width (weights are arguments), so --layers 8 shows the compiles of the whole depth in an eighth of the time.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_capture import QWEN35_27B, TINY, build_random_target, target_config  # noqa: E402
from bench_eval_speed import live_rounds, tokenizer_texts  # noqa: E402

from dflash_dist.capture.fused_target import RECOMPILE_LIMIT  # noqa: E402
from dflash_dist.config import load_config  # noqa: E402
from dflash_dist.evaluator.evaluator import Evaluator  # noqa: E402
from dflash_dist.model.drafter import DFlashDrafter  # noqa: E402
from dflash_dist.model.export import export_drafter  # noqa: E402
from dflash_dist.target.build_cache import save_target  # noqa: E402
from dflash_dist.target.loading import drafter_config_for  # noqa: E402
from dflash_dist.target.tiny_tokenizer import train_tokenizer  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "qwen3.6-27b.yaml"
_RECOMPILING = re.compile(r"Recompiling function (\S+)")


class Recompiles(logging.Handler):
    """Counts dynamo's recompile records by function name (TORCH_LOGS=recompiles, set in main)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_function: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        m = _RECOMPILING.search(record.getMessage())
        if m:
            self.by_function[m.group(1)] += 1


def graphs() -> int:
    """Graphs torch.compile has built in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def make_target(root: Path, small: bool, layers: int, device: str, dtype: torch.dtype) -> Path:
    """A random-weight Qwen3.5 target (the 27B widths, or the tiny shape) saved as an HF directory with a
    small BPE tokenizer (the evaluator reads token ids; the model's vocabulary is the 27B's)."""
    tokenizer = train_tokenizer(tokenizer_texts(1_000_000), 512 if small else 4096)
    config = target_config(tiny=small)
    base = TINY if small else QWEN35_27B
    if layers % 4:
        raise SystemExit(f"--layers {layers}: the Qwen3.5 pattern is 3 Gated DeltaNet layers and 1 attention layer")
    config.num_hidden_layers = layers
    config.layer_types = config.layer_types[:layers]
    config.vocab_size = max(base["vocab_size"], len(tokenizer))
    save_target(root / "target", build_random_target(config, device, dtype), tokenizer)
    return root / "target"


def overrides(target_dir: Path, args, kernels: str) -> list[str]:
    o = [f"target.path={target_dir}", f"target.device={args.device}", "data.train_path=unread.jsonl",
         f"target.dtype={'bfloat16' if args.device == 'cuda' else 'float32'}", f"capture.kernels={kernels}",
         f"eval.num_prompts={args.prompts}", f"eval.max_new_tokens={args.new_tokens}", "eval.mode=live",
         "eval.live_workers=1"]  # fmt: skip
    if args.small:  # the recipe's drafter sections at the tiny target's width
        o += ["drafter.num_layers=2", "drafter.num_heads=4", "drafter.num_kv_heads=2", "drafter.head_dim=16",
              "drafter.intermediate_size=128", "drafter.mask_token_id=500", "drafter.sliding_window=16",
              "drafter.layer_types=[sliding_attention,full_attention]"]  # fmt: skip
    return o


def make_export(root: Path, cfg, target_dir: Path, device: str) -> Path:
    """The recipe's drafter shape on this target, random weights, exported as a run's step_1."""
    torch.manual_seed(1)
    with torch.device(device):
        drafter = DFlashDrafter(drafter_config_for(cfg, target_dir))
    return export_drafter(drafter, root / "export" / "step_1", dtype=torch.bfloat16 if device == "cuda" else None)


def timed(label: str, fn, out: dict):
    g0, t0 = graphs(), time.perf_counter()
    value = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    out[label] = {"s": round(time.perf_counter() - t0, 2), "graphs": graphs() - g0}
    print(f"  {label}: {out[label]['s']} s, {out[label]['graphs']} graphs compiled", flush=True)
    return value


def profile_live(ev, drafter, refs, export: Path, out: dict) -> None:
    """One more (warm) live decoding of the first prompt under torch.profiler: its wall time against the
    device's busy time (host- or device-bound), and the ops that take the most of each."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        measured = ev._measure_live(drafter, refs, export)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    rounds = live_rounds(measured)
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events)
    out["live_profile"] = {"s": round(wall, 2), "rounds": rounds, "device_busy_s": round(device_us / 1e6, 2)}
    print(f"  live profile: {wall:.2f} s for {rounds} rounds ({1e3 * wall / max(rounds, 1):.1f} ms a round), device "
          f"busy {device_us / 1e6:.2f} s", flush=True)  # fmt: skip
    for key in ("self_device_time_total", "self_cpu_time_total"):
        print(events.table(sort_by=key, row_limit=25, max_name_column_width=70), flush=True)


def one_setting(kernels: str, root: Path, target_dir: Path, export: Path, prompts, args, out: dict) -> None:
    """One capture.kernels setting's phases, recorded in `out` as they finish (kept when a later phase raises)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    conv = modeling_qwen3_5.causal_conv1d_fn  # fuse_target swaps the module's conv: restored after
    cfg = load_config(str(RECIPE), overrides(target_dir, args, kernels), check_files=False)
    print(f"capture.kernels={kernels}", flush=True)
    try:
        ev = timed("start", lambda: Evaluator(cfg, root / f"run_{kernels}", target_dir, prompts, expected=None), out)
        out["kernel_path"] = ev.provenance.kernel_path
        refs = timed("references", ev.references, out)
        drafter = ev._load_drafter(export)
        refs = ev._counted(refs, drafter.config.block_size)
        replay = timed("replay", lambda: ev._replay(drafter, refs, cfg.eval.count), out)
        refs = refs[: args.live_prompts]  # live's worst case costs a target forward per token
        live = timed("live", lambda: ev._measure_live(drafter, refs, export), out)
        own = timed("replay_own", lambda: ev._replay_own(drafter, refs, live), out)
        if args.profile_live:
            profile_live(ev, drafter, refs[:1], export, out)
        rounds = live_rounds(live)
        out.update(live_prompts=len(refs), live_rounds=rounds,
                   ms_per_live_round=round(1e3 * out["live"]["s"] / max(rounds, 1), 2),
                   tau_replay=replay.result.tau_chain, tau_live=live.result.tau_chain,
                   tau_replay_own=own["tau_chain"] if own else None,
                   live_tokens_equal=live.tokens_equal)  # fmt: skip
        print(
            f"  tau chain: replay {out['tau_replay']:.3f}, live {out['tau_live']:.3f}, replay over live's own "
            f"{out['tau_replay_own']}; {rounds} live rounds ({out['ms_per_live_round']} ms a round); "
            f"{out['live_tokens_equal']}/{len(refs)} live continuations equal the references",
            flush=True,
        )
        ev = drafter = None  # the target and drafter go before the next setting loads its own
    finally:
        modeling_qwen3_5.causal_conv1d_fn = conv
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def summary(report: dict, recompiles: Recompiles, json_path: str | None) -> None:
    """Recompiles per function so far, printed; the report written (then renamed into place) when asked."""
    print(f"recompiles per compiled function so far (each capture kernel's limit: {RECOMPILE_LIMIT} compiles; "
          "functions compiled once are not listed):")  # fmt: skip
    for name, n in recompiles.by_function.most_common():
        print(f"  {name}: {n}")
    report["recompiles"] = dict(recompiles.by_function)
    worst = max(recompiles.by_function.values(), default=0)
    print(f"most recompiles of one function: {worst} (+1 first compile) of {RECOMPILE_LIMIT}", flush=True)
    if json_path:
        tmp = Path(f"{json_path}.tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        os.replace(tmp, json_path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--small",
        action="store_true",
        help="the tiny Qwen3.5 shape, CPU smoke run: 3 prompts of 24+ tokens, 12 new, all live",
    )
    ap.add_argument("--layers", type=int, default=8, help="target depth (the 27B has 64)")
    ap.add_argument("--kernels", default=None, help="capture.kernels settings in order (GPU default eager,fused2)")
    ap.add_argument("--prompts", type=int, default=40, help="eval prompts (the recipe's reference_batch: 32)")
    ap.add_argument("--live-prompts", type=int, default=8, help="of those, decoded live")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--profile-live", action="store_true", help="profile one more live decoding of one prompt")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.small:
        args.prompt_len, args.new_tokens, args.prompts, args.live_prompts = 24, 12, 3, 3
    settings = (args.kernels or ("eager,fused2" if args.device == "cuda" else "eager")).split(",")
    recompiles = Recompiles()
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(recompiles)
    logging.getLogger("torch._dynamo").propagate = False  # counted here, not printed twice per record
    on_gpu = args.device == "cuda"
    report: dict = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "layers": args.layers,
                    "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                    "torch": torch.__version__, "recompile_limit": RECOMPILE_LIMIT, "settings": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        target_dir = make_target(root, args.small, args.layers, args.device,
                                 torch.bfloat16 if on_gpu else torch.float32)  # fmt: skip
        cfg = load_config(str(RECIPE), overrides(target_dir, args, "eager"), check_files=False)
        export = make_export(root, cfg, target_dir, args.device)
        print(f"target ({args.layers} layers) and drafter built and saved in {time.perf_counter() - t0:.1f} s")
        gen = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, 400, (args.prompt_len + (i % 8) * 16,), generator=gen).tolist()
                   for i in range(args.prompts)]  # fmt: skip
        failed = 0
        for kernels in settings:
            before = Counter(recompiles.by_function)
            out: dict = {"kernels": kernels}
            report["settings"].append(out)
            try:
                one_setting(kernels, root, target_dir, export, prompts, args, out)
            except Exception as err:  # what this bench looks for (a kernel past its compile limit): kept, not lost
                out["error"] = f"{type(err).__name__}: {err}"
                print(f"  capture.kernels={kernels} failed: {out['error']}", flush=True)
                failed += 1
            finally:
                out["recompiles"] = dict(recompiles.by_function - before)
                summary(report, recompiles, args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
