"""`dflash-dist export CHECKPOINT_DIR`: a checkpoint's drafter exported again outside training is
bit for bit the trainer's own export of that step (ZeRO-2's whole module, ZeRO-3's consolidated
partitions), verifies, keeps a valid export unless --force, and refuses a damaged checkpoint
naming the file, writing nothing; the drafter's shape is the one the run recorded (the tag's marker,
or its run plan), never built again from the run's config and target. Real DeepSpeed (one gloo rank
in this process), tiny target."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dflash_dist.model.config import DrafterConfig
from dflash_dist.model.export import verify_export
from dflash_dist.trainer.checkpoint import MARKER
from dflash_dist.trainer.export_checkpoint import MODEL_STATES, ZERO3_MODEL_STATES
from dflash_dist.trainer.safe_load import weights_only_loads
from launcher.cli import main as cli
from tests.conftest import REPO
from tests.helpers.tiny import make_cfg, write_shards

STEPS = 2


def train_run(tiny, root: Path, zero_stage: int) -> Path:
    """A finished one-rank run with a checkpoint and the trainer's export of step 2, and its config.yaml."""
    from dflash_dist.trainer.loop import Trainer, TrainJob

    shards = root / "shards"
    write_shards(shards, tiny["prov"], tiny["samples"][:4], done=True)
    out = root / "run"
    cfg = make_cfg(out, tiny["target_dir"], f"drafter.mask_token_id={tiny['drafter'].mask_token_id}", world_size=1,
                   zero_stage=zero_stage, max_steps=STEPS, checkpoint_every=STEPS)  # fmt: skip
    job = TrainJob(str(tiny["target_dir"]), str(shards), tiny["prov"], tiny["drafter"], total_steps=STEPS)
    Trainer(cfg, job).run()
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))  # as the pipeline writes it
    return out


def moved_aside(out: Path) -> Path:
    """The trainer's own export of the step, moved out of the run (the command's default output)."""
    ref = out.parent / "trainer_export"
    shutil.move(out / "export" / f"step_{STEPS}", ref)
    return ref


def assert_same_export(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sorted(ta) == sorted(tb) and ta
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert torch.equal(ta[name].view(torch.uint8), tb[name].view(torch.uint8)), name
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())
    assert verify_export(a, required=True) and verify_export(b, required=True)


