"""The drafter's two row cuts of the training forward (issue 24; drafter.py's docstring): layer 0's input norm
and block q/k/v projections on each sequence's N+1 distinct rows (`dedup_layer0`), and the last layer's o_proj,
MLP and norms on the supervised rows only (`last_rows`). Each is the reference function over fewer rows: the
loss, every trainable gradient and the supervised rows' hidden states equal the reference path's (fp32: loss
bitwise, gradients to ~1e-6 relative, from GEMMs summing over other rows), with invalid blocks, loss-masked
slots, packed rows and either k/v projection form; the projections see exactly the rows the cut leaves."""

from __future__ import annotations

import pytest
import torch

from dflash_dist.model.attention import layer_masks
from dflash_dist.model.drafter import AnchorBlocks, DFlashDrafter
from dflash_dist.model.loss import block_inputs, dflash_loss, supervised_rows
from tests.helpers.drafter import cuda_bf16_case, small_drafter
from tests.helpers.drafter import loss_and_grads as _loss_and_grads
from tests.helpers.drafter import loss_batch as _batch
from tests.helpers.drafter import rel as _rel

CUTS = {"dedup0": (True, False), "lastrows": (False, True), "both": (True, True)}


def _rows_hidden(d: DFlashDrafter, batch, rows):
    """The drafter's output as dflash_loss calls it, with `rows` (None: every row)."""
    ids, feats, _, anchors = batch
    blk, s = d.config.block_size, ids.shape[1]
    block_ids, pos = block_inputs(ids, anchors, blk, d.config.mask_token_id)
    mask = layer_masks("dense", anchors.positions, anchors.keep, s, blk, d.config.layer_types,
                       d.config.sliding_window, anchors.starts)  # fmt: skip
    ctx_pos = torch.arange(s).expand(ids.shape[0], s)
    with torch.no_grad():
        return d(block_ids, pos, d.fuse_context(feats), ctx_pos, mask, anchor_blocks=True, rows=rows)


@pytest.mark.parametrize(("split", "packed"), [(False, True), (True, False)], ids=["cat-packed", "splitkv-rows"])
@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_cut_is_the_reference_function(cut, dtype, split, packed):
    """Same weights and batch, the cut on and off (the torch reference path): the loss, every trainable
    gradient and the supervised rows' hidden states; k/v projected from cat(context, x) with packed rows, and
    apart (splitkv) with one document a row. Observed on CPU: the loss bitwise in both dtypes;
    fp32 gradients <= 5.2e-7 relative (q/k_norm's; the last-row cut alone <= 8.1e-8), hidden rows <= 6.1e-8
    (bitwise under the last-row cut); bf16 gradients bitwise under the last-row cut and <= 7.2e-3 under dedup
    (layer 0's input norm weight: its dY summed over the slots in bf16), each as far from the fp32 gradient of
    the same weights as the reference's (input norm weight: 7.0e-3 against the reference's 7.5e-3), hidden
    rows bitwise."""
    d = small_drafter(block=4).train().to(dtype)
    d.set_split_kv(split)
    batch = _batch(d, dtype, packed)
    rows = supervised_rows(batch[0], batch[2], batch[3], 4)
    assert not d.dedup_layer0 and not d.last_rows  # the torch set: the reference path
    ref, ref_g = _loss_and_grads(d, batch)
    ref_h = _rows_hidden(d, batch, None).reshape(-1, d.config.hidden_size)[rows]
    d.set_row_cuts(*CUTS[cut])
    out, g = _loss_and_grads(d, batch)
    hidden = _rows_hidden(d, batch, rows)
    tol = {torch.float32: 5e-6, torch.bfloat16: 2e-2}[dtype]
    assert torch.equal(out.loss, ref.loss) or _rel(out.loss, ref.loss) < tol
    assert torch.equal(out.slot_correct, ref.slot_correct) and torch.equal(out.sample_count, ref.sample_count)
    worst = max(ref_g, key=lambda n: _rel(g[n], ref_g[n]))
    assert _rel(g[worst], ref_g[worst]) < tol, (worst, _rel(g[worst], ref_g[worst]))
    if dtype == torch.bfloat16:  # each bf16 gradient as far from fp32's (the same weights in fp32) as the reference's
        d32 = small_drafter(block=4).train().to(dtype).float()
        d32.set_split_kv(split)
        _, g32 = _loss_and_grads(d32, (batch[0], batch[1].float(), *batch[2:]))
        assert all(_rel(g[n], g32[n]) <= 1.1 * _rel(ref_g[n], g32[n]) + 1e-3 for n in g32)
    assert hidden.shape == ref_h.shape == (rows.numel(), d.config.hidden_size)
    assert _rel(hidden, ref_h) < tol / 10
    d.set_row_cuts(False, False)  # back: the reference bitwise
    again, again_g = _loss_and_grads(d, batch)
    assert torch.equal(again.loss, ref.loss) and all(torch.equal(again_g[n], ref_g[n]) for n in ref_g)


