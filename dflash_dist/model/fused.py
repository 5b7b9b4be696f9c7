"""Fast paths for the drafter's elementwise work: RMSNorm, SwiGLU, q/k-norm + RoPE, and the
per-chunk cross-entropy through the frozen lm_head.

Kernel sets (`DFlashDrafter(cfg, kernels=...)`):
- "torch": the plain torch code in drafter.py / vocab_loss.py, the reference and the CPU path
  (the pinned loss curve runs it);
- "compile": the same functions through torch.compile (inductor fuses each into one or two
  kernels; runs on CPU too), never eagerly: past its own recompile limit a function raises
  (`_compiled`);
- "liger": liger-kernel's Triton RMSNorm (llama casting: normalise in fp32, cast, then scale by
  the gain, as drafter.RMSNorm), its fused residual add + RMSNorm (drafter.RMSNorm.add_forward)
  and SiLU-mul, and its fused cross-entropy kernel (loss, argmax and
  softmax - onehot written in place of the chunk's logits in one launch). Liger's RoPE needs q and
  k of one length (ours: block queries against context + block keys), so RoPE is compiled.
  GPU only (Triton).

The liger and compile sets apply q/k RoPE in the projections' [b, T, heads, d] and return the
transposed view [b, heads, T, d] (the strides the former order gave too): no strided copy either
way, and the norm's incoming gradient stays contiguous (liger's backward copied it). The torch
set keeps RoPE after the transpose (drafter.py): its q/k-norm weight gradient sums over the
gradient's memory order, so fp32 bits would change. Liger's RMSNorm writes dX over dY
(in_place): no norm output's gradient is read after the norm's backward (each is a fresh sum of
GEMM gradients, a fresh row scatter, a disjoint slice of the k/v cat's, or, under the drafter's
last-row cut, the lm_head loss's fresh dL/dh of the rows). Both are bitwise the
former forms (tests/test_fused.py); `set_rope_layout("bhtd")` and `set_rms_norm_in_place(False)`
restore those for side-by-side timing (bench_train_step.py --settings).

Each fast function computes what its reference computes up to bf16 rounding (tests/test_fused.py).
Pure torch (STYLE 6): no DeepSpeed or Ray here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dflash_dist.model import ce_kernel
from dflash_dist.model.ce_kernel import NUM_WARPS, liger_block
from dflash_dist.strict_compile import strict_compile

KERNELS = ("torch", "liger", "compile")


ROPE_LAYOUTS = ("bthd", "bhtd")
# the switches the benchmark flips on a running model (read at each call)
_switch = {"rope_layout": "bthd", "rms_norm_in_place": True, "ce": "liger"}
CE_KERNELS = ("liger", "rows")


def set_rope_layout(layout: str) -> None:
    """liger and compile sets: "bthd" (default) RoPE on [b, T, heads, d], then the transpose view;
    "bhtd" RoPE after the transpose, as before issue 24 (a non-contiguous gradient into the norm)."""
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"rope layout {layout!r}; expected one of {ROPE_LAYOUTS}")
    _switch["rope_layout"] = layout


def set_rms_norm_in_place(in_place: bool) -> None:
    """liger RMSNorm's backward: True (default) writes dX over dY, False into a zeroed new buffer."""
    _switch["rms_norm_in_place"] = bool(in_place)


def set_ce_kernel(name: str) -> None:
    """liger set's per-chunk CE: "liger" (default) liger-kernel's kernel, "rows" ce_kernel.py's (liger's
    arithmetic, its second pass over a row last block first, for the L2 cache)."""
    if name not in CE_KERNELS:
        raise ValueError(f"CE kernel {name!r}; expected one of {CE_KERNELS}")
    _switch["ce"] = name


def check_kernels(kernels: str) -> str:
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}; expected one of {KERNELS}")
    return kernels


def resolve_kernels(kernels: str, on_gpu: bool) -> str:
    """train.kernels "auto": the torch reference on CPU; on a GPU liger when liger-kernel (and
    Triton) import, else torch.compile. Any other value is taken as given."""
    if kernels != "auto":
        return check_kernels(kernels)
    if not on_gpu:
        return "torch"
    try:
        _liger()
    except ImportError:
        return "compile"
    return "liger"


