"""The tiny core demo: a random tiny Qwen3.5 hybrid target on CPU, a drafter trained on its
captured features for a few hundred steps, replay tau printed before and after training.

`python -m dflash_dist.tools.demo` (or `dflash-dist demo`). Everything is seeded: same numbers each run.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from dflash_dist.config import TrainSection
from dflash_dist.model.capture import capture_features
from dflash_dist.model.config import DrafterConfig, build_target_layer_ids
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.loss import dflash_loss, sample_anchors
from dflash_dist.model.lr_schedule import warmup_cosine
from dflash_dist.model.replay import ReplayResult, replay_tau
from dflash_dist.target.gdn_path import route_cpu_to_torch
from dflash_dist.target.generation import greedy_continuation


@dataclass(frozen=True)
class DemoConfig:
    seed: int = 0
    vocab_size: int = 256
    target_hidden: int = 64
    target_layers: int = 8
    k: int = 3
    drafter_layers: int = 2
    block_size: int = 8
    num_prompts: int = 24
    prompt_len: int = 24
    new_tokens: int = 48
    steps: int = 300
    batch_size: int = 4
    num_anchors: int = 32
    lr: float = 3e-3
    budgets: tuple[int, ...] = (4, 8)
    init_std: float = 0.1  # larger than HF's 0.02 so the random target has peaked, learnable outputs
    position_weighting: str = TrainSection.model_fields["position_weighting"].default  # the trainer's default


def tiny_qwen35_target(cfg: DemoConfig):
    """A random Qwen3.5 text model: 3 Gated DeltaNet layers then 1 gated attention layer, repeated."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(cfg.seed)
    config = Qwen3_5TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.target_hidden, intermediate_size=2 * cfg.target_hidden,
        num_hidden_layers=cfg.target_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(cfg.target_layers)],
        tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None,
        initializer_range=cfg.init_std,
    )
    config._attn_implementation = "sdpa"
    model = Qwen3_5ForCausalLM(config).eval()
    route_cpu_to_torch()  # CPU forwards on torch's GDN code even where fla + Triton are installed (a GPU machine)
    return model


def drafter_for(target, cfg: DemoConfig) -> DFlashDrafter:
    tc = target.config
    dc = DrafterConfig(
        hidden_size=tc.hidden_size, num_hidden_layers=cfg.drafter_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=2 * tc.hidden_size, vocab_size=tc.vocab_size,
        target_layer_ids=tuple(build_target_layer_ids(tc.num_hidden_layers, cfg.k)),
        num_target_layers=tc.num_hidden_layers, block_size=cfg.block_size, mask_token_id=tc.vocab_size - 1,
    )
    torch.manual_seed(cfg.seed + 1)
    drafter = DFlashDrafter(dc)
    drafter.set_target_weights(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return drafter


def make_data(target, cfg: DemoConfig, mask_token_id: int):
    """Random prompts, the target's greedy responses, and the captured features of prompt+response."""
    g = torch.Generator().manual_seed(cfg.seed + 2)
    prompts = [torch.randint(0, mask_token_id, (cfg.prompt_len,), generator=g).tolist() for _ in range(cfg.num_prompts)]
    responses = [greedy_continuation(target, p, cfg.new_tokens) for p in prompts]
    ids = torch.tensor([p + r for p, r in zip(prompts, responses)])
    loss_mask = torch.zeros_like(ids, dtype=torch.float32)
    loss_mask[:, cfg.prompt_len:] = 1.0
    cap = capture_features(target, ids, build_target_layer_ids(target.config.num_hidden_layers, cfg.k))
    return prompts, responses, ids, loss_mask, cap


def train(drafter: DFlashDrafter, ids, features, loss_mask, cfg: DemoConfig, log_every: int = 50) -> list[float]:
    """A plain loop (the DeepSpeed trainer lives elsewhere): AdamW, cosine, warmup, clip 1.0."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    warmup = max(1, cfg.steps // 25)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, cfg.steps, warmup))
    losses = []
    drafter.train()
    for step in range(cfg.steps):
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        rows = torch.randperm(ids.shape[0], generator=g)[: cfg.batch_size]
        anchors = sample_anchors(loss_mask[rows], cfg.num_anchors, g)
        out = dflash_loss(drafter, ids[rows], features[rows], loss_mask[rows], anchors,
                          position_weighting=cfg.position_weighting)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(out.loss.item())
        if log_every and (step % log_every == 0 or step == cfg.steps - 1):
            print(f"step {step:4d}  loss {out.loss.item():.3f}  acc {out.accuracy.item():.3f}", flush=True)
    drafter.eval()
    return losses


def evaluate(target, drafter, prompts, responses, cfg: DemoConfig) -> ReplayResult:
    return replay_tau(target, drafter, prompts, responses, cfg.budgets)


def describe(tag: str, r: ReplayResult) -> str:
    trees = "  ".join(f"DDTree-{b} {r.tau_ddtree(b):.2f}" for b in sorted(r.tau_ddtree_per_prompt))
    return f"{tag}: tau chain {r.tau_chain:.2f}  {trees}  ({r.rounds} rounds, kernel={r.kernel_path})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dflash-dist demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=DemoConfig.steps)
    ap.add_argument("--seed", type=int, default=DemoConfig.seed)
    args = ap.parse_args(argv)
    cfg = DemoConfig(steps=args.steps, seed=args.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.time()
    target = tiny_qwen35_target(cfg)
    drafter = drafter_for(target, cfg)
    prompts, responses, ids, loss_mask, cap = make_data(target, cfg, drafter.config.mask_token_id)
    print(f"target: Qwen3.5 hybrid, {cfg.target_layers} layers ({target.config.layer_types.count('linear_attention')} "
          f"Gated DeltaNet), capture layers {list(cap.layer_ids)}, kernel path {cap.kernel_path}")
    before = evaluate(target, drafter, prompts, responses, cfg)
    print(describe("before training", before))
    train(drafter, ids, cap.features, loss_mask, cfg)
    after = evaluate(target, drafter, prompts, responses, cfg)
    print(describe("after training ", after))
    print(f"per-slot acceptance after: {[round(x, 2) for x in after.slot_acceptance]}")
    print(f"done in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
