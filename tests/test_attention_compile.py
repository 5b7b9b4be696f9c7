"""attention._compiled_flex, the drafter's compiled flex_attention (CUDA's path in `attend`): it never runs
eagerly. Past its recompile limit plain torch.compile runs the call in eager with only a logged warning, and
eager flex materialises the [Q, K] scores (98 GiB for a packed 27B row). Dynamo's config is per thread since
torch 2.12, so a limit raised in the thread that built the compile did not hold in the evaluator's or a
helper thread. Tested on CPU (compiled flex runs there too) in a thread other than the builder's."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch.nn.attention.flex_attention import flex_attention

from dflash_dist import strict_compile
from dflash_dist.model import attention


@pytest.fixture()
def fresh_flex():
    attention._compiled_flex.cache_clear()
    torch._dynamo.reset()
    yield
    attention._compiled_flex.cache_clear()
    torch._dynamo.reset()


def _ran(out: torch.Tensor, args) -> None:
    """The compiled call answered (its graph ran; the cache-entry counts below say it was compiled). Not
    compared with eager flex: on a 2-core AMD EPYC host with AVX2 (2026-12-06, torch 2.13.0 CPU) inductor's
    CPU flex_attention gave wrong rows at 24 keys (context 16: off by up to 1.04 against eager flex and SDPA
    with the same mask, right at 20 and 28 keys), and non-finite rows on CI's host (2026-12-06). The
    product never compiles flex on a CPU (`attend` runs eager flex there); the CUDA kernels' numerics are
    gpu tests."""
    assert out.shape == args[0].shape and torch.isfinite(out).all()


def _inputs(context_len: int):
    """One flex_attention call of the training mask; each context length is a new compiled shape."""
    gen = torch.Generator().manual_seed(context_len)
    anchors, keep, blk = torch.tensor([[3, context_len - 2]]), torch.tensor([[True, True]]), 4
    mask = attention.block_mask_flex(anchors, keep, context_len, blk)
    q = torch.randn(1, 2, 2 * blk, 16, generator=gen)
    k, v = (torch.randn(1, 1, context_len + 2 * blk, 16, generator=gen) for _ in range(2))
    return (q, k, v), dict(block_mask=mask, scale=0.25, enable_gqa=True, kernel_options=None)


@pytest.mark.parametrize("per_region", [True, False], ids=["compile_limit", "thread_config"])
def test_compiled_flex_in_another_thread_stays_compiled_to_its_limit_then_raises(fresh_flex, monkeypatch, per_region):
    """Built in the main thread (as the trainer builds it), called in a thread whose dynamo limit is below
    the flex one (dynamo's default 8 in a fresh thread; 1 here): each shape up to FLEX_RECOMPILE_LIMIT (2 here)
    compiles, the next raises the named error instead of running eager flex. per_region False: the path of a
    torch.compile without recompile_limit=... (2.11, maybe 2.12), where the limit lives in dynamo's config."""
    monkeypatch.setattr(attention, "FLEX_RECOMPILE_LIMIT", 2)  # one compile past the thread's limit
    if not per_region:
        monkeypatch.setattr(strict_compile, "compile_takes_recompile_limit", lambda: False)
    elif not strict_compile.compile_takes_recompile_limit():
        pytest.skip("this torch's torch.compile takes no recompile_limit (before 2.13)")
    flex = attention._compiled_flex()
    # 20 and 28 keys run; 24 keys (context 16) only reaches the limit's refusal and never runs its graph: inductor's
    # CPU flex at 24 keys gave wrong rows here and non-finite ones on CI's host (2026-12-06, see _ran)
    calls = [_inputs(s) for s in (12, 20, 16)]

    def other_thread():
        assert threading.current_thread() is not threading.main_thread()
        with torch._dynamo.config.patch(recompile_limit=1):
            for n, (args, kwargs) in enumerate(calls[:2], 1):
                _ran(flex(*args, **kwargs), args)
                assert len(_debug_get_cache_entry_list(flex_attention.__code__)) == n  # compiled, not eager
            args, kwargs = calls[2]
            with pytest.raises(
                RuntimeError,
                match=r"compiled flex_attention .* than its 2 compiles: .*"
                r"materialising the full \[Q, K\] scores.*FLEX_RECOMPILE_LIMIT",
            ):
                flex(*args, **kwargs)
            # the shapes already compiled keep running their graphs
            args, kwargs = calls[0]
            _ran(flex(*args, **kwargs), args)
            assert len(_debug_get_cache_entry_list(flex_attention.__code__)) == 2

    with ThreadPoolExecutor(1) as pool:
        pool.submit(other_thread).result()


def test_disabled_compile_is_refused_instead_of_eager_flex(fresh_flex, monkeypatch):
    """TORCHDYNAMO_DISABLE=1 makes torch.compile return flex_attention itself; TORCH_COMPILE_DISABLE=1
    (dynamo's `disable`) skips every frame: eager flex either way."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    with pytest.raises(ValueError, match=r"torch.compile is disabled .* train.attention=dense"):
        attention._compiled_flex()
    monkeypatch.delenv("TORCHDYNAMO_DISABLE")
    with torch._dynamo.config.patch(disable=True), pytest.raises(ValueError, match="torch.compile is disabled"):
        attention._compiled_flex()
