"""The fast kernel sets (model/fused.py) compute the torch reference's loss and gradients: the
compiled set on CPU (fp32), liger on CUDA (bf16, marked gpu); the default stays the torch path;
the loss's finite check stays on the device."""

from __future__ import annotations

import functools

import pytest
import torch

from dflash_dist.model import fused
from dflash_dist.model.drafter import DFlashDrafter
from dflash_dist.model.loss import Anchors, dflash_loss
from dflash_dist.model.vocab_loss import lm_head_cross_entropy
from tests.helpers.drafter import small_drafter


def _batch(d: DFlashDrafter, seed: int = 7, s: int = 24, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, d.config.vocab_size - 2, (2, s), generator=g)
    feats = torch.randn(2, s, d.config.num_context_layers * d.config.hidden_size, generator=g)
    lm = torch.ones(2, s)
    lm[1, :5] = 0
    anchors = Anchors(torch.tensor([[2, 9, 17], [6, 12, 0]]), torch.tensor([[True, True, True], [True, True, False]]))
    to = lambda t: t.to(device)  # noqa: E731
    return to(ids), to(feats), to(lm), Anchors(to(anchors.positions), to(anchors.keep))


def _loss_and_grads(d: DFlashDrafter, batch, on_graph=None, **kw):
    """Loss output and every trainable gradient; `on_graph(loss.grad_fn)` runs before the backward."""
    d.zero_grad(set_to_none=True)
    out = dflash_loss(d, *batch, gamma=3.0, **kw)
    if on_graph is not None:
        on_graph(out.loss.grad_fn)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in d.named_parameters() if p.requires_grad}
    return out, grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def test_default_is_the_torch_reference_path():
    d = small_drafter()
    assert d.kernels == "torch"
    assert all(m.fast is None for m in d.modules() if hasattr(m, "fast"))
    with pytest.raises(ValueError, match="kernels="):
        d.set_kernels("triton")


def test_compiled_kernels_match_torch_on_cpu():
    """Same weights, same batch: loss, accuracy and every trainable gradient of the compiled path
    agree with the reference to fp32 rounding; switching back restores the reference exactly."""
    d = small_drafter(block=4)
    batch = _batch(d)
    ref, ref_g = _loss_and_grads(d, batch)
    d.set_kernels("compile")
    assert all(m.fast is not None for m in d.modules() if type(m).__name__ == "RMSNorm")
    out, g = _loss_and_grads(d, batch)
    assert abs(float(out.loss.detach()) - float(ref.loss.detach())) <= 1e-5 * abs(float(ref.loss.detach()))
    assert torch.equal(out.slot_count, ref.slot_count) and out.num_blocks == ref.num_blocks
    assert float(out.accuracy) == pytest.approx(float(ref.accuracy))
    worst = max(_rel(g[n], ref_g[n]) for n in ref_g)
    assert worst < 1e-4, worst
    d.set_kernels("torch")
    again, again_g = _loss_and_grads(d, batch)
    assert torch.equal(again.loss, ref.loss) and all(torch.equal(again_g[n], ref_g[n]) for n in ref_g)


