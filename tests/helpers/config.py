"""Test configs built as a user's are: through load_config's `a.b=value` overrides, so the field
rules and the cross-field rules (config._validate) run on every config a test runs with."""

from __future__ import annotations

import json

from dflash_dist.config import Config, load_config

# The trainer and evaluator tests write their shards themselves (no capture), but an hf target's
# config must name its training data: this file is never opened (configs here skip file checks).
UNREAD_TRAIN_PATH = "unread-the-test-writes-its-shards.jsonl"


def overrides_of(tree: dict, prefix: str = "") -> list[str]:
    """`a.b=value` for every leaf of a nested mapping (as Config.to_dict gives); each value as
    JSON, which YAML reads back to the same value."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out += overrides_of(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value)}")
    return out


def config_from(tree: dict, *overrides: str, check_files: bool = False) -> Config:
    """The Config of `tree` (nested sections) plus `a.b=value` overrides, loaded and validated as
    load_config loads a file with its overrides. check_files: also require the target and data
    files it names to exist."""
    return load_config(None, [*overrides_of(tree), *overrides], check_files=check_files)
