"""HF configs of the project's own targets, from one settings record: Qwen3 dense
(`Qwen3ForCausalLM`) or the Qwen3.5 hybrid (`Qwen3_5ForCausalLM`: Gated DeltaNet layers with a
full-attention layer every fourth, as the real Qwen3.5/3.6 models lay them out)."""

from __future__ import annotations

from typing import Literal

from transformers import PretrainedConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

Arch = Literal["qwen3", "qwen3_5"]
ARCHS: tuple[Arch, ...] = ("qwen3", "qwen3_5")
HYBRID_PATTERN = ("linear_attention", "linear_attention", "linear_attention", "full_attention")
# The project's own targets at test size (built on CPU in seconds; still real, if poor, models).
TEST_SHAPE = dict(
    vocab_size=384,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_head_dim=16,
)


def hybrid_layer_types(num_layers: int) -> list[str]:
    if num_layers % len(HYBRID_PATTERN):
        raise ValueError(f"num_layers must be a multiple of {len(HYBRID_PATTERN)}, got {num_layers}")
    return list(HYBRID_PATTERN) * (num_layers // len(HYBRID_PATTERN))


def text_config(arch: Arch, settings, eos_id: int) -> PretrainedConfig:
    """`settings` has vocab_size, hidden_size, intermediate_size, num_layers, num_heads,
    num_kv_heads, head_dim, max_position_embeddings (and linear_* for the hybrid)."""
    common = dict(
        vocab_size=settings.vocab_size,
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_kv_heads,
        head_dim=settings.head_dim,
        max_position_embeddings=settings.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        attn_implementation="sdpa",
    )
    if arch == "qwen3":
        return Qwen3Config(**common)
    if arch == "qwen3_5":
        return Qwen3_5TextConfig(
            **common,
            linear_num_key_heads=settings.linear_num_key_heads,
            linear_num_value_heads=settings.linear_num_value_heads,
            linear_key_head_dim=settings.linear_head_dim,
            linear_value_head_dim=settings.linear_head_dim,
            layer_types=hybrid_layer_types(settings.num_layers),
        )
    raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")


def causal_lm(config: PretrainedConfig):
    """A freshly initialised model of `config` (the caller seeds torch first)."""
    return (Qwen3_5ForCausalLM if isinstance(config, Qwen3_5TextConfig) else Qwen3ForCausalLM)(config)
