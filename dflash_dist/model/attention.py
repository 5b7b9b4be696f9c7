"""Attention for the drafter and the DFlash training block mask.

Training puts all blocks of a sequence in one forward: block j (anchor a_j) sees the context
entries at positions < a_j (strictly: the anchor's own feature stays hidden), its own B entries
bidirectionally, and no other block. On CUDA this is a sparse flex_attention BlockMask; on CPU an
equivalent dense boolean mask through sdpa. Both are built from one mask rule below.

Packed rows (several documents in one row): `starts` [b, N] gives each anchor's document start;
block j then sees only context entries in [starts_j, a_j), so documents never see each other.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dflash_dist.strict_compile import strict_compile

try:  # flex_attention exists in every torch we support, but keep CPU-only builds importable.
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask = None  # type: ignore[assignment]

AttentionMask = torch.Tensor  # dense bool [b, Q, K] (True = may attend), or a flex BlockMask
# one mask per layer type ("full_attention", "sliding_attention"); None = every key visible
LayerMasks = dict[str, "AttentionMask | None"]
FULL, SLIDING = "full_attention", "sliding_attention"


def _mask_rule(q_idx, kv_idx, anchor, keep, context_len: int, block_size: int, window: int | None = None,
               start=None):
    """The one definition of who sees what; works on index tensors of any broadcast shape.

    Context entry kv sits at position kv; query q is slot q % B of block q // B. window=None: a
    full layer; window=w: a sliding layer (module docstring). start: the anchor's document start
    in a packed row (None: the row is one document)."""
    block_of_q = q_idx // block_size
    is_ctx = kv_idx < context_len
    sees_ctx = is_ctx & (kv_idx < anchor)
    if start is not None:
        sees_ctx = sees_ctx & (kv_idx >= start)
    sees_own_block = ~is_ctx & ((kv_idx - context_len) // block_size == block_of_q)
    if window is not None:
        slot = q_idx - block_of_q * block_size
        sees_ctx = sees_ctx & (kv_idx >= anchor + slot - (window - 1))
        sees_own_block = sees_own_block & ((kv_idx - context_len) % block_size <= slot)
    return keep & (sees_ctx | sees_own_block)


def block_mask_dense(anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int,
                     sliding_window: int | None = None, starts: torch.Tensor | None = None) -> torch.Tensor:
    """[b, N*B, S+N*B] bool mask for anchors/keep [b, N]; sliding_window=w: a sliding layer's;
    starts [b, N]: each anchor's document start in a packed row."""
    b, n = anchors.shape
    q_idx = torch.arange(n * block_size, device=anchors.device)
    kv_idx = torch.arange(context_len + n * block_size, device=anchors.device)
    anchor_q = anchors.repeat_interleave(block_size, dim=1)[:, :, None]  # [b, Q, 1]
    keep_q = keep.repeat_interleave(block_size, dim=1)[:, :, None]
    start_q = None if starts is None else starts.repeat_interleave(block_size, dim=1)[:, :, None]
    return _mask_rule(q_idx[None, :, None], kv_idx[None, None, :], anchor_q, keep_q, context_len, block_size,
                      sliding_window, start_q)


def block_mask_flex(anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int,
                    sliding_window: int | None = None, starts: torch.Tensor | None = None, build: str = "direct"):
    """The same mask as a sparse flex_attention BlockMask. build "direct": its block tables from
    each query's visible key ranges (`_block_tables`: ~20 small kernels, no host sync);
    "create": torch's create_block_mask, which evaluates mask_mod over all [Q, K] pairs under
    vmap (host-bound: the GPU idled while it ran, docs/BENCHMARKS.md). Both give the same tables
    (tests/test_block_mask.py)."""
    b, n = anchors.shape

    def mask_mod(bi, hi, q_idx, kv_idx):
        j = q_idx // block_size
        start = None if starts is None else starts[bi, j]
        return _mask_rule(q_idx, kv_idx, anchors[bi, j], keep[bi, j], context_len, block_size, sliding_window,
                          start)

    q_len, kv_len = n * block_size, context_len + n * block_size
    if build == "create":
        return create_block_mask(mask_mod, B=b, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=anchors.device)
    if build != "direct":
        raise ValueError(f"block mask build={build!r}; expected 'direct' or 'create'")
    partial, full = _block_tables(anchors, keep, context_len, block_size, sliding_window, starts)
    return BlockMask.from_kv_blocks(*_dense_to_ordered(partial), *_dense_to_ordered(full),
                                    BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK), mask_mod=mask_mod,
                                    seq_lengths=(q_len, kv_len))


FLEX_BLOCK = 128  # create_block_mask's default tile (query rows x key columns) for the tables below


