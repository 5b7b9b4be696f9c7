"""The DFlash drafter: Qwen3-style layers that denoise a block [anchor, MASK x (B-1)] in one pass,
conditioned on the target's hidden states injected as extra keys/values in every layer.

Plain nn.Module (STYLE 6): no Ray, DeepSpeed or torch.distributed here; builds on CPU and meta.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_dist.model.attention import FULL, SLIDING, AttentionMask, LayerMasks, attend, inference_sliding_mask
from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.fused import norm_rope_fn, rms_norm_fn, swiglu_fn


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: computed in fp32, g = weight (not zero-centred)."""

    fast = None  # fused.py's (x, weight, eps) kernel, set by DFlashDrafter.set_kernels; None: the code below

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast is not None:
            return self.fast(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Full-head rotate-half RoPE at absolute positions (Qwen3 default rope)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        return 1.0 / (self.theta**exponent)

    def reset_buffers(self) -> None:
        """Recompute inv_freq after materialising a model built on the meta device."""
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [b, T] -> cos/sin [b, T, head_dim], computed in fp32 like HF.
        freqs = positions[..., None].float() * self.inv_freq.float().to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, T, d]; cos/sin [b, T, d]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class DrafterAttention(nn.Module):
    norm_rope = None  # fused.py's q/k norm + RoPE, set by DFlashDrafter.set_kernels; None: the code below
    # False: k/v projections of cat([context, x]); True: of each part, the [S+Q, kv_heads*d] outputs
    # concatenated (a 5x smaller copy than the [S+Q, H] input at the 27B shape); DFlashDrafter.set_split_kv
    split_kv = False

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_kv: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMask | None,
    ) -> torch.Tensor:
        b, q_len, _ = x.shape
        # KV injection: the fused context features pass through this layer's own k/v projections
        # and k_norm, then sit in front of the block's keys; they never become queries.
        if self.split_kv:
            k_lin = torch.cat([self.k_proj(context), self.k_proj(x)], dim=1)
            v_lin = torch.cat([self.v_proj(context), self.v_proj(x)], dim=1)
        else:
            kv_in = torch.cat([context, x], dim=1)
            k_lin, v_lin = self.k_proj(kv_in), self.v_proj(kv_in)
        v = self._heads(v_lin, self.num_kv_heads).transpose(1, 2)
        if self.norm_rope is not None:
            qn, kn = self.q_norm, self.k_norm
            q = self.norm_rope(self._heads(self.q_proj(x), self.num_heads), qn.weight, qn.eps, *rope_q)
            k = self.norm_rope(self._heads(k_lin, self.num_kv_heads), kn.weight, kn.eps, *rope_kv)
        else:
            q = self.q_norm(self._heads(self.q_proj(x), self.num_heads)).transpose(1, 2)
            k = self.k_norm(self._heads(k_lin, self.num_kv_heads)).transpose(1, 2)
            q = apply_rope(q, *rope_q)
            k = apply_rope(k, *rope_kv)
        out = attend(q, k, v, mask, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DrafterMLP(nn.Module):
    act = None  # fused.py's (gate, up) -> silu(gate) * up, set by DFlashDrafter.set_kernels

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is not None:
            return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.attention_type = cfg.layer_types[layer_idx]  # which of the per-type masks this layer uses
        self.self_attn = DrafterAttention(cfg)
        self.mlp = DrafterMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, context, rope_q, rope_kv, mask):
        h = h + self.self_attn(self.input_layernorm(h), context, rope_q, rope_kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """Drafter weights (exported) plus the target's embedding and lm_head (frozen, not exported)."""

    TARGET_KEYS = ("embed_tokens.weight", "lm_head.weight")

    def __init__(self, cfg: DrafterConfig, kernels: str = "torch") -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_context_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)
        self.set_kernels(kernels)

    def set_kernels(self, kernels: str) -> None:
        """Elementwise kernels (fused.py): "torch" (reference, CPU), "compile" or "liger" (GPU).
        Changes no weights; the loss reads `self.kernels` for its cross-entropy kernel."""
        norm, act, norm_rope = rms_norm_fn(kernels), swiglu_fn(kernels), norm_rope_fn(kernels)
        self.kernels = kernels
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.fast = norm
            elif isinstance(m, DrafterMLP):
                m.act = act
            elif isinstance(m, DrafterAttention):
                m.norm_rope = norm_rope

    def set_split_kv(self, split: bool) -> None:
        """Project context and block keys/values apart and concatenate the projections
        (DrafterAttention.split_kv): the same math, GEMMs over other row splits."""
        for m in self.modules():
            if isinstance(m, DrafterAttention):
                m.split_kv = split

    def set_target_weights(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Share the target's embedding and lm_head (frozen)."""
        for name, w in (("embed_tokens", embed_weight), ("lm_head", lm_head_weight)):
            expected = getattr(self, name).weight.shape
            if tuple(w.shape) != tuple(expected):
                raise ValueError(f"target {name} weight has shape {tuple(w.shape)}, drafter expects {tuple(expected)}")
        dtype = self.fc.weight.dtype  # no copy when target and drafter share a dtype
        self.embed_tokens.weight = nn.Parameter(embed_weight.detach().to(dtype), requires_grad=False)
        self.lm_head.weight = nn.Parameter(lm_head_weight.detach().to(dtype), requires_grad=False)

    def drafter_state_dict(self) -> dict[str, torch.Tensor]:
        """The exported weights: everything but the target's embedding and lm_head."""
        return {k: v for k, v in self.state_dict().items() if k not in self.TARGET_KEYS}

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """[b, S, k*H] raw concatenated target features -> [b, S, H]. Uses ALL k layers."""
        if features.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"context features have width {features.shape[-1]}, fc expects k*H = {self.fc.in_features} "
                f"({self.config.num_context_layers} layers x {self.config.hidden_size})"
            )
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def forward(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        context: torch.Tensor,
        context_positions: torch.Tensor,
        mask: AttentionMask | LayerMasks | None = None,
        return_layer_outputs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Final normed hidden states of the block slots.

        block_ids/positions [b, Q]; context = fuse_context(features) [b, S, H] at context_positions
        [b, S]; mask None = one block at inference: full layers see every key, sliding layers the
        window (attention.inference_sliding_mask); training passes attention.layer_masks(...).
        """
        h = self.embed_tokens(block_ids).to(context.dtype)
        rope_q = self.rotary(block_positions, h.dtype)
        rope_kv = self.rotary(torch.cat([context_positions, block_positions], dim=1), h.dtype)
        masks = self._per_layer_masks(mask, context_positions, block_positions)
        outs = []
        for layer in self.layers:
            h = layer(h, context, rope_q, rope_kv, masks[layer.attention_type] if isinstance(masks, dict) else masks)
            outs.append(h)
        h = self.norm(h)
        return (h, outs) if return_layer_outputs else h

    def _per_layer_masks(self, mask, context_positions: torch.Tensor, block_positions: torch.Tensor):
        """The mask (or per-layer-type masks) the layers use; refuses one mask for a sliding drafter,
        which would silently run its sliding layers as full attention."""
        cfg = self.config
        if not cfg.has_sliding_layers:
            return mask[FULL] if isinstance(mask, dict) else mask
        if mask is None:
            sliding = inference_sliding_mask(block_positions.shape[1], context_positions, block_positions,
                                             cfg.sliding_window)
            return {FULL: None, SLIDING: sliding}
        if not isinstance(mask, dict) or set(cfg.layer_types) - set(mask):
            raise ValueError(
                f"this drafter has layer_types {list(cfg.layer_types)}: pass one mask per layer type "
                "(attention.layer_masks), not a single mask"
            )
        return mask

    def draft_block(
        self, features: torch.Tensor, anchor_token: int, start: int, context: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Inference round: logits [B-1, V] for positions start+1 .. start+B-1.

        features: raw target features of positions < start ([start, k*H]) or, precomputed,
        `context` = fuse_context(features)[:start].
        """
        cfg = self.config
        dev = self.fc.weight.device
        if context is None:
            context = self.fuse_context(features[None, :start].to(dev))
        ids = torch.full((1, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = anchor_token
        pos = torch.arange(start, start + cfg.block_size, device=dev)[None]
        ctx_pos = torch.arange(context.shape[1], device=dev)[None]
        hidden = self(ids, pos, context, ctx_pos, None)
        return self.lm_head(hidden[0, 1:]).float()
