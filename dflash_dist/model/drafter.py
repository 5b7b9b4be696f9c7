"""The DFlash drafter: Qwen3-style layers that denoise a block [anchor, MASK x (B-1)] in one pass,
conditioned on the target's hidden states injected as extra keys/values in every layer.

Two row cuts of the training forward (issue 24), each a switch that `set_kernels` turns on with the
fast kernel sets (liger, compile: the GPU) and off with "torch" (the CPU reference: the pinned loss
curve and the golden sets keep their bits; a GEMM over fewer rows sums its weight gradient in
another order). Each computes the same function, only fewer rows:
- `dedup_layer0`: training blocks are [anchor token, MASK x (B-1)] (loss.block_inputs; an invalid
  block is all MASK), so layer 0's input is the frozen embedding of N+1 distinct rows per sequence:
  each block's slot 0 and the MASK row. Its input norm and the q/k/v projections of the block part
  are row-wise, so they run on those N+1 rows (`AnchorBlocks`) and their outputs are expanded to the
  N*B slots before anything that depends on the position (q/k norm, RoPE, attention). The expansion
  is a cat of the slot-0 rows with the MASK row's `expand`: its backward is a sum, no scatter. The
  residual stream keeps all N*B rows; the context part of k/v is unchanged.
- `last_rows`: the loss reads only the supervised rows of the last layer's output (`rows`: slot 0,
  invalid blocks, slots past the sequence and loss-masked slots carry no weight), and after the
  last layer's attention every op is row-wise: o_proj, the residual add, the post-attention norm,
  the MLP and the final norm run on those rows only. All queries still attend (the mask is built
  for the whole block layout). Without the switch the full output is normed and then indexed, as
  the loss did before.

Each layer returns (h, its MLP output) unsummed: the next layer's input norm, or the final norm, adds them
(`RMSNorm.add_forward`), so with the fast kernel sets the residual add runs inside the norm's kernel
(fused.add_rms_norm_fn: liger's fused add + RMSNorm, whose backward also adds the residual gradient; one
80 MB pass less each way a layer at the 27B shape). The torch set adds, then norms: the same ops as before.
Opt-in (`set_one_dx`, bench_train_step's onedx; in the 27B step on an H100 within the noise of autograd's
adds, docs/BENCHMARKS.md sixteenth session): the linears that read one input (q/k/v
of cat([context, x]), the MLP's gate and up) sum their input gradient in one buffer, the GEMMs adding into it
(shared_input.py).

Plain nn.Module (STYLE 6): no Ray, DeepSpeed or torch.distributed here; builds on CPU and meta.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_dist.model.attention import FULL, SLIDING, AttentionMask, LayerMasks, attend, inference_sliding_mask
from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.fused import add_rms_norm_fn, norm_rope_fn, rms_norm_fn, swiglu_fn
from dflash_dist.model.shared_input import linears, project_qkv


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: computed in fp32, g = weight (not zero-centred)."""

    fast = None  # fused.py's (x, weight, eps) kernel, set by DFlashDrafter.set_kernels; None: the code below
    add_fast = None  # fused.py's (residual, x, weight, eps) -> (sum, normed) kernel; None: the add, then forward

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

    def add_forward(self, residual: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, the norm of it): the pre-norm layer's residual step, one kernel with `add_fast`."""
        if self.add_fast is not None:
            return self.add_fast(residual, x, self.weight, self.eps)
        s = residual + x
        return s, self(s)


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


