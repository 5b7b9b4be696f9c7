"""Packed rows (several documents in one row, loss.Anchors starts/ends): each document's blocks
get the CE they get when the document is trained alone; no block sees or is labelled by another
document; the flex mask equals the dense one."""

from __future__ import annotations

import pytest
import torch

from dflash_dist.model.attention import block_mask_dense, block_mask_flex
from dflash_dist.model.loss import Anchors, dflash_loss
from tests.helpers.drafter import small_drafter

BLOCK = 4


def _doc(d, s: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, d.config.vocab_size - 2, (1, s), generator=g)
    feats = torch.randn(1, s, d.config.num_context_layers * d.config.hidden_size, generator=g)
    lm = torch.ones(1, s)
    lm[0, :2] = 0  # a prompt
    return ids, feats, lm


def _ce(d, ids, feats, lm, anchors):
    out = dflash_loss(d, ids, feats, lm, anchors, gamma=3.0, attention="dense", return_logits=True)
    return out.extras["ce"][0], out.extras["binary"][0]


def test_packed_documents_train_as_if_alone():
    d = small_drafter(block=BLOCK)
    len1, len2, row = 11, 9, 22  # two documents and 2 padding tokens
    a1, a2 = [2, 5, 8], [1, 4]  # anchor 8 of doc 1: slots 9, 10 in the doc, slot 11 would be doc 2's
    doc1, doc2 = _doc(d, len1, 1), _doc(d, len2, 2)
    ids = torch.zeros(1, row, dtype=torch.long)
    feats = torch.zeros(1, row, doc1[1].shape[-1])
    lm = torch.zeros(1, row)
    for (i, f, m), off, n in ((doc1, 0, len1), (doc2, len1, len2)):
        ids[0, off : off + n], feats[0, off : off + n], lm[0, off : off + n] = i[0], f[0], m[0]
    packed = Anchors(
        torch.tensor([a1 + [len1 + a for a in a2]]),
        torch.ones(1, 5, dtype=torch.bool),
        starts=torch.tensor([[0, 0, 0, len1, len1]]),
        ends=torch.tensor([[len1] * 3 + [len1 + len2] * 2]),
    )
    ce, binary = _ce(d, ids, feats, lm, packed)
    ce1, bin1 = _ce(d, *doc1, Anchors(torch.tensor([a1]), torch.ones(1, 3, dtype=torch.bool)))
    ce2, bin2 = _ce(d, *doc2, Anchors(torch.tensor([a2]), torch.ones(1, 2, dtype=torch.bool)))
    assert torch.equal(binary, torch.cat([bin1, bin2]))  # labels stop at each document's end
    assert binary[2, 3] == 0  # anchor 8 + slot 3 = position 11: doc 2's first token, not a label
    # RoPE sees only relative positions, so shifting doc 2 by 11 changes its CE by fp32 rounding only
    assert torch.allclose(ce * binary, torch.cat([ce1 * bin1, ce2 * bin2]), atol=1e-5)


def test_packed_mask_keeps_documents_apart_and_flex_matches_dense():
    anchors = torch.tensor([[2, 5, 13, 17]])
    keep = torch.tensor([[True, True, True, False]])
    starts = torch.tensor([[0, 0, 11, 11]])
    s_len = 24
    dense = block_mask_dense(anchors, keep, s_len, BLOCK, starts=starts)[0]
    ctx = dense[:, :s_len]
    assert not ctx[2 * BLOCK : 3 * BLOCK, :11].any()  # doc 2's block sees nothing of doc 1
    assert ctx[2 * BLOCK : 3 * BLOCK, 11:13].all() and not ctx[2 * BLOCK :, 13:].any()
    assert ctx[BLOCK : 2 * BLOCK, :5].all()  # doc 1 unchanged
    unpacked = block_mask_dense(anchors, keep, s_len, BLOCK)[0]
    assert unpacked[2 * BLOCK : 3 * BLOCK, :11].all()  # without starts it would see doc 1
    flex = block_mask_flex(anchors, keep, s_len, BLOCK, starts=starts)
    q = torch.arange(4 * BLOCK)[:, None]
    kv = torch.arange(s_len + 4 * BLOCK)[None]
    from_flex = flex.mask_mod(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), q, kv)
    assert torch.equal(from_flex, dense)