def test_compiled_chunk_ce_matches_reference():
    """The fused per-chunk CE (compile) gives the reference CE, argmax and dL/dh, over several
    chunks including a short last one."""
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16) * 0.5
    y = torch.randint(0, 50, (37,))
    rw = torch.rand(37) / 37
    loss_ref, ce_ref, am_ref = lm_head_cross_entropy(h, w, y, rw, chunk_rows=10)
    (g_ref,) = torch.autograd.grad(loss_ref, h)
    loss, ce, am = lm_head_cross_entropy(h, w, y, rw, chunk_rows=10, kernels="compile")
    (g,) = torch.autograd.grad(loss, h)
    assert torch.allclose(loss, loss_ref, rtol=1e-5) and torch.allclose(ce, ce_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(am, am_ref)
    assert _rel(g, g_ref) < 1e-5


def test_non_finite_loss_is_flagged_on_device_not_raised():
    """No host sync per micro-batch: a NaN feature gives finite=False in the output."""
    d = small_drafter()
    ids, feats, lm, anchors = _batch(d)
    out = dflash_loss(d, ids, feats, lm, anchors)
    assert out.finite.device == out.loss.device and bool(out.finite)
    feats[0, 1] = float("nan")
    out = dflash_loss(d, ids, feats, lm, anchors)
    assert not bool(out.finite) and not torch.isfinite(out.loss)
    out = dflash_loss(d, ids, torch.randn_like(feats), torch.zeros_like(lm), anchors)  # nothing supervised
    assert bool(out.finite)


def _gpu_drafter(dtype):
    from dflash_dist.model.config import DrafterConfig

    torch.manual_seed(0)
    cfg = DrafterConfig(
        hidden_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=8192,
        target_layer_ids=(1, 3, 5),
        num_target_layers=8,
        block_size=16,
        mask_token_id=8191,
    )
    with torch.device("cuda"):
        d = DFlashDrafter(cfg)
        d.set_target_weights(torch.randn(8192, 512), torch.randn(8192, 512) * 512**-0.5)
    return d.to(dtype)


def _gpu_batch():
    """Two CUDA sequences of 512 tokens for _gpu_drafter: ids, bf16 features, loss mask, 64 anchors."""
    s = 512
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 8000, (2, s), device="cuda", generator=g)
    feats = torch.randn(2, s, 3 * 512, device="cuda", generator=g).bfloat16()
    lm = torch.ones(2, s, device="cuda")
    pos = torch.sort(torch.randperm(s - 1, generator=torch.Generator().manual_seed(2))[:64]).values
    anchors = Anchors(torch.stack([pos, pos]).cuda(), torch.ones(2, 64, dtype=torch.bool, device="cuda"))
    return ids, feats, lm, anchors


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["liger", "compile"])
def test_gpu_fast_kernels_match_torch_in_bf16(kernels):
    """bf16 on CUDA, flex_attention: the liger / compiled sets against the torch reference on the
    same weights and batch: loss to 1e-2 relative, gradients to bf16 noise (a few 1e-2)."""
    d = _gpu_drafter(torch.bfloat16)
    batch = _gpu_batch()
    ref, ref_g = _loss_and_grads(d, batch)
    d.set_kernels(kernels)
    out, gr = _loss_and_grads(d, batch)
    assert torch.isfinite(out.loss)
    assert abs(float(out.loss.detach()) - float(ref.loss.detach())) <= 1e-2 * abs(float(ref.loss.detach()))
    worst = max(_rel(gr[n], ref_g[n]) for n in ref_g)
    assert worst < 5e-2, worst


@pytest.mark.gpu
def test_gpu_liger_chunk_ce_matches_reference():
    """liger's CE kernel per chunk: CE and dL/dh of the torch chunked path, argmax equal where the
    top logit is not tied within bf16."""
    torch.manual_seed(0)
    h = torch.randn(700, 256, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(9000, 256, device="cuda") * 256**-0.5).bfloat16()
    y = torch.randint(0, 9000, (700,), device="cuda")
    rw = torch.rand(700, device="cuda") / 700
    loss_ref, ce_ref, am_ref = lm_head_cross_entropy(h, w, y, rw, chunk_rows=300)
    (g_ref,) = torch.autograd.grad(loss_ref, h)
    loss, ce, am = lm_head_cross_entropy(h, w, y, rw, chunk_rows=300, kernels="liger")
    (g,) = torch.autograd.grad(loss, h)
    assert _rel(ce, ce_ref) < 1e-4 and abs(float(loss) - float(loss_ref)) < 1e-4 * abs(float(loss_ref))
    assert float((am == am_ref).float().mean()) > 0.99
    assert _rel(g, g_ref) < 2e-2
    assert fused.ce_logits_bytes("liger") == 2


