"""CPU forwards of Gated DeltaNet models on machines that have fla and Triton.

transformers picks the GDN kernels once, when it imports a hybrid model's modeling module: if
`fla.ops.gated_delta_rule` imports (fla with Triton), the module-level `torch_chunk_gated_delta_rule`
and `torch_recurrent_gated_delta_rule` call fla for every tensor, CPU tensors included, and fla's
Triton kernels crash on those (`Pointer argument (at 0) cannot be accessed from Triton (cpu
tensor?)`). Every GPU machine that installs this package has both, and the tiny target is built,
captured and evaluated on CPU (configs/tiny.yaml).

`route_cpu_to_torch()` replaces each such selected function, in every loaded modeling module, by
one that sends CPU tensors to transformers' own torch reference (the function it decorated) and
everything else to the implementation transformers picked. Accelerator forwards are unchanged and
`model.capture.gdn_kernel_path` still reads the picked implementation (the `implementation` name
of the closure, as transformers' own wrapper has it).

Training a hybrid target on a GPU is the other case: fla 0.6.0 with Triton 3.6 refuses its GDN
backward on Hopper. `fla_gdn_backward_error` asks fla on the device, and `torch_gdn_kernels()`
sends every call to transformers' torch code while the training loop runs (code_target.py).
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from dflash_dist.model.capture import _resolved_impl

log = logging.getLogger(__name__)

# Module-level names transformers' hybrid models call and decorate with a package fallback.
ROUTED_NAMES = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def _first_tensor(args, kwargs):
    import torch

    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
    return None


def _routed(selected: Callable, reference: Callable, implementation: Callable) -> Callable:
    """`selected` (transformers' wrapper around `implementation`) for accelerator tensors,
    `reference` (its torch code) for CPU tensors."""

    params = inspect.signature(reference).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def routed(*args, **kwargs):
        _ = implementation  # a free name of this closure: gdn_kernel_path reads the picked kernel from it
        t = _first_tensor(args, kwargs)
        if t is not None and t.device.type == "cpu":
            if not takes_any:  # as transformers' wrapper does: only the arguments the function takes
                kwargs = {k: v for k, v in kwargs.items() if k in params}
            return reference(*args, **kwargs)
        return selected(*args, **kwargs)

    routed.__wrapped__ = selected  # type: ignore[attr-defined]
    routed.__name__ = getattr(selected, "__name__", "routed")
    routed.dflash_cpu_routed = True  # type: ignore[attr-defined]
    return routed


def _reference_of(fn: Callable) -> Callable | None:
    """The torch function transformers decorated (functools.wraps keeps it as __wrapped__)."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            return fn
        fn = inner
    return None


def route_cpu_to_torch() -> list[str]:
    """Route CPU calls of every non-torch GDN/conv kernel transformers selected to its torch
    reference, in every loaded `transformers.models.*.modeling_*` module. Idempotent; returns the
    routed `module.name`s (empty where transformers already runs torch, e.g. without Triton)."""
    routed: list[str] = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("transformers.models.") or ".modeling_" not in mod_name:
            continue
        for name in ROUTED_NAMES:
            fn = mod.__dict__.get(name)
            if fn is None or getattr(fn, "dflash_cpu_routed", False) or not callable(fn):
                continue
            impl = _resolved_impl(fn)
            reference = _reference_of(fn)
            if impl is None or reference is None or impl is reference or impl is fn:
                continue  # transformers runs its torch code already
            if getattr(impl, "__module__", "").startswith("transformers"):
                continue
            setattr(mod, name, _routed(fn, reference, impl))
            routed.append(f"{mod_name}.{name}")
    if routed:
        log.info("CPU calls of %s go to transformers' torch reference (fla's Triton kernels need GPU tensors)",
                 ", ".join(sorted({r.rsplit(".", 1)[1] for r in routed})))
    return routed


def selected_implementation(module, name: str = "torch_chunk_gated_delta_rule") -> str:
    """The module the GDN kernel transformers selected in `module` comes from ("fla..." or
    "transformers..."), looking through our CPU routing."""
    impl = _resolved_impl(module.__dict__[name])
    return getattr(impl, "__module__", "") or ""


@contextmanager
def torch_gdn_kernels() -> Iterator[list[str]]:
    """Inside: every GDN/conv kernel transformers selected, in every loaded modeling module, is
    its torch reference for all tensors, CUDA ones too; restored on exit. For training a hybrid
    target on a GPU where fla refuses its backward (PLATFORM.md: fla 0.6.0 with Triton 3.6 on
    Hopper); the forward-only users (capture, evaluation) keep fla. Yields the swapped names."""
    saved = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("transformers.models.") or ".modeling_" not in mod_name:
            continue
        for name in ROUTED_NAMES:
            fn = mod.__dict__.get(name)
            reference = _reference_of(fn) if callable(fn) else None
            if reference is not None and reference is not fn:
                saved.append((mod, name, fn))
                setattr(mod, name, reference)
    try:
        yield [f"{mod.__name__}.{name}" for mod, name, _ in saved]
    finally:
        for mod, name, fn in reversed(saved):
            setattr(mod, name, fn)


def fla_gdn_backward_error(device) -> str | None:
    """None when fla's chunked Gated DeltaNet runs forward and backward on `device`, else why not
    (fla missing, no Triton, or fla's own refusal of its backward on this GPU and Triton)."""
    import torch
    import torch.nn.functional as F

    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        shape = (1, 64, 2, 64)  # batch, time, heads, head dim
        q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = F.logsigmoid(torch.randn(shape[:3], device=device)).requires_grad_()
        beta = torch.rand(shape[:3], device=device, dtype=torch.bfloat16).requires_grad_()
        out, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        out.float().sum().backward()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as err:  # noqa: BLE001 (any failure means: do not train through fla here)
        return f"{type(err).__name__}: {err}"[:500]
    return None
