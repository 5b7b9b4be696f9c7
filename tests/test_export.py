"""Export in the z-lab/HF format and import back."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file

from dflash_dist.model.export import EXPORT_RECORD, export_drafter, load_drafter
from tests.helpers.drafter import small_drafter


def test_round_trip_identical_logits(tmp_path):
    d = small_drafter(k=3, block=4)
    for p in d.parameters():  # move off the init values so the test sees real weights travel
        if p.requires_grad:
            p.data.add_(torch.randn_like(p) * 0.05)
    out = export_drafter(d, tmp_path / "export")
    back = load_drafter(out, d.embed_tokens.weight, d.lm_head.weight)
    f = torch.randn(12, 96)
    assert torch.equal(back.draft_block(f, 5, 12), d.draft_block(f, 5, 12))
    assert back.config == d.config


def test_export_format_matches_zlab(tmp_path, golden_dir):
    d = small_drafter(k=3, block=4)
    out = export_drafter(d, tmp_path / "e")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 5
    assert cfg["dflash_config"] == {"mask_token_id": 63, "target_layer_ids": [1, 2, 3]}
    keys = set(load_file(str(out / "model.safetensors")))
    golden_keys = {k for k in load_file(str(golden_dir / "drafter_forward.safetensors"))
                   if k.startswith(("layers.", "fc.", "hidden_norm.", "norm."))}
    assert keys == golden_keys  # same key names as z-lab's drafter (both have 2 layers)
    assert not list(tmp_path.glob(".tmp-*"))


def test_golden_config_loads(golden_dir, tmp_path):
    """z-lab's own config.json + weights load through our importer."""
    import shutil

    from safetensors.torch import save_file

    g = load_file(str(golden_dir / "drafter_forward.safetensors"))
    (tmp_path / "zlab").mkdir()
    shutil.copy(golden_dir / "drafter_config.json", tmp_path / "zlab" / "config.json")
    save_file({k: v for k, v in g.items() if not k.startswith("target.") and "." in k and k.split(".")[0]
               in ("layers", "fc", "hidden_norm", "norm")}, str(tmp_path / "zlab" / "model.safetensors"))
    d = load_drafter(tmp_path / "zlab", g["target.model.embed_tokens.weight"], g["target.lm_head.weight"])
    logits = d.draft_block(g["context_features"][0], int(g["block_input_ids"][0, 0]), 32)
    assert torch.allclose(logits, g["draft_logits"][0], atol=2e-5)


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_drafter(tmp_path)
    d = small_drafter()
    out = export_drafter(d, tmp_path / "e")
    (out / EXPORT_RECORD).unlink()  # edited by hand below: a drafter config from elsewhere, not our export
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="layer_types has 2 entries, num_hidden_layers=3"):
        load_drafter(out)
    cfg["layer_types"] = ["full_attention"] * 3
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing"):
        load_drafter(out)
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6}
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_parameters.rope_type='yarn'"):
        load_drafter(out)
    cfg["rope_parameters"] = None
    cfg["layer_types"] = ["full_attention", "sliding_attention", "mamba"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json: layer_types\[2\]='mamba' is not supported"):
        load_drafter(out)


def test_an_export_carries_its_checksums_and_a_damaged_one_is_named(tmp_path):
    """Exports had no checksum: a flipped byte in model.safetensors (same size, still a valid file)
    loaded and was measured as if trained. The export now records its files' XXH3 checksums
    (dflash_export.json, beside the z-lab format's two files) and loading verifies them; the
    evaluator requires the record of its run's exports, a drafter from elsewhere has none."""
    from data_pipeline.checksums import ChecksumMismatch

    d = small_drafter(k=3, block=4)
    out = export_drafter(d, tmp_path / "e")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", EXPORT_RECORD, "model.safetensors"]
    load_drafter(out, d.embed_tokens.weight, d.lm_head.weight, require_record=True)
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x40  # a weight's byte: the file still parses
    weights.write_bytes(bytes(data))
    for required in (False, True):
        with pytest.raises(ChecksumMismatch, match=rf"{out}: model.safetensors differ\(s\) from the xxh3_128"):
            load_drafter(out, d.embed_tokens.weight, d.lm_head.weight, require_record=required)
    (out / EXPORT_RECORD).unlink()  # a drafter from elsewhere: loads; one of the run's own: refused
    load_drafter(out, d.embed_tokens.weight, d.lm_head.weight)
    with pytest.raises(ValueError, match=rf"{EXPORT_RECORD}: missing"):
        load_drafter(out, d.embed_tokens.weight, d.lm_head.weight, require_record=True)
    (out / EXPORT_RECORD).write_text('{"version": 1, "checksums": {"algorithm": "xxh3_128", "files": {}}}')
    with pytest.raises(ValueError, match="not a version-1 record"):
        load_drafter(out, d.embed_tokens.weight, d.lm_head.weight)


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["umask022", "umask077"])
def test_export_files_take_the_umask_like_the_runs_other_outputs(tmp_path, umask):
    """The export is what a serving engine loads, often as another user (a vLLM/SGLang container,
    a serving account on the shared storage): its directory and files get the umask's modes, as the
    checkpoints beside them do, not tempfile.mkdtemp's 0700 and safetensors' 0600."""
    before = os.umask(umask)
    try:
        out = export_drafter(small_drafter(k=3, block=4), tmp_path / "e")
    finally:
        os.umask(before)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    for name in ("config.json", "model.safetensors", EXPORT_RECORD):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o666 & ~umask, name


