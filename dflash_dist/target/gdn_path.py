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
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable

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
