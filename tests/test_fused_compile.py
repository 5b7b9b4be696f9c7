"""fused._compiled, the torch.compile regions of the compile kernel set (train.kernels=compile) and of
liger's RoPE: a call never runs eagerly. Past dynamo's recompile limit (8 per function) plain torch.compile
runs the call in eager with one logged warning: no fused kernel, and other numerics than the compiled
calls. The drafter's RMSNorm needs more compiles than that in one process (each requires_grad state,
dtype, batch of one row, each dim made dynamic in turn); each region has its own limit and raises a named
error past it. Tested on CPU (inductor compiles there too)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list as cache_entries

from dflash_dist import strict_compile
from dflash_dist.model import fused
from dflash_dist.model.drafter import DrafterAttention, RMSNorm
from dflash_dist.model.loss import Anchors, dflash_loss
from tests.helpers.drafter import small_drafter


def _clear():
    fused._compiled.cache_clear()
    torch._dynamo.reset()


@pytest.fixture()
def fresh_compile():
    _clear()
    yield
    _clear()


def _micro_batch(d, rows: int, length: int, anchors: int, dtype):
    g = torch.Generator().manual_seed(rows * 1000 + length)
    ids = torch.randint(0, d.config.vocab_size - 2, (rows, length), generator=g)
    feats = torch.randn(rows, length, d.config.num_context_layers * d.config.hidden_size, generator=g)
    pos = torch.stack([torch.sort(torch.randperm(length - 2, generator=g)[:anchors]).values for _ in range(rows)])
    keep = torch.ones(rows, anchors, dtype=torch.bool)
    keep[-1, -1] = False
    return ids, feats.to(dtype), torch.ones(rows, length), Anchors(pos, keep)


def _norm_calls(micro_batches) -> list[tuple]:
    """(x, weight, eps) of every call of the compile set's RMSNorm in the drafter's training forwards
    (grad on) over `micro_batches` ((dtype, rows, length, anchors) each), recorded through RMSNorm.fast
    running the reference: the context features' norm gets an input that needs no grad, the layers' and
    the final one an input that does (the q/k norms run in the norm + RoPE function, as in the set)."""
    calls = []

    def record(x, weight, eps):
        calls.append((x.detach().requires_grad_(x.requires_grad), weight, eps))
        return fused.rms_norm_ref(x, weight, eps)

    for dtype in dict.fromkeys(mb[0] for mb in micro_batches):
        d = small_drafter(block=4).train().to(dtype)
        d.set_row_cuts(True, True)  # as the compile set runs (drafter.row_cuts_default): [b, N+1, H] and [R, H] norms
        for m in d.modules():
            if isinstance(m, RMSNorm):
                m.fast = record
            elif isinstance(m, DrafterAttention):
                m.norm_rope = fused.norm_rope_ref
        for mb_dtype, rows, length, anchors in micro_batches:
            if mb_dtype == dtype:
                dflash_loss(d, *_micro_batch(d, rows, length, anchors, dtype), gamma=3.0)
    return calls


# micro-batches of 1-4 rows (a token budget's last one holds few) and varying lengths, bf16 as on the
# GPU, then fp32 in the same process (a bench, the GPU test session); the packed rows' one row of a fixed
# length with a varying anchor count among them
TRAINING = [
    (dtype, rows, length, anchors)
    for dtype in (torch.bfloat16, torch.float32)
    for rows, length, anchors in ((2, 40, 3), (2, 52, 4), (4, 30, 3), (1, 64, 2), (3, 20, 3), (1, 64, 5), (2, 45, 3))
]


def test_drafter_norm_stays_compiled_past_dynamos_default_limit(fresh_compile):
    """The compiled RMSNorm through the inputs the drafter hands it in training: every call runs a
    compiled graph (its output's grad_fn is the compiled function's), while the stream takes more
    compiles than dynamo's default limit (measured: 8 over the bf16 micro-batches, 13 with the fp32 ones, 7 and 11
    without the drafter's row cuts; the norm + RoPE function 4 and 6), past which plain torch.compile ran the
    calls eagerly."""
    calls = _norm_calls(TRAINING)
    norm = fused.rms_norm_fn("compile")
    eager = []
    for i, (x, weight, eps) in enumerate(calls):
        out = norm(x, weight, eps)
        if out.grad_fn is None or out.grad_fn.name() != "CompiledFunctionBackward":
            eager.append((i, tuple(x.shape), x.dtype, x.requires_grad, out.grad_fn))
        torch.testing.assert_close(out, fused.rms_norm_ref(x, weight, eps))
    compiles = len(cache_entries(fused.rms_norm_ref.__code__))
    assert not eager, f"{len(eager)} of {len(calls)} calls ran eagerly after {compiles} compiles: {eager[:3]}"
    # past dynamo's default limit (8; on torch 2.11 the config now holds the kernels' own, raised by _compiled)
    assert 8 < compiles <= fused.KERNEL_RECOMPILE_LIMIT, compiles


def _distinct_inputs(n: int):
    """n norm inputs of which each needs its own compile: a new rank each (dynamic shapes cannot share
    one graph across ranks)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*(2,) * r, 16, generator=gen) for r in range(1, n + 1)]