class AnchorBlocks:
    """Training blocks [slot 0, MASK x (B-1)] laid out as N blocks of B rows: `distinct` takes a
    sequence's N+1 distinct rows (each block's slot 0, then block 0's slot 1, a MASK), `expand` puts
    row-wise results of them back on the N*B slots. expand(f(distinct(h))) = f(h) for a row-wise f
    when every slot past 0 holds the same row, which is what the caller vouches for."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 2:
            raise ValueError(f"AnchorBlocks needs block_size >= 2 (a MASK slot), got {block_size}")
        self.n, self.block = num_blocks, block_size

    def distinct(self, h: torch.Tensor) -> torch.Tensor:
        """[b, N*B, D] -> [b, N+1, D]."""
        b, _, d = h.shape
        blocks = h.view(b, self.n, self.block, d)
        return torch.cat([blocks[:, :, 0], blocks[:, :1, 1]], dim=1)

    def expand(self, y: torch.Tensor) -> torch.Tensor:
        """[b, N+1, D] -> [b, N*B, D]: row j to slot 0 of block j, row N to every other slot."""
        b, _, d = y.shape
        mask = y[:, self.n :, None].expand(b, self.n, self.block - 1, d)  # backward: a sum over the slots
        # not a view of the 4-d cat (as a GEMM's 3-d output, which matmul returns through the same op): the compiled
        # q norm + RoPE guards on a view input's base, and a 4-d one took a graph of its own (7 compiles for 4)
        return torch.ops.aten._unsafe_view(torch.cat([y[:, : self.n, None], mask], dim=2), (b, self.n * self.block, d))


class DrafterAttention(nn.Module):
    norm_rope = None  # fused.py's q/k norm + RoPE, set by DFlashDrafter.set_kernels; None: the code below
    # False: k/v projections of cat([context, x]); True: of each part, the [S+Q, kv_heads*d] outputs
    # concatenated (a 5x smaller copy than the [S+Q, H] input at the 27B shape); DFlashDrafter.set_split_kv
    split_kv = False
    one_dx = False  # DFlashDrafter.set_one_dx: with cat([context, x]), q/k/v through shared_input.project_qkv

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
        blocks: AnchorBlocks | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[b, Q, H] -> [b, Q, H]. blocks: x holds the N+1 distinct rows [b, N+1, H] of training
        blocks, the block part's q/k/v projections are expanded to the Q = N*B slots; rows: the output
        of those flat [b*Q] rows only, [R, H] (o_proj on them alone)."""
        b = x.shape[0]
        expand = (lambda t: t) if blocks is None else blocks.expand
        # KV injection: the fused context features pass through this layer's own k/v projections
        # and k_norm, then sit in front of the block's keys; they never become queries.
        q_lin = None
        if self.split_kv:
            k_lin = torch.cat([self.k_proj(context), expand(self.k_proj(x))], dim=1)
            v_lin = torch.cat([self.v_proj(context), expand(self.v_proj(x))], dim=1)
        else:
            if self.one_dx:  # the same GEMMs; x's and context's gradients summed in one buffer (shared_input.py)
                w = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
                q_lin, k_lin, v_lin = project_qkv(context, x, *w)
            else:
                kv_in = torch.cat([context, x], dim=1)
                k_lin, v_lin = self.k_proj(kv_in), self.v_proj(kv_in)
            if blocks is not None:  # one GEMM over context and distinct rows, then the block part expanded
                s = context.shape[1]
                k_lin = torch.cat([k_lin[:, :s], blocks.expand(k_lin[:, s:])], dim=1)
                v_lin = torch.cat([v_lin[:, :s], blocks.expand(v_lin[:, s:])], dim=1)
        q_lin = expand(self.q_proj(x) if q_lin is None else q_lin)
        q_len = q_lin.shape[1]
        v = self._heads(v_lin, self.num_kv_heads).transpose(1, 2)
        if self.norm_rope is not None:
            qn, kn = self.q_norm, self.k_norm
            q = self.norm_rope(self._heads(q_lin, self.num_heads), qn.weight, qn.eps, *rope_q)
            k = self.norm_rope(self._heads(k_lin, self.num_kv_heads), kn.weight, kn.eps, *rope_kv)
        else:
            q = self.q_norm(self._heads(q_lin, self.num_heads)).transpose(1, 2)
            k = self.k_norm(self._heads(k_lin, self.num_kv_heads)).transpose(1, 2)
            q = apply_rope(q, *rope_q)
            k = apply_rope(k, *rope_kv)
        out = attend(q, k, v, mask, scale=self.head_dim**-0.5)
        if rows is not None:
            return self.o_proj(out.transpose(1, 2).reshape(b * q_len, -1)[rows])
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DrafterMLP(nn.Module):
    act = None  # fused.py's (gate, up) -> silu(gate) * up, set by DFlashDrafter.set_kernels
    one_dx = False  # DFlashDrafter.set_one_dx: gate and up through shared_input.linears

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_dx:
            gate, up = linears(x, (self.gate_proj.weight, self.up_proj.weight))
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.act is not None:
            return self.down_proj(self.act(gate, up))
        return self.down_proj(F.silu(gate) * up)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.attention_type = cfg.layer_types[layer_idx]  # which of the per-type masks this layer uses
        self.self_attn = DrafterAttention(cfg)
        self.mlp = DrafterMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, context, rope_q, rope_kv, mask, blocks: AnchorBlocks | None = None, rows=None, delta=None):
        """(h', mlp out): the layer's output is h' + mlp out, left unsummed so that the next layer's input
        norm (or the final norm) adds it in its own kernel (RMSNorm.add_forward). `delta`: the previous
        layer's mlp out, added to h here first (None: h is the whole residual stream).
        blocks: the input norm and q/k/v projections on the blocks' distinct rows (layer 0);
        rows: after the attention only these flat rows, [R, H] out (the last layer)."""
        if delta is None:
            x = self.input_layernorm(h if blocks is None else blocks.distinct(h))
        else:
            if blocks is not None:
                raise ValueError("the layer-0 row cut (blocks) takes the embedding itself: no delta")
            h, x = self.input_layernorm.add_forward(h, delta)
        a = self.self_attn(x, context, rope_q, rope_kv, mask, blocks, rows)
        if rows is not None:
            h = h.reshape(-1, h.shape[-1])[rows]
        h, y = self.post_attention_layernorm.add_forward(h, a)
        return h, self.mlp(y)


def row_cuts_default(kernels: str) -> bool:
    """The row cuts (`dedup_layer0`, `last_rows`) are on with the fast kernel sets (the GPU), off with
    the torch reference (the CPU: the pinned loss curve's bits)."""
    return kernels != "torch"


