"""flex_attention's BlockMask built directly from the anchors (attention.block_mask_flex
build="direct") equals torch's create_block_mask tables exactly, for full, sliding and packed
layers and for lengths off the 128-tile grid; so the attention is the same computation. On CUDA
(`-m gpu`) the compiled flex forward and backward agree bit for bit between the two builds."""

from __future__ import annotations

import pytest
import torch

from dflash_dist.model.attention import block_mask_flex, layer_masks
from dflash_dist.model.loss import sample_anchors

TABLES = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def anchors_for(b: int, s_len: int, n: int, packed: bool, seed: int = 1):
    mask = torch.ones(b, s_len)
    mask[:, : s_len // 5] = 0  # a prompt: no anchors there
    mask[-1, s_len // 2 :] = 0  # a shorter last row: padded anchors (keep False)
    anc = sample_anchors(mask, n, torch.Generator().manual_seed(seed))
    starts = (anc.positions // (s_len // 3)) * (s_len // 3) if packed else None  # three documents per row
    return anc.positions, anc.keep, starts


CASES = [  # (rows, context length, anchors, block size, sliding window, packed)
    (1, 768, 128, 16, None, False),  # the 27B shape / 4: tiles on the 128 grid
    (2, 300, 40, 16, None, False),  # Q = 640, K = 940: a cut last key tile
    (2, 300, 40, 16, 100, False),
    (1, 500, 70, 4, None, True),
    (3, 257, 33, 5, 64, True),  # a block size that does not divide 128
    (1, 1000, 1, 16, None, False),  # one block
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_direct_block_mask_equals_create_block_mask(case):
    b, s_len, n, blk, window, packed = case
    positions, keep, starts = anchors_for(b, s_len, n, packed)
    ref = block_mask_flex(positions, keep, s_len, blk, window, starts, build="create")
    got = block_mask_flex(positions, keep, s_len, blk, window, starts, build="direct")
    assert got.seq_lengths == ref.seq_lengths and got.BLOCK_SIZE == ref.BLOCK_SIZE
    for name in TABLES:
        want, have = getattr(ref, name), getattr(got, name)
        assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want), name
    if case == CASES[0]:  # full and partial tiles both occur (708 full, 148 partial at the 27B shape)
        assert int(ref.full_kv_num_blocks.sum()) > 0 and int(ref.kv_num_blocks.sum()) > 0
    # the mask_mod handed to flex for partial tiles is the same rule
    q = torch.arange(n * blk)[:, None]
    kv = torch.arange(s_len + n * blk)[None]
    zero = torch.zeros((), dtype=torch.long)
    assert torch.equal(got.mask_mod(zero, zero, q, kv), ref.mask_mod(zero, zero, q, kv))


def test_layer_masks_pass_the_build_through_and_refuse_unknown():
    positions, keep, _ = anchors_for(1, 300, 40, False)
    masks = layer_masks(
        "flex", positions, keep, 300, 16, ("sliding_attention", "full_attention"), 64, flex_build="direct"
    )
    ref = layer_masks(
        "flex", positions, keep, 300, 16, ("sliding_attention", "full_attention"), 64, flex_build="create"
    )
    for kind in masks:
        assert torch.equal(masks[kind].kv_indices, ref[kind].kv_indices)
    with pytest.raises(ValueError, match="build"):
        block_mask_flex(positions, keep, 300, 16, build="vmap")


@pytest.mark.gpu
@pytest.mark.parametrize("window,packed", [(None, False), (512, False), (None, True)])
def test_cuda_compiled_flex_is_identical_with_both_builds(window, packed):
    """The trainer's path: compiled flex_attention, bf16, forward and backward, GQA."""
    from dflash_dist.model.attention import attend

    torch.manual_seed(0)
    b, s_len, n, blk = 1, 1536, 256, 16
    positions, keep, starts = (t if t is None else t.cuda() for t in anchors_for(b, s_len, n, packed))
    q = torch.randn(b, 8, n * blk, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, 2, s_len + n * blk, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    outs = {}
    for build in ("create", "direct"):
        mask = block_mask_flex(positions, keep, s_len, blk, window, starts, build=build)
        out = attend(q, k, v, mask, scale=64**-0.5)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        outs[build] = (out.detach(), *grads)
    for x, y in zip(outs["create"], outs["direct"]):
        assert torch.equal(x, y)


S_LEN = 1536  # the context of the gpu tilings tests: 256 anchor blocks of 16


def _heads_of_the_27b_drafter():
    """(anchor positions, keep, q, k, v) on CUDA, seeded: head_dim 128 with GQA 4:1 (8 query heads, 2 kv heads),
    256 blocks of 16 queries over a 1536-token context and the blocks' own keys (bf16, requiring grad)."""
    torch.manual_seed(0)
    n, blk, d = 256, 16, 128
    positions, keep, _ = (t if t is None else t.cuda() for t in anchors_for(1, S_LEN, n, False))
    q = torch.randn(1, 8, n * blk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, S_LEN + n * blk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return positions, keep, q, k, torch.randn_like(k, requires_grad=True)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["m64n64", "m32n128", "stages2", "m32n64", "tma", "m32n64tma", "autotune"])
def test_cuda_flex_tilings_stay_as_close_to_fp32_as_torchs_own(preset):
    """Each tiling bench_train_step.py's fa* words time (attention.set_flex_tuning) sums the keys in another
    order: its bf16 output and q/k/v gradients stay within 2x torch's own tiling's error against an fp32
    dense reference, at head_dim 128 with GQA 4:1 (the 27B drafter's heads) and the training block mask."""
    import sys
    from pathlib import Path

    from dflash_dist.model.attention import attend, block_mask_dense, set_flex_tuning

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from train_step_settings import FLEX_PRESETS

    positions, keep, q, k, v = _heads_of_the_27b_drafter()
    s_len, blk, d = S_LEN, 16, q.shape[-1]
    dense = block_mask_dense(positions, keep, s_len, blk)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = attend(*ref_in, dense, scale=d**-0.5)
    g = torch.randn_like(ref)
    ref_all = (ref.detach(), *torch.autograd.grad(ref, ref_in, g))
    errors = {}
    try:
        for name in ("torch", preset):
            set_flex_tuning(FLEX_PRESETS.get(name), autotune=name == "autotune")
            out = attend(q, k, v, block_mask_flex(positions, keep, s_len, blk), scale=d**-0.5)
            got = (out.detach(), *torch.autograd.grad(out, (q, k, v), g.bfloat16()))
            errors[name] = [float((x.float() - r).abs().max() / r.abs().max()) for x, r in zip(got, ref_all)]
    finally:
        set_flex_tuning()
    print(f"flex {preset} vs torch's tiling, max |error| / max |fp32| for out, dq, dk, dv: "
          f"{errors[preset]} vs {errors['torch']}")
    for mine, torchs in zip(errors[preset], errors["torch"]):
        assert mine <= 2 * torchs + 1e-4


def test_the_default_flex_tiles_are_hoppers_at_head_dim_128_and_torchs_elsewhere():
    """attention.default_flex_options: HOPPER_D128_TILES on sm90 at head_dim 128 only; `attend` uses them unless
    set_flex_tuning gave options ({}: torch's own choice) or autotuning, and never on the CPU."""
    from dflash_dist.model import attention

    assert attention.default_flex_options((9, 0), 128) == attention.HOPPER_D128_TILES
    for cap, d in (((9, 0), 64), ((9, 0), 256), ((8, 0), 128), ((10, 0), 128), ((12, 0), 128), (None, 128)):
        assert attention.default_flex_options(cap, d) is None, (cap, d)
    q = torch.zeros(1, 2, 16, 128)
    try:
        assert attention._flex_options(q) is None  # the CPU: torch's own
        attention.set_flex_tuning({"fwd_BLOCK_M": 32})
        assert attention._flex_options(q) == {"fwd_BLOCK_M": 32}
        attention.set_flex_tuning({})
        assert attention._flex_options(q) is None and attention.flex_tuning()["options"] == {}
    finally:
        attention.set_flex_tuning()
    assert attention.flex_tuning() == {"options": None, "autotune": False}


@pytest.mark.gpu
def test_cuda_default_flex_tilings_sum_as_torchs_own_on_hopper():
    """On sm90 at head_dim 128 `attend` runs HOPPER_D128_TILES by default: torch's own 64-key forward tiles,
    backward tiles that accumulate in the same order, so the output and the q/k/v gradients are bitwise torch's own
    (the training block mask, GQA 4:1), and so is the output at a decoding shape (one block of 16 queries over a
    context no multiple of a tile)."""
    from dflash_dist.model import attention

    assert torch.cuda.get_device_capability() == (9, 0), "the device machine is an H100 or H200"
    positions, keep, q, k, v = _heads_of_the_27b_drafter()
    s_len, blk, d = S_LEN, 16, q.shape[-1]
    g = torch.randn_like(q)
    outs = {}
    try:
        for name, options in (("default", None), ("torch", {})):
            attention.set_flex_tuning(options)
            assert attention._flex_options(q) == (attention.HOPPER_D128_TILES if options is None else None)
            out = attention.attend(q, k, v, block_mask_flex(positions, keep, s_len, blk), scale=d**-0.5)
            outs[name] = (out.detach(), *torch.autograd.grad(out, (q, k, v), g))
        positions, keep, _ = (t if t is None else t.cuda() for t in anchors_for(1, 700, 1, False))
        q1, k1 = q[:, :, :blk].detach(), k[:, :, : 700 + blk].detach()
        for name, options in (("decode default", None), ("decode torch", {})):
            attention.set_flex_tuning(options)
            with torch.no_grad():
                outs[name] = (attention.attend(q1, k1, k1, block_mask_flex(positions, keep, 700, blk), scale=d**-0.5),)
    finally:
        attention.set_flex_tuning()
    for a, b in (("default", "torch"), ("decode default", "decode torch")):
        for x, y in zip(outs[a], outs[b]):
            assert torch.equal(x, y), a