def _block_tables(anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int,
                  sliding_window: int | None = None, starts: torch.Tensor | None = None):
    """(partial, full) int8 [b, 1, Q tiles, K tiles] as create_block_mask derives them from the
    dense mask (`_mask_rule`): a tile is full when every (query, key) pair in it may attend,
    partial when some but not all may (tiles past Q/K lengths count as masked).

    Each query sees two key ranges: the context [max(start, a + slot - (w - 1)), a) and its own
    block [S + jB, S + jB + (slot + 1 if sliding else B)); a tile is touched when some row's range
    meets its keys, full when every row's range covers them (a row's two ranges never join: the
    context ends at a < S - 1)."""
    b, n = anchors.shape
    dev = anchors.device
    q_len, kv_len = n * block_size, context_len + n * block_size
    slot = torch.arange(block_size, device=dev).repeat(n)  # [Q]
    blk = torch.arange(n, device=dev).repeat_interleave(block_size)  # [Q]
    a = anchors.repeat_interleave(block_size, dim=1)  # [b, Q]
    kq = keep.repeat_interleave(block_size, dim=1)
    lo = torch.zeros_like(a) if starts is None else starts.repeat_interleave(block_size, dim=1)
    if sliding_window is not None:
        lo = torch.maximum(lo, a + slot - (sliding_window - 1))
    hi = torch.clamp(a, max=context_len)
    own_lo = context_len + blk * block_size
    own_hi = own_lo + (slot + 1 if sliding_window is not None else block_size)
    own_lo, own_hi = own_lo.expand(b, -1), own_hi.expand(b, -1)
    hi = torch.where(kq, hi, lo)  # a dropped block sees nothing
    own_hi = torch.where(kq, own_hi, own_lo)
    n_q, n_kv = -(-q_len // FLEX_BLOCK), -(-kv_len // FLEX_BLOCK)
    pad = n_q * FLEX_BLOCK - q_len  # rows past Q: empty ranges (masked, as create_block_mask pads)
    ranges = [F.pad(t, (0, pad)).view(b, n_q, FLEX_BLOCK, 1) for t in (lo, hi, own_lo, own_hi)]
    k0 = torch.arange(n_kv, device=dev) * FLEX_BLOCK  # [K tiles]; keys past K are masked and no
    k1 = k0 + FLEX_BLOCK  # range reaches past K, so a cut last tile is never full
    touched = torch.zeros(b, n_q, n_kv, dtype=torch.bool, device=dev)
    covered = torch.zeros(b, n_q, FLEX_BLOCK, n_kv, dtype=torch.bool, device=dev)
    for r_lo, r_hi in (ranges[:2], ranges[2:]):
        touched |= (torch.maximum(r_lo, k0) < torch.minimum(r_hi, k1)).any(2)
        covered |= (r_lo <= k0) & (r_hi >= k1)
    full = covered.all(2)
    partial = touched & ~full
    return partial[:, None].to(torch.int8), full[:, None].to(torch.int8)


def _dense_to_ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tiles per row, their column indices first) int32, as create_block_mask orders them."""
    tiles = tiles.to(torch.int32)
    order = torch.argsort(tiles, dim=-1, descending=True, stable=True)
    return tiles.sum(-1).to(torch.int32), order.to(torch.int32)


def layer_masks(attention: str, anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int,
                layer_types: tuple[str, ...] = (), sliding_window: int | None = None,
                starts: torch.Tensor | None = None, flex_build: str = "direct") -> AttentionMask | LayerMasks:
    """The training block mask(s) for a drafter with these layer types: one mask when every layer
    is full (as before), else one per layer type. attention: "flex" or "dense". starts: packed
    rows' per-anchor document starts (None: one document per row). flex_build: block_mask_flex's."""
    if attention == "flex":
        build = functools.partial(block_mask_flex, build=flex_build)
    else:
        build = {"dense": block_mask_dense}[attention]
    full = build(anchors, keep, context_len, block_size, None, starts)
    if SLIDING not in layer_types:
        return full
    return {FULL: full, SLIDING: build(anchors, keep, context_len, block_size, sliding_window, starts)}


def inference_sliding_mask(block_len: int, context_positions: torch.Tensor, block_positions: torch.Tensor,
                           window: int) -> torch.Tensor:
    """Dense [b, Q, S+Q] sliding-layer mask for one block at inference: every context entry given
    is before the anchor; slot s sees context positions >= its position - (w-1) and slots t <= s."""
    q_pos = block_positions[:, :, None]
    ctx_ok = context_positions[:, None, :] >= q_pos - (window - 1)  # [b, Q, S]
    slot = torch.arange(block_len, device=block_positions.device)
    blk_ok = (slot[None, :] <= slot[:, None])[None].expand(block_positions.shape[0], -1, -1)
    return torch.cat([ctx_ok, blk_ok], dim=-1)


# Compiled flex_attention is specialised to its shapes (dynamic=False: the fastest kernels), and
# dynamo's default limit of 8 shapes per function is below what training sees (packed rows:
# batching.anchor_slots' ~20 anchor counts; unpacked: each padded length). Past its limit plain
# torch.compile runs flex_attention eagerly with only a logged warning, and eager flex materialises the
# [Q, K] scores (98 GiB for one packed row of the mid run on the H200: an OOM, or a silent slowdown).
FLEX_RECOMPILE_LIMIT = 64


@functools.cache
def _compiled_flex(autotune: bool = False):
    """flex_attention through torch.compile, never eagerly (strict_compile: fullgraph, at most
    FLEX_RECOMPILE_LIMIT shapes in any thread, then an error naming the limit and what to do)."""
    # autotune: inductor times its candidate tile configs of the forward and backward kernels at each
    # new shape and keeps the fastest (printing the table to stderr); a minute or more per shape
    mode = "max-autotune-no-cudagraphs" if autotune else None
    return strict_compile(
        flex_attention,
        dynamic=False,
        mode=mode,
        limit=FLEX_RECOMPILE_LIMIT,
        disabled="compiled flex_attention (dflash_dist/model/attention.py): torch.compile is disabled in this "
        "process (TORCHDYNAMO_DISABLE=1 or TORCH_COMPILE_DISABLE=1), so the drafter's attention would run eager "
        "flex_attention, which materialises the full [Q, K] scores; unset it, or train with train.attention=dense",
        past_limit=f"compiled flex_attention (dflash_dist/model/attention.py) met more shapes than its "
        f"{FLEX_RECOMPILE_LIMIT} compiles: torch.compile would run it eagerly, materialising the full [Q, K] "
        "scores (an OOM or a silent slowdown at the 27B shape); stopped instead. TORCH_LOGS=recompiles shows "
        "the shapes; raise dflash_dist.model.attention.FLEX_RECOMPILE_LIMIT, pack rows (train.packing=true: "
        "~20 anchor-slot shapes), or train with train.attention=dense",
    )


# The compiled flex kernels' tuning (set_flex_tuning): torch's FlexKernelOptions (tile sizes, warps,
# stages; a "fwd_"/"bwd_" prefix limits one to the forward or the backward kernels), or inductor's
# autotuning. Default (options None): the device's tiles below, else torch's own choice ({} asks for
# torch's own everywhere). Another tiling may sum a row's keys in another order, so the output and
# gradients may change in the last bits (tests/test_block_mask.py bounds each against an fp32 reference).
_FLEX_TUNING: dict = {"options": None, "autotune": False}

# Hopper (sm90) at head_dim 128, the 27B drafter's heads: forward tiles of 64 queries x 64 keys loaded by the
# TMA, backward 32 x 64 (dK/dV) and 64 x 32 (dQ), 4 warps, 3 stages (inductor's autotuning picked these tiles on
# the H200). The forward keeps torch's own 64-key tiles (the same softmax steps) and the backward's smaller
# tiles accumulate each sum in the same order: output and q/k/v gradients measured bitwise equal to torch's own
# choice at the 27B shape, and 3.7% faster forward + backward (bench/bench_flex.py on an H100, 2026-12-06:
# 16.30 against 16.92 ms a step; docs/BENCHMARKS.md).
HOPPER_D128_TILES = {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3,
                     "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                     "bwd_num_warps": 4, "bwd_num_stages": 3, "USE_TMA": True}


def default_flex_options(capability: tuple[int, int] | None, head_dim: int) -> dict | None:
    """The flex tiles `attend` uses without set_flex_tuning's: HOPPER_D128_TILES on an sm90 GPU at head_dim
    128, else None (torch's own choice; `capability` None: not a CUDA device)."""
    return dict(HOPPER_D128_TILES) if capability == (9, 0) and head_dim == 128 else None


def set_flex_tuning(options: dict | None = None, autotune: bool = False) -> None:
    """Tile options and/or autotuning for the compiled flex kernels of every later `attend` call.
    `options` None: the device's default tiles (default_flex_options); {}: torch's own choice."""
    from torch.nn.attention.flex_attention import FlexKernelOptions

    known = set(FlexKernelOptions.__annotations__)
    bad = [k for k in options or {} if k.removeprefix("fwd_").removeprefix("bwd_") not in known]
    if bad:
        raise ValueError(f"flex kernel options {bad}: not torch's FlexKernelOptions "
                         f"(known, optionally with a fwd_/bwd_ prefix: {sorted(known)})")
    _FLEX_TUNING.update(options=dict(options) if options is not None else None, autotune=bool(autotune))


def flex_tuning() -> dict:
    options = _FLEX_TUNING["options"]
    return {"options": None if options is None else dict(options), "autotune": _FLEX_TUNING["autotune"]}


def _flex_options(q: torch.Tensor) -> dict | None:
    options = _FLEX_TUNING["options"]
    if options is None and not _FLEX_TUNING["autotune"] and q.is_cuda:
        options = default_flex_options(torch.cuda.get_device_capability(q.device), q.shape[-1])
    return options or None


def attend(q, k, v, mask, scale: float) -> torch.Tensor:
    """q [b, Hq, Q, d], k/v [b, Hkv, K, d] -> [b, Hq, Q, d]. GQA by head grouping.

    Rows that may see nothing (invalid padding blocks) return zeros, as flex_attention does,
    instead of sdpa's NaN.
    """
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    if BlockMask is not None and isinstance(mask, BlockMask):
        fn = _compiled_flex(_FLEX_TUNING["autotune"]) if q.is_cuda else flex_attention
        return fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=True, kernel_options=_flex_options(q))
    dense = mask[:, None]  # [b, 1, Q, K]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale, enable_gqa=True)
    empty = ~dense.any(-1, keepdim=True)
    return out.masked_fill(empty, 0.0)
