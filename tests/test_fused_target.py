"""capture/fused_target.py's compile_kernel, the one torch.compile wrapper of the fused capture kernels
(capture.kernels=fused/fused2, kernel paths "fla_fused"/"fla_fused2"): a kernel never runs eagerly under the
fused path's name. Past its recompile limit plain torch.compile runs the call in eager without a
word (dynamo's RUN_ONLY fallback); these kernels raise instead. Tested on CPU through the production
entry points (`_compiled()`, `gpu_kernels()`), which build every compiled capture kernel."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list as cache_entries
from torch._dynamo.utils import counters

from dflash_dist import strict_compile
from dflash_dist.capture import fused_layers, fused_target


def _clear():
    for cached in (fused_target._compiled, fused_layers.gpu_kernels, fused_layers._compiled_rope):
        cached.cache_clear()
    torch._dynamo.reset()


@pytest.fixture()
def fresh_kernels():
    _clear()
    yield
    _clear()


def test_capture_kernel_past_its_recompile_limit_raises_instead_of_running_eagerly(fresh_kernels, monkeypatch):
    monkeypatch.setattr(fused_target, "RECOMPILE_LIMIT", 2, raising=False)
    per_region = "recompile_limit" in inspect.signature(torch.compile).parameters  # torch >= 2.13
    # older torch (the GPU image's 2.11): the kernels use dynamo's global limit, raised, never lowered
    with contextlib.nullcontext() if per_region else torch._dynamo.config.patch(recompile_limit=2):
        rms = fused_target._compiled()[0]  # the RMSNorm every fused target layer calls
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(16, generator=gen)
        xs = [torch.randn(*lead, 16, generator=gen) for lead in ((3,), (2, 3), (2, 2, 3))]  # ranks 2, 3, 4
        for x in xs[:2]:  # dynamic shapes: one graph per rank
            torch.testing.assert_close(rms(x, weight=w, eps=1e-6), fused_target._rms_norm(x, w, 1e-6))
        with pytest.raises(RuntimeError, match=r"capture kernel _rms_norm .* than its 2 compiles: .*RECOMPILE_LIMIT"):
            rms(xs[2], weight=w, eps=1e-6)
        # the shapes already compiled keep running their graphs
        torch.testing.assert_close(rms(xs[0], weight=w, eps=1e-6), fused_target._rms_norm(xs[0], w, 1e-6))


@pytest.mark.parametrize("per_region", [True, False], ids=["compile_limit", "thread_config"])
def test_capture_kernel_in_another_thread_compiles_to_its_limit_then_raises(fresh_kernels, monkeypatch, per_region):
    """Built in the main thread (as capture builds it), called in a thread whose dynamo limit is below the
    kernels' one (dynamo's default 8 in a fresh thread, where a live worker or a helper calls it; 1 here):
    each input up to RECOMPILE_LIMIT compiles, the next raises the named error. per_region False: the path
    of a torch.compile without recompile_limit=... (2.11, the GPU image's; per thread since 2.12), where
    the limit lives in dynamo's config: a thread below it is raised to it and tries again (the capture
    kernels stopped at the thread's limit before, as the drafter's did not)."""
    monkeypatch.setattr(fused_target, "RECOMPILE_LIMIT", 2)
    if not per_region:
        monkeypatch.setattr(strict_compile, "compile_takes_recompile_limit", lambda: False)
    elif not strict_compile.compile_takes_recompile_limit():
        pytest.skip("this torch's torch.compile takes no recompile_limit (before 2.13)")
    rms = fused_target._compiled()[0]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, generator=gen)
    xs = [torch.randn(*lead, 16, generator=gen) for lead in ((3,), (2, 3), (2, 2, 3))]  # ranks 2, 3, 4

    def other_thread():
        assert threading.current_thread() is not threading.main_thread()
        with torch._dynamo.config.patch(recompile_limit=1):
            for n, x in enumerate(xs[:2], 1):  # dynamic shapes: one graph per rank
                torch.testing.assert_close(rms(x, weight=w, eps=1e-6), fused_target._rms_norm(x, w, 1e-6))
                assert len(cache_entries(fused_target._rms_norm.__code__)) == n  # compiled, not eager
            past = r"capture kernel _rms_norm .* than its 2 compiles: .*RECOMPILE_LIMIT"
            with pytest.raises(RuntimeError, match=past):
                rms(xs[2], weight=w, eps=1e-6)
            torch.testing.assert_close(rms(xs[0], weight=w, eps=1e-6), fused_target._rms_norm(xs[0], w, 1e-6))
            assert len(cache_entries(fused_target._rms_norm.__code__)) == 2

    with ThreadPoolExecutor(1) as pool:
        pool.submit(other_thread).result()


def test_every_capture_kernel_goes_through_the_guard_and_compiles_whole_on_cpu(fresh_kernels):
    """fullgraph=True turns a graph break into an error too: each compiled kernel of both fused paths
    traces as one graph (on CPU here; the trace does not depend on the device) and equals its eager
    function."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    def guarded(k):
        return isinstance(k, functools.partial) and k.func is strict_compile._guarded

    rms, gated, silu_mul = fused_target._compiled()
    k = fused_layers.gpu_kernels()
    assert all(guarded(f) for f in (rms, gated, silu_mul, k.gating, k.gated_norm, k.add_norm, k.gate_out))
    assert guarded(fused_layers._compiled_rope(apply_rotary_pos_emb))

    gen = torch.Generator().manual_seed(1)
    b, t, h, d = 2, 5, 3, 8

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    x, z, w = r(b, t, h, d), r(b, t, h, d), r(d)
    torch.testing.assert_close(rms(x, weight=w, eps=1e-6), fused_target._rms_norm(x, w, 1e-6))
    torch.testing.assert_close(gated(x, z, weight=w, eps=1e-6), fused_target._gated_rms_norm(x, z, w, 1e-6))
    torch.testing.assert_close(silu_mul(x, z), fused_target._silu_mul(x, z))
    ba, a_log, dt = r(b, t, h), r(h), r(h)
    for got, want in zip(k.gating(ba, ba, a_log, dt), fused_layers._gating(ba, ba, a_log, dt), strict=True):
        torch.testing.assert_close(got, want)
    res, y, w2 = r(b, t, h * d), r(b, t, h * d), r(h * d)
    for got, want in zip(k.add_norm(res, y, w2, 1e-6), fused_layers._add_rms_norm(res, y, w2, 1e-6), strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(k.gate_out(x, z), fused_layers._gate_out(x, z))
    out_t = r(b, h, t, d).transpose(1, 2)  # SDPA's [B, H, T, d] output as attn_forward passes it, in place
    torch.testing.assert_close(k.gate_out(out_t, z), fused_layers._gate_out(out_t.contiguous(), z))
    cos, sin = r(b, t, d // 2), r(b, t, d // 2)  # partial RoPE over half the head
    args = (x, z, w, w, 1e-6, cos, sin)
    got = k.norm_rope(apply_rotary_pos_emb, *args)
    for g_, w_ in zip(got, fused_layers._norm_rope(apply_rotary_pos_emb, *args), strict=True):
        torch.testing.assert_close(g_, w_)


def test_silu_mul_is_one_graph_for_every_token_count_and_equals_eager(fresh_kernels):
    """SwiGLU's silu * up compiles with its width static and every other dimension dynamic (static_width): one
    graph serves every token count and batch size a capture, generation or verification forward brings (none of
    size 1 here, which specialises), each call equal to eager; a width it has not seen compiles again. The
    RMSNorm likewise, with plain-tensor weights too."""
    rms, _, silu_mul = fused_target._compiled()
    gen = torch.Generator().manual_seed(3)
    width = 24
    for b, t in ((2, 7), (2, 31), (3, 5), (4, 160)):
        g, u = (torch.randn(b, t, width, generator=gen).bfloat16() for _ in range(2))
        assert torch.equal(silu_mul(g, u), fused_target._silu_mul(g, u))
    assert len(cache_entries(fused_target._silu_mul.__code__)) == 1
    for n, w in enumerate((40, 56, 24), start=2):  # each new width its own static graph (none made dynamic)
        g, u = (torch.randn(2, 9, w, generator=gen).bfloat16() for _ in range(2))
        assert torch.equal(silu_mul(g, u), fused_target._silu_mul(g, u))
        assert len(cache_entries(fused_target._silu_mul.__code__)) == min(n, 3)  # 24 again: its first graph
    for t in (6, 11):
        rms(torch.randn(2, t, width, generator=gen), weight=torch.ones(width), eps=1e-6)
    rms(torch.randn(2, 6, 40, generator=gen), weight=torch.ones(40), eps=1e-6)
    assert len(cache_entries(fused_target._rms_norm.__code__)) == 2  # the norms too: one graph per width


def test_norms_compile_once_per_width_as_the_former_compile_did_through_their_parameter_weights(fresh_kernels):
    """Every capture norm (RMSNorm, gated RMSNorm, add + RMSNorm, q/k norm + RoPE) is compiled for its width, every
    other dimension dynamic: one graph per width whatever the token count and batch, with Parameter weights (the
    model's) and plain ones alike, each call equal to eager. The former dynamic=True compile made one graph per
    width too where the weight is an nn.Parameter, as every capture call site passes it: torch.compile specialises
    a Parameter's shape and the row's width with it, so the norms' graphs are the ones they were and kernel path
    "fla_fused2" stands; with a plain weight it made one graph of a dynamic width. (On the CPU either compile gives
    the same bits, so bits cannot tell them apart here: the graphs do.)"""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    rms, gated, _ = fused_target._compiled()
    k = fused_layers.gpu_kernels()
    former = [fused_target.compile_kernel(f) for f in (fused_target._rms_norm, fused_target._gated_rms_norm,
                                                       fused_layers._add_rms_norm)]  # fmt: skip
    gen = torch.Generator().manual_seed(5)

    def r(*shape):
        return torch.randn(*shape, generator=gen).bfloat16()

    def param(t):
        return nn.Parameter(t, requires_grad=False)

    def norms(rms_, gated_, add_norm, x, z, res, w):  # each call its own copies: a width-static compile marks them
        def weight():
            return w if isinstance(w, nn.Parameter) else w.clone()

        return [rms_(x.clone(), weight=weight(), eps=1e-6), gated_(x.clone(), z.clone(), weight=weight(), eps=1e-6),
                *add_norm(res.clone(), x.clone(), weight(), 1e-6)]  # fmt: skip

    def new_graphs(kernels, cases) -> int:  # graphs of a fresh start (dynamo caches per function, not per compile)
        torch._dynamo.reset()
        graphs = counters["stats"]["unique_graphs"]
        for x, z, res, w in cases:
            got = norms(*kernels, x, z, res, w)
            want = [fused_target._rms_norm(x, w, 1e-6), fused_target._gated_rms_norm(x, z, w, 1e-6),
                    *fused_layers._add_rms_norm(res, x, w, 1e-6)]  # fmt: skip
            for g_, w_ in zip(got, want, strict=True):
                torch.testing.assert_close(g_, w_)
        return counters["stats"]["unique_graphs"] - graphs

    shapes = ((2, 7), (2, 31), (3, 5), (4, 160))
    cases = [(r(b, t, w), r(b, t, w), r(b, t, w), r(w)) for b, t in shapes for w in (24, 40)]
    with_params = [(x, z, res, param(w)) for x, z, res, w in cases]
    assert new_graphs((rms, gated, k.add_norm), with_params) == 6  # 3 kernels x 2 widths, none made dynamic
    assert new_graphs(former, with_params) == 6  # the former compile: the Parameter fixed each width
    assert new_graphs((rms, gated, k.add_norm), cases) == 6  # plain weights: still one graph per width
    assert new_graphs(former, cases) == 3  # where the width came from the weight alone: one dynamic graph

    rope_cases = [(r(b, t, 3, 16), r(b, t, 2, 16), param(r(16)), param(r(16)), 1e-6, r(b, t, 8), r(b, t, 8))
                  for b, t in shapes]  # fmt: skip
    graphs = counters["stats"]["unique_graphs"]
    for args in rope_cases:
        k.norm_rope(apply_rotary_pos_emb, *args)
    assert counters["stats"]["unique_graphs"] == graphs + 1  # one graph (a partial: no code entry to count)
    b, t = shapes[0]  # RoPE's width (cos/sin's last dimension) is static too: another rotary width, another graph
    k.norm_rope(apply_rotary_pos_emb, r(b, t, 3, 16), r(b, t, 2, 16), param(r(16)), param(r(16)), 1e-6,
                r(b, t, 4), r(b, t, 4))  # fmt: skip
    assert counters["stats"]["unique_graphs"] == graphs + 2
    # against eager in fp32: the CPU backend drops bf16 roundings inside a fused kernel (compile_kernel's
    # docstring), which RoPE's sums of products then show; CUDA keeps them (test_fused_layers' bf16 features)
    for args in rope_cases:
        args = tuple(a.float() if isinstance(a, torch.Tensor) else a for a in args)
        got, want = k.norm_rope(apply_rotary_pos_emb, *args), fused_layers._norm_rope(apply_rotary_pos_emb, *args)
        for g_, w_ in zip(got, want, strict=True):
            torch.testing.assert_close(g_, w_)


def test_static_last_dim_needs_dynamic_none():
    with pytest.raises(ValueError, match="static_last_dim marks the dynamic dimensions itself"):
        strict_compile.strict_compile(fused_target._silu_mul, limit=1, past_limit="", disabled="",
                                      static_last_dim=True, dynamic=True)  # fmt: skip


def test_disabled_compile_is_refused_before_any_capture(fresh_kernels, monkeypatch):
    """TORCHDYNAMO_DISABLE=1 makes torch.compile return the function itself (eager kernels under the
    "fla_fused" name); TORCH_COMPILE_DISABLE=1 (dynamo's `disable`) skips every frame."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    with pytest.raises(ValueError, match="torch.compile is disabled .* capture.kernels=eager"):
        fused_target.compile_kernel(fused_target._silu_mul)
    monkeypatch.delenv("TORCHDYNAMO_DISABLE")
    with torch._dynamo.config.patch(disable=True), pytest.raises(ValueError, match="torch.compile is disabled"):
        fused_target._compiled()
