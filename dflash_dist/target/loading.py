"""The target model as the pipeline sees it: where it lives, how to load it (fully, for capture
and evaluation; or only its embedding and lm_head, for trainers), the drafter shape derived from
it, and the provenance every shard and evaluator compares."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from data_pipeline.feature_codec import ENCODING_OF
from data_pipeline.provenance import CAPTURE_KERNEL_PATHS, SHARD_SCHEMA_VERSION, Provenance, installed_versions
from dflash_dist.config import Config, ConfigError, load_config
from dflash_dist.model.capture import check_capture_layer_ids, gdn_kernel_path
from dflash_dist.model.config import DrafterConfig, build_target_layer_ids
from dflash_dist.node_address import node_label
from dflash_dist.target.gdn_path import route_cpu_to_torch
from dflash_dist.target.weights_check import (
    VerifiedWeights,
    check_unchanged,
    hashed_weights,
    verify_weights,
    weights_stamp,
)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Never code from a model directory. A config.json or tokenizer_config.json may name Python files
# beside it (`auto_map`) for a model type transformers lacks; left unset, transformers asks on the
# terminal and imports them on "y" (and a piped "y" answers it). False: it loads its own classes
# or refuses (no_remote_code says so in our words).
NO_REMOTE_CODE = {"trust_remote_code": False}


@contextlib.contextmanager
def no_remote_code(model_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Around a transformers load with NO_REMOTE_CODE: its refusal, which tells the user to pass
    trust_remote_code=True, becomes a ValueError naming the directory and what to do instead."""
    try:
        yield
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ValueError(
            f"{model_dir}: its config.json or tokenizer_config.json maps the model to Python files in the directory "
            "(auto_map), for a model type this transformers does not implement; dflash-dist never runs code from a "
            "model directory: use a transformers version that implements the model type"
        ) from None


class TargetNotOnNode(ValueError):
    """The target directory the run resolved (on the driver's node) is missing on the node of the
    process that loads it. A ValueError: a restart on the same node meets it again."""


def require_target_dir(target_dir: str | os.PathLike[str], who: str) -> None:
    """Raise TargetNotOnNode unless `target_dir` is a directory on this node. Every node that runs a
    target actor, a trainer rank or the evaluator loads the target from the path the run resolved:
    the error names this node (host name and address), the path, and the two ways to give it the
    target, so a multi-node run does not end in an error about weight files that names no node."""
    path = Path(target_dir)
    if path.is_dir():
        return
    what = "is not a directory" if path.exists() else "does not exist"
    node, host = node_label(), socket.gethostname()  # "host (address)", and the host alone
    raise TargetNotOnNode(
        f"{who}: the target directory {path} {what} on node {node}. Every node that runs a target actor, "
        "a trainer rank or the evaluator loads the target from this path: put the target on storage every node "
        f"mounts at the same path, or copy it to {path} on {host} (the same files: their hash is checked)"
    )


def resolve_target_dir(cfg: Config) -> Path:
    """The target's HF directory, absolute (the actors' working directory is their node's Ray's, not
    the driver's); the project's own targets (tiny_stdlib, code_lm) are built (once, cached) on
    first use."""
    if cfg.target.kind == "tiny_stdlib":
        from dflash_dist.target.tiny_target import build_tiny_target

        return build_tiny_target(cfg.target.path).absolute()
    if cfg.target.kind == "code_lm":
        from dflash_dist.target.code_target import build_code_target

        return build_code_target(cfg.target.path, cfg.target.preset, log=logging.getLogger(__name__).info).absolute()
    return Path(cfg.target.path).absolute()


def expected_target_dir(cfg: Config) -> Path:
    """Where resolve_target_dir finds (or builds) the target, without building anything (absolute)."""
    if cfg.target.path is not None or cfg.target.kind == "hf":
        return Path(cfg.target.path).absolute()
    if cfg.target.kind == "tiny_stdlib":
        from dflash_dist.target.tiny_target import default_cache_dir

        return default_cache_dir().absolute()
    from dflash_dist.target.code_target import default_cache_dir

    return default_cache_dir(cfg.target.preset).absolute()


def target_id(cfg: Config, target_dir: Path) -> str:
    """How shards, plans and regenerated data name the target: its path, or `<kind>:<directory name>`."""
    return str(cfg.target.path) if cfg.target.kind == "hf" else f"{cfg.target.kind}:{Path(target_dir).name}"


def target_device(cfg: Config) -> torch.device:
    if cfg.target.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.target.device)


def load_target(cfg: Config, target_dir: Path, device: torch.device | None = None):
    """(model in eval mode, tokenizer). Kernel paths are the caller's to check (capture does)."""
    from transformers import AutoModelForCausalLM

    device = device or target_device(cfg)
    with no_remote_code(target_dir):
        model = AutoModelForCausalLM.from_pretrained(
            target_dir, dtype=DTYPES[cfg.target.dtype], attn_implementation=cfg.target.attn_implementation,
            **NO_REMOTE_CODE,
        )
    tokenizer = load_tokenizer(target_dir)
    route_cpu_to_torch()  # CPU tensors to torch GDN: fla (picked where Triton imports) cannot run them
    return model.to(device).eval(), tokenizer