class DFlashDrafter(nn.Module):
    """Drafter weights (exported) plus the target's embedding and lm_head (frozen, not exported)."""

    TARGET_KEYS = ("embed_tokens.weight", "lm_head.weight")
    dedup_layer0 = False  # the row cuts of the training forward (module docstring); set_kernels sets both
    fused_add_norm = True  # set_fused_add_norm: with the fast kernel sets, each residual add in its norm's kernel
    last_rows = False
    one_dx = False  # set_one_dx

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
        Changes no weights; the loss reads `self.kernels` for its cross-entropy kernel. Also sets the
        row cuts to the set's default (`row_cuts_default`: on with liger/compile)."""
        norm, act, norm_rope = rms_norm_fn(kernels), swiglu_fn(kernels), norm_rope_fn(kernels)
        self.kernels = kernels
        self.dedup_layer0 = self.last_rows = row_cuts_default(kernels)
        self.set_fused_add_norm(self.fused_add_norm)  # each RMSNorm's add kernel for these kernels
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

    def set_one_dx(self, on: bool) -> None:
        """The input gradient of the linears that read one input (q/k/v of cat([context, x]), MLP gate and up)
        summed in one buffer by the GEMMs (shared_input.py) instead of autograd's bf16 adds; the same forward
        and weight gradients. Off by default, with every kernel set: timed in the 27B step on an H100 it was within
        the noise of autograd's adds (bench_train_step's onedx/adddx words); `set_kernels` leaves it as it is."""
        self.one_dx = bool(on)
        for m in self.modules():
            if isinstance(m, (DrafterAttention, DrafterMLP)):
                m.one_dx = self.one_dx

    def set_fused_add_norm(self, on: bool) -> None:
        """The residual add and the following RMSNorm in one kernel (fused.add_rms_norm_fn) with the fast
        kernel sets (on, the default; no effect with "torch"); off: the add, then the norm's own kernel, the
        form before 2026-12-07 (bench_train_step's noaddnorm). Not bitwise that form on the GPU: the fused
        backward rounds the norm's dX plus the residual gradient once, where the add rounded dX first."""
        self.fused_add_norm = bool(on)
        add_norm = add_rms_norm_fn(self.kernels) if self.fused_add_norm else None
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.add_fast = add_norm

    def set_row_cuts(self, dedup_layer0: bool | None = None, last_rows: bool | None = None) -> None:
        """Switch the training forward's row cuts (module docstring); None leaves one as it is.
        The same function either way; on: fewer rows through layer 0's projections and the last
        layer's o_proj/MLP. `set_kernels` sets both to its set's default."""
        if dedup_layer0 is not None:
            self.dedup_layer0 = bool(dedup_layer0)
        if last_rows is not None:
            self.last_rows = bool(last_rows)

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
        anchor_blocks: bool = False,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Final normed hidden states of the block slots.

        block_ids/positions [b, Q]; context = fuse_context(features) [b, S, H] at context_positions
        [b, S]; mask None = one block at inference: full layers see every key, sliding layers the
        window (attention.inference_sliding_mask); training passes attention.layer_masks(...).
        anchor_blocks: the caller vouches that block_ids are training blocks of config.block_size,
        each [any id, MASK x (B-1)] (loss.block_inputs): with `dedup_layer0` layer 0 projects each
        block's slot 0 and one MASK row only. rows: flat indices into [b*Q], ascending and distinct:
        only their hidden states, [R, H] (with `last_rows` the last layer computes no other row after
        its attention; without, the full output normed and then indexed).
        """
        h = self.embed_tokens(block_ids).to(context.dtype)
        rope_q = self.rotary(block_positions, h.dtype)
        rope_kv = self.rotary(torch.cat([context_positions, block_positions], dim=1), h.dtype)
        masks = self._per_layer_masks(mask, context_positions, block_positions)
        blocks = self._anchor_blocks(block_ids) if anchor_blocks and self.dedup_layer0 else None
        cut_last = rows is not None and self.last_rows
        if cut_last and return_layer_outputs:
            raise ValueError("return_layer_outputs needs every row of every layer: pass rows=None")
        outs, last, delta = [], len(self.layers) - 1, None
        for i, layer in enumerate(self.layers):
            m = masks[layer.attention_type] if isinstance(masks, dict) else masks
            h, delta = layer(h, context, rope_q, rope_kv, m, blocks if i == 0 else None,
                             rows if cut_last and i == last else None, delta)
            if return_layer_outputs:
                outs.append(h + delta)
        h = self.norm(h + delta) if self.layers else self.norm(h)
        if rows is not None and not cut_last:
            h = h.reshape(-1, h.shape[-1])[rows]
        return (h, outs) if return_layer_outputs else h

    def _anchor_blocks(self, block_ids: torch.Tensor) -> AnchorBlocks | None:
        blk = self.config.block_size
        if block_ids.shape[1] % blk:
            raise ValueError(
                f"anchor_blocks: {block_ids.shape[1]} block slots are not whole blocks of block_size {blk} "
                "(loss.block_inputs lays out N blocks of B slots)"
            )
        return AnchorBlocks(block_ids.shape[1] // blk, blk) if blk > 1 else None  # B = 1: every row distinct

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
