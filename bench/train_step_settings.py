"""bench_train_step.py's --settings vocabulary: each '+'-joined word sets one of issue 24's switches on the
running engine (SWITCHES), parse_setting reads a setting, apply_setting switches the engine to it."""

from __future__ import annotations

import torch

from dflash_dist.model import loss as loss_mod
from dflash_dist.model import vocab_loss
from dflash_dist.model.attention import HOPPER_D128_TILES, set_flex_tuning
from dflash_dist.model.drafter import row_cuts_default
from dflash_dist.model.fused import set_ce_kernel, set_rms_norm_in_place, set_rope_layout
from dflash_dist.model.vocab_loss import lm_head_cross_entropy

SWITCHES = {  # --settings vocabulary: each word sets one switch on the running engine
    "create": ("mask", "create"), "direct": ("mask", "direct"),  # flex block mask build (attention.py)
    "ds": ("step", "deepspeed"), "lean": ("step", "lean"),  # optimizer step (trainer/zero_step.py)
    "fused": ("step", "fused"),  # the lean step with one AdamW kernel (trainer/fused_adamw.py)
    # the lean step's gradient path: DeepSpeed's (the default) or the trainer's cuts (zero_step.cut_grad_path)
    "dsgrads": ("grads", "ds"), "leangrads": ("grads", "lean"),
    # DeepSpeed's end-of-backward synchronize under overlap_comm (the default), or the compute stream waiting on
    # the reduction stream instead (zero_step.wait_on_device; with lean or fused)
    "episync": ("epi", "sync"), "epiwait": ("epi", "wait"),
    # the one-kernel step's norm: of the gathered flat partitions (the default since 2026-12-06, one reduction a
    # group) or of the gradient list before the gather (the multi-tensor norm, as before)
    "gnormflat": ("gnorm", "flat"), "gnormlist": ("gnorm", "list"),
    # the one-kernel step's gradients: gathered into one flat partition a group (the default), or read where they
    # are, the AdamW update through views at each tensor's offset and the norm of the list (zero_step.install's
    # gather; bitwise the gather with gnormlist)
    "gather": ("gather", True), "nogather": ("gather", False),
    # before 2026-12-06 (default: after): DeepSpeed's throughput timer on and synchronized (its default: a device
    # synchronize in every forward and step()), and the loss's supervised rows found on the device (a nonzero)
    "dstimer": ("timer", True), "notimer": ("timer", False),
    "devrows": ("rows", "device"), "hostrows": ("rows", "host"),
    "ovf": ("ovf", True), "noovf": ("ovf", False),  # DeepSpeed's inf/nan pass (bf16 check_grad_overflow)
    "cat": ("kv", False), "splitkv": ("kv", True),  # k/v projections of cat(context, x) or of each part
    # the drafter's row cuts (drafter.py; without a word, on with liger/compile, off with torch: the trainer's):
    # layer 0's norm and block q/k/v projections on the N+1 distinct rows, or on all N*B block rows
    "dedup0": ("dedup0", True), "nodedup0": ("dedup0", False),
    # the last layer's o_proj, MLP and norms on the supervised rows only, or on every block row
    "lastrows": ("lastrows", True), "alllastrows": ("lastrows", False),
    # each residual add in the next RMSNorm's kernel (drafter.RMSNorm.add_forward; the default with liger/compile)
    # or the add and then the norm (before 2026-12-07)
    "addnorm": ("addnorm", True), "noaddnorm": ("addnorm", False),
    # the dX of the linears reading one input (q/k/v of the k/v cat, MLP gate and up) summed in one buffer by the
    # GEMMs (shared_input.py; opt-in), or autograd's adds (the default)
    "onedx": ("onedx", True), "adddx": ("onedx", False),
    # slot weights (default: --position-weighting); twopass: D-PACE as before 2026-12-04, a no-grad
    # lm_head pass for the confidences and then the weighted one (onepass: the head once, vocab_loss.py)
    "decay": ("weighting", "decay"), "dpace": ("weighting", "dpace"),
    "onepass": ("passes", 1), "twopass": ("passes", 2),
    # fused.py (liger/compile): q/k RoPE before the transpose or after it; liger RMSNorm dX over dY or into zeros
    "ropebthd": ("rope", "bthd"), "ropebhtd": ("rope", "bhtd"), "rmsinplace": ("rms", True), "rmscopy": ("rms", False),
    # the compiled flex kernels' tiles (attention.set_flex_tuning): without an fa word the device's default (m32n64tma
    # on sm90 at head_dim 128: attention.default_flex_options), fatorch torch's own choice, another FLEX_PRESETS
    # entry, or inductor's autotuning of the forward and backward kernels at this shape (its timing table on stderr)
    # the head's chunks (vocab_loss.py): logits bytes a chunk (2 GiB the default since 2026-12-07, 1 GiB before; 4 GiB:
    # the 27B shape's 7680 rows in one chunk) and how the rows are cut (balanced, the default since 2026-12-07, or
    # greedy: full chunks then the rest). Every setting without these words, BEFORE's too, runs the defaults.
    "ce1g": ("ce_bytes", 2**30), "ce2g": ("ce_bytes", 2**31), "ce4g": ("ce_bytes", 2**32),
    "cegreedy": ("ce_split", "greedy"), "cebal": ("ce_split", "balanced"),
    # the liger set's per-chunk CE kernel (fused.set_ce_kernel): liger-kernel's (the default) or ce_kernel.py's
    # (liger's arithmetic, the second pass over a row last block first)
    "celiger": ("ce_kernel", "liger"), "cerows": ("ce_kernel", "rows"),
    # the gradient list's norm (nogather, gnormlist): torch's multi-tensor norm (the default) or a vector_norm for each
    # tensor of at least 1M elements (zero_step.set_list_norm)
    "normforeach": ("list_norm", "foreach"), "normsplit": ("list_norm", "split"),
    **{f"fa{name}": ("flex", name)
       for name in ("torch", "m64n64", "m32n128", "stages2", "m32n64", "tma", "m32n64tma", "autotune")},
}
# Backward tiles (BLOCK_M1 x BLOCK_N1 for dK/dV, BLOCK_M2 x BLOCK_N2 for dQ) against torch's choice on an
# H100/H200 at head_dim 128 (64 x 128, 128 x 64, 8 warps, 3 stages): the profile of 2026-12-04 put the
# flex backward at 3.1 ms a layer, 4.3x its forward (FlashAttention-2-style kernels run ~2.5x), so the
# tiling is the first suspect. Each tiling sums in another order: the gpu test in tests/test_block_mask.py
# bounds each one's error against an fp32 reference by the default's.
FLEX_PRESETS = {
    "torch": {},
    "m64n64": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
               "bwd_num_warps": 4, "bwd_num_stages": 3},
    # 8 warps: with 4, the dK and dV accumulators of a 128-key tile at head_dim 128 need ~256 registers a
    # thread (the limit is 255), a spilling kernel (review); torch picks this tiling only below head_dim 64
    "m32n128": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                "bwd_num_warps": 8, "bwd_num_stages": 3},
    "stages2": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                "bwd_num_warps": 8, "bwd_num_stages": 2},
    # inductor's autotuning picked these on the H200 (eighth lease, docs/BENCHMARKS.md): forward 64 x 64 (8.24
    # against 8.96 for torch's 128 x 128 in its table), backward 32 x 64 / 64 x 32 (24.7 against 26.4); the
    # whole step under autotuning was not faster, inside the step's spread: bench_flex.py times them alone
    "m32n64": {k: v for k, v in HOPPER_D128_TILES.items() if k != "USE_TMA"},
    # Hopper's tensor memory accelerator for the q/k/v/dO tile loads (torch's templates have it, off by default
    # on CUDA): the same tiles and sums, loaded by TMA
    "tma": {"USE_TMA": True},
}
FLEX_PRESETS["m32n64tma"] = dict(HOPPER_D128_TILES)  # the default on sm90 at head_dim 128 since 2026-12-06
CHUNKS = (vocab_loss.CHUNK_BYTES, vocab_loss.CHUNK_SPLIT)  # the defaults, for settings without ce words
BEFORE = {"mask": "create", "step": "deepspeed", "ovf": True, "kv": False, "grads": "ds"}  # before issue 24