def load_tokenizer(target_dir: str | Path):
    """The target's tokenizer (AutoTokenizer), never code from its directory (NO_REMOTE_CODE)."""
    from transformers import AutoTokenizer

    with no_remote_code(target_dir):
        return AutoTokenizer.from_pretrained(target_dir, **NO_REMOTE_CODE)


def load_verified_target(cfg: Config, target_dir: Path, recorded_hash: str, where: str,
                         verified: VerifiedWeights | None = None, purpose: str = "eval"):
    """(model, tokenizer, VerifiedWeights): load_target of weight files checked to hash to the
    run's recorded target_hash (weights_check.py; `verified`: the run plan's or the evaluator's
    check, reused while the files carry its stamp; `purpose` "eval" or "capture": what a mismatch puts at stake), and
    unchanged from before the load to after it. For every process that loads the plan's target.

    The hash (where this process has none for these files) runs in a thread while the target
    loads: both read the same files, the later reader from the page cache, and sha256 releases the
    GIL, so the check adds about max(hash, load) - load of wall time. Its verdict is in before this
    returns: nothing is made from another model's weights. A load that fails waits for the hash,
    whose mismatch (another model, another shape) says more than the load's own error. A target
    directory missing on this node is refused first, naming the node (require_target_dir)."""
    require_target_dir(target_dir, where)
    before = weights_stamp(target_dir)
    hashed = _in_thread(verify_weights, target_dir, recorded_hash, where, verified, purpose)
    try:
        model, tokenizer = load_target(cfg, target_dir)
    except Exception:
        hashed()  # raises the mismatch, if there is one, from the load's error
        raise
    weights = hashed()
    check_unchanged(weights, where, since=before)
    return model, tokenizer, weights


def _in_thread(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """fn(*args) started in a daemon thread (one left behind by an error holds no process open);
    the returned call waits for it and returns its value or raises its error."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # raised by the waiting call
            box["error"] = e

    thread = threading.Thread(target=run, name=fn.__name__, daemon=True)
    thread.start()

    def wait() -> Any:
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    return wait


def target_matmul_params(target_dir: Path) -> int:
    """Parameters a token's forward multiplies by: all but the input embedding (a lookup; a tied
    lm_head still counts), from the target's config.json alone, built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"), no_remote_code(target_dir):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(target_dir, **NO_REMOTE_CODE),
                                                 **NO_REMOTE_CODE)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    return sum(p.numel() for p in model.parameters()) - (0 if tied else embed.weight.numel())


def target_config_dict(target_dir: Path) -> dict:
    d = json.loads((Path(target_dir) / "config.json").read_text())
    return d.get("text_config", d) if "num_hidden_layers" not in d else d


