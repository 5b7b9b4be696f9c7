"""The chunked loss through the frozen lm_head equals the naive full-logits loss: value, accuracy,
per-slot counts and every trainable gradient; no lm_head gradient; one chunk of logits at a time."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dflash_dist.model import vocab_loss
from dflash_dist.model.loss import Anchors, dflash_loss
from dflash_dist.model.vocab_loss import ChunkedLMHeadCE, chunk_bounds, default_chunk_rows, lm_head_cross_entropy
from tests.helpers.drafter import small_drafter


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """allclose at ~1e-6 of the reference's scale."""
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, b.abs().max().item()))


def _batch(all_unsupervised: bool = False):
    """Two rows of 20 tokens, block 4: an anchor whose last slot is past the end (17 + 3 = 20),
    loss-masked tokens inside blocks, and an invalid block in each row."""
    torch.manual_seed(3)
    s = 20
    ids = torch.randint(0, 60, (2, s))
    feats = torch.randn(2, s, 96)
    lm = torch.ones(2, s)
    lm[0, 5:7] = 0
    lm[1, 11] = 0
    if all_unsupervised:
        lm.zero_()
    anchors = Anchors(torch.tensor([[3, 17, 0], [2, 9, 0]]), torch.tensor([[True, True, False], [True, True, False]]))
    return ids, feats, lm, anchors


def _run(d, batch, **kw):
    d.zero_grad(set_to_none=True)
    out = dflash_loss(d, *batch, gamma=3.0, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.requires_grad}
    return out, grads


@pytest.mark.parametrize("chunk_rows", [1, 4, 5, 7, None])
def test_chunked_equals_full_logits(chunk_rows):
    d = small_drafter(block=4).train()
    batch = _batch()
    ref, ref_grads = _run(d, batch, return_logits=True)
    out, grads = _run(d, batch, vocab_chunk_rows=chunk_rows)
    assert 0 < int(ref.slot_count.sum()) < 2 * 3 * 4  # some slots carry no weight and are skipped
    assert _close(out.loss, ref.loss)
    assert torch.equal(out.accuracy, ref.accuracy) and out.num_blocks == ref.num_blocks == 4
    assert torch.equal(out.slot_correct, ref.slot_correct) and torch.equal(out.slot_count, ref.slot_count)
    assert out.logits is None and out.extras is None
    assert set(grads) == set(ref_grads) and "lm_head.weight" not in grads
    for name, g in grads.items():
        assert _close(g, ref_grads[name]), name
    assert d.lm_head.weight.grad is None and d.embed_tokens.weight.grad is None


def test_no_supervised_slot_gives_zero_loss_and_gradients():
    d = small_drafter(block=4).train()
    batch = _batch(all_unsupervised=True)
    ref, ref_grads = _run(d, batch, return_logits=True)
    out, grads = _run(d, batch, vocab_chunk_rows=3)
    assert out.loss.item() == ref.loss.item() == 0.0 and out.accuracy.item() == 0.0
    assert all(torch.equal(g, ref_grads[n]) and not g.any() for n, g in grads.items())


def test_bad_arguments():
    h, w, y, rw = torch.randn(3, 4), torch.randn(5, 4, requires_grad=True), torch.tensor([0, 1, 2]), torch.ones(3)
    with pytest.raises(ValueError, match="frozen"):
        lm_head_cross_entropy(h, w, y, rw)
    with pytest.raises(ValueError, match="ZeRO-3 partition"):  # an un-gathered ZeRO-3 parameter is empty
        lm_head_cross_entropy(h, torch.empty(0), y, rw)
    with pytest.raises(ValueError, match="row_weights"):
        lm_head_cross_entropy(h, w.detach(), y, torch.ones(4))
    with pytest.raises(ValueError, match="chunk_rows"):
        lm_head_cross_entropy(h, w.detach(), y, rw, chunk_rows=0)


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op allocates (views and in-place results are not new)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.largest = max(self.largest, t.numel())
        return out


