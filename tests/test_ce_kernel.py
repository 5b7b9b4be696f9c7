"""ce_kernel.py's per-row CE (liger's arithmetic, the second pass last block first) against
liger-kernel's, bit for bit, and its wiring in fused.py (the liger set's CE switch)."""

from __future__ import annotations

import pytest
import torch

from dflash_dist.model import fused
from dflash_dist.model.ce_kernel import ce_rows
from dflash_dist.model.vocab_loss import lm_head_cross_entropy


def test_ce_kernel_switch_names_its_choices_and_refuses_others():
    with pytest.raises(ValueError, match=r"CE kernel 'fast'; expected one of \('liger', 'rows'\)"):
        fused.set_ce_kernel("fast")
    assert fused._switch["ce"] == "liger"  # the default, untouched by the refused name


def test_ce_rows_refuses_a_cpu_tensor_with_the_reason():
    with pytest.raises(ValueError, match="ce_rows runs on a CUDA device with Triton; got logits on cpu"):
        ce_rows(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), True)


@pytest.fixture
def rows_kernel():
    fused.set_ce_kernel("rows")
    yield
    fused.set_ce_kernel("liger")


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [248320, 70000, 65536, 1000])
@pytest.mark.parametrize("form", [{}, {"reverse": False}, {"programs": 7}])
def test_ce_rows_is_bitwise_liger_on_cuda(vocab, form, monkeypatch):
    """CE, argmax and softmax - onehot equal liger's kernel's bit for bit: at the 27B vocab (8 blocks,
    the last partial), at one not a multiple of the block, at an exact multiple, and below one block
    (liger's smaller block); in either order of the second pass and with fewer programs than rows.
    Labels at the first and last class; a tie for the row maximum (across blocks where V > 32768)."""
    monkeypatch.setitem(fused._switch, "ce", "liger")  # the reference is liger's kernel, whatever a test left
    torch.manual_seed(0)
    rows = 24
    h = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(vocab, 256, device="cuda", dtype=torch.bfloat16) * 0.3
    logits = h @ w.t()
    logits[3, : vocab // 2] = logits[3].max()  # a tie for the argmax across blocks
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    labels[5] = logits[5].argmax()  # the label at the row's maximum (softmax - 1 near 0)
    labels[0], labels[1] = 0, vocab - 1
    for need_grad in (True, False):
        ref = fused._liger_ce_chunk(logits.clone(), labels, need_grad)
        out = ce_rows(logits.clone(), labels, need_grad, **form)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]), (vocab, form, need_grad)
        if need_grad:
            assert torch.equal(out[2], ref[2]), (vocab, form)
        else:
            assert out[2] is None and ref[2] is None
    assert int(out[1][3]) == 0  # the first index of the tied maximum


@pytest.mark.gpu
def test_the_loss_with_the_rows_kernel_is_bitwise_the_liger_loss(rows_kernel, monkeypatch):
    """Through lm_head_cross_entropy (the chunked head, D-PACE's deferred weights): the loss, the CE,
    the argmax and dL/dh with fused.set_ce_kernel("rows") equal the liger kernel's bit for bit, and the
    rows kernel ran once a chunk."""
    from dflash_dist.model import ce_kernel

    calls = []
    monkeypatch.setattr(ce_kernel, "ce_rows", lambda *a, **k: calls.append(a[0].shape) or ce_rows(*a, **k))
    torch.manual_seed(1)
    n, h, v = 700, 512, 24832
    weight = (torch.randn(v, h, device="cuda") * h**-0.5).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda")
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)

    def run():
        x = hidden.clone().requires_grad_(True)
        loss, ce, argmax = lm_head_cross_entropy(x, weight, labels, lambda c: torch.softmax(-c, 0), 256, "liger")
        loss.backward()
        return loss.detach(), ce, argmax, x.grad

    ours = run()
    assert calls == [(256, v), (256, v), (188, v)]
    fused.set_ce_kernel("liger")
    ref = run()
    assert len(calls) == 3
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