def test_zero2_checkpoint_exports_bitwise_as_the_trainer_and_damage_is_refused(tiny, tmp_path, single_rank_gloo,
                                                                                capsys):  # fmt: skip
    out = train_run(tiny, tmp_path, zero_stage=2)
    tag = out / "checkpoints" / f"step_{STEPS}"
    ref = moved_aside(out)

    assert cli(["export", str(tag)]) == 0
    assert_same_export(out / "export" / tag.name, ref)
    assert f"step {STEPS} (ZeRO-2)" in capsys.readouterr().out

    # a valid export is kept unless --force; a damaged one is replaced without it
    assert cli(["export", str(tag)]) == 1
    assert "already holds a valid export" in capsys.readouterr().err
    assert cli(["export", str(tag), "--force"]) == 0
    weights = out / "export" / tag.name / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(ValueError, match=rf"export it again from its checkpoint: dflash-dist export {tag}$"):
        verify_export(weights.parent, required=True)  # the damaged export's message names the command
    assert cli(["export", str(tag)]) == 0
    assert_same_export(weights.parent, ref)

    # --dtype: the trainer's fp32 weights cast
    assert cli(["export", str(tag), "--out", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    bf16, fp32 = load_file(str(tmp_path / "bf16" / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert all(torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"

    # a directory that is not an export is never replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert cli(["export", str(tag), "--out", str(tmp_path / "mine"), "--force"]) == 1
    assert "not an export directory" in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"

    # usage errors exit 2
    with pytest.raises(SystemExit) as usage:
        cli(["export"])
    assert usage.value.code == 2
    with pytest.raises(SystemExit) as usage:
        cli(["export", str(tag), "--dtype", "int8"])
    assert usage.value.code == 2

    # a flipped byte in the model states: refused naming the file, nothing written (a real process's exit code)
    states = tag / MODEL_STATES
    good = states.read_bytes()
    states.write_bytes(good[: len(good) // 2] + bytes([good[len(good) // 2] ^ 1]) + good[len(good) // 2 + 1 :])
    fresh = tmp_path / "fresh"
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "export", str(tag), "--out", str(fresh)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert f"{tag}: {MODEL_STATES} differ(s) from the xxh3_128 checksum" in proc.stderr
    assert "export another tag" in proc.stderr and "Traceback" not in proc.stderr
    assert not fresh.exists() and not list(tmp_path.glob(".tmp-*"))
    states.write_bytes(good)

    # the shape is the run's record, never derived again from its config.yaml over its target: with the
    # target gone and config.yaml naming another drafter (each refused before), the export is the trained one
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    cfg["target"]["path"] = str(tmp_path / "target-gone")
    cfg["drafter"]["num_layers"] = 2
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert cli(["export", str(tag), "--out", str(fresh)]) == 0
    assert_same_export(fresh, ref)
    (out / "config.yaml").unlink()
    assert cli(["export", str(tag), "--out", str(fresh), "--force"]) == 0
    shutil.rmtree(fresh)


def test_a_tag_without_a_drafter_record_is_exported_from_its_run_plan_or_refused(tiny, tmp_path, single_rank_gloo,
                                                                                capsys):  # fmt: skip
    """A tag saved before markers recorded the drafter: its run's run_plan.json (Slurm: plans/*.json)
    gives the shape; none, or plans that disagree, are refused naming the files."""
    import dataclasses

    from dflash_dist.orchestration import run_plan
    from dflash_dist.trainer import export_checkpoint

    assert (export_checkpoint.RUN_PLAN, export_checkpoint.SLURM_PLANS) == (run_plan.PLAN_NAME, run_plan.PLANS_DIR)
    out = train_run(tiny, tmp_path, zero_stage=2)
    tag = out / "checkpoints" / f"step_{STEPS}"
    ref = moved_aside(out)
    marker = json.loads((tag / MARKER).read_text())
    assert DrafterConfig.from_hf_dict(marker.pop("drafter")) == tiny["drafter"]  # what the trainer recorded
    (tag / MARKER).write_text(json.dumps(marker))  # as an older trainer wrote it
    (out / "config.yaml").unlink()

    assert cli(["export", str(tag)]) == 1
    err = capsys.readouterr().err
    assert f"{tag / MARKER} records no drafter shape" in err and f"{out / 'run_plan.json'}" in err
    assert not (out / "export" / tag.name).exists()

    plan = {"schema": 3, "drafter": dataclasses.asdict(tiny["drafter"])}  # the run plan's record of it
    (out / "run_plan.json").write_text(json.dumps(plan))
    assert cli(["export", str(tag)]) == 0
    assert_same_export(out / "export" / tag.name, ref)

    theta = tiny["drafter"].rope_theta * 2  # same shapes, another model
    other = dataclasses.asdict(dataclasses.replace(tiny["drafter"], rope_theta=theta))
    (out / "plans").mkdir()
    (out / "plans" / "7-0-0.json").write_text(json.dumps({**plan, "drafter": other}))
    assert cli(["export", str(tag), "--out", str(tmp_path / "x")]) == 1
    assert "record 2 different ones" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_zero3_checkpoint_consolidates_bitwise_as_the_trainer(tiny, tmp_path, single_rank_gloo):
    out = train_run(tiny, tmp_path, zero_stage=3)
    tag = out / "checkpoints" / f"step_{STEPS}"
    with weights_only_loads():
        module = torch.load(tag / ZERO3_MODEL_STATES)["module"]
    layers = [v for k, v in module.items() if k.startswith("drafter.layers.")]
    assert layers and all(v.numel() == 0 for v in layers), "ZeRO-3's module states are placeholders"
    ref = moved_aside(out)
    assert cli(["export", str(tag)]) == 0
    assert_same_export(out / "export" / tag.name, ref)


def test_an_unlisted_file_in_a_zero3_tag_is_refused_not_consolidated(tiny, tmp_path, single_rank_gloo, capsys):
    """DeepSpeed's ZeRO-3 consolidation globs the tag for `*_model_states.pt` and takes the first
    (natural order) for the parameters' names and shapes: a file the marker does not list was read
    without any checksum. Planted as a copy of rank 0's with two same-shaped parameters' names
    swapped (plain data, so the weights-only load takes it), it made an export with k_proj and
    v_proj exchanged and exit 0. The tag's files are exactly those its marker lists."""
    from collections import OrderedDict

    out = train_run(tiny, tmp_path, zero_stage=3)
    tag = out / "checkpoints" / f"step_{STEPS}"
    ref = moved_aside(out)
    with weights_only_loads():
        states = torch.load(tag / ZERO3_MODEL_STATES)
    k, v = "drafter.layers.0.self_attn.k_proj.weight", "drafter.layers.0.self_attn.v_proj.weight"
    swap = {k: v, v: k}
    states["param_shapes"] = [OrderedDict((swap.get(n, n), s) for n, s in g.items()) for g in states["param_shapes"]]
    torch.save(states, tag / "a_model_states.pt")  # sorts before zero_pp_rank_0_...

    assert cli(["export", str(tag)]) == 1
    err = capsys.readouterr().err
    assert "a_model_states.pt" in err and MARKER in err and "not list" in err
    assert not (out / "export" / tag.name).exists()
    (tag / "a_model_states.pt").unlink()
    assert cli(["export", str(tag)]) == 0
    assert_same_export(out / "export" / tag.name, ref)
