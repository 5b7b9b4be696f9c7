"""The quality bench's recipe variants: each a name, one line of why, and the run-config change
that makes it (`key.path=value` overrides on the run's own config.yaml, as `dflash-dist run`
takes them), so a variant trains exactly as the product would with that config. Adding one is
one `register(...)` line.

`default` is the run's config unchanged: the product's recipe, drafter shape, lr, anchors,
block, micro-batching/packing and epochs. A variant whose resolved config equals an earlier
one's (block16 when the run's block is 16) is not trained twice: it is listed as that one's alias.

Feature codecs: a variant may train on the captured features passed through a codec, e.g. the
shard encoding's round trip (`fp8_features`: capture.feature_dtype fp8, data_pipeline/
feature_codec.py); evaluation stays on the target's own features, as serving does. A codec is
one line in FEATURE_CODECS: name -> (rows [N, k*H], k) -> rows, applied on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from data_pipeline.feature_codec import round_trip_fp8
from dflash_dist.config import Config, load_config
from dflash_dist.model.config import DrafterConfig
from dflash_dist.target.loading import drafter_config_for

# codec name -> round trip of feature rows ([N, k*H], k layers) -> [N, k*H] in the same dtype
FEATURE_CODECS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {"fp8": round_trip_fp8}


@dataclass(frozen=True)
class Facts:
    """What a variant's change may depend on: the run's config and its data."""

    cfg: Config
    captured_layers: tuple[int, ...]
    median_supervised: int  # loss-masked tokens per sample (median): anchors beyond it change nothing
    window: int  # the sliding variant's window (--window)
    # no sample has a supervised token followed by an unsupervised one before its end (single-turn
    # chats whose response ends the sample): the anchor rules mask and mask_next draw the same anchors
    anchor_rules_agree: bool = False


@dataclass(frozen=True)
class Variant:
    name: str
    doc: str
    change: Callable[[Facts], dict[str, object]]  # config path -> value
    codec: str | None = None  # FEATURE_CODECS key: train on round-tripped features


REGISTRY: dict[str, Variant] = {}


def register(name: str, doc: str, change: dict | Callable[[Facts], dict], codec: str | None = None) -> None:
    REGISTRY[name] = Variant(name, doc, change if callable(change) else (lambda _f, c=change: dict(c)), codec)


def _sliding(f: Facts) -> dict:
    n = f.cfg.drafter.num_layers
    return {
        "drafter.layer_types": ["sliding_attention"] * (n - 1) + ["full_attention"],
        "drafter.sliding_window": f.window,
    }


def _anchors_half(f: Facts) -> dict:
    drawn = min(f.cfg.train.num_anchors, max(f.median_supervised, 2))  # what the default draws per sample
    return {"train.num_anchors": max(1, drawn // 2)}


register("default", "the run's own recipe: fc over all k captured layers", {})
register(
    "drop_top",
    "fc without the top captured layer (the seed's bug)",
    lambda f: {"capture.layer_ids": list(f.captured_layers[:-1])},
)
register("dpace", "D-PACE slot weights instead of exp(-(s-1)/gamma)", {"train.position_weighting": "dpace"})
register("decay", "exp(-(s-1)/gamma) slot weights instead of D-PACE (the default before 2026-12-04)",
         {"train.position_weighting": "decay"})
register("step_slots", "loss normalised over the optimizer step's slots", {"train.loss_norm": "step_slots"})
register("mask_next", "anchors need loss_mask at a and a+1", {"train.anchor_rule": "mask_next"})
register("sliding", "drafter layers sliding except the last, window --window", _sliding)
register("full", "every drafter layer full attention (no sliding window)",
         {"drafter.layer_types": None, "drafter.sliding_window": None})
register("block8", "block size 8 (gamma 4)", {"drafter.block_size": 8})
register("block16", "block size 16 (gamma 7)", {"drafter.block_size": 16})
register("anchors_half", "half the anchors the default draws per sample", _anchors_half)
register(
    "peer_specforge",
    "SpecForge: mask_next anchors, step-normalised decay, gamma 7 at block 16",
    {
        "train.anchor_rule": "mask_next",
        "train.loss_norm": "step_slots",
        "train.position_weighting": "decay",
        "train.gamma": 7.0,
        "drafter.block_size": 16,
    },
)
register(
    "peer_modelopt",
    "Model-Optimizer / speculators: D-PACE at block 16",
    {"train.position_weighting": "dpace", "drafter.block_size": 16},
)
register("fp8_features", "trained on features round-tripped through the shard fp8 encoding", {}, codec="fp8")


def available(name: str) -> bool:
    v = REGISTRY[name]
    return v.codec is None or v.codec in FEATURE_CODECS


@dataclass(frozen=True)
class Resolved:
    """One variant against one run: its full config, drafter shape, and which captured layers
    (feature column blocks) its fc reads."""

    name: str
    doc: str
    overrides: tuple[str, ...]
    cfg: dict  # Config.to_dict()
    drafter: DrafterConfig
    feature_layers: tuple[int, ...]  # indices into the captured layers, in fc order
    codec: str | None
    aliases: tuple[str, ...] = field(default=())

    def key(self, facts: Facts) -> tuple:
        """What decides training on this data: equal keys train identically."""
        train = {k: v for k, v in self.cfg["train"].items() if k not in ("checkpoint_every", "log_every")}
        if facts.anchor_rules_agree:
            train["anchor_rule"] = "mask"
        if train["grad_accum"] * train["world_size"] == 1:  # one micro-batch a step: its slots are the step's
            train["loss_norm"] = "micro_batch"
        if train["gamma"] is None:  # the block's default decay (7 at 16) is the same as setting it
            train["gamma"] = self.drafter.loss_decay_gamma
        return (repr(sorted(train.items())), self.drafter, self.feature_layers, self.codec)


def _yaml(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    return str(value)


def resolve(
    names: list[str], config_path: Path, target_dir: Path, mask_token_id: int, facts: Facts, extra: tuple[str, ...] = ()
) -> list[Resolved]:
    """Each named variant's config (`extra` overrides apply to all, the default included), its
    drafter, its feature columns; variants that train identically on this data folded into aliases."""
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; registered: {sorted(REGISTRY)}")
    missing = [n for n in names if not available(n)]
    if missing:
        raise ValueError(
            f"variants {missing} need feature codecs that are not registered yet "
            f"({[REGISTRY[n].codec for n in missing]}): see FEATURE_CODECS in bench/quality_variants.py"
        )
    out: list[Resolved] = []
    for name in names:
        v = REGISTRY[name]
        overrides = tuple(extra) + tuple(f"{k}={_yaml(val)}" for k, val in v.change(facts).items())
        cfg = load_config(config_path, list(overrides), check_files=False)
        drafter = drafter_config_for(cfg, target_dir, mask_token_id)
        missing_layers = [i for i in drafter.target_layer_ids if i not in facts.captured_layers]
        if missing_layers:
            raise ValueError(
                f"variant {name}: its drafter reads target layers {missing_layers}, which the run did "
                f"not capture (captured: {list(facts.captured_layers)})"
            )
        layers = tuple(facts.captured_layers.index(i) for i in drafter.target_layer_ids)
        r = Resolved(name, v.doc, overrides, cfg.to_dict(), drafter, layers, v.codec)
        same = next((o for o in out if o.key(facts) == r.key(facts)), None)
        if same is not None:
            out[out.index(same)] = replace(same, aliases=same.aliases + (name,))
            continue
        out.append(r)
    return out


def default_names() -> list[str]:
    """Every registered variant that can run here, default first."""
    return [n for n in REGISTRY if available(n)]