def test_never_more_than_one_chunk_of_logits():
    n, hdim, vocab, chunk = 23, 8, 64, 5
    hidden = torch.randn(n, hdim, requires_grad=True)
    weight, labels = torch.randn(vocab, hdim), torch.randint(0, vocab, (n,))
    with _LargestTensor() as mode:
        loss, _, _ = lm_head_cross_entropy(hidden, weight, labels, torch.rand(n), chunk)
        loss.backward()
    assert mode.largest == chunk * vocab  # forward and backward: one chunk's logits at most
    with _LargestTensor() as naive:  # the check has teeth: the naive loss holds [N, V]
        F.cross_entropy(hidden @ weight.T, labels, reduction="none").sum().backward()
    assert naive.largest == n * vocab


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_function_matches_naive_per_row(dtype):
    torch.manual_seed(0)
    n, hdim, vocab = 13, 16, 50
    hidden = torch.randn(n, hdim).to(dtype).requires_grad_()
    weight, labels = (torch.randn(vocab, hdim) * 0.3).to(dtype), torch.randint(0, vocab, (n,))
    w = torch.rand(n)  # per-row weights / denominator, as dflash_loss passes them
    logits = F.linear(hidden, weight).float()
    ref_ce = F.cross_entropy(logits, labels, reduction="none")
    ref = (w * ref_ce).sum()
    for upstream in (1.0, 1 / 3):  # DeepSpeed scales the loss by 1/grad_accum
        (ref_grad,) = torch.autograd.grad(ref * upstream, hidden, retain_graph=True)
        loss, ce, argmax = lm_head_cross_entropy(hidden, weight, labels, w, chunk_rows=4)
        (grad,) = torch.autograd.grad(loss * upstream, hidden)
        assert ce.dtype == torch.float32 and grad.dtype == dtype
        assert not ce.requires_grad and not argmax.requires_grad
        assert torch.equal(argmax, logits.argmax(-1)) and torch.equal(ce, ref_ce)
        assert _close(loss, ref)
        tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the same casts; rounding order differs
        assert torch.allclose(grad.float(), ref_grad.float(), rtol=tol, atol=tol * ref_grad.abs().max().item())