def test_expansion_puts_slot_0_rows_first_and_the_mask_row_everywhere_else():
    """AnchorBlocks on a block layout whose slot-0 rows are all different and whose other slots hold one
    MASK row: expand(distinct(h)) is h, row for row; the backward of expand sums each distinct row's slots.
    A MASK row in slot 0, or a slot-0 row elsewhere, breaks the first equality."""
    n, blk, dim = 3, 4, 5
    mask_row = torch.randn(dim)
    h = mask_row.expand(2, n, blk, dim).clone()
    h[:, :, 0] = torch.randn(2, n, dim)
    h[1, 2, 0] = mask_row  # an invalid block: all MASK
    h = h.view(2, n * blk, dim)
    blocks = AnchorBlocks(n, blk)
    distinct = blocks.distinct(h)
    assert distinct.shape == (2, n + 1, dim)
    assert torch.equal(distinct[:, :n], h.view(2, n, blk, dim)[:, :, 0])
    assert torch.equal(distinct[:, n], mask_row.expand(2, dim))
    assert torch.equal(blocks.expand(distinct), h)
    y = distinct.clone().requires_grad_()
    grad = torch.randn(2, n * blk, dim)
    blocks.expand(y).backward(grad)
    per_slot = grad.view(2, n, blk, dim)
    assert torch.allclose(y.grad[:, :n], per_slot[:, :, 0])
    assert torch.allclose(y.grad[:, n], per_slot[:, :, 1:].sum((1, 2)))
    with pytest.raises(ValueError, match="block_size >= 2"):
        AnchorBlocks(n, 1)


def test_hidden_state_of_every_slot_matches_under_dedup():
    """Each slot of each block (slot 0, the MASK slots, an invalid block's) gets the reference hidden state
    under the layer-0 cut: a MASK row expanded into slot 0, or an anchor row into a MASK slot, moves it."""
    d = small_drafter(block=4)
    batch = _batch(d, torch.float32, packed=False)
    ref = _rows_hidden(d, batch, None)
    d.set_row_cuts(dedup_layer0=True)
    out = _rows_hidden(d, batch, None)
    per_slot = (out - ref).norm(dim=-1).view(2, 4, 4) / ref.norm(dim=-1).view(2, 4, 4)
    assert float(per_slot.max()) < 1e-6, per_slot
    ids, feats, lm, anchors = batch
    with pytest.raises(ValueError, match="not whole blocks of block_size 4"):
        d(ids[:, :6], torch.arange(6)[None].expand(2, 6), d.fuse_context(feats), torch.arange(24)[None].expand(2, 24),
          None, anchor_blocks=True)  # fmt: skip


