"""Target features: the outputs of k chosen decoder layers of any HF causal LM, concatenated to
[T, k*H], plus the target's own next-token argmax (SPEC 1).

Feature of layer l = output of decoder layer l (post-residual, before the final norm) =
`hidden_states[l + 1]` of HF's output_hidden_states. We hook the k layers instead of asking for
all L+1 hidden states, and compute the argmax from the final hidden state in vocab-sized chunks
so the [T, V] logits are never held at once.

The last layer (id N-1) is refused: there the two definitions part (HF's hidden_states[N] is
after the final norm, the layer's output before it), and the reference feature extractors read
hidden_states[l + 1], so a drafter trained on either would be served the other somewhere. The
default layer rule never picks it (its top layer is N-3).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

KERNEL_PATHS = ("fla", "torch")


@dataclass
class CaptureOutput:
    features: torch.Tensor  # [b, T, k*H] in the target's dtype
    target_argmax: torch.Tensor | None  # [b, T] int64: argmax of the target's logits at each position
    kernel_path: str  # "fla" | "torch": how Gated DeltaNet layers (if any) were computed
    layer_ids: tuple[int, ...]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer stack of an HF causal LM (model.model.layers and the usual variants)."""
    base = getattr(model, "model", None) or getattr(model, "transformer", None) or model.base_model
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (looked for layers/h/blocks)")


def _gdn_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def _resolved_impl(fn) -> object:
    """transformers 5.x wraps its torch reference in a decorator that resolves, at import time, to
    the fla kernel when fla (with Triton) imports; read which one it picked."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        try:
            nonlocals = inspect.getclosurevars(fn).nonlocals
        except TypeError:
            return fn
        impl = nonlocals.get("implementation")
        if impl is not None and impl is not fn:
            return impl
        fn = getattr(fn, "__wrapped__", None)
    return fn


def gdn_kernel_path(model: nn.Module) -> str:
    """'fla' when the Gated DeltaNet layers run fla's kernels on an accelerator, else 'torch'.

    A model without GDN layers reports 'torch' (plain HF attention; there is no fla path).
    """
    gdn = _gdn_modules(model)
    if not gdn:
        return "torch"
    on_accel = next(gdn[0].parameters()).device.type != "cpu"
    layer = gdn[0]
    impl = getattr(layer, "chunk_gated_delta_rule", None)  # older transformers kept it on the module
    if impl is None:
        module = inspect.getmodule(type(layer))
        impl = _resolved_impl(getattr(module, "torch_chunk_gated_delta_rule", None))
    uses_fla = getattr(impl, "__module__", "") .startswith("fla")
    return "fla" if (uses_fla and on_accel) else "torch"


def kernel_path_refusal(path: str, on_cuda: bool, has_gdn: bool, allow_torch_gdn_on_cuda: bool) -> str | None:
    """Why a capture must not run (None: it may). The torch reference GDN path on CUDA is refused:
    its features differ from fla's by percents (SPEC 1) and a drafter trained on one and run on
    the other produces garbage."""
    if on_cuda and has_gdn and path == "torch" and not allow_torch_gdn_on_cuda:
        return ("the target's Gated DeltaNet layers would run the torch reference path on CUDA: install "
                "flash-linear-attention (with triton) so they run fla's kernels, or set "
                "target.allow_torch_gdn_on_cuda=true to accept features that differ from fla's")
    return None


def check_kernel_path(model: nn.Module, allow_torch_gdn_on_cuda: bool = False) -> str:
    """The model's kernel path, after refusing what kernel_path_refusal refuses."""
    path = gdn_kernel_path(model)
    on_cuda = any(p.is_cuda for p in model.parameters())
    reason = kernel_path_refusal(path, on_cuda, bool(_gdn_modules(model)), allow_torch_gdn_on_cuda)
    if reason:
        raise RuntimeError(reason)
    return path


def check_capture_layer_ids(layer_ids: list[int] | tuple[int, ...], num_layers: int) -> None:
    """Refuse ids outside the target and the last layer N-1 (module docstring), naming them."""
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} outside the target's {num_layers} decoder layers")
    if num_layers - 1 in layer_ids:
        raise ValueError(
            f"layer id {num_layers - 1} is the target's last decoder layer: its output before the final norm "
            f"differs from HF's hidden_states[{num_layers}] (after it), which the reference feature extractors "
            f"read; pick capture.layer_ids <= {num_layers - 2} (the default rule's top layer is {num_layers - 3})"
        )


class LayerTap:
    """Forward hooks that keep the outputs of the chosen decoder layers."""

    def __init__(self, model: nn.Module, layer_ids: list[int] | tuple[int, ...]) -> None:
        layers = decoder_layers(model)
        check_capture_layer_ids(layer_ids, len(layers))
        self.layer_ids = tuple(layer_ids)
        self.outputs: dict[int, torch.Tensor] = {}
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in set(layer_ids)]

    def _hook(self, i: int):
        def hook(_module, _args, output):
            self.outputs[i] = output[0] if isinstance(output, (tuple, list)) else output

        return hook

    def concat(self) -> torch.Tensor:
        return torch.cat([self.outputs[i] for i in self.layer_ids], dim=-1)

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def __enter__(self) -> LayerTap:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def chunked_argmax(hidden: torch.Tensor, lm_head: nn.Module, chunk_tokens: int = 2048) -> torch.Tensor:
    """argmax(lm_head(hidden)) over [b, T, H] without materialising all [b, T, V] logits."""
    b, t, h = hidden.shape
    flat = hidden.reshape(-1, h)
    out = [lm_head(flat[i : i + chunk_tokens]).argmax(-1) for i in range(0, flat.shape[0], chunk_tokens)]
    return torch.cat(out).view(b, t)


def is_right_padding(attention_mask: torch.Tensor) -> bool:
    """Every row is ones then zeros: in a causal LM no real position sees the pads after it."""
    return attention_mask.dim() == 2 and bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())


@torch.no_grad()
def capture_features(
    model: nn.Module,
    input_ids: torch.Tensor,
    layer_ids: list[int] | tuple[int, ...],
    attention_mask: torch.Tensor | None = None,
    with_argmax: bool = True,
    allow_torch_gdn_on_cuda: bool = False,
) -> CaptureOutput:
    """Run the target once over input_ids [b, T]; return the k layers' outputs and its argmax."""
    path = check_kernel_path(model, allow_torch_gdn_on_cuda)
    if attention_mask is not None and is_right_padding(attention_mask):
        attention_mask = None  # same features at real positions, and sdpa runs its causal kernel, not a masked one
    base = getattr(model, "model", None) or model.base_model
    with LayerTap(model, layer_ids) as tap:
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        features = tap.concat()
    argmax = chunked_argmax(out.last_hidden_state, model.get_output_embeddings()) if with_argmax else None
    return CaptureOutput(features, argmax, path, tuple(layer_ids))