def test_auto_kernels_resolve_to_torch_on_cpu():
    """train.kernels "auto" keeps the reference on CPU (the pinned loss curve's path)."""
    assert fused.resolve_kernels("auto", on_gpu=False) == "torch"
    assert fused.resolve_kernels("compile", on_gpu=False) == "compile"
    with pytest.raises(ValueError, match="kernels="):
        fused.resolve_kernels("cuda", on_gpu=True)


def test_liger_without_liger_kernel_fails_at_construction():
    """On a machine without liger-kernel (the CPU test machine) the choice fails when made, naming
    the package and the alternatives, instead of at the first forward."""
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("liger-kernel is installed here")
    with pytest.raises(ImportError, match="liger-kernel"):
        small_drafter().set_kernels("liger")


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["torch", "liger", "compile"])
def test_gpu_ce_of_the_gradient_pass_equals_a_no_grad_pass(kernels):
    """D-PACE's weights come from the CE of the pass that forms the gradient (vocab_loss.py); the
    former form took them from a no-grad pass. Where the two CEs are equal, one pass gives bitwise
    the former loss and gradient; this tells, on the GPU, for which kernel sets that holds."""
    torch.manual_seed(0)
    h = torch.randn(700, 256, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(9000, 256, device="cuda") * 256**-0.5).bfloat16()
    y = torch.randint(0, 9000, (700,), device="cuda")
    with torch.no_grad():
        _, ce_no_grad, _ = lm_head_cross_entropy(h, w, y, torch.zeros(700, device="cuda"), 300, kernels)
    _, ce, _ = lm_head_cross_entropy(h, w, y, lambda c: torch.exp(-c) / 700, 300, kernels)
    assert torch.equal(ce, ce_no_grad), (ce - ce_no_grad).abs().max()


@pytest.fixture
def restore_switches():
    yield
    fused.set_rope_layout("bthd")
    fused.set_rms_norm_in_place(True)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's state as in a fresh process, before and after: the compiled tests below compare two
    compiles bitwise, and what earlier tests of the process compiled decides a function's next graph
    (each input's sizes seen so far: a static or a dynamic graph, which differ in the last bits; its
    compiles so far, counted toward the recompile limit) and would reach later tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _is_heads(g: torch.Tensor | None) -> bool:
    return g is not None and g.dim() == 4


