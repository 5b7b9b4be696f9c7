"""FLOP counts of the trainer step at a batch's real anchors (bench_train_step.py, quality_budget.py):
SPEC section 6's model FLOPs, and the part of them the drafter's row cuts do not run."""

from __future__ import annotations

from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.loss import Anchors, label_targets


def model_flops(
    dc: DrafterConfig, seq_len: int, input_ids, loss_mask, anchors: Anchors, context_tokens: int | None = None,
    phases: bool = False,
):
    """SPEC 6 cost model for one micro-batch (all rows), from the anchors actually drawn;
    `context_tokens`: the real (unpadded) context tokens, default seq_len per row. phases=True:
    (forward, backward) FLOPs instead of their sum."""
    h, L, blk, d = dc.hidden_size, dc.num_hidden_layers, dc.block_size, dc.head_dim
    nq, nkv = dc.num_attention_heads, dc.num_key_value_heads
    kv_params = 2 * h * nkv * d
    layer_params = 2 * h * nq * d + kv_params + 3 * h * dc.intermediate_size
    keep = anchors.keep
    block_tokens = int(keep.sum()) * blk
    rows = input_ids.shape[0]
    layers = 6 * layer_params * block_tokens * L
    ctx_tokens = seq_len * rows if context_tokens is None else context_tokens
    context = 6 * (dc.num_context_layers * h * h + L * kv_params) * ctx_tokens
    # each query of block j sees the context keys in [start_j, a_j) and the block's B keys
    start = 0 if anchors.starts is None else anchors.starts
    pairs = float(((anchors.positions - start + blk) * keep).sum()) * blk
    attention = 3 * 4 * nq * d * pairs * L
    _, binary = label_targets(input_ids, loss_mask, anchors, blk)
    head = 4 * h * dc.vocab_size * float(binary.sum())
    if phases:  # SPEC 6's 1:2 forward:backward split; the chunked head forms dL/dh in the forward
        body = layers + context + attention
        return body / 3 + head, 2 * body / 3
    return layers + context + attention + head


def row_cut_flops(dc: DrafterConfig, input_ids, loss_mask, anchors: Anchors) -> float:
    """The part of model_flops (SPEC 6's count, 6 FLOPs a parameter a row) that the drafter's row cuts
    (drafter.py: dedup_layer0, last_rows) do not run: layer 0's q/k/v projections on all but the N+1
    distinct rows of each sequence, and the last layer's o_proj and MLP on the rows the loss does not read.
    With the cuts on, a bound share over model_flops counts this work as if it were done."""
    h, d, blk = dc.hidden_size, dc.head_dim, dc.block_size
    block_tokens = int(anchors.keep.sum()) * blk
    distinct = int(anchors.keep.sum()) + input_ids.shape[0]  # each kept block's slot 0, and one MASK row a sequence
    _, binary = label_targets(input_ids, loss_mask, anchors, blk)
    qkv = h * (dc.num_attention_heads + 2 * dc.num_key_value_heads) * d
    last = h * dc.num_attention_heads * d + 3 * h * dc.intermediate_size
    return 6 * qkv * max(block_tokens - distinct, 0) + 6 * last * max(block_tokens - float(binary.sum()), 0)
