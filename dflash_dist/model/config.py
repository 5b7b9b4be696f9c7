"""Drafter configuration: the Qwen3-style fields plus the DFlash ones, read from and written to
the z-lab/HF `config.json` format so an export loads in z-lab's code, SGLang and vLLM."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

# Qwen3 config keys we read; anything that would change the math and that we do not implement
# (biases, sliding windows, scaled RoPE) is refused instead of silently ignored.
_UNSUPPORTED = {
    "attention_bias": False,
    "use_sliding_window": False,
    "hidden_act": "silu",
}


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
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
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
    def loss_decay_gamma(self) -> float:
        """Paper defaults: 7 for B=16, 5 for B=10, 4 for B=8; in between, interpolate linearly."""
        table = {16: 7.0, 10: 5.0, 8: 4.0}
        if self.block_size in table:
            return table[self.block_size]
        return max(1.0, 4.0 + (self.block_size - 8) * 3.0 / 8.0)

    @classmethod
    def from_hf_dict(cls, d: dict, where: str = "config.json") -> DrafterConfig:
        """Read a z-lab/HF drafter config.json dict."""
        for key, allowed in _UNSUPPORTED.items():
            if key in d and d[key] not in (allowed, None):
                raise ValueError(f"{where}: {key}={d[key]!r} is not supported (expected {allowed!r})")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"{where}: rope_type={rope_type!r} is not supported (expected 'default')")
        theta = rope.get("rope_theta", d.get("rope_theta"))
        dflash = d.get("dflash_config") or {}
        missing = [k for k in ("mask_token_id", "target_layer_ids") if k not in dflash]
        if missing or "block_size" not in d:
            raise ValueError(
                f"{where}: not a DFlash drafter config: missing "
                f"{['block_size'] if 'block_size' not in d else []}"
                f"{[f'dflash_config.{k}' for k in missing]}"
            )
        heads = d["num_attention_heads"]
        known = {
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "vocab_size", "num_target_layers", "block_size",
            "rms_norm_eps", "max_position_embeddings", "dflash_config", "rope_parameters",
            "rope_scaling", "rope_theta",
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
            block_size=d["block_size"],
            mask_token_id=int(dflash["mask_token_id"]),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta if theta is not None else 1e7),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_hf_dict(self) -> dict:
        """The z-lab/HF config.json: Qwen3 fields plus block_size, num_target_layers, dflash_config."""
        d = {k: v for k, v in asdict(self).items() if k not in ("extra", "target_layer_ids", "mask_token_id")}
        d.update(
            architectures=["DFlashDraftModel"],
            model_type="qwen3",
            hidden_act="silu",
            attention_bias=False,
            attention_dropout=0.0,
            tie_word_embeddings=False,
            use_sliding_window=False,
            sliding_window=None,
            layer_types=["full_attention"] * self.num_hidden_layers,
            rope_theta=self.rope_theta,
            rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
            rope_scaling=None,
            dflash_config={
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        )
        return d


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
