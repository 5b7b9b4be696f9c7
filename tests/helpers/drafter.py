"""A small random drafter (2 layers, or one per `layer_types`) with random target embeddings, and
context features of its shape, for the drafter, loss and export tests; a loss batch with invalid blocks,
loss-masked slots and packed rows, its loss and gradients, and a relative distance (the row-cut and
add-norm tests)."""

from __future__ import annotations

import torch

from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.loss import Anchors, dflash_loss


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


def loss_batch(d: DFlashDrafter, dtype: torch.dtype, packed: bool):
    """Two rows of 24 tokens: invalid blocks (keep False), loss-masked slots inside valid blocks, an anchor
    whose block runs past the sequence; packed: row 0 holds two documents [0, 13) and [13, 24)."""
    g = torch.Generator().manual_seed(7)
    s = 24
    ids = torch.randint(0, d.config.vocab_size - 2, (2, s), generator=g)
    feats = torch.randn(2, s, d.config.num_context_layers * d.config.hidden_size, generator=g).to(dtype)
    lm = torch.ones(2, s)
    lm[1, :5] = 0
    lm[0, 10:12] = 0  # slots of valid blocks without a label
    pos = torch.tensor([[2, 9, 15, 21], [6, 12, 0, 0]])
    keep = torch.tensor([[True, True, True, True], [True, True, False, False]])
    if not packed:
        return ids, feats, lm, Anchors(pos, keep)
    starts = torch.tensor([[0, 0, 13, 13], [0, 0, 0, 0]])
    ends = torch.tensor([[13, 13, 24, 24], [24, 24, 24, 24]])
    return ids, feats, lm, Anchors(pos, keep, starts, ends)


def loss_and_grads(d: DFlashDrafter, batch):
    """dflash_loss on `batch` (gamma 3) and every trainable parameter's gradient."""
    d.zero_grad(set_to_none=True)
    out = dflash_loss(d, *batch, gamma=3.0)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in d.named_parameters() if p.requires_grad}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (L2, in fp32)."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def cuda_bf16_case(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, vocab: int, k: int, rows: int,
                   anchors: int, id_max: int, masked: float = 0.0, invalid_from: int | None = None):  # fmt: skip
    """The gpu tests' case (2 layers, block 16, 512 tokens a row): a bf16 drafter on CUDA in train mode, a batch
    for it (rows x 512 tokens, `anchors` sorted anchors shared by the rows, a `masked` share of the slots without
    a label, the last row's blocks from `invalid_from` on invalid) and every trainable gradient of the same
    weights in fp32 through the torch reference (the distance the fast forms are held to)."""
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
                        target_layer_ids=tuple(range(1, 2 * k, 2)), num_target_layers=8, block_size=16,
                        mask_token_id=vocab - 1)  # fmt: skip
    with torch.device("cuda"):
        d = DFlashDrafter(cfg)
        d.set_target_weights(torch.randn(vocab, hidden), torch.randn(vocab, hidden) * hidden**-0.5)
    d = d.to(torch.bfloat16).train()
    d32 = DFlashDrafter(cfg).cuda().train()  # the fp32 reference: the bf16 weights, in fp32
    d32.load_state_dict({n: v.float() for n, v in d.state_dict().items()})
    s, g = 512, torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, id_max, (rows, s), device="cuda", generator=g)
    feats = torch.randn(rows, s, k * hidden, device="cuda", generator=g)
    lm = torch.ones(rows, s, device="cuda")
    if masked:
        lm = (torch.rand(rows, s, device="cuda", generator=g) > masked).float()
    pos = torch.sort(torch.randperm(s - 1, generator=torch.Generator().manual_seed(2))[:anchors]).values
    keep = torch.ones(rows, anchors, dtype=torch.bool)
    if invalid_from is not None:
        keep[-1, invalid_from:] = False
    batch = (ids, feats, lm, Anchors(torch.stack([pos] * rows).cuda(), keep.cuda()))
    _, g32 = loss_and_grads(d32, batch)
    return d, (ids, feats.bfloat16(), lm, batch[3]), g32