def parse_setting(text: str) -> dict:
    """'direct+lean' -> the BEFORE switches with those words applied."""
    out = dict(BEFORE)
    for word in text.split("+"):
        if word not in SWITCHES:
            raise SystemExit(f"--settings: unknown word {word!r} in {text!r}; expected '+'-joined {sorted(SWITCHES)}")
        key, value = SWITCHES[word]
        out[key] = value
    if out.get("passes") == 2 and out.get("weighting") != "dpace":
        raise SystemExit(f"--settings: {text!r}: twopass is D-PACE's former form, so it needs the word dpace")
    if out["grads"] == "lean" and out["step"] not in ("lean", "fused"):
        raise SystemExit(f"--settings: {text!r}: leangrads cuts the lean step's gradient path; add lean or fused")
    if out.get("epi") == "wait" and out["step"] not in ("lean", "fused"):
        raise SystemExit(f"--settings: {text!r}: epiwait comes with the lean step; add lean or fused")
    if out.get("gather") is False and out["step"] != "fused":
        raise SystemExit(f"--settings: {text!r}: nogather is the one-kernel step's; add fused")
    if out.get("list_norm") == "split" and out.get("gather", True) and out.get("gnorm", "flat") == "flat":
        raise SystemExit(f"--settings: {text!r}: normsplit splits the gradient list's norm; add nogather or gnormlist")
    if out.get("gather") is False and out.get("gnorm") == "flat":
        raise SystemExit(f"--settings: {text!r}: gnormflat is the norm of the gathered partitions; nogather has none")
    return out


