"""The target's decoding cache during live speculative decoding, and its exact rollback.

A hybrid target (Qwen3.5/3.6) keeps two kinds of state per layer in transformers' DynamicCache:
full-attention layers keep keys/values per token ([b, heads, T, d]: cut the last n tokens and
they are exactly as before); Gated DeltaNet layers keep a conv state (the last K inputs of the
short causal conv, [b, conv_dim, K]) and a recurrent state ([b, heads, dk, dv]) that folds in
every token seen, so neither can be cut back. transformers 5.24's `crop` rewinds the conv state
and leaves the recurrent state advanced (wrong logits after a partial accept); 5.25 changed the
API again. So the rollback is owned here and does not depend on a version's `crop`:

- `snapshot()` clones the GDN states (small, independent of the context length) and notes the
  KV length; `restore()` copies them back and cuts the KV to that length. The accepted tokens are
  then fed again (the state is recomputed for exactly the accepted length).
- `rows(n)` is an independent copy with every state repeated n times: tree verification runs each
  root-to-leaf path as its own batch row there, so every node's GDN state comes from its parent
  (siblings never share a recurrent state), and the cache itself is never touched by a verify.

Works for any kernel path (fla or torch): only the cache's tensors are read and written.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

from dflash_dist.model.capture import LayerTap

_GDN_DICTS = ("conv_states", "recurrent_states", "is_conv_states_initialized", "is_recurrent_states_initialized",
              "has_previous_state", "conv_kernel_size")


@dataclass(frozen=True)
class CacheSnapshot:
    """What `restore` puts back: the KV length and every GDN layer's (conv, recurrent) states."""

    length: int
    gdn: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor | None]]  # (layer, state idx) -> states


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor  # [b, T, V] float32
    features: torch.Tensor | None  # [b, T, k*H]: the tapped layers' outputs at the fed positions


def _is_gdn(layer) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


class TargetCache:
    """A DynamicCache of `model` plus the length it holds; forwards go through `step`."""

    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...] = (), cache: DynamicCache | None = None,
                 length: int = 0) -> None:
        self.model = model
        self.layer_ids = tuple(layer_ids)
        self.cache = cache if cache is not None else DynamicCache(config=model.config)
        self.length = length  # tokens fed so far (= the next position)
        self.device = next(model.parameters()).device

    @property
    def has_gdn(self) -> bool:
        return any(_is_gdn(layer) for layer in self.cache.layers)

    @torch.no_grad()
    def step(self, ids: torch.Tensor | list[int], position_ids: torch.Tensor | None = None,
             attention_mask: dict | torch.Tensor | None = None, last_logits_only: bool = False) -> StepOutput:
        """Feed `ids` ([b, T] or one row as a list) at positions length.. (or `position_ids`).
        `last_logits_only`: logits of the last position alone (a long prefill's [T, V] is large)."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        if ids.dim() == 1:
            ids = ids[None]
        b, t = ids.shape
        if position_ids is None:
            position_ids = torch.arange(self.length, self.length + t, device=self.device)[None].expand(b, t)
        kwargs = {"input_ids": ids, "position_ids": position_ids, "attention_mask": attention_mask,
                  "use_cache": True, "cache": self.cache}
        if last_logits_only:
            kwargs["logits_to_keep"] = 1
        if self.layer_ids:
            with LayerTap(self.model, self.layer_ids) as tap:
                out = self.model(**kwargs)
                features = tap.concat()
        else:
            out, features = self.model(**kwargs), None
        self.length += t
        return StepOutput(out.logits.float(), features)

    # ---- rollback -------------------------------------------------------------------------

    @property
    def plain_kv(self) -> bool:
        """Every layer a plain attention KV cache (no GDN state, no sliding window): a forward's
        rejected positions can be dropped afterwards (`keep`), as the authors' loops crop theirs."""
        return bool(self.cache.layers) and all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def keep(self, start: int, offsets: list[int]) -> None:
        """Of the positions fed since `start` keep only start + offsets, in that order (a plain-KV
        cache: each entry's key was rotated at its own position, so the kept ones must be the
        positions start, start+1, ... they end up at: a prefix, or a tree's root-to-node path)."""
        if not self.plain_kv:
            raise ValueError("keep() needs a plain attention KV cache; restore a snapshot on this target")
        idx = torch.tensor(offsets, dtype=torch.long, device=self.device) + start
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys.index_select(-2, idx)], dim=-2)
                layer.values = torch.cat([layer.values[..., :start, :], layer.values.index_select(-2, idx)], dim=-2)
        self.length = start + len(offsets)

    def snapshot(self) -> CacheSnapshot:
        gdn = {}
        for i, layer in enumerate(self.cache.layers):
            if _is_gdn(layer):
                for s in range(layer.number_of_states):
                    conv, rec = layer.conv_states[s], layer.recurrent_states[s]
                    gdn[(i, s)] = (None if conv is None else conv.clone(), None if rec is None else rec.clone())
        return CacheSnapshot(self.length, gdn)

    def restore(self, snap: CacheSnapshot) -> None:
        """Put the cache back to `snap`: KV cut to its length, GDN states copied back."""
        drop = self.length - snap.length
        if drop < 0:
            raise ValueError(f"cannot restore a snapshot of {snap.length} tokens into a cache of {self.length}")
        for i, layer in enumerate(self.cache.layers):
            if isinstance(layer, DynamicLayer) and drop:
                DynamicLayer.crop(layer, -drop)  # the KV part only; never the linear-attention crop
            if _is_gdn(layer):
                for s in range(layer.number_of_states):
                    conv, rec = snap.gdn[(i, s)]
                    for name, saved in (("conv_states", conv), ("recurrent_states", rec)):
                        current = getattr(layer, name)[s]
                        if saved is None:
                            continue
                        if current is not None and current.shape == saved.shape:
                            current.copy_(saved)  # in place: keeps the tensor's (static) address
                        else:
                            getattr(layer, name)[s] = saved.clone()
        self.length = snap.length

    def rows(self, n: int) -> TargetCache:
        """An independent cache holding this one's state in each of n batch rows."""
        new = copy.copy(self.cache)
        new.layers = []
        index = torch.zeros(n, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            c = copy.copy(layer)
            for name in _GDN_DICTS:
                if hasattr(layer, name):
                    setattr(c, name, dict(getattr(layer, name)))
            c.reorder_cache(index)  # index_select: fresh tensors, the original layer is untouched
            new.layers.append(c)
        return TargetCache(self.model, self.layer_ids, new, self.length)

    def gdn_states(self) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """The GDN (conv, recurrent) states as they are now (clones), for checks."""
        return self.snapshot().gdn
