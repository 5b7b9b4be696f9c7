"""The run configuration: one typed tree, loaded from YAML plus `key.path=value` overrides.

Unknown keys and wrong types are errors naming the field path (STYLE 3). Derived values (layer
ids, mask id, world size) are computed where they are needed, never stored twice.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message names the field."""


@dataclass
class RunSection:
    name: str = "dflash"
    seed: int = 0
    out_dir: str = "runs/dflash"


@dataclass
class TargetSection:
    kind: str = "hf"  # "hf": a local HF model directory; "tiny_stdlib": the project's own tiny target
    path: str | None = None
    dtype: str = "bfloat16"
    device: str = "auto"  # auto: cuda when available
    attn_implementation: str = "sdpa"
    allow_torch_gdn_on_cuda: bool = False


@dataclass
class DataSection:
    train_path: str | None = None  # JSONL, .parquet, or a `datasets` save_to_disk dir; tiny_stdlib makes its own
    eval_path: str | None = None  # held-out conversations (their prompts) for tau
    train_jsonl: str | None = None  # older name of train_path
    eval_jsonl: str | None = None  # older name of eval_path
    format: str = "auto"  # auto (per record) | messages (OpenAI role/content) | sharegpt (conversations from/value)
    enable_thinking: bool | None = None  # passed to templates with that switch; None: the template's default
    on_bad_record: str = "error"  # error: stop naming file:line/row; skip: skip, count per reason, report
    on_overlong: str = "truncate"  # over max_length: truncate | skip (counted) | error
    max_train_samples: int | None = None
    max_length: int = 2048


@dataclass
class CaptureSection:
    num_actors: int = 1
    num_layers: int = 5  # k, when layer_ids is not given
    layer_ids: list[int] | None = None
    regenerate: bool = True  # replace assistant responses by the target's greedy ones
    max_new_tokens: int = 256
    batch_size: int = 8  # prompts per greedy-regeneration batch; sequences per capture pass without token_budget
    # padded tokens (longest x count) per target capture pass, sequences length-sorted within
    # sort_window; None: batch_size sequences per pass
    token_budget: int | None = None
    sort_window: int = 256
    shard_bytes: int = 1 << 30  # a shard is closed before it would exceed this (about 1 GB)
    # unconsumed (not yet trained-and-checkpointed) shard bytes at which capture pauses; the
    # directory then holds at most this plus one shard in flight per actor. None: unbounded
    max_buffer_bytes: int | None = None
    # shards released by a checkpoint: auto deletes them under a cap with train.epochs == 1, else keeps
    consumed_shards: str = "auto"
    buffer_stall_s: float = 3600.0  # paused this long with no shard released: an error, not a hang
    max_restarts: int = 3  # Ray restarts a dead target actor this often; its capture resumes from the ledger
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0


@dataclass
class DrafterSection:
    num_layers: int = 5
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate_size: int | None = None  # default: the target's
    block_size: int = 16
    mask_token_id: int | None = None  # default: the tokenizer's mask token


@dataclass
class TrainSection:
    world_size: int = 1
    zero_stage: int = 2
    micro_batch_size: int = 1
    # token budget per micro-batch: samples join while (longest x count) <= budget (at least one);
    # None: micro_batch_size samples each. DeepSpeed's train_micro_batch_size_per_gpu stays
    # micro_batch_size either way (it only does bookkeeping: throughput, train_batch_size)
    micro_batch_tokens: int | None = None
    # samples within a shard in a permutation seeded by (run.seed, epoch, shard); the shard order
    # of epochs after the first is permuted by (run.seed, epoch) either way
    shuffle: bool = True
    grad_accum: int = 1
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    epochs: int = 6
    max_steps: int | None = None
    num_anchors: int = 512
    label_source: str = "data"
    gamma: float | None = None  # default by block size (7 for B=16)
    attention: str = "auto"
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    log_every: int = 10
    log_sample_keys: bool = False  # every rank appends its trained sample keys to <out>/sample_log/ (audits)
    histogram_every: int = 100  # steps between TensorBoard histograms (per-parameter grad norms, per-sample loss)
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    max_restarts: int = 3  # a lost rank: the group restarts from the latest checkpoint this many times (faults.py)


@dataclass
class EvalSection:
    enabled: bool = True
    num_prompts: int = 16
    max_new_tokens: int = 256
    budgets: list[int] = field(default_factory=lambda: [8, 16])
    poll_s: float = 5.0
    max_backlog: int = 4  # more exports waiting than this: evaluate the newest and every stride-th
    backlog_stride: int = 2
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_restarts: int = 3  # Ray restarts a lost evaluator this many times; it continues after its last result


