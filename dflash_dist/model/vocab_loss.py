"""Weighted cross-entropy through the frozen lm_head, chunked over rows (SPEC 3, 6).

At the 27B shape the naive `lm_head(hidden).float()` over 7680 slots x 248320 tokens is 7.6 GB of
fp32 logits, with as much again for their gradient. Here the logits of at most `chunk_rows` rows
exist at a time. The per-row weights are known in the forward, so each chunk's contribution to
dL/dh = w * (softmax - onehot) @ W is formed right there, while its logits are live: the head
costs 2*H*V FLOPs per row for the logits and 2*H*V for dL/dh, as in the naive path (the frozen
weight has no gradient) and a third less than recomputing the logits in the backward. The
backward only scales the stored [N, H] gradient.

Numerics follow the naive `(w * F.cross_entropy(F.linear(h, W).float(), y)).sum()`: the matmul
runs in the input dtype, the log-softmax in (at least) fp32 on the upcast logits (the per-row CE
and argmax are bitwise the naive ones), and softmax - onehot is cast to the input dtype before
the matmul with W. One difference: the row weight scales the [rows, H] product (in fp32) rather
than the [rows, V] logits' gradient, which saves a pass over the chunk; in bf16 that moves dL/dh
by about one bf16 rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from dflash_dist.model.fused import ce_chunk_fn, ce_logits_bytes, check_kernels

# logits bytes of one chunk (fp32 with the torch kernels, bf16 with liger/compile). On an H200 at the 27B shape
# (7680 slots, H 5120, V 248320, bf16) a forward+backward took 78.9 / 75.5 / 74.1 / 73.6 ms at 256 MiB / 512 MiB /
# 1 GiB / 2 GiB chunks (peak 0.8 / 1.6 / 3.1 / 6.1 GiB) against 75.6 ms and 21.3 GiB for the full logits. 2 GiB
# balanced (2 x 3840 rows there) since 2026-12-07: the 27B step 1.3 ms faster than 1 GiB greedy in 3 of 3 pairs on
# an H100 (docs/BENCHMARKS.md, sixteenth session; -1.8 ms in means in the fourteenth), 0.8 GiB more peak.
CHUNK_BYTES = 2**31
# How the rows are cut into chunks of at most chunk_rows: "greedy" (full chunks, then the rest: 7680 rows at 2162
# a chunk are 3 x 2162 + 1194) or "balanced" (the default: as few chunks, of equal size rounded up to CHUNK_ALIGN
# rows, the last one shorter: 4 x 1920). The cut decides the head GEMMs' shapes, and with them cuBLAS's tiles and waves.
# A row's logits, CE and dL/dh do not depend on the cut on the CPU (tests/test_vocab_loss.py); on CUDA another
# GEMM shape may sum in another order (last bits). bench/bench_loss.py times the cuts.
CHUNK_SPLITS = ("greedy", "balanced")
CHUNK_SPLIT = "balanced"
CHUNK_ALIGN = 128


def default_chunk_rows(vocab_size: int, chunk_bytes: int | None = None, logit_bytes: int = 4) -> int:
    """Rows whose logits fit in `chunk_bytes` (default CHUNK_BYTES: 2162 fp32 rows at V = 248320 and
    2 GiB; the fused kernels hold only bf16 logits, `logit_bytes` 2: 4324 rows)."""
    return max(1, (CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // (logit_bytes * vocab_size))


def chunk_bounds(n: int, chunk_rows: int, split: str | None = None) -> list[tuple[int, int]]:
    """[(lo, hi)] covering rows 0..n in order, each at most `chunk_rows` long, cut as `split` says
    (default CHUNK_SPLIT; see CHUNK_SPLITS)."""
    split = CHUNK_SPLIT if split is None else split
    if split not in CHUNK_SPLITS:
        raise ValueError(f"chunk split {split!r}; expected one of {CHUNK_SPLITS}")
    size = chunk_rows
    if split == "balanced" and n > 0:
        count = math.ceil(n / chunk_rows)
        size = min(chunk_rows, math.ceil(math.ceil(n / count) / CHUNK_ALIGN) * CHUNK_ALIGN)
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


class ChunkedLMHeadCE(torch.autograd.Function):
    """(hidden [N, H], weight [V, H] frozen, labels [N], row_weights [N] or a function of the CE,
    chunk_rows, kernels) -> (loss = sum(row_weights * ce), ce [N], argmax [N]).

    row_weights as a function `ce [N] -> row_weights [N]` (D-PACE: a row's weight depends on the
    CE of the other slots of its block): it is called once on the detached CE of all rows after
    the chunks, and only then are the stored per-row products (softmax - onehot) @ W scaled by
    their weights. The products are in the input dtype either way and the scale runs in fp32 into
    the same buffer, so the result is bitwise that of passing the same weights as a tensor, at one
    pass over the head instead of two.

    kernels "torch": the passes below; "liger"/"compile": one fused CE per chunk (fused.py) that
    returns the CE, the argmax and softmax - onehot in the logits' dtype.

    Only `loss` is differentiable, and only in `hidden`; `ce` and `argmax` are for metrics. The
    gradient is formed whenever `hidden` requires grad, under no_grad too: call it through
    `lm_head_cross_entropy`.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, chunk_rows, kernels="torch"):
        n = hidden.shape[0]
        fused_ce = ce_chunk_fn(kernels)
        acc = torch.promote_types(hidden.dtype, torch.float32)
        ce = torch.empty(n, dtype=acc, device=hidden.device)
        argmax = torch.empty(n, dtype=torch.long, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        deferred = callable(row_weights)  # the weights come from the CE: scale the products after the chunks

        def store_grad(lo: int, hi: int, g: torch.Tensor) -> None:  # w * g @ W of rows lo:hi (w later if deferred)
            if deferred:
                torch.matmul(g, weight, out=grad_hidden[lo:hi])
            else:
                torch.mul(g @ weight, row_weights[lo:hi, None], out=grad_hidden[lo:hi])

        for lo, hi in chunk_bounds(n, chunk_rows):
            rows, y = torch.arange(hi - lo, device=hidden.device), labels[lo:hi]
            logits = F.linear(hidden[lo:hi], weight)  # the input dtype
            if fused_ce is not None:
                ce[lo:hi], argmax[lo:hi], grad = fused_ce(logits, y, grad_hidden is not None)
                if grad is not None:
                    store_grad(lo, hi, grad)
                del logits, grad
                continue
            log_probs = torch.log_softmax(logits, -1, dtype=acc)  # = cross_entropy's, on the upcast logits
            ce[lo:hi] = -log_probs[rows, y]
            argmax[lo:hi] = logits.argmax(-1)
            if grad_hidden is not None:  # w * (softmax - onehot) @ W; softmax - onehot cast like autograd's
                probs = torch.exp(log_probs, out=logits)  # reuses the logits' buffer
                probs[rows, y] = (log_probs[rows, y].exp() - 1).to(probs.dtype)
                del log_probs
                store_grad(lo, hi, probs)
            del logits
        if deferred:
            row_weights = _row_weights_of(row_weights, ce, n)
            if grad_hidden is not None:
                torch.mul(grad_hidden, row_weights[:, None], out=grad_hidden)
        loss = (row_weights.to(acc) * ce).sum()
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(ce, argmax)
        return loss, ce, argmax

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_ce, _grad_argmax):
        (grad_hidden,) = ctx.saved_tensors
        if grad_hidden is None:
            return None, None, None, None, None, None
        # the upstream scale (1, or 1/grad_accum under DeepSpeed) is applied in fp32
        return (grad_hidden.float() * grad_loss).to(grad_hidden.dtype), None, None, None, None, None


