"""Recipe quality on the tiny target: greedy-replay tau (chain and DDTree-8) per checkpoint against
training samples seen, one line per recipe variant, same data, budget and seeds.

    python bench/bench_quality.py                      # the full set, regenerated responses, 4 epochs
    python bench/bench_quality.py --responses data --labels target --epochs 2 --eval-every 20
                                                       # docs/BENCHMARKS.md's run (fits a loaded 2-core machine)
    python bench/bench_quality.py --quick              # a smoke run of the same code (~3 min)
    python bench/bench_quality.py --variants all_layers,drop_top --seeds 0,1,2

The target is configs/tiny.yaml's tiny stdlib Qwen3.5 (target/tiny_target.py builds and caches
it). Train prompts come from the stdlib train split, held-out prompts from the heldout split
(target/stdlib_corpus.py, as data_prep.py writes them); the target answers each greedily
(capture.max_new_tokens / eval.max_new_tokens) and its features are captured once on the CPU
torch path (model/capture.py), then every variant trains on the same samples in the same order
with the trainer's pieces: batching.make_micro_batch (per-sample seeded anchors), dflash_loss,
build_optimizer (AdamW) and the WarmupCosine schedule, micro_batch_size x --accum micro-batches per
optimizer step (the tiny run's 2 ranks x 4). The step_slots normalisation is emulated over the
accumulated micro-batches: each gets the step's summed `loss_weights` as its denominator and the
losses are summed (micro_batch: averaged, as DeepSpeed averages over micro-batches and ranks).
tau is model/replay.py's replay_sequence over the held-out continuations, whose features are
also captured once.

Variants (each differs from `all_layers`, today's defaults (the config's, D-PACE included), in one thing):
  all_layers   fc over all k captured layers                       (--seeds, default 3 seeds)
  drop_top     fc without the top captured layer (the failed run's bug: its slice dropped)
  sliding      drafter layers [sliding_attention, full_attention], window --window (64: the tiny
               sequences are 60-260 tokens long, so the window cuts real context)
  decay        exp(-(s-1)/gamma) position weighting instead of D-PACE (the default until 2026-12-04;
               docs/BENCHMARKS.md's tiny-target run of 2026-12-03 had decay as its base and this as "dpace")
  step_slots   sum(w*CE) over the optimizer step / sum(w) over the step
  mask_next    anchors need loss_mask at a and a+1
Workers (--workers, default 2) each run one variant at a time with one torch thread. On a GPU the
drafters train there (`--device cuda`); the target stays on the CPU torch path.
Writes <out>/results.json, a markdown table on stdout and in <out>/table.md, and the PNG (<out>/quality.png, or --png).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from pathlib import Path

import torch
from safetensors.torch import load_file, save

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_pipeline.chat_data import ChatEncoder  # noqa: E402
from data_pipeline.checksums import FILE_ALGORITHM, digest_bytes, digest_file  # noqa: E402
from data_pipeline.durable_files import atomic_path, write_text_atomic  # noqa: E402
from data_pipeline.records import Sample  # noqa: E402
from dflash_dist.config import TrainSection, load_config  # noqa: E402
from dflash_dist.model.capture import capture_features  # noqa: E402
from dflash_dist.model.config import DrafterConfig  # noqa: E402
from dflash_dist.model.drafter import DFlashDrafter  # noqa: E402
from dflash_dist.model.loss import dflash_loss, loss_weights  # noqa: E402
from dflash_dist.model.replay import replay_sequence  # noqa: E402
from dflash_dist.target.generation import generate_responses, pad_token_id, stop_token_ids  # noqa: E402
from dflash_dist.target.loading import drafter_config_for, load_embeddings, tokenizer_mask_id  # noqa: E402
from dflash_dist.target.stdlib_corpus import code_chat_samples  # noqa: E402
from dflash_dist.target.tiny_target import TEST_SETTINGS, build_tiny_target, load_tiny_target  # noqa: E402
from dflash_dist.trainer.batching import make_micro_batch  # noqa: E402
from dflash_dist.trainer.ds_config import WarmupCosine, build_optimizer  # noqa: E402

log = logging.getLogger("bench_quality")
VARIANTS = ("all_layers", "drop_top", "sliding", "decay", "step_slots", "mask_next")
SEEDED = ("all_layers", "drop_top")  # run with every --seeds; the others with the first seed


@dataclass(frozen=True)
class Variant:
    name: str
    seed: int
    drop_top: bool = False
    sliding_window: int | None = None
    position_weighting: str = TrainSection.model_fields["position_weighting"].default  # the product's
    loss_norm: str = "micro_batch"
    anchor_rule: str = "mask"


def make_variant(name: str, seed: int, window: int) -> Variant:
    base = Variant(name, seed)
    return {
        "all_layers": base,
        "drop_top": replace(base, drop_top=True),
        "sliding": replace(base, sliding_window=window),
        "decay": replace(base, position_weighting="decay"),
        "step_slots": replace(base, loss_norm="step_slots"),
        "mask_next": replace(base, anchor_rule="mask_next"),
    }[name]


# --- data: generated and captured once ---


def _respond(model, tokenizer, prompts: list[list[int]], max_new: int, batch: int) -> list[list[int]]:
    stops = stop_token_ids(tokenizer)
    pad = pad_token_id(tokenizer, stops)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths per batch
    out: list[list[int]] = [[] for _ in prompts]
    for lo in range(0, len(order), batch):
        chunk = order[lo : lo + batch]
        for i, g in zip(chunk, generate_responses(model, [prompts[i] for i in chunk], max_new, stops, pad)):
            out[i] = list(g.tokens)
        log.info("generated %d / %d responses", min(lo + batch, len(order)), len(order))
    return out


def prepare_data(args, cfg, data_path: Path) -> dict:
    """Train and held-out sequences with their features, cached in <out>/data.safetensors."""
    want = {"responses": args.responses, "test_target": args.test_target, "train": args.train_samples,
            "eval": args.eval_prompts, "seed": args.data_seed, "train_new": cfg.capture.max_new_tokens,
            "eval_new": args.eval_new_tokens}
    if (meta := cached_meta(data_path, want)) is not None:
        log.info("reusing captured data in %s", data_path)
        return meta
    t0 = time.time()
    if args.test_target:  # the tiny target's test-size settings, built under <out>: seconds, for smoke runs
        target_dir = build_tiny_target(data_path.parent / "tiny-target-test", TEST_SETTINGS, log=log.info)
    else:
        target_dir = build_tiny_target(log=log.info)
    model, tok = load_tiny_target(target_dir)
    dcfg = drafter_config_for(cfg, target_dir, tokenizer_mask_id(tok))
    enc = ChatEncoder(tok)
    tensors, meta = {}, {"want": want, "target_dir": str(target_dir), "layer_ids": list(dcfg.target_layer_ids),
                         "mask_token_id": dcfg.mask_token_id}
    splits = {"train": ("train", args.train_samples, cfg.capture.max_new_tokens, args.data_seed),
              "eval": ("heldout", args.eval_prompts, args.eval_new_tokens, args.data_seed + 1)}
    for name, (split, n, max_new, seed) in splits.items():
        records = code_chat_samples(split, n, seed)
        if name == "train" and args.responses == "data":  # the corpus' own responses, loss mask from the template
            encoded = [enc.encode(r["messages"]) for r in records]
            seqs = [(e.input_ids.tolist(), e.loss_mask.tolist()) for e in encoded]
        else:  # the target's greedy responses (the pipeline's capture.regenerate)
            prompts = [enc.prompt_ids(r["messages"]).tolist() for r in records]
            responses = _respond(model, tok, prompts, max_new, args.gen_batch)
            seqs = [(p + y, [0] * len(p) + [1] * len(y)) for p, y in zip(prompts, responses) if y]
        lens, starts, ids, masks, feats, argmax = [], [], [], [], [], []
        for seq, mask in seqs:
            cap = capture_features(model, torch.tensor([seq]), dcfg.target_layer_ids, with_argmax=True)
            ids.append(torch.tensor(seq, dtype=torch.int32))
            masks.append(torch.tensor(mask, dtype=torch.uint8))
            feats.append(cap.features[0].float())
            argmax.append(cap.target_argmax[0].to(torch.int32))
            lens.append(len(seq))
            starts.append(mask.index(1))
        tensors[f"{name}.ids"], tensors[f"{name}.mask"] = torch.cat(ids), torch.cat(masks)
        tensors[f"{name}.features"], tensors[f"{name}.argmax"] = torch.cat(feats), torch.cat(argmax)
        meta[f"{name}.lengths"], meta[f"{name}.starts"] = lens, starts
        log.info("%s: %d sequences, %d tokens (%.0f s so far)", name, len(lens), sum(lens), time.time() - t0)
    return store_data(data_path, tensors, meta)


def cached_meta(data_path: Path, want: dict) -> dict | None:
    """<out>/data.json when it was written for `want` and <out>/data.safetensors still holds the bytes
    it was written with (their checksum: the data of another `want`, or a file torn by an earlier
    crash, is captured again); else None."""
    meta_path = data_path.with_suffix(".json")
    if not (data_path.is_file() and meta_path.is_file()):
        return None
    meta = json.loads(meta_path.read_text())
    if meta.get("want") != want:
        return None
    if meta.get("data_xxh3_128") != digest_file(data_path):
        log.warning("%s does not match the checksum %s recorded: capturing again", data_path, meta_path)
        return None
    return meta


def store_data(data_path: Path, tensors: dict, meta: dict) -> dict:
    """data.safetensors written then renamed, then data.json with its checksum (written then renamed):
    a crash at any point leaves no data.json that vouches for other bytes. Partial files of crashed
    writers (their process gone) are removed first."""
    for tmp in data_path.parent.glob(f".{data_path.name}.tmp-*"):
        pid = tmp.name.rsplit(".tmp-", 1)[1].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)
    blob = save(tensors)  # in memory, then our write: not save_file, whose own tmp handling varies by version
    with atomic_path(data_path) as tmp:
        tmp.write_bytes(blob)
    meta = {**meta, "data_xxh3_128": digest_bytes(blob, FILE_ALGORITHM)}
    write_text_atomic(data_path.with_suffix(".json"), json.dumps(meta))
    return meta


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _split(tensors: dict, meta: dict, name: str) -> list[tuple[torch.Tensor, ...]]:
    """(ids, features, start, loss_mask, target_argmax) per sequence."""
    ids, feats = tensors[f"{name}.ids"], tensors[f"{name}.features"]
    mask, argmax = tensors[f"{name}.mask"], tensors[f"{name}.argmax"]
    out, lo = [], 0
    for n, start in zip(meta[f"{name}.lengths"], meta[f"{name}.starts"]):
        out.append((ids[lo : lo + n], feats[lo : lo + n], start, mask[lo : lo + n], argmax[lo : lo + n]))
        lo += n
    return out


# --- one variant (in a worker process) ---

_DATA: dict = {}


def _init_worker(data_path: str, threads: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(processName)s %(message)s", stream=sys.stdout)
    torch.set_num_threads(threads)
    meta = json.loads(Path(data_path).with_suffix(".json").read_text())
    tensors = load_file(data_path)
    _DATA.update(meta=meta, train=_split(tensors, meta, "train"), eval=_split(tensors, meta, "eval"))


def _drafter(cfg, v: Variant, device: torch.device) -> DFlashDrafter:
    meta = _DATA["meta"]
    target_dir = Path(meta["target_dir"])
    base = drafter_config_for(cfg, target_dir, meta["mask_token_id"])
    changes = {}
    if v.drop_top:
        changes["target_layer_ids"] = tuple(base.target_layer_ids[:-1])
    if v.sliding_window is not None:
        n = base.num_hidden_layers
        changes["layer_types"] = ("sliding_attention",) * (n - 1) + ("full_attention",)
        changes["sliding_window"] = v.sliding_window
    dcfg = DrafterConfig(**{**asdict(base), **changes})
    torch.manual_seed(v.seed)
    drafter = DFlashDrafter(dcfg)
    drafter.set_target_weights(*load_embeddings(target_dir))
    return drafter.to(device)


def _features(feats: torch.Tensor, v: Variant, hidden: int) -> torch.Tensor:
    return feats[..., : feats.shape[-1] - hidden] if v.drop_top else feats


@torch.no_grad()
def _tau(drafter: DFlashDrafter, v: Variant, budget: int) -> tuple[float, float]:
    drafter.eval()
    chain, tree = [], []
    h = drafter.config.hidden_size
    for ids, feats, start, _, _ in _DATA["eval"]:
        c, t = replay_sequence(drafter, ids.tolist(), _features(feats, v, h), start, (budget,))
        chain.append(sum(c) / len(c))
        tree.append(sum(t[budget]) / len(t[budget]))
    drafter.train()
    return sum(chain) / len(chain), sum(tree) / len(tree)


def run_variant(v: Variant, config_path: str, args: dict) -> dict:
    t0 = time.time()
    cfg = load_config(config_path)
    device = torch.device(args["device"])
    drafter = _drafter(cfg, v, device)
    blk, gamma, h = drafter.config.block_size, drafter.config.loss_decay_gamma, drafter.config.hidden_size
    opt = build_optimizer(cfg, drafter)
    mb, accum = cfg.train.micro_batch_size, args["accum"]
    train = _DATA["train"][: args["train_limit"]]
    per_step = mb * accum
    steps_per_epoch = len(train) // per_step
    total = args["epochs"] * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(total, math.ceil(cfg.train.warmup_frac * total)))
    samples = [
        Sample(f"s{i}", ids, mask, _features(feats, v, h), argmax)
        for i, (ids, feats, _, mask, argmax) in enumerate(train)
    ]
    points, losses, step = [], [], 0
    for epoch in range(args["epochs"]):
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(1000 * v.seed + epoch)).tolist()
        for s in range(steps_per_epoch):
            idx = order[s * per_step : (s + 1) * per_step]
            batches = [
                make_micro_batch([samples[i] for i in idx[m * mb : (m + 1) * mb]], {}, dtype=torch.float32,
                                 num_anchors=cfg.train.num_anchors, seed=v.seed, epoch=epoch,
                                 anchor_rule=v.anchor_rule).to(device)
                for m in range(accum)
            ]
            denom = None
            if v.loss_norm == "step_slots":  # what the trainer all-reduces at step start
                denom = sum(loss_weights(b.input_ids, b.loss_mask, b.anchors, blk, gamma, v.position_weighting).sum()
                            for b in batches)
            step_loss = 0.0
            for b in batches:
                out = dflash_loss(drafter, b.input_ids, b.features, b.loss_mask, b.anchors, gamma=gamma,
                                  target_argmax=b.target_argmax, label_source=args["labels"],
                                  position_weighting=v.position_weighting, loss_denominator=denom)
                loss = out.loss if denom is not None else out.loss / accum
                loss.backward()
                step_loss += float(loss.detach())
            if cfg.train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_([p for p in drafter.parameters() if p.requires_grad],
                                               cfg.train.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            losses.append(step_loss)
            if step % args["eval_every"] == 0 or step == total:
                chain, tree = _tau(drafter, v, args["budget"])
                points.append({"step": step, "samples": step * per_step, "tau_chain": chain, "tau_ddtree": tree,
                               "loss": sum(losses[-args["eval_every"]:]) / len(losses[-args["eval_every"]:])})
                log.info("%s seed %d step %d: tau chain %.3f ddtree-%d %.3f (%.0f s)", v.name, v.seed, step,
                         chain, args["budget"], tree, time.time() - t0)
    return {"variant": asdict(v), "points": points, "wall_s": time.time() - t0, "steps": total}


# --- report ---


def _mean_sd(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def table(results: list[dict], budget: int) -> str:
    by: dict[str, list[dict]] = {}
    for r in results:
        by.setdefault(r["variant"]["name"], []).append(r)
    half = lambda r: r["points"][max(0, len(r["points"]) // 2 - 1)]  # noqa: E731
    lines = [
        f"| variant | seeds | tau chain (final) | tau DDTree-{budget} (final) | tau chain at {{half}} samples | "
        "train loss (last) | wall s / run |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        rs = by.get(name)
        if not rs:
            continue
        lines.append(
            f"| {name} | {','.join(str(r['variant']['seed']) for r in rs)} "
            f"| {_mean_sd([r['points'][-1]['tau_chain'] for r in rs])} "
            f"| {_mean_sd([r['points'][-1]['tau_ddtree'] for r in rs])} "
            f"| {_mean_sd([half(r)['tau_chain'] for r in rs])} "
            f"| {_mean_sd([r['points'][-1]['loss'] for r in rs])} "
            f"| {statistics.mean(r['wall_s'] for r in rs):.0f} |"
        )
    some = results[0]
    return "\n".join(lines).replace("{half}", str(half(some)["samples"]))


def plot(results: list[dict], png: Path, budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    colors = dict(zip(VARIANTS, ("black", "tab:red", "tab:blue", "tab:green", "tab:orange", "tab:purple")))
    for r in results:
        name, seed = r["variant"]["name"], r["variant"]["seed"]
        x = [p["samples"] for p in r["points"]]
        first = seed == min(q["variant"]["seed"] for q in results if q["variant"]["name"] == name)
        for ax, key in zip(axes, ("tau_chain", "tau_ddtree")):
            ax.plot(x, [p[key] for p in r["points"]], color=colors[name], marker=".", alpha=0.85,
                    linestyle="-" if first else "--", label=name if first else None)
    axes[0].set_title("greedy-replay tau, chain")
    axes[1].set_title(f"greedy-replay tau, DDTree-{budget}")
    for ax in axes:
        ax.set_xlabel("training samples seen")
        ax.set_ylabel("tau")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("tiny stdlib target: recipe variants (dashed: further seeds)")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    tmp = png.with_name(png.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, png)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs/tiny.yaml"))
    ap.add_argument("--out", default=str(ROOT / "runs/bench_quality"))
    ap.add_argument("--png", default=None,
                    help="the figure (default <out>/quality.png; docs/quality.png is the documented run's)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--train-samples", type=int, default=400)
    ap.add_argument("--eval-prompts", type=int, default=12)
    ap.add_argument("--eval-new-tokens", type=int, default=48)
    ap.add_argument("--responses", choices=("target", "data"), default="target",
                    help="train responses: the target's greedy ones (capture.regenerate) or the corpus' own")
    ap.add_argument("--labels", choices=("data", "target"), default="data", help="train.label_source")
    ap.add_argument("--train-limit", type=int, default=None, help="train on the first N captured samples only")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--report", default=None, help="only render the table and plot of a results.json")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step (the tiny run's ranks)")
    ap.add_argument("--eval-every", type=int, default=25, help="optimizer steps between tau measurements")
    ap.add_argument("--budget", type=int, default=8, help="DDTree node budget")
    ap.add_argument("--window", type=int, default=64, help="sliding window of the sliding variant")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--gen-batch", type=int, default=16)
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="smoke run: 64 samples, 2 epochs, 2 seeds")
    ap.add_argument("--test-target", action="store_true", help="the tiny target at its test size (a smoke run)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(processName)s %(message)s", stream=sys.stdout)
    if args.quick:
        args.train_samples, args.epochs, args.eval_every, args.eval_prompts = 64, 2, 4, 4
        args.seeds = ",".join(args.seeds.split(",")[:2])
    names = [n for n in args.variants.split(",") if n]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown --variants {unknown}; choose from {VARIANTS}")
    seeds = [int(s) for s in args.seeds.split(",")]
    # first seed of every variant, then the further seeds of the all-layers / drop-top pair: a run
    # cut short still has every comparison
    variants = [make_variant(n, seeds[0], args.window) for n in names]
    variants += [make_variant(n, s, args.window) for s in seeds[1:] for n in names if n in SEEDED]
    if args.report:
        results = json.loads(Path(args.report).read_text())["results"]
        md = table(results, args.budget)
        plot(results, Path(args.png or Path(args.out) / "quality.png"), args.budget)
        print(md)
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.config)
    t0 = time.time()
    torch.set_num_threads(max(1, args.workers * args.threads))
    data_path = out / "data.safetensors"
    prepare_data(args, cfg, data_path)
    log.info("data ready in %.0f s; %d runs on %d workers (%s)", time.time() - t0, len(variants), args.workers,
             args.device)
    worker_args = {"labels": args.labels, "device": args.device, "accum": args.accum, "epochs": args.epochs,
                   "train_limit": args.train_limit,
                   "eval_every": args.eval_every, "budget": args.budget}
    results: list[dict] = []
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn"), initializer=_init_worker,
                             initargs=(str(data_path), args.threads)) as pool:
        futures = [pool.submit(run_variant, v, args.config, worker_args) for v in variants]
        for f in futures:
            results.append(f.result())
            write_text_atomic(out / "results.json", json.dumps({"args": vars(args), "results": results}, indent=1))
    md = table(results, args.budget)
    write_text_atomic(out / "table.md", md + "\n")
    plot(results, Path(args.png or out / "quality.png"), args.budget)
    print(md)
    log.info("total %.0f s; results in %s, plot in %s", time.time() - t0, out / "results.json",
             args.png or out / "quality.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