# ---- references (the same arithmetic as drafter.py's modules) ----


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm_ref(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """The pre-norm residual step: (residual + x, RMSNorm of it)."""
    s = residual + x
    return s, rms_norm_ref(s, weight, eps)


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, T, heads, d]; cos/sin [b, T, d]."""
    return x * cos[:, :, None] + _rotate_half(x) * sin[:, :, None]


def rope_bhtd_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, T, d]; cos/sin [b, T, d] (the layout before issue 24)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """q/k path of the attention: x [b, T, heads, d] -> RMSNorm over d, RoPE, to [b, heads, T, d]."""
    return rope_ref(rms_norm_ref(x, weight, eps), cos, sin).transpose(1, 2)


def norm_rope_bhtd_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """norm_rope_ref as before issue 24: RoPE after the transpose."""
    return rope_bhtd_ref(rms_norm_ref(x, weight, eps).transpose(1, 2), cos, sin)


def ce_chunk_ref(logits: torch.Tensor, labels: torch.Tensor, need_grad: bool):
    """(ce fp32 [r], argmax [r], softmax - onehot in the logits' dtype [r, V] or None) of one chunk."""
    log_probs = torch.log_softmax(logits, -1, dtype=torch.float32)
    ce = -log_probs.gather(1, labels[:, None]).squeeze(1)
    argmax = logits.argmax(-1)
    if not need_grad:
        return ce, argmax, None
    cols = torch.arange(logits.shape[-1], device=logits.device)
    probs = log_probs.exp()
    grad = torch.where(cols[None] == labels[:, None], probs - 1, probs).to(logits.dtype)
    return ce, argmax, grad


# ---- torch.compile ----

# Each function compiles with dynamic=None: static at its first call, a dim made dynamic at the first
# recompile it changes at. Every other guard is one more compile: each requires_grad state (the context
# features' norm gets an input that needs no grad, the layers' norms one that does), dtype, size 1 (a
# micro-batch of one row, a one-row last CE chunk), storage offset. Measured on CPU, the drafter's RMSNorm
# took 8 compiles over bf16 micro-batches of 1-4 rows and varying lengths, 13 with fp32 ones as well
# (tests/test_fused_compile.py; 7 and 11 without the drafter's row cuts, whose layer-0 norm sees [b, N+1, H]
# and last norms [rows, H]), 12 with a no-grad pass (before the cuts); norm + RoPE, SwiGLU and the chunk CE at most 7;
# packed rows (one length, varying anchors) 3 in bf16. Dynamo's default limit is 8 per function, past
# which plain torch.compile runs the call eagerly with one logged warning: no fused kernel, and other
# numerics than the compiled calls. Here each function has its own limit, room for a process that runs
# both dtypes, both RoPE layouts, split and joined k/v and no-grad passes (a bench, the GPU tests), and
# raises past it (dflash_dist/strict_compile.py).
KERNEL_RECOMPILE_LIMIT = 64


@functools.cache
def _compiled(fn: Callable) -> Callable:
    """`fn` through torch.compile, never eagerly (strict_compile: fullgraph, so a graph break or a
    TorchDispatchMode, under which dynamo compiles nothing, raises too; at most KERNEL_RECOMPILE_LIMIT
    compiles in any thread, then an error naming the function and what to do)."""
    return strict_compile(
        fn,
        dynamic=None,
        limit=KERNEL_RECOMPILE_LIMIT,
        disabled=f"the compiled kernels ({fn.__name__}, dflash_dist/model/fused.py): torch.compile is disabled "
        "in this process (TORCHDYNAMO_DISABLE=1 or TORCH_COMPILE_DISABLE=1), so train.kernels=compile (and "
        "liger's RoPE) would run the torch reference eagerly under the compiled set's name; unset it, or set "
        "train.kernels=torch",
        past_limit=f"compiled {fn.__name__} (dflash_dist/model/fused.py, train.kernels=compile or liger's RoPE) "
        f"met more input shapes/dtypes/grad states than its {KERNEL_RECOMPILE_LIMIT} compiles: torch.compile "
        "would run it eagerly from here on (no fused kernel, other numerics than its compiled calls); stopped "
        "instead. TORCH_LOGS=recompiles shows what changed; raise dflash_dist.model.fused.KERNEL_RECOMPILE_LIMIT, "
        "or train with train.kernels=torch",
    )


def _compiled_norm_rope(x, weight, eps, cos, sin):
    fn = norm_rope_ref if _switch["rope_layout"] == "bthd" else norm_rope_bhtd_ref
    return _compiled(fn)(x, weight, eps, cos, sin)


# ---- liger ----


@functools.cache
def _liger():
    try:
        from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError as e:  # pragma: no cover (GPU environments)
        raise ImportError(
            "kernels='liger' needs liger-kernel (and Triton on a CUDA device): pip install liger-kernel==0.8.5, "
            f"or use kernels='compile' / 'torch' ({e})"
        ) from e
    return LigerRMSNormFunction, LigerSiLUMulFunction, liger_cross_entropy_kernel, LigerFusedAddRMSNormFunction


def _liger_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # llama casting = drafter.RMSNorm: (x_fp32 * rstd).to(dtype) * weight. in_place: dX over dY,
    # safe as no norm output's gradient is read again (its output feeds GEMMs, RoPE, a row gather or
    # the loss's head, never a residual add, whose backward would hand the same buffer on)
    return _liger()[0].apply(x, weight, eps, 0.0, "llama", _switch["rms_norm_in_place"])


def _liger_add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """(residual + x, its RMSNorm) in one kernel, llama casting as _liger_rms_norm; the backward adds the
    residual stream's gradient into the norm's dX in the same pass (one bf16 rounding of the sum, where the
    separate add rounded the norm's dX first). in_place: dX over dY, safe as for _liger_rms_norm."""
    y, s = _liger()[3].apply(x, residual, weight, eps, 0.0, "llama", _switch["rms_norm_in_place"])
    return s, y


def _liger_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _liger()[1].apply(gate, up)


def _liger_norm_rope(x, weight, eps, cos, sin):
    if _switch["rope_layout"] == "bthd":
        return _compiled(rope_ref)(_liger_rms_norm(x, weight, eps), cos, sin).transpose(1, 2)
    return _compiled(rope_bhtd_ref)(_liger_rms_norm(x, weight, eps).transpose(1, 2), cos, sin)


def _liger_ce_chunk(logits: torch.Tensor, labels: torch.Tensor, need_grad: bool):
    """Liger's CE kernel, reduction "sum": per-row CE and argmax; with need_grad the logits buffer
    is overwritten with softmax - onehot (fp32 math, stored in the logits' dtype)."""
    if _switch["ce"] == "rows":
        return ce_kernel.ce_rows(logits, labels, need_grad)
    kernel = _liger()[2]
    rows, v = logits.shape
    logits = logits.contiguous()
    labels = labels.contiguous()
    ce = torch.empty(rows, dtype=torch.float32, device=logits.device)
    argmax = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        kernel[(rows,)](
            X_ptr=logits, X_stride=logits.stride(-2), Y_ptr=labels, Y_stride=labels.stride(-1), weight_ptr=None,
            loss_ptr=ce, z_loss_ptr=None, loss_stride=ce.stride(-1), token_accuracy_ptr=None,
            token_accuracy_stride=0, predicted_tokens_ptr=argmax, predicted_tokens_stride=argmax.stride(-1),
            n_cols=v, n_non_ignore=1.0, sum_non_ignore_weight=1.0, weight_sum=0.0, ignore_index=-100,
            lse_square_scale=0.0, label_smoothing=0.0, reduction="sum", softcap=None, RETURN_Z_LOSS=False,
            RETURN_TOKEN_ACCURACY=False, RETURN_PREDICTED_TOKENS=True, HAS_WEIGHT=False, HAS_SOFTCAPPING=False,
            HAS_GRADIENTS=need_grad, BLOCK_SIZE=liger_block(v), num_warps=NUM_WARPS,
        )
    return ce, argmax, (logits if need_grad else None)


# ---- the tables the drafter and the loss read ----


def rms_norm_fn(kernels: str) -> Callable | None:
    """(x, weight, eps) -> normed x; None = the module's own torch code. Raises at once (not at
    the first forward) when kernels="liger" and liger-kernel does not import."""
    if check_kernels(kernels) == "liger":
        _liger()
    return {"torch": None, "compile": _compiled(rms_norm_ref), "liger": _liger_rms_norm}[check_kernels(kernels)]


def add_rms_norm_fn(kernels: str) -> Callable | None:
    """(residual, x, weight, eps) -> (residual + x, RMSNorm of it) in one kernel; None = the add, then the
    norm's own kernel (drafter.RMSNorm.add_forward)."""
    return {"torch": None, "compile": _compiled(add_rms_norm_ref), "liger": _liger_add_rms_norm}[check_kernels(kernels)]


def swiglu_fn(kernels: str) -> Callable | None:
    """(gate, up) -> silu(gate) * up; None = the module's own torch code."""
    return {"torch": None, "compile": _compiled(swiglu_ref), "liger": _liger_swiglu}[check_kernels(kernels)]


def norm_rope_fn(kernels: str) -> Callable | None:
    """(x [b, T, heads, d], norm weight, eps, cos, sin) -> [b, heads, T, d]; None = torch code."""
    return {"torch": None, "compile": _compiled_norm_rope, "liger": _liger_norm_rope}[check_kernels(kernels)]


def ce_chunk_fn(kernels: str) -> Callable:
    """(logits [r, V], labels [r], need_grad) -> (ce fp32, argmax, softmax - onehot or None), or
    None for vocab_loss.py's own torch code."""
    return {"torch": None, "compile": _compiled(ce_chunk_ref), "liger": _liger_ce_chunk}[check_kernels(kernels)]


def ce_logits_bytes(kernels: str) -> int:
    """Bytes per logit a chunk holds at once: the torch path keeps fp32 log-probs, the fused ones
    only the input-dtype logits (assumed bf16), so their chunks hold twice the rows."""
    return 4 if check_kernels(kernels) == "torch" else 2