def _samples(d, lengths, seed=3):
    from data_pipeline.records import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        lm = torch.ones(n, dtype=torch.uint8)
        lm[:2] = 0
        out.append(Sample(
            key=f"s{i}", input_ids=torch.randint(0, d.config.vocab_size - 2, (n,), generator=g, dtype=torch.int32),
            loss_mask=lm, features=torch.randn(n, d.config.num_context_layers * d.config.hidden_size, generator=g),
            target_argmax=torch.randint(0, d.config.vocab_size - 2, (n,), generator=g, dtype=torch.int32),
        ))  # fmt: skip
    return out


def test_trainer_packing_row_trains_each_sample_as_alone():
    """train.packing: one row of micro_batch_tokens; each sample's anchors are its unpacked ones
    shifted to its offset; the row's loss is the slot-weighted mean over the samples' own CE."""
    from dflash_dist.trainer.batching import BatchLimit, make_micro_batch

    d = small_drafter(block=BLOCK)
    samples = _samples(d, [9, 12, 7])
    kw = dict(dtype=torch.float32, num_anchors=4, seed=0, epoch=0)
    packed = make_micro_batch(samples, {}, pack_tokens=32, **kw)
    assert packed.input_ids.shape == (1, 32) and packed.lengths == (28,) and packed.keys == ("s0", "s1", "s2")
    assert packed.anchors.positions.shape[1] % 4 == 0  # padded to a multiple of num_anchors
    wce, w, off = 0.0, 0.0, 0
    for smp in samples:
        alone = make_micro_batch([smp], {}, **kw)
        a = alone.anchors
        sel = (packed.anchors.starts[0] == off) & packed.anchors.keep[0]
        assert torch.equal(packed.anchors.positions[0][sel], a.positions[0][a.keep[0]] + off)
        assert torch.equal(packed.anchors.ends[0][sel], torch.full((int(sel.sum()),), off + smp.num_tokens))
        out = dflash_loss(d, alone.input_ids, alone.features, alone.loss_mask, a, gamma=3.0, attention="dense",
                          return_logits=True)
        wce += float((out.extras["weights"] * out.extras["ce"]).sum())
        w += float(out.extras["weights"].sum())
        off += smp.num_tokens
    out = dflash_loss(d, packed.input_ids, packed.features, packed.loss_mask, packed.anchors, gamma=3.0,
                      attention="dense")
    assert abs(float(out.loss) - wce / (w + 1e-6)) < 1e-5 * (wce / w)
    limit = BatchLimit(size=1, tokens=32, packed=True)
    assert limit.fits([9, 12], 7) and not limit.fits([9, 12, 7], 5) and limit.full([20, 12])
    assert not BatchLimit(size=1, tokens=32).fits([9, 12], 7)  # padded: longest x count


def test_packing_is_the_gpu_default_and_its_row_length():
    """train.packing "auto" packs on GPU ranks only (the CPU default and the pinned loss curve
    keep right-padding); the row is micro_batch_tokens, else micro_batch_size x data.max_length;
    the LR schedule counts samples unless max_steps fixes it in steps."""
    from dflash_dist.config import ConfigError, load_config

    base = ["target.kind=tiny_stdlib", "data.max_length=3072"]
    cpu = load_config(None, base)
    assert cpu.train.packing == "auto" and cpu.pack_tokens() is None and cpu.schedule_unit() == "sample"
    gpu = load_config(None, [*base, "train.gpus_per_rank=1", "train.micro_batch_size=2"])
    assert gpu.pack_tokens() == 2 * 3072 and gpu.schedule_unit() == "sample"
    assert load_config(None, [*base, "train.gpus_per_rank=1", "train.max_steps=100"]).schedule_unit() == "step"
    assert load_config(None, [*base, "train.gpus_per_rank=1", "train.packing=false"]).pack_tokens() is None
    padded_budget = load_config(None, [*base, "train.micro_batch_tokens=8192"])  # CPU: padded, token budget
    assert padded_budget.pack_tokens() is None and padded_budget.schedule_unit() == "sample"
    cfg = load_config(None, [*base, "train.packing=true", "train.micro_batch_tokens=4096"])
    assert cfg.pack_tokens() == 4096 and cfg.train.kernels == "auto"
    with pytest.raises(ConfigError, match="micro_batch_tokens=1024 is shorter than data.max_length=3072"):
        load_config(None, [*base, "train.packing=true", "train.micro_batch_tokens=1024"])