def load_embeddings(target_dir: Path, who: str = "a trainer rank") -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and lm_head weights, read from its safetensors files without
    building the model (a 27B target need not fit a trainer's memory); `who` names the loader in the
    error of a target directory missing on this node (require_target_dir)."""
    require_target_dir(target_dir, who)
    files = sorted(Path(target_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{target_dir}: no *.safetensors weight files")
    found: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key.endswith("embed_tokens.weight") and "mtp" not in key:
                    found["embed"] = st.get_tensor(key)
                elif key == "lm_head.weight" or key.endswith(".lm_head.weight"):
                    found["lm_head"] = st.get_tensor(key)
    if "embed" not in found:
        raise ValueError(f"{target_dir}: no embed_tokens weight found in {[f.name for f in files]}")
    if "lm_head" not in found:
        if not target_config_dict(target_dir).get("tie_word_embeddings", False):
            raise ValueError(f"{target_dir}: no lm_head weight and tie_word_embeddings is false")
        found["lm_head"] = found["embed"]
    return found["embed"], found["lm_head"]


def layer_ids_for(cfg: Config, num_target_layers: int) -> list[int]:
    if cfg.capture.layer_ids is not None:
        check_capture_layer_ids(cfg.capture.layer_ids, num_target_layers)
        return list(cfg.capture.layer_ids)
    return build_target_layer_ids(num_target_layers, cfg.capture.num_layers)


def drafter_config_for(cfg: Config, target_dir: Path, mask_token_id: int | None = None) -> DrafterConfig:
    """The drafter shape: sizes from the run config, hidden/vocab/layers from the target."""
    t = target_config_dict(target_dir)
    d = cfg.drafter
    mask = d.mask_token_id if d.mask_token_id is not None else mask_token_id
    if mask is None:
        raise ValueError("drafter.mask_token_id is not set and the tokenizer has no mask token: set it in the config")
    rope = t.get("rope_parameters") or {}
    intermediate = d.intermediate_size or t.get("intermediate_size")
    if intermediate is None:  # an MoE target has only per-expert sizes
        raise ValueError(f"{target_dir}/config.json has no intermediate_size (an MoE target?): set "
                         "drafter.intermediate_size in the run config")
    return DrafterConfig(
        hidden_size=t["hidden_size"], num_hidden_layers=d.num_layers, num_attention_heads=d.num_heads,
        num_key_value_heads=d.num_kv_heads, head_dim=d.head_dim,
        intermediate_size=intermediate, vocab_size=t["vocab_size"],
        target_layer_ids=tuple(layer_ids_for(cfg, t["num_hidden_layers"])), num_target_layers=t["num_hidden_layers"],
        block_size=d.block_size, mask_token_id=int(mask), rms_norm_eps=t.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 1e7))),
        max_position_embeddings=t.get("max_position_embeddings", 32768),
        layer_types=tuple(d.layer_types or ()), sliding_window=d.sliding_window,
    )


def drafter_config_from_files(config_path: str | Path, overrides: list[str] = (),
                              target_dir: str | Path | None = None) -> DrafterConfig:
    """The drafter shape of a run config from its target's config.json alone: no weights, no
    tokenizer, no data (configs/*.yaml name target.path to a directory holding only the public
    config.json). target_dir overrides target.path; the mask token must be in the config."""
    cfg = load_config(config_path, list(overrides), check_files=False)
    if target_dir is None:
        if cfg.target.kind != "hf":
            raise ConfigError(f"{config_path}: target.kind={cfg.target.kind!r}: the shape comes from the built "
                              "target; pass target_dir")
        target_dir = cfg.target.path
    target_json = Path(target_dir) / "config.json"
    if not target_json.is_file():
        raise ConfigError(f"{config_path}: target.path: {target_json} not found (the target's config.json)")
    if cfg.drafter.mask_token_id is None:
        raise ConfigError(f"{config_path}: drafter.mask_token_id is not set (no tokenizer is read here)")
    return drafter_config_for(cfg, Path(target_dir))


def tokenizer_mask_id(tokenizer) -> int | None:
    """The tokenizer's mask token (the tiny target's `<|mask|>`; Qwen3.5's is set in the config)."""
    return tokenizer.mask_token_id if getattr(tokenizer, "mask_token", None) else None


@dataclass(frozen=True)
class TargetIdentity:
    """What the pipeline knows about its target before anything runs; a record, not a model."""

    target_dir: str
    target_id: str
    target_hash: str
    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str


def target_identity(cfg: Config, target_dir: Path, weights: VerifiedWeights | None = None) -> TargetIdentity:
    """The target's identity; its weights hashed once per process and set of files (weights_check.py),
    or `weights`: this process's hashed_weights of `target_dir`, whose hash it records."""
    t = target_config_dict(target_dir)
    weights = weights or hashed_weights(target_dir)
    return TargetIdentity(str(target_dir), target_id(cfg, target_dir), weights.target_hash,
                          tuple(layer_ids_for(cfg, t["num_hidden_layers"])), t["hidden_size"], cfg.target.dtype)


def _provenance(ident: TargetIdentity, kernel_path: str, template_hash: str, feature_dtype: str) -> Provenance:
    return Provenance(
        schema_version=SHARD_SCHEMA_VERSION, target_id=ident.target_id, target_hash=ident.target_hash,
        layer_ids=ident.layer_ids, hidden_size=ident.hidden_size, dtype=ident.dtype,
        kernel_path=kernel_path, template_hash=template_hash, feature_encoding=ENCODING_OF[feature_dtype],
        **installed_versions(),
    )


def provenance_for(ident: TargetIdentity, model, template_hash: str, feature_dtype: str = "bf16") -> Provenance:
    """The provenance of features this process would produce with `model` as loaded, stored as
    capture.feature_dtype `feature_dtype` says."""
    return _provenance(ident, gdn_kernel_path(model), template_hash, feature_dtype)


def expected_kernel_path(cfg: Config, target_dir: Path) -> str:
    """The kernel path capture and evaluation will use for this config: fla for Gated DeltaNet
    layers on CUDA, the torch reference otherwise (capture refuses torch on CUDA unless allowed)."""
    has_gdn = "linear_attention" in (target_config_dict(target_dir).get("layer_types") or [])
    on_cuda = target_device(cfg).type == "cuda"
    if has_gdn and on_cuda and cfg.capture.kernels != "eager":
        return CAPTURE_KERNEL_PATHS[cfg.capture.kernels]  # an evaluator on "fla" refuses them
    return "fla" if (has_gdn and on_cuda) else "torch"


def expected_provenance(cfg: Config, target_dir: Path, ident: TargetIdentity, tokenizer) -> Provenance:
    """What trainers demand of every shard of this run (computed without loading the model)."""
    from data_pipeline.chat_data import template_hash

    return _provenance(
        ident, expected_kernel_path(cfg, target_dir), template_hash(tokenizer, cfg.data.enable_thinking),
        cfg.capture.feature_dtype,
    )