@pytest.mark.parametrize("per_region", [True, False], ids=["compile_limit", "thread_config"])
def test_compiled_kernel_past_its_limit_raises_instead_of_running_eagerly(fresh_compile, monkeypatch, per_region):
    """In a thread whose dynamo limit is below the kernels' one (dynamo's default 8 in a fresh thread; 1
    here): each input up to KERNEL_RECOMPILE_LIMIT compiles, the next raises the named error instead of
    running eagerly, and the inputs compiled before keep running their graphs. per_region False: the path
    of a torch.compile without recompile_limit=... (2.11, the GPU image's), where the limit is dynamo's
    config."""
    monkeypatch.setattr(fused, "KERNEL_RECOMPILE_LIMIT", 2)
    if not per_region:
        monkeypatch.setattr(strict_compile, "compile_takes_recompile_limit", lambda: False)
    elif not strict_compile.compile_takes_recompile_limit():
        pytest.skip("this torch's torch.compile takes no recompile_limit (before 2.13)")
    norm = fused.rms_norm_fn("compile")
    w = torch.rand(16) + 0.5
    xs = _distinct_inputs(3)

    def other_thread():
        assert threading.current_thread() is not threading.main_thread()
        with torch._dynamo.config.patch(recompile_limit=1):
            for n, x in enumerate(xs[:2], 1):
                torch.testing.assert_close(norm(x, w, 1e-6), fused.rms_norm_ref(x, w, 1e-6))
                assert len(cache_entries(fused.rms_norm_ref.__code__)) == n  # compiled, not eager
            with pytest.raises(
                RuntimeError, match=r"compiled rms_norm_ref .* than its 2 compiles: .*KERNEL_RECOMPILE_LIMIT"
            ):
                norm(xs[2], w, 1e-6)
            torch.testing.assert_close(norm(xs[0], w, 1e-6), fused.rms_norm_ref(xs[0], w, 1e-6))
            assert len(cache_entries(fused.rms_norm_ref.__code__)) == 2

    with ThreadPoolExecutor(1) as pool:
        pool.submit(other_thread).result()


def test_every_compiled_kernel_is_guarded_and_traces_whole(fresh_compile):
    """fullgraph=True (what makes dynamo raise at the limit) turns a graph break into an error too: each
    compiled function of both sets (compile; liger's RoPE) traces as one graph and equals its reference."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 4, 8, generator=gen)
    w = torch.rand(8, generator=gen) + 0.5
    ang = torch.randn(2, 6, 8, generator=gen)
    cos, sin = ang.cos(), ang.sin()
    logits, labels = torch.randn(5, 11, generator=gen), torch.randint(0, 11, (5,), generator=gen)
    cases = [
        (fused.rms_norm_ref, (x, w, 1e-6)),
        (fused.swiglu_ref, (x, x.flip(0))),
        (fused.norm_rope_ref, (x, w, 1e-6, cos, sin)),
        (fused.norm_rope_bhtd_ref, (x, w, 1e-6, cos, sin)),
        (fused.rope_ref, (x, cos, sin)),
        (fused.rope_bhtd_ref, (x.transpose(1, 2), cos, sin)),
        (fused.ce_chunk_ref, (logits, labels, True)),
    ]
    for fn, args in cases:
        compiled = fused._compiled(fn)
        assert compiled.func is strict_compile._guarded, fn.__name__
        torch.testing.assert_close(compiled(*args), fn(*args))
        assert len(cache_entries(fn.__code__)) == 1, fn.__name__


def test_disabled_compile_is_refused_instead_of_running_the_reference_eagerly(fresh_compile, monkeypatch):
    """TORCHDYNAMO_DISABLE=1 makes torch.compile return the function itself; TORCH_COMPILE_DISABLE=1
    (dynamo's `disable`) skips every frame: the compile set would run the torch reference under its
    name. Refused when the set is chosen."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    with pytest.raises(ValueError, match=r"torch.compile is disabled .* train.kernels=torch"):
        small_drafter().set_kernels("compile")
    monkeypatch.delenv("TORCHDYNAMO_DISABLE")
    _clear()
    with torch._dynamo.config.patch(disable=True), pytest.raises(ValueError, match="torch.compile is disabled"):
        fused.rms_norm_fn("compile")
