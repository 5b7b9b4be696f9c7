"""The run configuration: one typed tree, loaded from YAML plus `key.path=value` overrides.

Every section is a pydantic model with `extra="forbid"` and strict types: an unknown key, a wrong
type, a value out of its range or not among its choices is an error naming the field path
(STYLE 3). Each field's rule sits next to it (its type, `Literal` choices, `Field` bounds); the
rules across fields are in `_validate`. Derived values (layer ids, mask id, world size) are
computed where they are needed, never stored twice.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message names the field."""


def _yaml_float(value):
    """YAML 1.1 reads `1e-3` (no dot) as a string: accept numeric strings for float fields."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


# every float finite: `.inf`/`.nan` (YAML) or "inf"/"nan" are refused naming the field
Float = Annotated[float, BeforeValidator(_yaml_float), Field(allow_inf_nan=False)]
PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
PosFloat = Annotated[Float, Field(gt=0)]
NonNegFloat = Annotated[Float, Field(ge=0)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


class RunSection(_Section):
    name: str = "dflash"
    seed: NonNegInt = 0
    out_dir: str = "runs/dflash"


class TargetSection(_Section):
    # hf: a local HF model directory; tiny_stdlib: the project's tiny target; code_lm: the project's
    # ~88M code LM (target/code_target.py). The project's own kinds are built on first use and cached
    # (target.path: their directory instead of the cache's)
    kind: Literal["hf", "tiny_stdlib", "code_lm"] = "hf"
    # code_lm only: qwen3 (dense, the default) | qwen3_5 (hybrid) | test, test_qwen3_5 (test size, CPU, seconds)
    preset: Literal["qwen3", "qwen3_5", "test", "test_qwen3_5"] = "qwen3"
    path: str | None = None
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = "sdpa"
    allow_torch_gdn_on_cuda: bool = False


class DataSection(_Section):
    # JSONL, .parquet, or a `datasets` save_to_disk dir; the project's own targets (tiny_stdlib, code_lm) make their own
    train_path: str | None = None
    eval_path: str | None = None  # held-out conversations (their prompts) for tau
    # auto (per record) | messages (OpenAI role/content) | sharegpt (conversations from/value)
    format: Literal["auto", "messages", "sharegpt"] = "auto"
    enable_thinking: bool | None = None  # passed to templates with that switch; None: the template's default
    on_bad_record: Literal["error", "skip"] = "error"  # error: stop naming file:line/row; skip: skip, count, report
    on_overlong: Literal["truncate", "skip", "error"] = "truncate"  # over max_length: truncate | skip (counted) | error
    max_train_samples: PosInt | None = None
    max_length: Annotated[int, Field(ge=2)] = 2048
    # samples lost in total, those the capture skipped (non-finite features, or an empty response of
    # capture.regenerate) plus those no trainer could read (a missing, truncated or corrupt shard), as a
    # fraction of the run's planned samples (epochs x samples), before the run fails (a capture alone is
    # held to it too); 0: any loss fails it. `dflash-dist regenerate` holds its empty responses to it too
    max_lost_fraction: Annotated[Float, Field(ge=0, le=1)] = 0.0


class CaptureSection(_Section):
    num_actors: PosInt = 1
    num_layers: PosInt = 5  # k, when layer_ids is not given
    layer_ids: list[NonNegInt] | None = None
    # replace assistant responses by the target's greedy ones; an empty one (the target stopped at once)
    # makes no sample: recorded lost in shards/skipped.jsonl (empty_response), held to data.max_lost_fraction
    regenerate: bool = True
    max_new_tokens: PosInt = 256
    batch_size: PosInt = 8  # prompts per greedy-regeneration batch; sequences per capture pass without token_budget
    # padded tokens (longest x count) per target capture pass, sequences length-sorted within
    # sort_window; None: batch_size sequences per pass
    token_budget: PosInt | None = None
    sort_window: PosInt = 256
    shard_bytes: PosInt = 1 << 30  # a shard is closed before it would exceed this (about 1 GB)
    # unconsumed (not yet trained-and-checkpointed) shard bytes at which capture pauses; the directory
    # then holds at most this plus one shard in flight per writer (capture.writers, at least one) of each
    # actor. None: unbounded
    max_buffer_bytes: PosInt | None = None
    # shards released by a checkpoint: auto deletes them under a cap with train.epochs == 1 or when later
    # epochs are captured again, else keeps
    consumed_shards: Literal["auto", "keep", "delete"] = "auto"
    # epochs after the first: keep re-reads epoch 0's shards (the whole set stays on disk); recapture runs
    # the target forward again over the conversations fixed in epoch 0 (kept as tokens under
    # shards/sequences/) into shards/epoch_<e>/, deleted once trained, so disk stays at the cap for any
    # train.epochs at the cost of epochs x the capture's GPU time; auto: recapture when one epoch's shards
    # would not fit capture.max_buffer_bytes (the run plan prints both costs; orchestration/later_epochs.py)
    later_epochs: Literal["keep", "recapture", "auto"] = "keep"
    buffer_stall_s: PosFloat = 3600.0  # paused this long with no shard released: an error, not a hang
    max_restarts: NonNegInt = 3  # Ray restarts a dead target actor this often; its capture resumes from the ledger
    cpus_per_actor: NonNegFloat = 1.0
    gpus_per_actor: NonNegFloat = 0.0
    # writer processes per target actor: device-to-host copies on a side stream into pinned shared
    # buffers, encoded and written off the GPU thread (capture/host_sink.py); 0: on the GPU thread
    writers: NonNegInt = 0
    # with writers > 0: a writer process with no job for 2 ms starts the disk write of its open shard
    # (ShardWriter.start_writeback: Linux sync_file_range, in 32 MiB ranges until a job comes; the pages
    # stay cached), so closing a shard, and the drain after the capture's last pass, wait for its tail
    # only, not for up to a whole shard kept dirty in the page cache. False: the kernel's own write-back
    # (from vm.dirty_background_ratio of memory or dirty_expire_centisecs' age) and the closing fsync
    writeback_idle: bool = True
    # eager: transformers' modules as they are; fused (CUDA only): torch.compile'd RMSNorms, gated
    # RMSNorm and SwiGLU plus fla's causal conv (capture/fused_target.py): kernel path "fla_fused";
    # fused2: that plus the rewritten Gated DeltaNet, attention and decoder-layer forwards
    # (capture/fused_layers.py: one input GEMM, compiled gating, q/k norm + RoPE, add + norm): "fla_fused2"
    kernels: Literal["eager", "fused", "fused2"] = "eager"
    # how shards store the features (data_pipeline/feature_codec.py): bf16: as the target computes
    # them (bf16 on every real target; a float32 CPU test target's stay float32); fp8: float8_e4m3fn
    # with a power-of-two scale per (token, layer), about half the bytes, decoded when read. The
    # provenance records it: trainers refuse shards of the other encoding. The evaluator always
    # measures on the target's own features, as serving does
    feature_dtype: Literal["bf16", "fp8"] = "bf16"


class DrafterSection(_Section):
    num_layers: PosInt = 5
    num_heads: PosInt = 32
    num_kv_heads: PosInt = 8
    head_dim: Annotated[int, Field(ge=2, multiple_of=2)] = 128  # even: RoPE rotates pairs
    intermediate_size: PosInt | None = None  # default: the target's
    block_size: Annotated[int, Field(ge=2)] = 16  # the anchor and at least one slot to draft
    mask_token_id: NonNegInt | None = None  # default: the tokenizer's mask token
    # attention per drafter layer (SPEC 2): full_attention (bidirectional over context < anchor and the
    # block) or sliding_attention (the last `sliding_window` positions, causal inside the block; z-lab's
    # Qwen3.6-27B drafter: 4 x sliding + full, window 2048). None: every layer full
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    sliding_window: PosInt | None = None  # tokens a sliding layer's query sees, itself included (HF's convention)


class TrainSection(_Section):
    world_size: PosInt = 1
    zero_stage: Literal[0, 1, 2, 3] = 2
    micro_batch_size: PosInt = 1
    # token budget per micro-batch: samples join while (longest x count) <= budget (at least one);
    # None: micro_batch_size samples each. DeepSpeed's train_micro_batch_size_per_gpu stays
    # micro_batch_size either way (it only does bookkeeping: throughput, train_batch_size)
    micro_batch_tokens: PosInt | None = None
    # concatenate a micro-batch's samples into one row of micro_batch_tokens (default: micro_batch_size
    # x data.max_length), documents kept apart by the block mask (trainer/batching.py); 1.19x samples/s
    # over padding on a chat-like length mix at the 27B shape (docs/BENCHMARKS.md). "auto": on for
    # GPU ranks (gpus_per_rank > 0), off on CPU. Off: right-padded rows. With token-budget micro-batches
    # (packing or micro_batch_tokens) a step holds a varying number of samples, so the LR schedule
    # follows samples trained instead of steps (unless train.max_steps fixes its length in steps)
    packing: bool | Literal["auto"] = "auto"
    # samples within a shard in a permutation seeded by (run.seed, epoch, shard); the shard order
    # of epochs after the first is permuted by (run.seed, epoch) either way
    shuffle: bool = True
    grad_accum: PosInt = 1
    lr: Annotated[Float, Field(gt=0, le=1)] = 6e-4
    warmup_frac: Annotated[Float, Field(ge=0, lt=1)] = 0.04
    weight_decay: NonNegFloat = 0.0
    grad_clip: NonNegFloat = 1.0  # 0: no clipping
    epochs: PosInt = 6
    max_steps: PosInt | None = None
    num_anchors: PosInt = 512
    label_source: Literal["data", "target"] = "data"
    gamma: PosFloat | None = None  # default by block size (7 for B=16)
    # Recipe options (model/loss.py; issue 13). Each default is the behaviour the pinned loss curve
    # (tests/data/loss_curve_zero2.json) was recorded with; bench/bench_quality_run.py measures the
    # alternatives on a finished run (docs/BENCHMARKS.md) and a default flips where a variant
    # separates from it over seeds (issue 20).
    # anchors: "mask" needs loss_mask[a]; "mask_next" also loss_mask[a+1] (SpecForge's DSpark and
    # TorchSpec's DFlash samplers), so no block starts on a turn's last token and supervises nothing
    anchor_rule: Literal["mask", "mask_next"] = "mask"
    # slot weights: "decay" exp(-(s-1)/gamma) (the paper, SpecForge's default); "dpace" D-PACE
    # (arXiv 2605.18810, alpha 0.5), the default of Model-Optimizer (PR #1724) and speculators (PR #980).
    # dpace since 2026-12-04: on the H200 quality bench over the mid_gpu run (88M code target, 3 seeds,
    # 7252 samples) tau 1.815 +- 0.021 chain / 2.142 +- 0.051 DDTree-8 against decay's 1.377 +- 0.014 /
    # 1.680 +- 0.014, above on every seed at every mark (docs/BENCHMARKS.md); the pinned loss curve was
    # re-recorded for it
    position_weighting: Literal["decay", "dpace"] = "dpace"
    # "micro_batch": sum(w*CE)/sum(w) per micro-batch (each micro-batch counts the same);
    # "step_slots": over the whole optimizer step and all ranks (each supervised slot counts the same)
    loss_norm: Literal["micro_batch", "step_slots"] = "micro_batch"
    attention: Literal["auto", "dense", "flex"] = "auto"
    # the drafter's elementwise kernels and lm_head CE (model/fused.py): "torch" (the reference; CPU),
    # "liger" (Triton, needs liger-kernel), "compile" (torch.compile); "auto": torch on CPU, on a GPU
    # liger when liger-kernel imports, else compile (27B shape, H200: 3.29 -> 3.84 samples/s, docs/BENCHMARKS.md)
    kernels: Literal["auto", "torch", "liger", "compile"] = "auto"
    # DeepSpeed's separate inf/nan pass over the bf16 gradients before the step (bf16
    # check_grad_overflow); off saves ~9 ms a step at the 27B shape, but a non-finite gradient is then
    # applied instead of skipped (the trainer still fails on a non-finite logged loss)
    grad_overflow_check: bool = True
    # the optimizer step around AdamW (trainer/zero_step.py): "deepspeed" (DeepSpeed's ZeRO-1/2 step),
    # "lean" (the same state and checkpoints; one fp32 norm, clip and non-finite skip inside the fused
    # AdamW kernel, no host sync), "fused" (lean with one compiled AdamW kernel that reads the bf16
    # gradients and writes the bf16 weights: trainer/fused_adamw.py; opt-in: at the 27B shape on the H200
    # -7.5 ms a step at world size 1 (3%), but 3.38 vs lean's 3.94 ms at 1/9 of the parameters, 0.13% of a
    # 9-rank step, docs/BENCHMARKS.md), "auto": lean on GPU ranks, deepspeed on CPU (the pinned loss curve)
    optimizer_step: Literal["auto", "deepspeed", "lean", "fused"] = "auto"
    # ZeRO-1/2's gradient reduction each micro-batch (DeepSpeed's use_multi_rank_bucket_allreduce,
    # ds_config.py): "allreduce" (DeepSpeed's default) all-reduces every whole bucket, 2(N-1)/N x 2P bytes
    # of ring bus per rank; "reduce" sends each rank its partition's slices, one `reduce` per destination
    # rank and bucket, 2P of bus in all (0.56x at 9 ranks), but DeepSpeed synchronizes the device before
    # each reduce under overlap_comm. gloo, 377,728 parameters, per rank and micro-batch: 766,400 ->
    # 573,456 B sent at 2 ranks, 1,028,044 -> 686,288 at 3; the same losses and weights bitwise at 2 ranks,
    # within one bf16 rounding at 3 (another addition order; tests/test_grad_reduce.py). The cost model
    # (bench/cost_model.py) puts 9 ranks of the 27B drafter at 4.80 vs 4.74 samples/s per GPU in one NVLink
    # domain, 4.52 vs 4.53 as 5+4 nodes, 3.04 vs 3.52 as 8+1: allreduce stays the default until NCCL
    # timings on several GPUs exist (docs/BENCHMARKS.md)
    zero_grad_reduce: Literal["allreduce", "reduce"] = "allreduce"
    checkpoint_every: PosInt = 500
    keep_checkpoints: PosInt = 3
    log_every: PosInt = 10
    log_sample_keys: bool = False  # every rank appends its trained sample keys to <out>/sample_log/ (audits)
    histogram_every: PosInt = 100  # steps between TensorBoard histograms (per-parameter grad norms, per-sample loss)
    cpus_per_rank: NonNegFloat = 1.0
    gpus_per_rank: NonNegFloat = 0.0
    max_restarts: NonNegInt = 3  # a lost rank: the group restarts from the latest checkpoint this often (0: never)
    # the n-th restart waits restart_backoff_s * 2**(n-1), at most max_restart_backoff_s: long enough for a lost
    # node to be replaced or declared dead by the cluster (Slurm, Ray autoscaler) before the new group asks for it
    restart_backoff_s: NonNegFloat = 2.0
    max_restart_backoff_s: NonNegFloat = 60.0


class EvalSection(_Section):
    enabled: bool = True
    num_prompts: PosInt = 16
    max_new_tokens: PosInt = 256
    budgets: list[PosInt] = Field(default_factory=lambda: [8, 16])  # DDTree node budgets (besides the chain)
    poll_s: PosFloat = 5.0
    max_backlog: PosInt = 4  # more exports waiting than this: evaluate the newest and every stride-th
    backlog_stride: PosInt = 2
    num_cpus: NonNegFloat = 1.0
    num_gpus: NonNegFloat = 0.0
    max_restarts: NonNegInt = 3  # Ray restarts a lost evaluator this often; it continues after its last result
    # replay: greedy-replay tau at every checkpoint; live: also real speculative decoding through the target's
    # cache (exact GDN rollback); server: also the serving engine's own count from eval.server_url
    mode: Literal["replay", "live", "server"] = "replay"
    live_every: PosInt = 1  # live/server: at every N-th evaluated checkpoint (and the first); replay runs at every one
    live_first: bool = True  # live/server at the first evaluated checkpoint (an early check of the decoding path)
    live_last: bool = True  # ... and at the run's last export (train.max_steps, when the run sets it)
    # live: processes decoding prompts side by side, each with its own copy of the target and drafter (live
    # decoding is one prompt at a time and launch-bound on a small target; keep 1 where the target fills the GPU)
    live_workers: PosInt = 1
    reference_batch: PosInt = 32  # held-out prompts per greedy-generation batch of the references (left-padded)
    # capped: a round stops at the continuation's end; uncapped: the authors' count
    count: Literal["capped", "uncapped"] = "capped"
    # a z-lab-format drafter directory, measured once beside the run's checkpoints
    reference_drafter: str | None = None
    server_url: str | None = None  # server: the engine's base URL, e.g. http://127.0.0.1:30000 (SGLang), :8000 (vLLM)
    server_engine: Literal["sglang", "vllm"] = "sglang"  # server: which engine's accept-length fields to read
    server_model: str | None = None  # server: the served model name (vLLM needs it; SGLang ignores it)
    server_concurrency: PosInt = 4  # server: requests in flight
    server_max_retries: NonNegInt = 3  # server: retries of a 5xx, 429, timeout or lost connection (backoff)
    server_timeout_s: PosFloat = 300.0  # server: per request


class RegenSection(_Section):
    """`dflash-dist regenerate`: the target answers the input's prompts afresh (dflash_dist/capture/regenerate.py);
    an empty response leaves its record out (<output>.rejected.jsonl), held to data.max_lost_fraction."""

    source: Literal["target", "server"] = "target"  # target: the run's target via generate; server: OpenAI-compatible
    input: str | None = None  # conversations (any data.* source kind); default data.train_path
    output: str | None = None  # the new JSONL; default <run.out_dir>/data/train.regenerated.jsonl
    url: str | None = None  # server: base URL, e.g. http://127.0.0.1:30000/v1
    model: str | None = None  # server: the served model's name
    api_key_env: str = "OPENAI_API_KEY"  # server: environment variable holding its key (unset: no key)
    temperature: NonNegFloat = 0.0  # 0: greedy
    top_p: Annotated[Float, Field(gt=0, le=1)] = 1.0
    max_new_tokens: PosInt = 256
    batch_size: PosInt = 8  # target: prompts per generate call
    concurrency: PosInt = 8  # server: requests in flight
    max_retries: NonNegInt = 5  # server: retries of a 5xx, 429, timeout or lost connection (exponential backoff)
    timeout_s: PosFloat = 600.0  # server: per request


class NodeResources(_Section):
    """Node constraint per role: a custom resource that only the intended nodes declare
    (cluster.yaml node types' `resources`, or `ray start --resources`); None: any node."""

    target: str | None = None
    trainer: str | None = None
    evaluator: str | None = None


class RaySection(_Section):
    address: str | None = None  # None: start a local cluster
    num_cpus: PosInt | None = None
    dashboard: bool = False
    dashboard_host: str = "127.0.0.1"
    # one placement group, a bundle per role process (dflash_dist/orchestration/placement.py)
    placement: Literal["pack", "spread", "strict_pack", "none"] = "pack"
    placement_timeout_s: PosFloat = 600.0  # the cluster cannot place every bundle by then: an error saying why
    node_resources: NodeResources = Field(default_factory=NodeResources)


class Config(_Section):
    run: RunSection = Field(default_factory=RunSection)
    target: TargetSection = Field(default_factory=TargetSection)
    data: DataSection = Field(default_factory=DataSection)
    capture: CaptureSection = Field(default_factory=CaptureSection)
    drafter: DrafterSection = Field(default_factory=DrafterSection)
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    ray: RaySection = Field(default_factory=RaySection)
    regen: RegenSection = Field(default_factory=RegenSection)

    @property
    def out(self) -> Path:
        return Path(self.run.out_dir)

    def pack_tokens(self) -> int | None:
        """The packed row's length when the trainer packs (train.packing, "auto": on GPU ranks),
        else None."""
        t = self.train
        on = t.gpus_per_rank > 0 if t.packing == "auto" else t.packing
        if not on:
            return None
        return t.micro_batch_tokens if t.micro_batch_tokens is not None else t.micro_batch_size * self.data.max_length

    def schedule_unit(self) -> Literal["step", "sample"]:
        """What the LR schedule counts: samples trained, unless train.max_steps fixes its length
        in optimizer steps. Steps per epoch are not known ahead: token-budgeted micro-batches hold
        varying sample counts, and an epoch's last steps train whatever remainder its shards leave
        each rank (trainer/step_source.py), while the samples of an epoch are known."""
        return "step" if self.train.max_steps is not None else "sample"

    def to_dict(self) -> dict:
        return self.model_dump()


_TYPE_WORDS = {"float": "float", "int": "int", "string": "str", "bool": "bool", "list": "a list", "dict": "a mapping",
               "model": "a mapping"}


def _describe(err: dict) -> str:
    """One pydantic error as `path: what is wrong`, in the words of the old hand-written checker."""
    loc = [str(x) for x in err["loc"] if not (isinstance(x, str) and x.startswith(("function-", "constrained-")))]
    # a union's branch names (`int`, `none`, ...) appear in loc; keep field names and list indices
    path = ".".join(x for x in loc if x not in {"int", "float", "str", "bool", "none", "list[int]", "list"})
    kind, got = err["type"], err.get("input")
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden":
        return f"unknown key {path}"
    if kind == "finite_number":
        return f"{path} must be a finite number, got {got!r}"
    if kind == "literal_error":
        return f"{path}: {got!r} is not one of {ctx.get('expected', '')}"
    for bound, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than") and bound in ctx:
            return f"{path} must be {word} {ctx[bound]}, got {got!r}"
    if kind == "multiple_of":
        return f"{path} must be a multiple of {ctx.get('multiple_of')}, got {got!r}"
    for prefix, word in _TYPE_WORDS.items():
        if kind.startswith(prefix):
            return f"{path}: expected {word}, got {type(got).__name__} {got!r}"
    return f"{path}: {err['msg']} (got {got!r})"


def _known_keys(path: str) -> str:
    """`(known keys of SECTION: ...)` for an unknown key at `path`."""
    model: type[BaseModel] = Config
    parts = path.split(".")[:-1]
    for p in parts:
        field = model.model_fields.get(p)
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return ""
        model = ann
    where = f" of {'.'.join(parts)}" if parts else ""
    return f" (known keys{where}: {', '.join(sorted(model.model_fields))})"


def _build(tree: dict) -> Config:
    if not isinstance(tree, dict):
        raise ConfigError(f"expected a mapping at the top, got {type(tree).__name__}")
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        first = e.errors()[0]
        msg = _describe(first)
        if first["type"] == "extra_forbidden":
            msg += _known_keys(msg.removeprefix("unknown key "))
        more = len(e.errors()) - 1
        raise ConfigError(msg + (f" (and {more} more error{'s' if more > 1 else ''})" if more else "")) from None


def _set_path(tree: dict, dotted: str, value, where: str) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{where}: {dotted}: {k} is not a section")
    node[keys[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] = (), out_dir: str | None = None,
                check_files: bool = True) -> Config:
    """YAML file (or the defaults when path is None) + `a.b=c` overrides (values parsed as YAML).

    check_files=False skips the checks that the named target and data files exist (deriving a
    drafter shape from a target's config.json needs neither weights nor data)."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found")
        try:
            tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not a UTF-8 text file ({e.reason} at byte {e.start}): pass a YAML file") \
                from None  # fmt: skip
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: expected a mapping of sections (run:, target:, ...) at the top, got "
                              f"a YAML {type(tree).__name__}")  # fmt: skip
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        _set_path(tree, key.strip(), yaml.safe_load(raw) if raw.strip() else None, f"override {item!r}")
    if out_dir is not None:
        _set_path(tree, "run.out_dir", str(out_dir), "--out")
    try:
        cfg = _build(tree)
    except ConfigError as e:
        raise ConfigError(f"{path or 'config'}: {e}") from None
    _validate(cfg, path, check_files)
    return cfg


def _validate(cfg: Config, path, check_files: bool = True) -> None:
    where = path or "config"
    if cfg.target.kind == "hf" and not cfg.target.path:
        raise ConfigError(f"{where}: target.path is required when target.kind is 'hf'")
    if cfg.target.preset != "qwen3" and cfg.target.kind != "code_lm":
        raise ConfigError(f"{where}: target.preset={cfg.target.preset!r} applies to target.kind code_lm only (kind is "
                          f"{cfg.target.kind!r}): remove it")
    _validate_drafter(cfg.drafter, where)
    if check_files and cfg.target.path and cfg.target.kind == "hf" and not Path(cfg.target.path).exists():
        raise ConfigError(f"{where}: target.path {cfg.target.path} does not exist")
    for key in ("data.train_path", "data.eval_path"):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if check_files and value is not None and not Path(value).exists():
            raise ConfigError(f"{where}: {key}: file {value} not found")
    if cfg.target.kind == "hf" and cfg.data.train_path is None:
        raise ConfigError(f"{where}: data.train_path is required for an hf target")
    d = cfg.drafter
    if d.num_heads % d.num_kv_heads:
        raise ConfigError(f"{where}: drafter.num_heads={d.num_heads} is not a multiple of drafter.num_kv_heads="
                          f"{d.num_kv_heads} (grouped-query attention shares each KV head among equal groups)")
    t = cfg.train
    if t.micro_batch_tokens is not None and t.micro_batch_tokens < cfg.data.max_length and cfg.pack_tokens():
        raise ConfigError(f"{where}: train.micro_batch_tokens={t.micro_batch_tokens} is shorter than data.max_length="
                          f"{cfg.data.max_length}: a packed row must hold the longest sample (raise it, or unset it "
                          "for micro_batch_size x max_length)")
    if t.zero_grad_reduce != "allreduce" and t.zero_stage not in (1, 2):
        raise ConfigError(f"{where}: train.zero_grad_reduce={t.zero_grad_reduce} applies to ZeRO stages 1 and 2 "
                          f"(zero_stage is {t.zero_stage}): remove it or set train.zero_stage to 1 or 2")
    if t.max_restart_backoff_s < t.restart_backoff_s:
        raise ConfigError(f"{where}: train.max_restart_backoff_s={t.max_restart_backoff_s} is below "
                          f"train.restart_backoff_s={t.restart_backoff_s}, the first restart's wait: raise the cap "
                          "or lower the base")
    _validate_capture(cfg, where)
    _validate_regen(cfg.regen, where)
    _validate_eval(cfg.eval, where)
    _validate_ray(cfg.ray, where)


def _validate_ray(r: RaySection, where) -> None:
    """The local cluster's dashboard serves Ray's job API (it runs any command it is sent): only on
    a loopback address, reached from elsewhere through an SSH tunnel (README)."""
    import ipaddress

    host = r.dashboard_host
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(f"{where}: ray.dashboard_host {host!r} is not a loopback address: the dashboard serves "
                          "Ray's job API, which runs whatever it is sent; keep 127.0.0.1 and reach it through an "
                          "SSH tunnel (ssh -L 8265:127.0.0.1:8265 HOST)")


def _validate_eval(e: EvalSection, where) -> None:
    if e.mode == "server" and not e.server_url:
        raise ConfigError(f"{where}: eval.server_url is required when eval.mode is 'server'")
    if e.server_url and not e.server_url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}: eval.server_url {e.server_url!r} must start with http:// or https://")
    if e.reference_drafter is not None and not (Path(e.reference_drafter) / "config.json").is_file():
        raise ConfigError(f"{where}: eval.reference_drafter: {e.reference_drafter}/config.json not found "
                          "(a z-lab-format drafter directory: config.json + model.safetensors)")


def _validate_drafter(d: DrafterSection, where) -> None:
    if d.layer_types is not None and len(d.layer_types) != d.num_layers:
        raise ConfigError(f"{where}: drafter.layer_types has {len(d.layer_types)} entries for drafter.num_layers="
                          f"{d.num_layers}: give one per drafter layer")
    if d.layer_types and "sliding_attention" in d.layer_types and d.sliding_window is None:
        raise ConfigError(f"{where}: drafter.layer_types has sliding_attention layers: set drafter.sliding_window")


def _validate_regen(r: RegenSection, where) -> None:
    if r.source == "server":
        for key in ("url", "model"):
            if not getattr(r, key):
                raise ConfigError(f"{where}: regen.{key} is required when regen.source is 'server'")
        if not r.url.startswith(("http://", "https://")):
            raise ConfigError(f"{where}: regen.url {r.url!r} must start with http:// or https:// (e.g. .../v1)")
    if r.input is not None and not Path(r.input).exists():
        raise ConfigError(f"{where}: regen.input: {r.input} not found")

def _validate_capture(cfg: Config, where) -> None:
    c = cfg.capture
    if c.max_buffer_bytes is not None and c.max_buffer_bytes < cfg.train.world_size * c.shard_bytes:
        raise ConfigError(
            f"{where}: capture.max_buffer_bytes={c.max_buffer_bytes} < train.world_size x capture.shard_bytes = "
            f"{cfg.train.world_size * c.shard_bytes}: every trainer rank reads its own shards, so the buffer must "
            "hold at least one per rank; raise max_buffer_bytes or lower shard_bytes"
        )
    if c.consumed_shards == "delete" and cfg.train.epochs > 1 and c.later_epochs == "keep":
        raise ConfigError(
            f"{where}: capture.consumed_shards=delete with train.epochs={cfg.train.epochs}: later epochs re-read "
            "every shard; use keep (or auto) for several epochs from one capture, or capture.later_epochs=recapture"
        )
    if c.consumed_shards == "keep" and c.later_epochs != "keep":
        raise ConfigError(
            f"{where}: capture.consumed_shards=keep with capture.later_epochs={c.later_epochs}: a re-captured "
            "epoch's shards are read once, and keeping them would hold every epoch's shards on disk; use "
            "consumed_shards auto (or delete), or later_epochs=keep to re-read one capture"
        )


def with_absolute_paths(cfg: Config) -> Config:
    """`cfg` with the paths that processes on other nodes open made absolute, against this process's
    working directory (where the command was typed): run.out_dir and eval.reference_drafter. A Ray
    actor's working directory is where its node's Ray was started (`ray start` of the cluster
    launcher, an srun step), not the driver's, so a relative --out had the actors on every node
    write and read somewhere else than the driver. Both may change across a resume (a moved run
    directory resumes). The paths only the driver reads (data.*) are left as given; the target's
    directory is made absolute where it is resolved (target/loading.py)."""
    cfg = cfg.model_copy(deep=True)
    cfg.run.out_dir = os.path.abspath(cfg.run.out_dir)
    if cfg.eval.reference_drafter is not None:
        cfg.eval.reference_drafter = os.path.abspath(cfg.eval.reference_drafter)
    return cfg


def load_config_dict(tree: dict) -> Config:
    """Rebuild a Config from `Config.to_dict()` (how actors receive it: a plain record)."""
    return _build(tree)