def _row_weights_of(weight_fn, ce: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        row_weights = weight_fn(ce.detach())
    if not isinstance(row_weights, torch.Tensor) or row_weights.shape != (n,):
        got = getattr(row_weights, "shape", type(row_weights))
        raise ValueError(f"the row_weights function returned {got}, expected a tensor of shape [{n}]")
    return row_weights.detach()


def lm_head_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    row_weights,
    chunk_rows: int | None = None,
    kernels: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sum(row_weights * CE) over rows of `hidden @ weight.T` (differentiable in `hidden`), with
    the per-row CE and argmax, holding at most `chunk_rows` rows of logits at once (default:
    `default_chunk_rows(V)`).

    hidden [N, H]; weight [V, H], frozen (requires_grad False); labels [N] int64 in [0, V);
    row_weights [N] (not differentiated), or a function of the per-row CE [N] that returns them
    (called once, after every chunk; see ChunkedLMHeadCE). Pass only the rows that carry weight. kernels: "torch"
    (the reference), "liger" or "compile" (fused.py's CE per chunk).
    """
    check_kernels(kernels)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head weight has shape {tuple(weight.shape)}, expected [V, {hidden.shape[-1]}]; an empty weight "
            "is a ZeRO-3 partition read outside a module forward: call the loss inside one (DeepSpeed then "
            "gathers it) or register the weight with deepspeed.zero.register_external_parameter"
        )
    weights_shape = None if callable(row_weights) else tuple(row_weights.shape)
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1] or weights_shape not in (None, tuple(hidden.shape[:1])):
        raise ValueError(
            f"expected hidden [N, H], labels [N], row_weights [N] (or a function of the CE); got "
            f"{tuple(hidden.shape)}, {tuple(labels.shape)}, {weights_shape}"
        )
    if weight.requires_grad:
        raise ValueError("the lm_head weight must be frozen (requires_grad=False): no weight gradient is computed")
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(weight.shape[0], logit_bytes=ce_logits_bytes(kernels))
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if not torch.is_grad_enabled():
        hidden = hidden.detach()  # needs_input_grad ignores no_grad: skip the gradient work explicitly
    if not callable(row_weights):
        row_weights = row_weights.detach()
    return ChunkedLMHeadCE.apply(hidden, weight, labels, row_weights, chunk_rows, kernels)