def _two_pass_dpace(hidden, weight, labels, row_weights, chunk_rows=None, kernels="torch"):
    """D-PACE's chunked loss as it ran before 2026-12-04: a no-grad head pass for the CE, the
    weights from it, then the weighted pass (the same numbers as one pass, a head pass more)."""
    if callable(row_weights):
        with torch.no_grad():
            _, ce, _ = lm_head_cross_entropy(hidden, weight, labels, torch.zeros_like(labels, dtype=torch.float32),
                                             chunk_rows, kernels)
        row_weights = row_weights(ce)
    return lm_head_cross_entropy(hidden, weight, labels, row_weights, chunk_rows, kernels)


def apply_setting(engine, setting: dict) -> None:
    """Switch the running engine (same weights, same compiled flex) to a --settings entry."""
    from dflash_dist.trainer import zero_step

    engine.module.block_mask = setting["mask"]
    base = vars(engine.module).setdefault("cli_weighting", engine.module.position_weighting)  # before any setting
    engine.module.position_weighting = setting.get("weighting", base)
    loss_mod.lm_head_cross_entropy = _two_pass_dpace if setting.get("passes", 1) == 2 else lm_head_cross_entropy
    drafter = engine.module.drafter
    drafter.set_split_kv(setting["kv"])
    cuts = row_cuts_default(drafter.kernels)  # a setting without the words: what the trainer runs with these kernels
    drafter.set_row_cuts(setting.get("dedup0", cuts), setting.get("lastrows", cuts))
    drafter.set_fused_add_norm(setting.get("addnorm", True))
    drafter.set_one_dx(setting.get("onedx", False))
    engine.optimizer.check_grad_overflow = setting["ovf"]
    timer = engine.tput_timer.config  # ds_config turns it off; "dstimer" as DeepSpeed's default has it
    timer.enabled = timer.synchronized = setting.get("timer", False)
    engine.module.host_rows = setting.get("rows", "host") == "host"
    zero_step.set_list_norm(setting.get("list_norm", "foreach"))
    zero_step.uninstall(engine)  # DeepSpeed's step and gradient path, then the setting's
    # a setting without epiwait: DeepSpeed's sync; without gnormlist: the norm of the gathered partitions; without
    # nogather: the gather
    zero_step.install(engine, setting["step"], on_gpu=True, grad_cuts=setting["grads"] == "lean",
                      epilogue_wait=setting.get("epi") == "wait", norm_of_flat=setting.get("gnorm", "flat") == "flat",
                      gather=setting.get("gather", True))
    set_rope_layout(setting.get("rope", "bthd"))  # a setting without these words: the defaults (after issue 24)
    set_rms_norm_in_place(setting.get("rms", True))
    set_ce_kernel(setting.get("ce_kernel", "liger"))
    vocab_loss.CHUNK_BYTES = setting.get("ce_bytes", CHUNKS[0])
    vocab_loss.CHUNK_SPLIT = setting.get("ce_split", CHUNKS[1])
    flex = setting.get("flex")  # none: the device's default tiles (attention.default_flex_options)
    set_flex_tuning(FLEX_PRESETS.get(flex), autotune=flex == "autotune")


def recover(engine) -> None:
    """After a setting failed inside its step: drop the interrupted step's gradients and DeepSpeed
    0.19.8's ZeRO-1/2 reduce bookkeeping, as a finished step leaves them. A tiling the compiler refuses
    fails in the flex backward (compiled at its first call), after the gradient hooks of the later
    layers queued their parameters in the reduce bucket or marked them reduced: without this the next
    setting's backward fails on them (a stale bucket entry whose gradient zero_grad dropped, or
    DeepSpeed's "has already been reduced" assertion) and every later setting with it."""
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

    opt = engine.optimizer
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # reductions the interrupted backward queued on DeepSpeed's side stream
    for bucket in opt.ipg_buckets.values():
        bucket.clear()
    opt.extra_large_param_to_reduce.clear()
    for params in opt.previous_reduced_grads.values():
        params.clear()
    opt.params_already_reduced[:] = [False] * len(opt.params_already_reduced)
    opt._release_ipg_buffers()  # the bucket buffers and the large-gradient partition, rebuilt at the next backward
    for i in range(len(opt.bit16_groups)):
        opt.averaged_gradients[i] = None
        opt.all_grad_tensors[i] = None
    opt.micro_step_id = INITIAL_MICRO_STEP_ID
    engine.zero_grad()
