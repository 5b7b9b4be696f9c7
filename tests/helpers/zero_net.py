"""The small ZeRO test model and run pieces tests/test_zero_step.py and tests/test_grad_reduce.py share:
two partition groups (matrices and a 1-D gain), seeded micro-batches, the engine config, exact state copies."""

from __future__ import annotations

import torch
from torch import nn

from dflash_dist.config import load_config

CLIP = 0.05  # far below the gradient norm of the first steps: the clip is active


class Net(nn.Module):
    """Matrices (decayed) and a 1-D gain (not decayed): two DeepSpeed partition groups."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 48)
        self.g = nn.Parameter(torch.ones(48))
        self.b = nn.Linear(48, 8, bias=False)

    def forward(self, x, y):
        return ((self.b(torch.tanh(self.a(x)) * self.g) - y) ** 2).mean()


def cfg_for(grad_clip: float = CLIP, grad_accum: int = 2):
    return load_config(
        None,
        [
            "target.kind=tiny_stdlib",
            f"train.grad_clip={grad_clip}",
            "train.weight_decay=0.01",
            "train.max_steps=50",
            f"train.grad_accum={grad_accum}",
            "train.lr=0.01",
            "train.warmup_frac=0.0",
        ],
    )


def batches(n: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 16, generator=g).to(device), 3 * torch.randn(4, 8, generator=g).to(device)) for _ in range(n)
    ]


BUCKET = 400  # reduce_bucket_size: a.weight (768) is past it, b.weight (384), a.bias and g are not


def state_of(engine) -> list[torch.Tensor]:
    """The bf16 weights, fp32 masters and AdamW moments, as exact copies."""
    opt = engine.optimizer
    moments = [s[k].clone() for s in opt.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return (
        [p.detach().clone() for p in engine.module.parameters()]
        + [m.detach().clone() for m in opt.single_partition_of_fp32_groups]
        + moments
    )


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), i
