"""The typed config tree: YAML + overrides, errors that name the field, the CLI's exit codes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dflash_dist.config import Config, ConfigError, load_config, load_config_dict
from tests.conftest import REPO

TINY = REPO / "configs" / "tiny.yaml"


def test_tiny_config_loads_with_overrides():
    cfg = load_config(TINY, ["train.lr=1e-3", "eval.budgets=[2, 4]", "train.max_steps=7"], out_dir="/tmp/x")
    assert isinstance(cfg, Config)
    assert cfg.train.lr == 1e-3 and cfg.eval.budgets == [2, 4] and cfg.train.max_steps == 7
    assert cfg.run.out_dir == "/tmp/x" and cfg.target.kind == "tiny_stdlib"
    assert load_config_dict(cfg.to_dict()) == cfg  # how actors receive it


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lrr=1", "unknown key train.lrr"),
        ("trian.lr=1", "unknown key trian"),
        ("train.lr=fast", "train.lr: expected float"),
        ("train.world_size=two", "train.world_size: expected int"),
        ("train.zero_stage=4", "train.zero_stage: 4 is not one of"),
        ("eval.budgets=8", "eval.budgets: expected a list"),
        ("data.train_path=/no/such/file.jsonl", "data.train_path: file /no/such/file.jsonl not found"),
        ("data.train_jsonl=x.jsonl", "unknown key data.train_jsonl"),
        ("train.micro_batch_size=0", "train.micro_batch_size must be >= 1"),
        ("train.log_every=0", "train.log_every must be >= 1"),
        ("train.warmup_frac=1.5", "train.warmup_frac must be < 1"),
        ("train.lr=0", "train.lr must be > 0"),
        ("train.lr=-1e-3", "train.lr must be > 0"),
        ("train.lr=.inf", "train.lr must be a finite number, got inf"),
        ("train.lr=.nan", "train.lr must be a finite number, got nan"),
        ("train.lr=-.inf", "train.lr must be a finite number, got -inf"),
        ("train.lr=inf", "train.lr must be a finite number, got 'inf'"),
        ("train.lr=2", "train.lr must be <= 1"),
        ("train.grad_clip=.inf", "train.grad_clip must be a finite number"),
        ("capture.buffer_stall_s=.inf", "capture.buffer_stall_s must be a finite number"),
        ("eval.server_timeout_s=.nan", "eval.server_timeout_s must be a finite number"),
        ("eval.budgets=[8, 0]", "eval.budgets.1 must be >= 1"),
        ("capture.layer_ids=[1, -2]", "capture.layer_ids.1 must be >= 0"),
        ("drafter.head_dim=33", "drafter.head_dim must be a multiple of 2"),
        ("drafter.num_heads=5", "drafter.num_heads=5 is not a multiple of drafter.num_kv_heads=2"),
        ("drafter.block_size=1", "drafter.block_size must be >= 2"),
        ("regen.top_p=0", "regen.top_p must be > 0"),
        ("capture.gpus_per_actor=-1", "capture.gpus_per_actor must be >= 0"),
        ("train.shuffle=1", "train.shuffle: expected bool"),
        ("ray.placement=packed", "ray.placement: 'packed' is not one of"),
        ("ray.dashboard_host=0.0.0.0", "ray.dashboard_host '0.0.0.0' is not a loopback address.*job API"),
        ("ray.dashboard_host='::'", "ray.dashboard_host '::' is not a loopback address"),
        ("ray.dashboard_host=10.1.2.3", "ray.dashboard_host '10.1.2.3' is not a loopback address"),
        ("ray.dashboard_host=node7", "ray.dashboard_host 'node7' is not a loopback address"),
        ("eval.bogus.x=1", "unknown key eval.bogus"),
        ("novalue", "expected key.path=value"),
    ],
)
def test_bad_config_names_the_field(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(TINY, [override])


def test_the_dashboard_may_listen_on_loopback_addresses():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert load_config(TINY, ["ray.dashboard=true", f"ray.dashboard_host={host}"]).ray.dashboard_host == host


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    (tmp_path / "hf.yaml").write_text("target:\n  kind: hf\n")
    with pytest.raises(ConfigError, match="target.path is required"):
        load_config(tmp_path / "hf.yaml")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "configs/tiny.yaml", "train.bogus=1"], "unknown key train.bogus"),
        (["run", "configs/tiny.yaml", "train.lr=x"], "train.lr: expected float"),
        (["run", "configs/missing.yaml"], "config file configs/missing.yaml not found"),
        (["run", "configs/tiny.yaml", "train.log_every=0"], "train.log_every must be >= 1"),
    ],
)
def test_cli_bad_config_exits_nonzero_naming_it(args, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", *args, "--out", str(tmp_path / "o")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not (tmp_path / "o").exists()  # nothing half-written


def test_unknown_key_lists_the_section_keys_and_assignment_is_checked():
    with pytest.raises(ConfigError, match=r"unknown key train.lrr \(known keys of train: .*\blr\b"):
        load_config(TINY, ["train.lrr=1"])
    cfg = Config()
    cfg.train.lr = 1  # an int is a float
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    with pytest.raises(ValueError, match="log_every"):
        cfg.train.log_every = 0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"- train\n- eval\n", "expected a mapping of sections (run:, target:, ...) at the top, got a YAML list"),
        (b"just words\n", "at the top, got a YAML str"),
        (bytes(range(255, -1, -1)), "not a UTF-8 text file"),
        (b"\x00\x01\x02binary", "not valid YAML"),
    ],
)
def test_cli_config_that_is_no_mapping_exits_nonzero_naming_the_file(content, message, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "train", str(path), "--out", str(tmp_path / "o")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"dflash-dist: config error: {path}: ") and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()


def test_cli_read_only_out_is_one_line_naming_it(tmp_path):
    """A directory the user cannot write: one line naming --out, exit 1, before any role starts.
    As root (CI) the command runs without the capabilities that override file modes (util-linux
    setpriv), so the mode bits hold for it as for any user."""
    import os

    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    ro.chmod(0o555)
    as_user = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"] if os.geteuid() == 0 else []
    out = ro / "run"
    try:
        proc = subprocess.run([*as_user, sys.executable, "-m", "launcher.cli", "train",
                               str(REPO / "configs" / "tiny.yaml"), "--out", str(out)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        ro.chmod(0o755)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == f"dflash-dist train: error: --out {out} is not writable (Permission denied): pass a " \
                          "directory this user can write\n"  # fmt: skip
    assert not out.exists()