def test_a_failed_replacement_keeps_the_previous_export(tmp_path, monkeypatch):
    """Replacing an export moved the old directory aside, then renamed the new one into place: when
    that second rename failed (or an interrupt came between the two), the new one was removed and the
    old one stayed under `.old-<name>-<pid>`, so `<name>` held no export at all. It is moved back."""
    from dflash_dist.model import export as export_mod

    first, second = small_drafter(seed=1), small_drafter(seed=2)
    out = export_drafter(first, tmp_path / "export" / "step_2")
    real_rename = os.rename

    def rename(src, dst):
        if ".tmp-" in str(src) and str(dst) == str(out):
            raise KeyboardInterrupt  # e.g. SIGINT between the two renames
        return real_rename(src, dst)

    monkeypatch.setattr(export_mod.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        export_drafter(second, out)
    monkeypatch.undo()
    back = load_drafter(out, require_record=True)
    assert all(torch.equal(a, b) for a, b in zip(back.drafter_state_dict().values(),
                                                  first.drafter_state_dict().values()))  # fmt: skip
    assert sorted(p.name for p in out.parent.iterdir()) == ["step_2"]


def test_a_killed_exports_leftovers_are_removed_by_the_next_export_of_its_name(tmp_path):
    """A process killed while exporting leaves `.tmp-<name>-*` (a whole drafter's weights: GBs at the
    27B shape) or, killed while replacing, `.old-<name>-<pid>`; nothing removed them, and an old
    directory at the name the next replacement wanted (the same pid, as in a fresh container)
    failed that export with ENOTEMPTY. The next export of the name removes them; others' stay."""
    root = tmp_path / "export"
    out = export_drafter(small_drafter(seed=1), root / "step_2")
    stale = [root / ".tmp-step_2-dead0001", root / f".old-step_2-{os.getpid()}"]
    for d in stale:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 100)
    (root / ".tmp-step_20-0000beef").mkdir()  # other names' (step_20, step_2-x): untouched
    (root / ".tmp-step_2-x-0000beef").mkdir()
    export_drafter(small_drafter(seed=2), out)
    load_drafter(out, require_record=True)
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step_2-x-0000beef", ".tmp-step_20-0000beef", "step_2"]


@pytest.mark.parametrize("change", [
    {"dflash_config": {"block_size": 8}},  # z-lab's DFlashDraftModel reads dflash_config's first: 8, not 4
    {"dflash_config": {"input_embedding_scale": 2.0}},  # scales the block's embeddings
    {"input_embedding_scale": 2.0},  # the top level is read when dflash_config has none
    {"output_multiplier": 0.5},  # scales the logits
    {"dflash_config": {"final_logit_softcapping": 30.0}},  # tanh-caps the logits
    {"architectures": ["DFlash2DraftModel"]},
    {"is_causal": False},  # with sliding layers: z-lab then runs them bidirectional, we causal in the block
], ids=["dflash_block_size", "embedding_scale", "embedding_scale_top", "output_multiplier", "softcap", "dflash2",
        "is_causal_false_sliding"])  # fmt: skip
def test_a_drafter_config_that_zlab_would_run_differently_is_refused(tmp_path, change):
    """A drafter from elsewhere (eval.reference_drafter) is read as z-lab's DFlashDraftModel reads its
    config.json: dflash_config's value of block_size/mask_token_id/target_layer_ids before the top
    level's, and input_embedding_scale, output_multiplier, final_logit_softcapping and is_causal change
    its forward. These were put in `extra` or ignored, and the drafter ran another forward than the
    one the config describes (its tau measured for a model nobody serves); now each is refused, naming it."""
    from safetensors.torch import save_file

    d = small_drafter(k=3, block=4, layer_types=("sliding_attention", "full_attention"), sliding_window=8)
    out = tmp_path / "ref"
    out.mkdir()
    cfg = d.config.to_hf_dict()
    for key, value in change.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(d.drafter_state_dict(), str(out / "model.safetensors"))
    key = next(iter(next(iter(change.values())))) if "dflash_config" in change else next(iter(change))
    with pytest.raises(ValueError, match=rf"config.json: .*{key}"):
        load_drafter(out)
    base = d.config.to_hf_dict()
    same = {**base, "dflash_config": {**base["dflash_config"], "block_size": 4, "input_embedding_scale": 1.0,
                                      "final_logit_softcapping": 0}, "output_multiplier": 1}  # fmt: skip
    (out / "config.json").write_text(json.dumps(same))  # the defaults, spelled out: the same forward
    assert load_drafter(out).config == d.config
