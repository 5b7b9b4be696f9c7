"""Drafter configuration: the Qwen3-style fields plus the DFlash ones, read from and written to
the z-lab/HF `config.json` format so an export loads in z-lab's code, SGLang and vLLM."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

# Qwen3 config keys we read; anything that would change the math and that we do not implement
# (biases, other activations, scaled or partial RoPE) is refused instead of silently ignored.
_UNSUPPORTED = {
    "attention_bias": False,
    "hidden_act": "silu",
    "partial_rotary_factor": 1.0,
    "is_causal": False,  # SGLang's switch to causal full layers; we train bidirectional ones
    "attn_output_gate": False,  # Qwen3.5's gated attention: not in the DFlash drafter
    "mlp_bias": False,
}

# z-lab's DFlashDraftModel (dflash/model.py `_draft_value`) reads these from `dflash_config` first, else
# from the top level; each changes its forward, and this drafter implements only the value that does not
# (final_logit_softcapping: None or <= 0 is off)
_ZLAB_FORWARD_DEFAULTS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
ARCHITECTURE = "DFlashDraftModel"

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
_QWEN3_MAX_WINDOW_LAYERS = 28  # transformers' Qwen3Config default, used only when layer_types is absent


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    block_size: int = 16
    mask_token_id: int = 248070
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    max_position_embeddings: int = 32768
    # per drafter layer: "full_attention" (bidirectional over context < anchor and the block) or
    # "sliding_attention" (window `sliding_window` over positions, causal inside the block; SPEC 2).
    # Empty: every layer full.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        types_ = tuple(self.layer_types) or (FULL_ATTENTION,) * self.num_hidden_layers
        object.__setattr__(self, "layer_types", types_)  # frozen: normalise once (lists from JSON too)
        if len(types_) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(types_)} entries for num_hidden_layers={self.num_hidden_layers}: "
                "give one per drafter layer"
            )
        bad_types = [(i, t) for i, t in enumerate(types_) if t not in LAYER_TYPES]
        if bad_types:
            i, t = bad_types[0]
            raise ValueError(f"layer_types[{i}]={t!r} is not supported (expected one of {LAYER_TYPES})")
        if SLIDING_ATTENTION in types_:
            if self.sliding_window is None or int(self.sliding_window) < 1:
                raise ValueError(
                    f"layer_types has sliding_attention layers but sliding_window={self.sliding_window!r}: "
                    "set sliding_window >= 1 (tokens a query sees, itself included)"
                )
            object.__setattr__(self, "sliding_window", int(self.sliding_window))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size}: a block needs an anchor and >= 1 MASK slot")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty: fc needs all k captured layers")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} outside vocab of {self.vocab_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside the target's {self.num_target_layers} layers")

    @property
    def num_context_layers(self) -> int:
        """k: the number of captured target layers; fc maps k*H -> H."""
        return len(self.target_layer_ids)

    @property
    def has_sliding_layers(self) -> bool:
        return SLIDING_ATTENTION in self.layer_types

    @property
    def loss_decay_gamma(self) -> float:
        """Paper defaults: 7 for B=16, 5 for B=10, 4 for B=8; in between, interpolate linearly."""
        table = {16: 7.0, 10: 5.0, 8: 4.0}
        if self.block_size in table:
            return table[self.block_size]
        return max(1.0, 4.0 + (self.block_size - 8) * 3.0 / 8.0)

    @classmethod
    def from_hf_dict(cls, d: dict, where: str = "config.json") -> DrafterConfig:
        """Read a z-lab/HF drafter config.json dict.

        Attention layout, read as transformers' Qwen3Config (z-lab's DFlashDraftModel), SGLang and
        vLLM read it: explicit `layer_types` decide; without them, layers i >= max_window_layers
        slide when use_sliding_window is true. Sliding layers need `sliding_window`. A config that
        lists sliding_attention layers with use_sliding_window false is refused: Qwen3Config then
        drops the window, so z-lab's code would run those layers as full attention while SGLang
        refuses a sliding layer without a window; the config is ambiguous, not full attention.
        """
        for key, allowed in _UNSUPPORTED.items():
            if key in d and d[key] not in (allowed, None):
                raise ValueError(f"{where}: {key}={d[key]!r} is not supported (expected {allowed!r})")
        for key in ("rope_parameters", "rope_scaling"):
            rope = d.get(key) or {}
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in ("default", None):
                raise ValueError(f"{where}: {key}.rope_type={rope_type!r} is not supported (expected 'default')")
            if rope.get("partial_rotary_factor", 1.0) not in (1.0, None):
                raise ValueError(f"{where}: {key}.partial_rotary_factor={rope['partial_rotary_factor']!r} "
                                 "is not supported (expected 1.0: RoPE over the full head)")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = rope.get("rope_theta", d.get("rope_theta"))
        layer_types, window = _attention_layout(d, where)
        dflash = d.get("dflash_config") or {}
        _check_zlab_forward(d, dflash, layer_types, where)
        block_size = dflash.get("block_size", d.get("block_size"))  # z-lab's precedence
        missing = [k for k in ("mask_token_id", "target_layer_ids") if k not in dflash]
        if missing or block_size is None:
            raise ValueError(
                f"{where}: not a DFlash drafter config: missing "
                f"{['block_size'] if block_size is None else []}"
                f"{[f'dflash_config.{k}' for k in missing]}"
            )
        heads = d["num_attention_heads"]
        known = {
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "vocab_size", "num_target_layers", "block_size",
            "rms_norm_eps", "max_position_embeddings", "dflash_config", "rope_parameters",
            "rope_scaling", "rope_theta", "layer_types", "sliding_window", "use_sliding_window",
            "max_window_layers",
        }
        return cls(
            hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            target_layer_ids=tuple(int(i) for i in dflash["target_layer_ids"]),
            num_target_layers=d["num_target_layers"],
            block_size=block_size,
            mask_token_id=int(dflash["mask_token_id"]),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta if theta is not None else 1e7),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            layer_types=layer_types,
            sliding_window=window,
            extra={k: v for k, v in d.items() if k not in known},
        )

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        """The record `dataclasses.asdict` made of one (the run plan's `drafter`), its lists tuples again."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def to_hf_dict(self) -> dict:
        """The z-lab/HF config.json: Qwen3 fields plus block_size, num_target_layers, dflash_config."""
        d = {k: v for k, v in asdict(self).items() if k not in ("extra", "target_layer_ids", "mask_token_id")}
        sliding = self.has_sliding_layers
        d.update(
            architectures=["DFlashDraftModel"],
            model_type="qwen3",
            hidden_act="silu",
            attention_bias=False,
            attention_dropout=0.0,
            tie_word_embeddings=False,
            # read back as written by Qwen3Config (z-lab), SGLang and vLLM: explicit layer_types
            # decide; max_window_layers only matters to readers that derive them (none slide then)
            use_sliding_window=sliding,
            sliding_window=self.sliding_window if sliding else None,
            max_window_layers=self.num_hidden_layers,
            layer_types=list(self.layer_types),
            rope_theta=self.rope_theta,
            rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
            rope_scaling=None,
            dflash_config={
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        )
        return d


def _check_zlab_forward(d: dict, dflash: dict, layer_types: tuple[str, ...], where: str) -> None:
    """Refuse what z-lab's DFlashDraftModel would run differently from this drafter (its code reads
    dflash_config's value before the top level's): another architecture, two different block sizes,
    a non-default embedding scale, logit multiplier or softcap, is_causal false over sliding layers."""
    arch = d.get("architectures")
    if arch is not None and arch != [ARCHITECTURE]:
        raise ValueError(f"{where}: architectures={arch!r}: this drafter is z-lab's {ARCHITECTURE} only")
    if "block_size" in dflash and "block_size" in d and dflash["block_size"] != d["block_size"]:
        raise ValueError(f"{where}: dflash_config.block_size={dflash['block_size']!r} but block_size="
                         f"{d['block_size']!r}: z-lab's DFlashDraftModel uses the first; make them agree")  # fmt: skip
    for key, default in _ZLAB_FORWARD_DEFAULTS.items():
        for name, value in ((f"dflash_config.{key}", dflash.get(key)), (key, d.get(key))):
            off = value is None or (key == "final_logit_softcapping" and isinstance(value, (int, float)) and value <= 0)
            if not off and value != default:
                raise ValueError(f"{where}: {name}={value!r} is not supported (z-lab's DFlashDraftModel applies it "
                                 f"in its forward; this drafter implements {default!r} only)")  # fmt: skip
    if d.get("is_causal") is False and SLIDING_ATTENTION in layer_types:
        raise ValueError(f"{where}: is_causal=False with sliding_attention layers: z-lab's DFlashDraftModel then runs "
                         "those layers bidirectionally in the block; this drafter (SGLang's and SpecForge's rule) "
                         "runs them causal there: drop is_causal")  # fmt: skip


def _attention_layout(d: dict, where: str) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window) of an HF drafter config dict; see from_hf_dict."""
    n = d["num_hidden_layers"]
    use_swa = bool(d.get("use_sliding_window", False))
    window = d.get("sliding_window")
    types_ = d.get("layer_types")
    if types_ is None:
        first = d.get("max_window_layers", _QWEN3_MAX_WINDOW_LAYERS)
        types_ = [SLIDING_ATTENTION if use_swa and window is not None and i >= first else FULL_ATTENTION
                  for i in range(n)]
    if isinstance(types_, str) or not isinstance(types_, (list, tuple)):
        raise ValueError(f"{where}: layer_types={types_!r} must be a list with one entry per layer")
    for i, t in enumerate(types_):
        if t not in LAYER_TYPES:
            raise ValueError(f"{where}: layer_types[{i}]={t!r} is not supported (expected one of {LAYER_TYPES})")
    if len(types_) != n:
        raise ValueError(f"{where}: layer_types has {len(types_)} entries, num_hidden_layers={n}")
    sliding = SLIDING_ATTENTION in types_
    if sliding and not use_swa:
        raise ValueError(
            f"{where}: layer_types lists sliding_attention layers but use_sliding_window is "
            f"{d.get('use_sliding_window')!r}: transformers' Qwen3Config would then drop the window (z-lab runs "
            "those layers as full attention) and SGLang refuses them; set use_sliding_window: true to train/serve "
            "the window, or make those layer_types full_attention"
        )
    if sliding and (window is None or not isinstance(window, int) or window < 1):
        raise ValueError(f"{where}: sliding_attention layers need sliding_window >= 1, got {window!r}")
    return tuple(types_), (int(window) if sliding else None)


def build_target_layer_ids(num_target_layers: int, k: int) -> list[int]:
    """z-lab's evenly spaced layer choice, with Python's round (ties to even): (14, 5) -> [1,4,6,8,11]."""
    if k < 1:
        raise ValueError(f"need at least one captured layer, got k={k}")
    if k == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(f"a target with {num_target_layers} layers is too shallow for k={k} (need >= 4)")
    ids = [round(1 + i * (num_target_layers - 4) / (k - 1)) for i in range(k)]
    assert all(0 <= i < num_target_layers for i in ids) and not any(math.isnan(i) for i in ids)
    return ids