class _HeadCalls(TorchDispatchMode):
    """Counts matmuls whose output has the vocabulary as its last dimension (the head's logits)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.calls = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.linear):
            self.calls += int(out.shape[-1] == self.vocab)
        return out


@pytest.mark.parametrize("kernels", ["torch", "compile"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_weights_from_the_ce_equal_the_same_weights_given(dtype, kernels):
    """D-PACE's path: a function of the CE gives the weights after the chunks; loss, CE, argmax and
    the gradient are bitwise those of the same weights passed as a tensor, with one head pass."""
    torch.manual_seed(1)
    n, hdim, vocab = 23, 16, 50
    hidden = torch.randn(n, hdim).to(dtype).requires_grad_()
    weight, labels = (torch.randn(vocab, hdim) * 0.3).to(dtype), torch.randint(0, vocab, (n,))
    seen = []

    def from_ce(ce):  # depends on other rows' CE, as D-PACE's cumulative product does
        seen.append(ce.clone())
        return torch.cumprod(torch.exp(-ce), 0).flip(0).cumsum(0).flip(0) / n

    for chunk in (1, 5, 23):
        calls = len(seen)
        # the head's calls are counted on the torch path; under a dispatch mode torch.compile compiles
        # nothing, and the compiled set refuses to run eagerly (fused._compiled: fullgraph)
        heads = _HeadCalls(vocab)
        with heads if kernels == "torch" else contextlib.nullcontext():
            loss, ce, argmax = lm_head_cross_entropy(hidden, weight, labels, from_ce, chunk, kernels)
        (grad,) = torch.autograd.grad(loss * 0.5, hidden)
        assert len(seen) == calls + 1, "the weights function is called once a pass"
        assert not seen[-1].requires_grad and torch.equal(seen[-1], ce)
        given = from_ce(ce)
        loss2, ce2, argmax2 = lm_head_cross_entropy(hidden, weight, labels, given, chunk, kernels)
        (grad2,) = torch.autograd.grad(loss2 * 0.5, hidden)
        assert torch.equal(loss, loss2) and torch.equal(ce, ce2) and torch.equal(argmax, argmax2)
        assert torch.equal(grad, grad2) and grad.any()
        if kernels == "torch":  # the logits once per chunk (the compiled kernel's matmuls are not aten ops)
            assert heads.calls == -(-n // chunk)
    with pytest.raises(ValueError, match="row_weights function returned"):
        lm_head_cross_entropy(hidden, weight, labels, lambda ce: ce[:3], 5, kernels)


def test_no_gradient_work_without_grad():
    hidden, weight = torch.randn(6, 4, requires_grad=True), torch.randn(9, 4)
    with _LargestTensor() as mode, torch.no_grad():
        loss, _, _ = lm_head_cross_entropy(hidden, weight, torch.zeros(6, dtype=torch.long), torch.ones(6), 2)
    assert not loss.requires_grad and mode.largest < hidden.numel()  # no [N, H] gradient buffer


def test_gradcheck_float64():
    torch.manual_seed(0)
    hidden = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight, labels = torch.randn(7, 4, dtype=torch.float64), torch.tensor([0, 6, 3, 3, 1])
    w = torch.rand(5, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda h: ChunkedLMHeadCE.apply(h, weight, labels, w, 2)[0], (hidden,))


def test_default_chunk_rows():
    assert default_chunk_rows(248320) == 2162  # 2 GiB of fp32 logits at the 27B vocabulary
    assert default_chunk_rows(248320, logit_bytes=2) == 4324  # bf16 (liger/compile): 7680 rows in 2 balanced chunks
    assert vocab_loss.CHUNK_SPLIT == "balanced" and chunk_bounds(7680, 4324) == [(0, 3840), (3840, 7680)]
    assert default_chunk_rows(10**12) == 1


def test_balanced_chunks_cut_as_few_equal_aligned_chunks_and_change_no_row(monkeypatch):
    """vocab_loss.CHUNK_SPLIT "balanced" cuts the rows into as many chunks as "greedy" (so no chunk
    holds more logits than the budget), of equal sizes rounded up to CHUNK_ALIGN rows: the 27B shape's
    7680 rows at 2162 a chunk are 4 x 1920 instead of 3 x 2162 + 1194. Which chunk a row is in changes
    nothing of it: the loss, each row's CE and argmax, and dL/dh are the same under either cut, and each
    chunk's logits are formed once."""
    assert chunk_bounds(7680, 2162, "greedy") == [(0, 2162), (2162, 4324), (4324, 6486), (6486, 7680)]
    assert chunk_bounds(7680, 2162, "balanced") == [(0, 1920), (1920, 3840), (3840, 5760), (5760, 7680)]
    assert chunk_bounds(7000, 2162, "balanced") == [(0, 1792), (1792, 3584), (3584, 5376), (5376, 7000)]
    assert chunk_bounds(300, 128, "balanced") == [(0, 128), (128, 256), (256, 300)]  # the alignment caps
    assert chunk_bounds(5, 2, "balanced") == [(0, 2), (2, 4), (4, 5)] and chunk_bounds(0, 4, "balanced") == []
    with pytest.raises(ValueError, match="chunk split 'even'"):
        chunk_bounds(10, 4, "even")

    torch.manual_seed(0)
    n, h, v = 300, 32, 97
    weight = torch.randn(v, h)
    labels = torch.randint(0, v, (n,))
    row_weights = torch.rand(n)
    shapes = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(vocab_loss.F, "linear", lambda x, w: shapes.append(x.shape[0]) or linear(x, w))
    out = {}
    for split in ("greedy", "balanced"):
        monkeypatch.setattr(vocab_loss, "CHUNK_SPLIT", split)
        monkeypatch.setattr(vocab_loss, "CHUNK_ALIGN", 16)
        shapes.clear()
        hidden = torch.randn(n, h, generator=torch.Generator().manual_seed(1)).requires_grad_()
        loss, ce, argmax = lm_head_cross_entropy(hidden, weight, labels, row_weights, chunk_rows=120)
        loss.backward()
        out[split] = (loss.detach(), ce, argmax, hidden.grad)
        assert shapes == {"greedy": [120, 120, 60], "balanced": [112, 112, 76]}[split]
    for a, b in zip(out["greedy"], out["balanced"]):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_balanced_cut_stays_within_bf16_rounding_of_the_greedy_one(monkeypatch):
    """On CUDA another cut gives the head GEMMs other shapes, which cuBLAS may sum in another order: the
    balanced cut's per-row CE, argmax and dL/dh (bf16, liger's CE as in training) stay within bf16
    rounding of the greedy cut's at a head 1/10 of the 27B one's size; the printed figures are what
    docs/BENCHMARKS.md states for the cut."""
    from dflash_dist.model import vocab_loss

    torch.manual_seed(0)
    n, h, v = 3000, 1024, 24832
    weight = (torch.randn(v, h, device="cuda") * h**-0.5).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda")
    row_weights = torch.rand(n, device="cuda") / n
    hidden0 = torch.randn(n, h, device="cuda").bfloat16()
    out = {}
    for split in ("greedy", "balanced"):
        monkeypatch.setattr(vocab_loss, "CHUNK_SPLIT", split)
        hidden = hidden0.clone().requires_grad_()
        loss, ce, argmax = lm_head_cross_entropy(hidden, weight, labels, row_weights, chunk_rows=1100, kernels="liger")
        loss.backward()
        out[split] = (loss.detach().float(), ce.float(), argmax, hidden.grad.float())
    (l0, ce0, a0, g0), (l1, ce1, a1, g1) = out["greedy"], out["balanced"]
    ce_diff = float((ce1 - ce0).abs().max())
    grad_rel = float((g1 - g0).norm() / g0.norm())
    agree = float((a1 == a0).float().mean())
    print(f"cut balanced vs greedy: loss {float(l1):.6f} vs {float(l0):.6f}, CE max |diff| {ce_diff:.2e}, "
          f"dL/dh rel L2 {grad_rel:.2e}, argmax agreement {agree:.4%}")
    assert ce_diff < 2e-2 and grad_rel < 1e-2 and agree > 0.995
    assert abs(float(l1) - float(l0)) < 1e-3 * abs(float(l0))
