"""A small random drafter (2 layers, or one per `layer_types`) with random target embeddings, and
context features of its shape, for the drafter, loss and export tests."""

from __future__ import annotations

import torch

from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.drafter import DFlashDrafter


def small_drafter(
    k: int = 3,
    block: int = 4,
    vocab: int = 64,
    seed: int = 0,
    layer_types: tuple[str, ...] = (),
    sliding_window: int | None = None,
) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        hidden_size=32,
        num_hidden_layers=len(layer_types) or 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=vocab,
        target_layer_ids=tuple(range(1, 1 + k)),
        num_target_layers=k + 2,
        block_size=block,
        mask_token_id=vocab - 1,
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    d = DFlashDrafter(cfg)
    d.set_target_weights(torch.randn(vocab, 32), torch.randn(vocab, 32) * 0.3)
    return d.eval()


def context_features(d, b, s):
    return torch.randn(b, s, d.config.num_context_layers * d.config.hidden_size)
