"""torch.compile that never falls back to eager: the one guard of the drafter's compiled flex_attention
(model/attention.py), its compiled kernel set (model/fused.py), the fused capture kernels
(capture/fused_target.py, capture/fused_layers.py) and the one-kernel AdamW (trainer/fused_adamw.py).

Past dynamo's recompile limit (8 per function by default), or at a graph break, plain torch.compile runs
the call eagerly with at most a logged warning: eager flex materialises the [Q, K] scores (an OOM at the
27B shape), an eager kernel has other numerics than its compiled calls, and capture features would no
longer come from the kernel path their shards record. `strict_compile` compiles with fullgraph=True, so
dynamo raises instead, and turns the limit's error into the caller's own message (what to raise, or the
setting to switch). Each caller keeps its limit constant, compile options and messages; this module only
holds the mechanism.

The limit: where torch.compile takes `recompile_limit` (torch 2.13 does, 2.11 not) it is this region's
own, so it holds in every thread. Else it is dynamo's config, global in 2.11 but per thread since 2.12: it
is raised when the region is built, and again in a calling thread still below it (the evaluator's, a
trainer helper's, one dynamo started at its default 8), which then gets one more try before the error.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch


def compile_takes_recompile_limit() -> bool:
    """Whether torch.compile takes a per-region `recompile_limit` (torch 2.13 does, 2.11 not)."""
    return "recompile_limit" in inspect.signature(torch.compile).parameters


def raise_thread_limit(limit: int) -> bool:
    """Dynamo's recompile limits in this thread's config (per thread since torch 2.12, global before) up to
    `limit` (and the accumulated one, over every region of a code object, up to 4x), never down; whether
    either was below."""
    import torch._dynamo.config as dynamo_config

    below = False
    for name, ours in (("recompile_limit", limit), ("accumulated_recompile_limit", 4 * limit)):
        if getattr(dynamo_config, name) < ours:
            setattr(dynamo_config, name, ours)
            below = True
    return below


def strict_compile(fn: Callable, *, limit: int, past_limit: str, disabled: str, static_last_dim: bool = False,
                   **compile_kwargs) -> Callable:  # fmt: skip
    """`fn` through torch.compile(fullgraph=True, **compile_kwargs), never eagerly (module docstring): at
    most `limit` compiles, past which a call raises RuntimeError(past_limit) instead of running eagerly
    (the inputs compiled before keep running their graphs). A process where torch.compile is disabled
    (TORCHDYNAMO_DISABLE=1 returns `fn` itself; TORCH_COMPILE_DISABLE=1, dynamo's `disable`, skips every
    frame) is refused here with ValueError(disabled). Callers cache what this returns (functools.cache):
    one compiled object, and its graphs, per function.
    `static_last_dim` (with dynamic=None): each call marks every dimension of its positional tensor arguments
    but the last as dynamic (torch._dynamo.maybe_mark_dynamic) and the last static, so each graph is
    specialised to its widths and shared by every token count (a new width compiles its own)."""
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.exc import FailOnRecompileLimitHit

    if static_last_dim and compile_kwargs.get("dynamic") is not None:
        raise ValueError("static_last_dim marks the dynamic dimensions itself: compile with dynamic=None")

    per_region = compile_takes_recompile_limit()
    if per_region:
        compile_kwargs["recompile_limit"] = limit
    else:
        raise_thread_limit(limit)
    compiled = torch.compile(fn, fullgraph=True, **compile_kwargs)
    if compiled is fn or dynamo_config.disable:
        raise ValueError(disabled)
    mark = _all_but_last_dynamic if static_last_dim else None
    return functools.partial(_guarded, compiled, limit, per_region, past_limit, FailOnRecompileLimitHit, mark)


def _all_but_last_dynamic(args) -> None:
    """Each positional tensor argument: every dimension but the last maybe-dynamic, the last static (without the
    mark, automatic dynamic shapes would make the width dynamic at the recompile a second width brings)."""
    for t in args:
        if isinstance(t, torch.Tensor) and t.dim():
            for dim in range(t.dim() - 1):
                torch._dynamo.maybe_mark_dynamic(t, dim)
            torch._dynamo.mark_static(t, t.dim() - 1)


def _guarded(compiled, limit: int, per_region: bool, past_limit: str, limit_hit: type[Exception], mark, *args,
             **kwargs):  # fmt: skip
    if mark is not None:
        mark(args)
    try:
        return compiled(*args, **kwargs)
    except limit_hit as err:
        if not per_region and raise_thread_limit(limit):  # a thread that met dynamo's default: once more at ours
            return _guarded(compiled, limit, per_region, past_limit, limit_hit, None, *args, **kwargs)
        raise RuntimeError(past_limit) from err
