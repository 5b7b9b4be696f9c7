"""trainer/fused_adamw.py's compiled AdamW (train.optimizer_step=fused) under strict_compile, as the
drafter's and the capture's compiled kernels: it never runs eagerly (eagerly its fp64 temporaries take
~8 B per parameter each, and the update other roundings than the compiled calls). Past its recompile limit
plain torch.compile runs the call in eager with only a logged warning; this kernel raises instead, in any
thread, and a process where torch.compile is disabled is refused when the step is installed. On CPU
through the production entry points (`step_group`, `zero_step.install`)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list as cache_entries

from dflash_dist import strict_compile
from dflash_dist.trainer import fused_adamw, zero_step

N = 37  # the flat partition's length (any: dynamic shapes)


def _clear():
    fused_adamw._kernel.cache_clear()
    torch._dynamo.reset()


@pytest.fixture()
def fresh_kernel():
    _clear()
    yield
    _clear()


def _adamw():
    """A flat fp32 master under torch's AdamW, as DeepSpeed's partition group holds it."""
    master = torch.nn.Parameter(torch.linspace(-1.0, 1.0, N))
    opt = torch.optim.AdamW([master], lr=1e-2, weight_decay=0.01)
    return opt, master


def _step(opt, master, grad_dtype: torch.dtype) -> torch.Tensor:
    """One step_group from a gradient of `grad_dtype`; the bf16 weights it wrote."""
    low = torch.empty(N, dtype=torch.bfloat16)
    grad = torch.linspace(0.5, -0.5, N).to(grad_dtype)
    fused_adamw.step_group(opt, opt.param_groups[0], master.data, grad, low, None, torch.zeros(()))
    return low


def test_the_kernel_is_guarded_and_traces_whole(fresh_kernel):
    """fullgraph=True (what makes dynamo raise at the limit) turns a graph break into an error too: the
    kernel is strict_compile's and one step compiles one graph (for every partition length)."""
    assert fused_adamw._kernel().func is strict_compile._guarded
    opt, master = _adamw()
    before = master.detach().clone()
    low = _step(opt, master, torch.float32)
    assert len(cache_entries(fused_adamw._adamw.__code__)) == 1
    assert not torch.equal(master.detach(), before) and torch.equal(low, master.detach().to(torch.bfloat16))


@pytest.mark.parametrize("per_region", [True, False], ids=["compile_limit", "thread_config"])
def test_the_kernel_past_its_limit_raises_instead_of_running_eagerly(fresh_kernel, monkeypatch, per_region):
    """Built in the main thread (as install builds it), stepped in a thread whose dynamo limit is below the
    kernel's (dynamo's default 8 in a fresh thread; 1 here): each gradient dtype up to RECOMPILE_LIMIT
    compiles, the next raises the named error instead of running eagerly, and the dtypes compiled before keep
    running their graphs. per_region False: the path of a torch.compile without recompile_limit=... (2.11,
    the GPU image's), where the limit is dynamo's config."""
    monkeypatch.setattr(fused_adamw, "RECOMPILE_LIMIT", 2, raising=False)
    if not per_region:
        monkeypatch.setattr(strict_compile, "compile_takes_recompile_limit", lambda: False)
    elif not strict_compile.compile_takes_recompile_limit():
        pytest.skip("this torch's torch.compile takes no recompile_limit (before 2.13)")
    fused_adamw._kernel()
    opt, master = _adamw()

    def other_thread():
        assert threading.current_thread() is not threading.main_thread()
        with torch._dynamo.config.patch(recompile_limit=1):
            for n, dtype in enumerate((torch.float32, torch.bfloat16), 1):
                _step(opt, master, dtype)
                assert len(cache_entries(fused_adamw._adamw.__code__)) == n  # compiled, not eager
            past = r"one-kernel AdamW .* than its 2 compiles: .*fused_adamw.RECOMPILE_LIMIT.*optimizer_step=lean"
            with pytest.raises(RuntimeError, match=past):
                _step(opt, master, torch.float16)
            _step(opt, master, torch.float32)
            assert len(cache_entries(fused_adamw._adamw.__code__)) == 2

    with ThreadPoolExecutor(1) as pool:
        pool.submit(other_thread).result()


def test_disabled_compile_is_refused_when_the_step_is_installed(fresh_kernel, monkeypatch, single_rank_gloo):
    """TORCHDYNAMO_DISABLE=1 makes torch.compile return the function itself; TORCH_COMPILE_DISABLE=1
    (dynamo's `disable`) skips every frame: the AdamW would run eagerly under train.optimizer_step=fused.
    Refused when the engine gets the step, before any training."""
    import deepspeed

    from dflash_dist.trainer.ds_config import build_lr_schedule, build_optimizer, deepspeed_config
    from tests.helpers.zero_net import Net, cfg_for

    cfg = cfg_for()
    model = Net()
    opt = build_optimizer(cfg, model, fused=False)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=opt,
        lr_scheduler=build_lr_schedule(cfg, opt, 50),
        config=deepspeed_config(cfg, 1, False),
        dist_init_required=False,
    )
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    with pytest.raises(ValueError, match=r"torch.compile is disabled .* train.optimizer_step=lean"):
        zero_step.install(engine, "fused", on_gpu=False)
    monkeypatch.delenv("TORCHDYNAMO_DISABLE")
    _clear()
    with torch._dynamo.config.patch(disable=True), pytest.raises(ValueError, match="torch.compile is disabled"):
        zero_step.install(engine, "fused", on_gpu=False)
    assert zero_step.install(engine, "fused", on_gpu=False) == "fused"
