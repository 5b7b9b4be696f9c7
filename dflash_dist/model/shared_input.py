"""Linear maps that read one input, with the input's gradient summed in one buffer (issue 24).

Autograd gives each `F.linear` of a shared input its own dX GEMM and then adds them: a bf16 add kernel of
the input's size for every extra reader (at the 27B shape each drafter layer has three: the k/v projections
of cat(context, x), their sum with the q projection's at the x rows, and the MLP's gate and up; ~4.6 GB a
step read and written, ~1.45 ms of add kernels on an H100). Here the first dX GEMM writes the buffer and
each other one adds its product in the GEMM's epilogue (`addmm_`, beta 1): one bf16 rounding of the sum of
the other products, where the adds rounded each product first. The forward is the same `F.linear` calls,
bitwise; the weight gradients are the same GEMMs.

`project_qkv(context, x, wq, wk, wv)`: the drafter's q projection of the block rows x and k/v projections of
cat(context, x), whose x rows are x itself: the q projection's dX is added into the cat's gradient at those
rows, so autograd's cat backward hands x its whole gradient (and x's own slot gets none).
`linears(x, weights)`: every weight on all of x (the MLP's gate and up).

Used by the drafter when `DFlashDrafter.set_one_dx(True)` (opt-in: in the 27B step on an H100 within the noise of
autograd's form, bench_train_step's onedx); off, autograd's form runs, so the pinned loss curve and the golden
sets keep their bits.
Pure torch (STYLE 6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SharedInputLinears(torch.autograd.Function):
    """outputs = [F.linear(x, w) for w in full] + [F.linear(tail_x, w) for w in tail]; `tail_x` is the
    tensor whose rows sit at `x[:, start:]` (x = cat(other, tail_x) along dim 1): its readers' dX is added
    there, and tail_x itself gets no gradient through this function."""

    @staticmethod
    def forward(ctx, x, tail_x, start: int, n_full: int, *weights):
        ctx.save_for_backward(x, tail_x, *weights)
        ctx.start, ctx.n_full = start, n_full
        outs = [F.linear(x, w) for w in weights[:n_full]]
        outs += [F.linear(tail_x, w) for w in weights[n_full:]]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, tail_x, *weights = ctx.saved_tensors
        start, n_full = ctx.start, ctx.n_full
        h = x.shape[-1]
        x2 = x.reshape(-1, h)
        gx = None
        if ctx.needs_input_grad[0]:
            for dy, w in zip(grads[:n_full], weights[:n_full]):
                dy2 = dy.reshape(-1, dy.shape[-1])
                gx = torch.mm(dy2, w) if gx is None else gx.addmm_(dy2, w)
            gx = torch.zeros_like(x2) if gx is None else gx
            gx = gx.view(x.shape)
            for dy, w in zip(grads[n_full:], weights[n_full:]):
                rows = gx[:, start:]  # the tail rows of each sequence, [b, T-start, H]
                for j in range(rows.shape[0]):  # a sequence's tail is contiguous; the batch is not
                    rows[j].addmm_(dy[j], w)
        dws = []
        tail2 = None if tail_x is None or n_full == len(weights) else tail_x.reshape(-1, h)
        for i, dy in enumerate(grads):
            if not ctx.needs_input_grad[4 + i]:
                dws.append(None)
                continue
            src = x2 if i < n_full else tail2
            dws.append(dy.reshape(-1, dy.shape[-1]).t().mm(src))
        return (gx, None, None, None, *dws)


def _autograd_ok(*tensors: torch.Tensor) -> bool:
    """The summed form only where it changes something and its saved dtypes hold: grad on, no autocast."""
    autocast = torch.is_autocast_enabled(tensors[0].device.type)
    return torch.is_grad_enabled() and not autocast and any(t.requires_grad for t in tensors)


def linears(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """[F.linear(x, w) for w in weights], x's gradient summed in one buffer."""
    if not _autograd_ok(x, *weights):
        return tuple(F.linear(x, w) for w in weights)
    return _SharedInputLinears.apply(x, None, 0, len(weights), *weights)


def project_qkv(context: torch.Tensor, x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor):
    """(q of x, k of cat(context, x), v of cat(context, x)) for [b, S, H] context and [b, Q, H] x, x's and
    context's gradients summed in the cat's buffer."""
    kv_in = torch.cat([context, x], dim=1)
    if not _autograd_ok(kv_in, wq, wk, wv):
        return F.linear(x, wq), F.linear(kv_in, wk), F.linear(kv_in, wv)
    k, v, q = _SharedInputLinears.apply(kv_in, x, context.shape[1], 2, wk, wv, wq)
    return q, k, v