def _rows_seen(d: DFlashDrafter, batch) -> dict[str, int]:
    """Rows each Linear and RMSNorm of the drafter sees in one training forward (forward hooks)."""
    seen: dict[str, int] = {}
    def hook(name):
        return lambda m, args, out: seen.__setitem__(name, args[0].numel() // args[0].shape[-1])

    hooks = [m.register_forward_hook(hook(name)) for name, m in d.named_modules()
             if type(m).__name__ in ("Linear", "RMSNorm") and name]  # fmt: skip
    try:
        with torch.no_grad():
            dflash_loss(d, *batch, gamma=3.0)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _gemm_flops(d: DFlashDrafter, seen: dict[str, int]) -> int:
    mods = dict(d.named_modules())
    return sum(2 * rows * mods[n].in_features * mods[n].out_features for n, rows in seen.items()
               if type(mods[n]).__name__ == "Linear")  # fmt: skip


@pytest.mark.parametrize("split", [False, True], ids=["cat", "splitkv"])
def test_projections_see_only_the_rows_each_cut_leaves(split):
    """Forward hooks count the rows: with the cuts layer 0's input norm and q projection see b*(N+1) rows and
    its k/v projections the context plus those; the last layer's o_proj, post-attention norm, MLP and the final
    norm see exactly the supervised rows (not one fewer: each is a row the loss reads). The drafter's GEMM
    FLOPs drop by exactly those rows' share (the tiny shape's FLOP check)."""
    d = small_drafter(block=4)
    d.set_split_kv(split)
    batch = _batch(d, torch.float32, packed=False)
    ids, _, lm, anchors = batch
    b, s = ids.shape
    n, blk = anchors.positions.shape[1], 4
    r = supervised_rows(ids, lm, anchors, blk).numel()
    full = _rows_seen(d, batch)
    d.set_row_cuts(True, True)
    cut = _rows_seen(d, batch)
    assert r < b * n * blk and full["layers.1.self_attn.o_proj"] == full["norm"] == b * n * blk
    kv = {"k_proj": b * (s + n + 1)} if not split else {"k_proj": b * (n + 1)}  # the hook keeps the last call
    want = {
        "layers.0.input_layernorm": b * (n + 1), "layers.0.self_attn.q_proj": b * (n + 1),
        "layers.0.self_attn.k_proj": kv["k_proj"], "layers.0.self_attn.v_proj": kv["k_proj"],
        "layers.1.self_attn.o_proj": r, "layers.1.post_attention_layernorm": r, "layers.1.mlp.gate_proj": r,
        "layers.1.mlp.up_proj": r, "layers.1.mlp.down_proj": r, "norm": r,
        "layers.1.self_attn.q_proj": b * n * blk, "layers.0.self_attn.o_proj": b * n * blk,  # untouched
        "layers.0.mlp.down_proj": b * n * blk, "layers.1.input_layernorm": b * n * blk,
    }
    assert {k: cut[k] for k in want} == want
    assert {k: v for k, v in cut.items() if k not in want} == {k: v for k, v in full.items() if k not in want}
    cfg = d.config
    h, kvd, qd = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.num_attention_heads * cfg.head_dim
    saved_layer0 = 2 * b * (n * blk - (n + 1)) * h * (qd + 2 * kvd)
    saved_last = 2 * (b * n * blk - r) * (qd * h + 3 * h * cfg.intermediate_size)
    assert _gemm_flops(d, full) - _gemm_flops(d, cut) == saved_layer0 + saved_last


def test_fast_kernel_sets_turn_the_cuts_on_and_torch_off():
    """set_kernels: on with compile (and liger: the GPU's sets), off with the torch reference, which the
    pinned loss curve and the golden sets run; a drafter starts on the torch set."""
    d = small_drafter()
    assert (d.dedup_layer0, d.last_rows) == (False, False)
    d.set_kernels("compile")
    assert (d.dedup_layer0, d.last_rows) == (True, True)
    d.set_row_cuts(last_rows=False)
    assert (d.dedup_layer0, d.last_rows) == (True, False)
    d.set_kernels("torch")
    assert (d.dedup_layer0, d.last_rows) == (False, False)


def test_full_forwards_keep_every_row():
    """Inference (draft_block) and return_logits (parity) run every row of every layer under both cuts;
    rows with return_layer_outputs is refused (the last layer would hold the rows only)."""
    d = small_drafter(block=4)
    batch = _batch(d, torch.float32, packed=False)
    ids, feats, lm, anchors = batch
    ref_logits = dflash_loss(d, *batch, gamma=3.0, return_logits=True).logits
    ref_draft = d.draft_block(feats[0], 5, 9)
    d.set_row_cuts(True, True)
    logits = dflash_loss(d, *batch, gamma=3.0, return_logits=True).logits
    assert logits.shape == ref_logits.shape and _rel(logits, ref_logits) < 1e-6
    assert torch.equal(d.draft_block(feats[0], 5, 9), ref_draft)
    rows = supervised_rows(ids, lm, anchors, 4)
    with pytest.raises(ValueError, match="return_layer_outputs"):
        block_ids, pos = block_inputs(ids, anchors, 4, d.config.mask_token_id)
        d(block_ids, pos, d.fuse_context(feats), torch.arange(24).expand(2, 24), None, True, rows=rows)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["liger", "compile"])
def test_gpu_cuts_match_the_uncut_forward_in_bf16(kernels):
    """bf16 on CUDA, flex attention, the GPU's kernel sets (cuts on by default) against the same set with the
    cuts off, same weights and batch (2 rows of 512 tokens, 64 anchors of 16 slots, a quarter of the slots
    loss-masked, invalid blocks): loss to 1e-3 relative, every gradient to bf16 noise, and no further from the
    fp32 torch reference of the same weights than the uncut gradient (printed: the lease's record)."""
    d, batch, g32 = cuda_bf16_case(512, 8, 2, 64, 1536, 8192, 3, rows=2, anchors=64, id_max=8000, masked=0.25,
                                   invalid_from=48)
    d.set_kernels(kernels)
    assert d.dedup_layer0 and d.last_rows
    cut, cut_g = _loss_and_grads(d, batch)
    d.set_row_cuts(False, False)
    ref, ref_g = _loss_and_grads(d, batch)
    worst = max(ref_g, key=lambda n: _rel(cut_g[n], ref_g[n]))
    print(f"{kernels}: loss {float(cut.loss):.6f} vs {float(ref.loss):.6f}; worst gradient {worst} rel "
          f"{_rel(cut_g[worst], ref_g[worst]):.2e}; distance to fp32, cut/uncut: "
          + ", ".join(f"{n} {_rel(cut_g[n], g32[n]):.2e}/{_rel(ref_g[n], g32[n]):.2e}" for n in ref_g if "layers.0" in n
                      or "layers.1.mlp" in n))  # fmt: skip
    assert _rel(cut.loss, ref.loss) < 1e-3
    assert _rel(cut_g[worst], ref_g[worst]) < 5e-2, worst
    assert all(_rel(cut_g[n], g32[n]) <= 1.25 * _rel(ref_g[n], g32[n]) + 2e-3 for n in g32)