@pytest.mark.gpu
def test_cuda_packed_row_through_flex_trains_each_sample_as_alone():
    """The GPU default path: a packed row of three samples through flex_attention (one block mask
    per layer type, sliding + full layers) with the GPU kernel set, bf16, gives the slot-weighted
    mean of the three samples' own losses, and its gradient matches theirs."""
    from data_pipeline.records import Sample
    from dflash_dist.model.attention import FULL, SLIDING
    from dflash_dist.model.config import DrafterConfig
    from dflash_dist.model.drafter import DFlashDrafter
    from dflash_dist.model.fused import resolve_kernels
    from dflash_dist.trainer.batching import make_micro_batch

    if not torch.cuda.is_available():
        pytest.fail("pytest -m gpu needs a CUDA GPU")
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=1024, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=128, intermediate_size=2816, vocab_size=4096, target_layer_ids=(1, 5, 9),
                        num_target_layers=12, block_size=16, mask_token_id=4095,
                        layer_types=(SLIDING, SLIDING, FULL), sliding_window=128)  # fmt: skip
    d = DFlashDrafter(cfg, kernels=resolve_kernels("auto", True))
    d.set_target_weights(torch.randn(4096, 1024) * 0.02, torch.randn(4096, 1024) * 0.02)
    d = d.to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    samples = []
    for i, n in enumerate((300, 520, 180)):
        lm = torch.ones(n, dtype=torch.uint8)
        lm[: n // 4] = 0
        samples.append(Sample(key=f"s{i}", input_ids=torch.randint(0, 4000, (n,), generator=g, dtype=torch.int32),
                              loss_mask=lm, features=torch.randn(n, 3 * 1024, generator=g).bfloat16(),
                              target_argmax=torch.randint(0, 4000, (n,), generator=g, dtype=torch.int32)))  # fmt: skip
    kw = dict(dtype=torch.bfloat16, num_anchors=64, seed=0, epoch=0)

    def run(batch):
        b = batch.to("cuda")
        d.zero_grad(set_to_none=True)
        out = dflash_loss(d, b.input_ids, b.features, b.loss_mask, b.anchors, attention="flex",
                          loss_denominator=torch.ones((), device="cuda"))  # fmt: skip
        out.loss.backward()  # sum(w * CE) with a denominator of 1
        return float(out.loss.detach()), float(out.weight_sum), d.fc.weight.grad.float().clone()

    packed = make_micro_batch(samples, {}, pack_tokens=1024, **kw)
    assert packed.input_ids.shape == (1, 1024) and packed.anchors.starts is not None
    p_wce, p_w, p_grad = run(packed)
    alone = [run(make_micro_batch([s], {}, **kw)) for s in samples]
    a_wce, a_w = sum(x[0] for x in alone), sum(x[1] for x in alone)
    a_grad = sum(x[2] for x in alone)
    assert p_w == pytest.approx(a_w, rel=1e-6)  # the same supervised slots and weights
    assert p_wce == pytest.approx(a_wce, rel=2e-2)  # bf16 noise
    assert ((p_grad - a_grad).norm() / a_grad.norm()).item() < 5e-2


def test_packed_rows_take_few_anchor_shapes_and_flex_compiles_past_dynamos_default_limit():
    """A packed row's anchor slots (a flex_attention shape each) come from a small set, padded by
    under num_anchors or 25%, whatever the row holds; the compiled flex_attention accepts that many shapes
    (past dynamo's default of 8 it would run eagerly and materialise the scores: an OOM on the
    H200 at the mid config; past its own limit it raises)."""
    from dflash_dist.model import attention
    from dflash_dist.trainer.batching import anchor_slots, make_micro_batch

    shapes = set()
    for k in range(1, 64 * 128 + 1):
        n = anchor_slots(k, 128)
        assert n >= k and n % 128 == 0 and (n - k < 128 or (n - k) / k < 0.25)
        shapes.add(n)
    assert len(shapes) == 20
    d = small_drafter(block=BLOCK)
    kw = dict(dtype=torch.float32, num_anchors=2, seed=0, epoch=0, pack_tokens=9 * 24)
    rows = [make_micro_batch(_samples(d, [9] * c), {}, **kw) for c in range(1, 25)]
    for row in rows:
        k = int(row.anchors.keep.sum())
        assert row.anchors.positions.shape[1] == anchor_slots(k, 2)
    assert len({row.anchors.positions.shape[1] for row in rows}) < len({int(r.anchors.keep.sum()) for r in rows})
    # the compiled flex_attention's own limit, in every thread (tests/test_attention_compile.py)
    assert len(shapes) <= attention.FLEX_RECOMPILE_LIMIT