def _compiled_heads_grads(root, contiguous: list[bool]) -> None:
    """Hook every compiled function's backward in the autograd graph under `root`: append whether
    each [b, T, heads, d] gradient it hands out is contiguous. In the drafter those are the q/k
    heads' gradients out of the compile set's norm + RoPE graph (its other compiled functions take
    [b, T, hidden] or [rows, V]): strided when RoPE runs after the transpose, as the eager forms."""
    seen, todo = set(), [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() == "CompiledFunctionBackward":
            node.register_hook(lambda g_in, _: contiguous.extend(g.is_contiguous() for g in g_in if _is_heads(g)))
        todo.extend(n for n, _ in node.next_functions)


def _differences(runs: dict, base) -> str:
    """Where each run differs from runs[base]: the loss's difference and the gradient furthest off (relative)."""
    out_b, g_b = runs[base]
    lines = []
    for key, (out, g) in runs.items():
        worst = max(g_b, key=lambda n: _rel(g[n], g_b[n]))
        lines.append(f"{key}: loss {float(out.loss) - float(out_b.loss):+.3e}, grads differing "
                     f"{sum(not torch.equal(g[n], g_b[n]) for n in g_b)}/{len(g_b)}, worst {worst} "
                     f"rel {_rel(g[worst], g_b[worst]):.3e}")  # fmt: skip
    return "; ".join(lines)


def _same(a, b) -> bool:
    (out_a, g_a), (out_b, g_b) = a, b
    return torch.equal(out_a.loss, out_b.loss) and all(torch.equal(g_a[n], g_b[n]) for n in g_a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_set_rope_layouts_are_bitwise_equal(dtype, restore_switches, fresh_dynamo):
    """The compile set's q/k RoPE on [b, T, heads, d] (default) gives bitwise the loss and every
    gradient of RoPE after the transpose (its form before issue 24), with either k/v projection,
    each graph compiled alike: from a reset, called until q's and k's shapes made it dynamic (the
    fp32 norm-weight gradient of a static and a dynamic kernel differ in the last bit). The switch
    reached the compiled graph: q's and k's gradients out of it (each layer) are strided after the
    transpose (bhtd), contiguous before it (bthd)."""
    assert fused._switch["rope_layout"] == "bthd"
    with pytest.raises(ValueError, match="rope layout"):
        fused.set_rope_layout("bshd")
    d = small_drafter(block=4).train().to(dtype)
    d.set_kernels("compile")
    d.set_row_cuts(False, False)  # the layouts alone (the cuts' own tests: test_row_cuts, test_fused_add_norm):
    d.set_fused_add_norm(False)  # fewer shapes to compile
    ids, feats, lm, anchors = _batch(d)
    batch = (ids, feats.to(dtype), lm, anchors)
    for split in (False, True):
        d.set_split_kv(split)
        runs = {}
        for layout in ("bhtd", "bthd"):
            fused.set_rope_layout(layout)
            _loss_and_grads(d, batch)
            contiguous: list[bool] = []
            runs[layout] = _loss_and_grads(
                d, batch, on_graph=functools.partial(_compiled_heads_grads, contiguous=contiguous)
            )
            assert contiguous == [layout == "bthd"] * (2 * d.config.num_hidden_layers), (layout, contiguous)
        assert _same(runs["bhtd"], runs["bthd"])


def test_new_rope_layout_hands_the_norm_a_contiguous_gradient(restore_switches, fresh_dynamo):
    """RoPE before the transpose: the gradient into the q/k norm is contiguous (liger's backward
    copies a strided one); after it (the former order) it is the transposed, strided one. The
    compile set's own function through set_rope_layout: each layout runs its own compiled graph
    (dynamo's cache holds the bhtd function's code only until bthd is chosen), and the gradient it
    hands q's heads (its norm is inside the graph) is strided after the switch to bhtd, contiguous
    with bthd, with the same values and output strides. (liger's set needs CUDA: pytest -m gpu.)"""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as cache_entries

    y = torch.randn(2, 12, 4, 8, requires_grad=True)  # the q/k norm's output [b, T, heads, d]
    ang = torch.randn(2, 12, 8)
    cos, sin = ang.cos(), ang.sin()
    new = fused.rope_ref(y, cos, sin).transpose(1, 2)
    old = fused.rope_bhtd_ref(y.transpose(1, 2), cos, sin)
    assert torch.equal(new, old) and new.stride() == old.stride()
    g = torch.randn(2, 12, 4, 8).transpose(1, 2)  # the attention's grad_q: in q's memory order
    (g_new,) = torch.autograd.grad(new, y, g)
    (g_old,) = torch.autograd.grad(old, y, g)
    assert torch.equal(g_new, g_old)
    assert g_new.is_contiguous() and not g_old.is_contiguous()

    x = torch.randn(2, 12, 4, 8, requires_grad=True)  # q's heads, the projection's view
    weight = torch.rand(8) + 0.5
    norm_rope = fused.norm_rope_fn("compile")
    compiled, outs, grads = {}, {}, {}
    for layout in ("bhtd", "bthd"):
        fused.set_rope_layout(layout)
        outs[layout] = norm_rope(x, weight, 1e-6, cos, sin)
        (grads[layout],) = torch.autograd.grad(outs[layout], x, g)
        compiled[layout] = [len(cache_entries(f.__code__)) > 0 for f in (fused.norm_rope_bhtd_ref, fused.norm_rope_ref)]
    assert compiled == {"bhtd": [True, False], "bthd": [True, True]}
    assert not grads["bhtd"].is_contiguous() and grads["bthd"].is_contiguous()
    assert outs["bhtd"].stride() == outs["bthd"].stride() == new.stride()
    torch.testing.assert_close(outs["bthd"], outs["bhtd"], rtol=0, atol=0)
    torch.testing.assert_close(grads["bthd"], grads["bhtd"], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["liger", "compile"])
def test_gpu_rope_layout_and_in_place_norm_are_bitwise(kernels, restore_switches, fresh_dynamo):
    """bf16 on CUDA, flex_attention, the real kernels: RoPE on [b, T, heads, d] and liger's in-place
    RMSNorm backward give bitwise the loss and gradients of the former forms (under compile the in-place
    switch bitwise, the layouts within bf16 rounding: see below); for liger the
    defaults drop the zeros_like of every plain norm's backward (LigerRMSNormFunction; the fused add + norm's
    backward allocates with empty_like in either form, so the count is the plain norms' backwards the step
    runs, not 4 per layer + 2 as before the add-norm default) and its dY copies. From a fresh
    dynamo state (fresh_dynamo): each layout's function compiles alike, static for q's shape, then
    dynamic for k's, whatever the process compiled before (the default layout's function in the
    earlier compile tests, the other's not)."""
    d = _gpu_drafter(torch.bfloat16)
    d.set_kernels(kernels)
    batch = _gpu_batch()
    runs, ops = {}, {}
    for layout, in_place in (("bhtd", False), ("bthd", False), ("bhtd", True), ("bthd", True)):
        fused.set_rope_layout(layout)
        fused.set_rms_norm_in_place(in_place)
        _loss_and_grads(d, batch)  # compiles (q's shape, then k's: dynamic)
        _loss_and_grads(d, batch)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            runs[layout, in_place] = _loss_and_grads(d, batch)
        names = [e.key for e in prof.key_averages()]
        count = {k: sum(e.count for e in prof.key_averages() if e.key == k) for k in names}
        ops[layout, in_place] = (count.get("aten::zeros_like", 0), count.get("aten::clone", 0),
                                 count.get("LigerRMSNormFunctionBackward", 0))
    if kernels == "liger":
        assert all(_same(runs["bhtd", False], r) for r in runs.values()), _differences(runs, ("bhtd", False))
    else:  # inductor on CUDA compiles each layout's norm + RoPE as its own graph and may tile its RMSNorm
        # reduction otherwise, so the q/k norm's bf16 output and everything after it may round otherwise
        # (H200, 2026-12-06: only q_proj.weight differed, rel 1.13e-05; H100, 2026-12-07: loss +1.14e-05 of 9.57,
        # every gradient, worst rel 3.9e-03 at a layer's input norm); bitwise on the CPU
        # (test_compiled_set_rope_layouts_are_bitwise_equal), which also checks the layouts' strides. A RoPE
        # on the wrong axis or positions moves q/k's gradients by O(1). The in-place switch is liger's only: the
        # compile set runs the same graphs with it on or off, bitwise
        where = _differences(runs, ("bhtd", False))
        for layout in ("bhtd", "bthd"):
            assert _same(runs[layout, False], runs[layout, True]), (layout, _differences(runs, (layout, False)))
        (base_out, base_g), (out, g) = runs["bhtd", False], runs["bthd", False]
        assert abs(float(out.loss) - float(base_out.loss)) <= 1e-5 * abs(float(base_out.loss)), where
        for n in base_g:
            assert _rel(g[n], base_g[n]) < 2e-2, (n, where)
    if kernels == "liger":
        layers = d.config.num_hidden_layers
        norms = ops["bthd", True][2]
        assert norms >= 2 * layers, ops  # at least q_norm and k_norm a layer
        for layout in ("bhtd", "bthd"):  # the in-place switch alone drops one zeros_like a plain norm's backward
            assert ops[layout, False][0] - ops[layout, True][0] == norms, (layout, ops)
        assert ops["bhtd", False][1] - ops["bthd", True][1] >= 2 * layers, ops  # the dY copies: layout and switch