@dataclass
class RegenSection:
    """`dflash-dist regenerate`: the target answers the input's prompts afresh (dflash_dist/capture/regenerate.py)."""

    source: str = "target"  # target: the run's target via transformers generate; server: OpenAI-compatible URL
    input: str | None = None  # conversations (any data.* source kind); default data.train_path
    output: str | None = None  # the new JSONL; default <run.out_dir>/data/train.regenerated.jsonl
    url: str | None = None  # server: base URL, e.g. http://127.0.0.1:30000/v1
    model: str | None = None  # server: the served model's name
    api_key_env: str = "OPENAI_API_KEY"  # server: environment variable holding its key (unset: no key)
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int = 256
    batch_size: int = 8  # target: prompts per generate call
    concurrency: int = 8  # server: requests in flight
    max_retries: int = 5  # server: retries of a 5xx, 429, timeout or lost connection (exponential backoff)
    timeout_s: float = 600.0  # server: per request


@dataclass
class NodeResources:
    """Node constraint per role: a custom resource that only the intended nodes declare
    (cluster.yaml node types' `resources`, or `ray start --resources`); None: any node."""

    target: str | None = None
    trainer: str | None = None
    evaluator: str | None = None


@dataclass
class RaySection:
    address: str | None = None  # None: start a local cluster
    num_cpus: int | None = None
    dashboard: bool = False
    dashboard_host: str = "127.0.0.1"
    placement: str = "pack"  # one placement group, a bundle per role process (dflash_dist/orchestration/placement.py)
    placement_timeout_s: float = 600.0  # the cluster cannot place every bundle by then: an error saying why
    node_resources: NodeResources = field(default_factory=NodeResources)


@dataclass
class Config:
    run: RunSection = field(default_factory=RunSection)
    target: TargetSection = field(default_factory=TargetSection)
    data: DataSection = field(default_factory=DataSection)
    capture: CaptureSection = field(default_factory=CaptureSection)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    ray: RaySection = field(default_factory=RaySection)
    regen: RegenSection = field(default_factory=RegenSection)

    @property
    def out(self) -> Path:
        return Path(self.run.out_dir)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CHOICES = {
    "target.kind": ("hf", "tiny_stdlib"),
    "target.dtype": ("bfloat16", "float16", "float32"),
    "target.device": ("auto", "cpu", "cuda"),
    "train.zero_stage": (0, 1, 2, 3),
    "capture.consumed_shards": ("auto", "keep", "delete"),
    "train.label_source": ("data", "target"),
    "train.attention": ("auto", "dense", "flex"),
    "data.format": ("auto", "messages", "sharegpt"),
    "data.on_bad_record": ("error", "skip"),
    "data.on_overlong": ("truncate", "skip", "error"),
    "ray.placement": ("pack", "spread", "strict_pack", "none"),
    "regen.source": ("target", "server"),
}


