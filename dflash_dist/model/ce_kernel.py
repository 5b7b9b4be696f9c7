"""The chunked loss's per-row cross-entropy on a GPU in one Triton kernel: CE, argmax and
softmax - onehot written over the chunk's logits, with liger-kernel's arithmetic (its
`liger_cross_entropy_kernel` at reduction "sum", no weight, smoothing, z-loss or softcap) and one
change in where the bytes come from.

Liger's kernel reads a row twice, once for the online max and sum of exponentials and once to
write the gradient, first block to last both times. A row at the 27B shape is 248320 bf16 logits
(485 KiB) and a chunk's rows run ~264 at a time, so when the second pass starts at the row's first
block that block has long left the L2 cache (50 MB on an H100, 60 on an H200). Here the second
pass runs the blocks last to first: the blocks the first pass read last are read again first,
while they are still in L2. The gradient is elementwise in (x, max, sum), so the order of the
second pass leaves every stored value as it was; the first pass is liger's, block for block, with
the same block size and warps, so the row's max, sum, argmax and CE are liger's bit for bit
(tests/test_ce_kernel.py's gpu test).

`programs` > 0 runs that many programs over the rows in turn (row r on program r % programs):
fewer rows in flight, so more of each row is still in L2 for the second pass, at the cost of the
first pass's memory parallelism. 0 (the default) launches one program per row as liger does.

GPU only (Triton). Labels must be valid class ids (0 <= y < V): as liger's kernel with no ignored
index, nothing checks them on the device.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 32768  # liger's cap: a row is read in blocks of min(32768, the next power of two of V) logits
NUM_WARPS = 32  # liger's


def liger_block(v: int) -> int:
    """The block of logits liger's CE kernel reads a row of V in (fused._liger_ce_chunk's BLOCK_SIZE)."""
    return min(BLOCK_SIZE, 1 << (v - 1).bit_length())


try:  # GPU environments; on a CPU-only install ce_rows refuses before any launch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover (the CPU test environment has no Triton)
    triton = None

if triton is not None:
    LOG2_E = tl.constexpr(1.4426950408889634)  # liger's: exp(x) as exp2(x * log2(e))

    @triton.jit
    def _ce_rows_kernel(x_ptr, x_stride, y_ptr, loss_ptr, argmax_ptr, n_rows, n_cols, step,
                        BLOCK: tl.constexpr, HAS_GRAD: tl.constexpr, REVERSE: tl.constexpr):
        for row in range(tl.program_id(0), n_rows, step):
            row64 = tl.cast(row, tl.int64)
            x_row = x_ptr + row64 * x_stride
            y = tl.load(y_ptr + row64)
            m = float("-inf")
            d = 0.0
            best = 0
            x_y = tl.load(x_row + y).cast(tl.float32)
            for i in range(0, n_cols, BLOCK):  # liger's first pass, block for block
                offs = i + tl.arange(0, BLOCK)
                blk = tl.load(x_row + offs, mask=offs < n_cols, other=float("-inf")).cast(tl.float32)
                blk_max = tl.max(blk)
                blk_arg = tl.min(tl.where(blk == blk_max, offs, n_cols))
                best = tl.where(blk_max > m, blk_arg, best)
                m_new = tl.maximum(m, blk_max)
                d = d * tl.exp2((m - m_new) * LOG2_E) + tl.sum(tl.exp2((blk - m_new) * LOG2_E))
                m = m_new
            lse = m + tl.log(d)
            if HAS_GRAD:
                n_blocks = tl.cdiv(n_cols, BLOCK)
                for j in range(0, n_blocks):
                    if REVERSE:
                        i = (n_blocks - 1 - j) * BLOCK
                    else:
                        i = j * BLOCK
                    offs = i + tl.arange(0, BLOCK)
                    blk = tl.load(x_row + offs, mask=offs < n_cols, other=float("-inf")).cast(tl.float32)
                    tl.store(x_row + offs, tl.exp2((blk - m) * LOG2_E) / d, mask=offs < n_cols)
                tl.debug_barrier()  # the loop's store to x[y] lands first
                tl.store(x_row + y, tl.exp2((x_y - m) * LOG2_E) / d - 1.0)
            tl.debug_barrier()
            tl.store(loss_ptr + row64, lse - x_y)
            tl.store(argmax_ptr + row64, best.to(tl.int64))


def ce_rows(logits: torch.Tensor, labels: torch.Tensor, need_grad: bool, *, reverse: bool = True,
            programs: int = 0, block: int | None = None, num_warps: int = NUM_WARPS):
    """(per-row CE fp32 [N], argmax int64 [N], softmax - onehot over `logits` or None), as
    fused._liger_ce_chunk returns them. `reverse`, `programs`, `block` and `num_warps` are for the
    benchmark (bench/bench_ce_kernel.py); the defaults are the loss's."""
    rows, v = logits.shape
    block = liger_block(v) if block is None else block
    if not logits.is_cuda or triton is None:
        raise ValueError(f"ce_rows runs on a CUDA device with Triton; got logits on {logits.device}")
    logits = logits.contiguous()
    labels = labels.contiguous()
    ce = torch.empty(rows, dtype=torch.float32, device=logits.device)
    argmax = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        step = programs if 0 < programs < rows else rows
        _ce_rows_kernel[(step,)](logits, logits.stride(0), labels, ce, argmax, rows, v, step, BLOCK=block,
                           HAS_GRAD=need_grad, REVERSE=reverse, num_warps=num_warps)
    return ce, argmax, (logits if need_grad else None)