def _check_type(value, tp, path: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(value, inner[0], path)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(tp)
        return [_check_type(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool) and (not isinstance(value, tp) or (tp is int and isinstance(value, bool))):
        raise ConfigError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown key {where}{unknown[0]} (known keys{' of ' + prefix if prefix else ''}: "
                          f"{', '.join(sorted(names))})")
    kwargs = {}
    for name, value in data.items():
        path = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value or {}, path)
        else:
            value = _check_type(value, tp, path)
            if path in CHOICES and value not in CHOICES[path]:
                raise ConfigError(f"{path}: {value!r} is not one of {CHOICES[path]}")
            kwargs[name] = value
    return cls(**kwargs)


def _set_path(tree: dict, dotted: str, value, where: str) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{where}: {dotted}: {k} is not a section")
    node[keys[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] = (), out_dir: str | None = None) -> Config:
    """YAML file (or the defaults when path is None) + `a.b=c` overrides (values parsed as YAML)."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        _set_path(tree, key.strip(), yaml.safe_load(raw) if raw.strip() else None, f"override {item!r}")
    if out_dir is not None:
        _set_path(tree, "run.out_dir", str(out_dir), "--out")
    try:
        cfg = _build(Config, tree, "")
    except ConfigError as e:
        raise ConfigError(f"{path or 'config'}: {e}") from None
    _validate(cfg, path)
    return cfg


def _validate(cfg: Config, path) -> None:
    where = path or "config"
    if cfg.target.kind == "hf" and not cfg.target.path:
        raise ConfigError(f"{where}: target.path is required when target.kind is 'hf'")
    if cfg.target.path and cfg.target.kind == "hf" and not Path(cfg.target.path).exists():
        raise ConfigError(f"{where}: target.path {cfg.target.path} does not exist")
    for key in ("data.train_path", "data.eval_path", "data.train_jsonl", "data.eval_jsonl"):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None and not Path(value).exists():
            raise ConfigError(f"{where}: {key}: file {value} not found")
    for new, old in (("train_path", "train_jsonl"), ("eval_path", "eval_jsonl")):
        if getattr(cfg.data, new) is not None and getattr(cfg.data, old) is not None:
            raise ConfigError(f"{where}: data.{new} and data.{old} (its older name) are both set; keep data.{new}")
    if cfg.target.kind == "hf" and cfg.data.train_path is None and cfg.data.train_jsonl is None:
        raise ConfigError(f"{where}: data.train_path is required for an hf target")
    positive = {"capture.num_actors": cfg.capture.num_actors, "train.world_size": cfg.train.world_size,
                "train.micro_batch_size": cfg.train.micro_batch_size, "train.grad_accum": cfg.train.grad_accum,
                "train.checkpoint_every": cfg.train.checkpoint_every, "drafter.block_size": cfg.drafter.block_size,
                "train.histogram_every": cfg.train.histogram_every}
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{where}: {key} must be >= 1, got {value}")
    for key, value in (("train.max_restarts", cfg.train.max_restarts), ("eval.max_restarts", cfg.eval.max_restarts)):
        if value < 0:
            raise ConfigError(f"{where}: {key} must be >= 0 (0: no restarts), got {value}")
    _validate_capture(cfg, where)
    _validate_regen(cfg.regen, where)


def _validate_regen(r: RegenSection, where) -> None:
    if r.source == "server":
        for key in ("url", "model"):
            if not getattr(r, key):
                raise ConfigError(f"{where}: regen.{key} is required when regen.source is 'server'")
        if not r.url.startswith(("http://", "https://")):
            raise ConfigError(f"{where}: regen.url {r.url!r} must start with http:// or https:// (e.g. .../v1)")
    if r.input is not None and not Path(r.input).exists():
        raise ConfigError(f"{where}: regen.input: {r.input} not found")
    if r.temperature < 0:
        raise ConfigError(f"{where}: regen.temperature must be >= 0 (0: greedy), got {r.temperature}")
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"{where}: regen.top_p must be in (0, 1], got {r.top_p}")
    for key in ("max_new_tokens", "batch_size", "concurrency"):
        if getattr(r, key) < 1:
            raise ConfigError(f"{where}: regen.{key} must be >= 1, got {getattr(r, key)}")
    if r.max_retries < 0 or r.timeout_s <= 0:
        raise ConfigError(f"{where}: regen.max_retries must be >= 0 and regen.timeout_s > 0")


def _validate_capture(cfg: Config, where) -> None:
    c = cfg.capture
    for key in ("batch_size", "sort_window", "shard_bytes", "token_budget", "max_buffer_bytes"):
        value = getattr(c, key)
        if value is not None and value < 1:
            raise ConfigError(f"{where}: capture.{key} must be >= 1, got {value}")
    if c.max_restarts < 0:
        raise ConfigError(f"{where}: capture.max_restarts must be >= 0, got {c.max_restarts}")
    if c.buffer_stall_s <= 0:
        raise ConfigError(f"{where}: capture.buffer_stall_s must be > 0, got {c.buffer_stall_s}")
    if c.max_buffer_bytes is not None and c.max_buffer_bytes < cfg.train.world_size * c.shard_bytes:
        raise ConfigError(
            f"{where}: capture.max_buffer_bytes={c.max_buffer_bytes} < train.world_size x capture.shard_bytes = "
            f"{cfg.train.world_size * c.shard_bytes}: every trainer rank reads its own shards, so the buffer must "
            "hold at least one per rank; raise max_buffer_bytes or lower shard_bytes"
        )
    if c.consumed_shards == "delete" and cfg.train.epochs > 1:
        raise ConfigError(
            f"{where}: capture.consumed_shards=delete with train.epochs={cfg.train.epochs}: later epochs re-read "
            "every shard; use keep (or auto) for several epochs from one capture"
        )


def load_config_dict(tree: dict) -> Config:
    """Rebuild a Config from `Config.to_dict()` (how actors receive it: a plain record)."""
    return _build(Config, tree, "")
