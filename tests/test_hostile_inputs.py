"""What someone who can write a run directory (shared storage) or a model directory can plant
there, and what it must not achieve: no code of theirs runs, nothing outside the directory is
written, no file of a few MB takes gigabytes of memory. Each case is a real hostile file on disk
read by the real code path (webdataset, tarfile, transformers: none mocked).

- compressed tars (plain_tar.py): a shard or token-store tar gzip'd decompresses in memory before
  any checksum is compared; the readers accept plain tars only.
- remote code (target/loading.py NO_REMOTE_CODE): a target directory whose config names Python
  files beside it (`auto_map`); transformers asks on the terminal and imports them on "y".
- planted links (durable_files.open_own_file): a name we write in place (the run lock, a line
  log, a write's temporary name) made a symlink to a file elsewhere; we would truncate or append
  to that file.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import threading
import tracemalloc
from pathlib import Path

import pytest

from data_pipeline.plain_tar import NotPlainTar
from data_pipeline.records import MANIFEST_NAME
from data_pipeline.shard_reader import CORRUPT_SHARD, ShardStream, iter_shard_samples, read_manifest
from data_pipeline.shard_writer import ShardWriter, mark_done
from tests.conftest import REPO
from tests.helpers.shards import make_prov, make_sample

BOMB_BYTES = 256 << 20  # one member's declared size: a quarter GiB of zeros, ~1 MB of gzip


class _Zeros(io.RawIOBase):
    def __init__(self, n: int) -> None:
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


def _rewrite_line(manifest: Path, **fields) -> None:
    """The manifest's one line with `fields` changed: whoever can write a shard can write this too."""
    line = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**line, **fields}) + "\n")


def _one_shard(tmp_path: Path):
    prov = make_prov()
    with ShardWriter(tmp_path, prov, prefix="cap") as w:
        w.write(make_sample("a", prov, finite=True))
    mark_done(tmp_path)
    (record,) = read_manifest(tmp_path)
    return prov, tmp_path / record.name


# ---------------------------------------------------------------- compressed tars
def test_a_gzip_bomb_shard_is_refused_before_it_is_decompressed(tmp_path):
    """A shard replaced by a gzip'd tar whose first member declares 256 MiB: the old reader
    (webdataset's "r|*") decompressed it into memory before the member's checksum could fail."""
    prov, path = _one_shard(tmp_path)
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("00000000.features.npy")
        info.size = BOMB_BYTES
        tar.addfile(info, io.BufferedReader(_Zeros(BOMB_BYTES), 1 << 20))
    assert path.stat().st_size < BOMB_BYTES // 100
    _rewrite_line(tmp_path / MANIFEST_NAME, n_bytes=path.stat().st_size)
    stream = ShardStream(tmp_path, prov)
    tracemalloc.start()
    try:
        handed = [s.key for s in stream]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"reading a {path.stat().st_size}-byte shard peaked at {peak / 2**20:.0f} MiB"
    assert handed == [] and stream.skipped == {CORRUPT_SHARD: 1}
    assert "gzip-compressed file, not a plain tar" in stream.problems[0], stream.problems
    with pytest.raises(NotPlainTar, match=rf"{path}: a gzip-compressed file"):
        list(iter_shard_samples(path))


def test_a_compressed_copy_of_a_real_shard_is_refused(tmp_path):
    """The writer's own shard gzip'd: every member and so every checksum is unchanged, and the
    old reader handed the sample out. Only a plain tar is one our writer made."""
    prov, path = _one_shard(tmp_path)
    path.write_bytes(gzip.compress(path.read_bytes()))
    _rewrite_line(tmp_path / MANIFEST_NAME, n_bytes=path.stat().st_size)
    stream = ShardStream(tmp_path, prov)
    assert [s.key for s in stream] == [] and stream.skipped == {CORRUPT_SHARD: 1}


def test_a_compressed_token_store_tar_is_refused(tmp_path):
    """The token store verifies a whole file's checksum first, but its manifest line is as
    writable as the file: a gzip'd tar listed with its own size and checksum was read."""
    from data_pipeline.checksums import FILE_ALGORITHM, digest_bytes
    from data_pipeline.token_store import read_sequences, read_store, write_sequences

    record = write_sequences(tmp_path, "cap", [("k", [1, 2, 3], [0, 1, 1])])
    path = tmp_path / record.name
    data = gzip.compress(path.read_bytes())
    path.write_bytes(data)
    _rewrite_line(tmp_path / MANIFEST_NAME, n_bytes=len(data), checksum=digest_bytes(data, FILE_ALGORITHM))
    (listed,) = read_store(tmp_path)
    with pytest.raises(NotPlainTar, match=rf"{path}: a gzip-compressed file"):
        read_sequences(tmp_path, listed)


# ---------------------------------------------------------------- code in a model directory
EVIL_MODULE = """
import os, pathlib
pathlib.Path(os.environ["DFLASH_TEST_FLAG"]).touch()  # the planted code's effect
from transformers import PretrainedConfig, PreTrainedModel
class EvilConfig(PretrainedConfig):
    model_type = "evil_lm"
class EvilModel(PreTrainedModel):
    config_class = EvilConfig
class EvilTokenizer:
    pass
"""
LOADS = {  # each way the package reads a target directory with transformers
    "config": "from dflash_dist.target.loading import target_matmul_params as f; f(D)",
    "tokenizer": "from dflash_dist.target.loading import load_tokenizer as f; f(D)",
    "model": "from dflash_dist.target.loading import load_target as f; from tests.helpers.config import config_from; "
    "f(config_from({'target': {'path': D}, 'data': {'train_path': 'x.jsonl'}}), D, 'cpu')",
}


@pytest.mark.parametrize("load", sorted(LOADS))
def test_code_in_a_target_directory_never_runs(tmp_path, load):
    """A target directory whose config.json and tokenizer_config.json map the Auto classes to a
    Python file beside them, for a model type transformers lacks. Asked nothing, transformers
    prompted "Do you wish to run the custom code? [y/N]" and imported the file on "y" (here a
    piped answer, as a terminal user's): the flag appeared."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "evil.py").write_text(EVIL_MODULE)
    auto = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (target / "config.json").write_text(json.dumps({"model_type": "evil_lm", "auto_map": auto}))
    (target / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}})
    )
    flag = tmp_path / "flag"
    env = dict(os.environ, PYTHONPATH=str(REPO), DFLASH_TEST_FLAG=str(flag), HF_MODULES_CACHE=str(tmp_path / "hf"))
    proc = subprocess.run([sys.executable, "-c", f"D = {str(target)!r}\n{LOADS[load]}"], input="y\ny\ny\n",
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)  # fmt: skip
    assert not flag.exists(), f"the target directory's code ran ({load}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    assert proc.returncode != 0 and "dflash-dist never runs code from a model directory" in proc.stderr, proc.stderr
    assert f"ValueError: {target}: its config.json or tokenizer_config.json maps" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- planted links where we write
def _victim(tmp_path: Path) -> tuple[Path, bytes]:
    """A file of the user's outside the run directory (their ~/.bashrc), with no newline at its end."""
    victim = tmp_path / "home" / ".bashrc"
    victim.parent.mkdir()
    victim.write_bytes(b"export PATH=$HOME/bin:$PATH\nalias ll='ls -l'")
    return victim, victim.read_bytes()


def test_a_planted_run_lock_link_is_refused_not_truncated(tmp_path):
    """`<out>/.dflash.lock` made a link: the run truncated the linked file and wrote its holder record there."""
    from data_pipeline.durable_files import UnsafeFileError
    from dflash_dist.orchestration.run_lock import LOCK_NAME, RunLock

    out = tmp_path / "out"
    out.mkdir()
    victim, before = _victim(tmp_path)
    (out / LOCK_NAME).symlink_to(victim)
    with pytest.raises(UnsafeFileError, match=rf"{out / LOCK_NAME} is a symbolic link or not a regular file"):
        RunLock(out, "run").acquire()
    assert victim.read_bytes() == before


@pytest.mark.parametrize("log", ["skipped", "manifest"])
def test_a_planted_line_log_link_is_refused_not_appended_to(tmp_path, log):
    """A line log made a link: append_lines cut the linked file back to its last newline (a "torn
    line") and appended our records to it. The skipped-sample ledger and the shard manifest."""
    from data_pipeline.durable_files import UnsafeFileError
    from data_pipeline.ledger import record_skipped
    from data_pipeline.records import SKIPPED_NAME

    victim, before = _victim(tmp_path)
    if log == "manifest":  # an empty file (a manifest is read before it is appended to: it must parse)
        victim.write_bytes(before := b"")
    shards = tmp_path / "shards"
    shards.mkdir()
    name = SKIPPED_NAME if log == "skipped" else MANIFEST_NAME
    (shards / name).symlink_to(victim)
    with pytest.raises(UnsafeFileError, match=rf"{shards / name} is a symbolic link"):
        if log == "skipped":
            record_skipped(shards, "k1", "nonfinite_features", 0)
        else:
            _one_shard(shards)
    assert victim.read_bytes() == before


def test_a_planted_link_at_a_temporary_name_is_replaced_not_followed(tmp_path):
    """write_text_atomic's temporary name (`.NAME.tmp-PID-TID`) can be guessed; made a link, the
    write truncated and filled the linked file, then renamed the link into place."""
    from data_pipeline.durable_files import write_text_atomic

    victim, before = _victim(tmp_path)
    path = tmp_path / "latest"
    path.with_name(f".latest.tmp-{os.getpid()}-{threading.get_ident()}").symlink_to(victim)
    write_text_atomic(path, "step_4")
    assert victim.read_bytes() == before
    assert path.read_text() == "step_4" and not path.is_symlink()


def test_a_planted_export_link_is_replaced_not_followed(tmp_path):
    """`export/step_N` made a link to another directory: the export renamed the link aside and then
    failed in rmtree (which refuses a link), failing the trainer. Now the link goes, the directory
    it named is untouched, and the export is in place."""
    from dflash_dist.model.export import export_drafter, load_drafter
    from tests.helpers.drafter import small_drafter

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("mine")
    out = tmp_path / "export" / "step_2"
    out.parent.mkdir()
    out.symlink_to(elsewhere, target_is_directory=True)
    export_drafter(small_drafter(), out)
    assert out.is_dir() and not out.is_symlink() and [p.name for p in elsewhere.iterdir()] == ["notes.txt"]
    load_drafter(out, require_record=True)
    assert not list(out.parent.glob(".old-*"))


@pytest.mark.slow
def test_a_planted_checkpoint_tag_link_is_replaced_not_followed(tiny, tmp_path, single_rank_gloo):
    """`checkpoints/step_2` made a link before the trainer saved step 2: the tag was cleared with
    rmtree (which silently refuses a link under ignore_errors), then DeepSpeed wrote the tag's
    files, and rank 0 the completion marker, into the directory the link named."""
    from dflash_dist.trainer import checkpoint
    from dflash_dist.trainer.loop import Trainer, TrainJob
    from tests.helpers.tiny import make_cfg, write_shards

    shards = tmp_path / "shards"
    write_shards(shards, tiny["prov"], tiny["samples"][:4], done=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "step_2").symlink_to(elsewhere, target_is_directory=True)
    cfg = make_cfg(out, tiny["target_dir"], world_size=1, max_steps=2, checkpoint_every=2)
    job = TrainJob(str(tiny["target_dir"]), str(shards), tiny["prov"], tiny["drafter"], total_steps=2)
    Trainer(cfg, job).run()
    assert list(elsewhere.iterdir()) == [], f"the checkpoint was written through the link: {list(elsewhere.iterdir())}"
    tag = out / "checkpoints" / "step_2"
    assert not tag.is_symlink() and checkpoint.read_marker(tag) is not None


def _tag_with_files(tmp_path: Path) -> Path:
    """A checkpoint tag of two files under a completion marker, as rank 0 writes it."""
    from dflash_dist.trainer import checkpoint

    tag = tmp_path / "checkpoints" / "step_2"
    (tag / "zero").mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"model bytes")
    (tag / "zero" / "fp32.pt").write_bytes(b"")
    checkpoint.write_marker(tag, {"step": 2})
    return tag


@pytest.mark.parametrize("how", ["link_out", "dir_link_out", "dev_zero"])
def test_a_checkpoint_file_replaced_by_a_link_or_device_is_refused(tmp_path, how):
    """A tag's file made a link to a file elsewhere with the same bytes (marker and checksums stay
    true: the resume would hand DeepSpeed a file outside the tag), a directory of the tag made a
    link, or a file made a link to /dev/zero (size 0, as the marker may record): the hash before
    the resume never ended. Each is now a named problem of the tag, and a checksum mismatch."""
    from dflash_dist.trainer import checkpoint

    tag = _tag_with_files(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    if how == "link_out":
        (outside / "model.pt").write_bytes(b"model bytes")
        (tag / "mp_rank_00_model_states.pt").unlink()
        (tag / "mp_rank_00_model_states.pt").symlink_to(outside / "model.pt")
        named = tag / "mp_rank_00_model_states.pt"
    elif how == "dir_link_out":
        (outside / "fp32.pt").write_bytes(b"")
        (tag / "zero" / "fp32.pt").unlink()
        (tag / "zero").rmdir()
        (tag / "zero").symlink_to(outside, target_is_directory=True)
        named = tag / "zero"
    else:
        (tag / "zero" / "fp32.pt").unlink()
        (tag / "zero" / "fp32.pt").symlink_to("/dev/zero")
        named = tag / "zero" / "fp32.pt"
    result: dict = {}

    def check() -> None:
        result["problem"] = checkpoint.marker_problem(tag)
        meta = json.loads((tag / checkpoint.MARKER).read_text())
        try:
            checkpoint.verify_checksums(tag, meta)
        except checkpoint.ResumeError as e:
            result["verify"] = str(e)

    thread = threading.Thread(target=check, daemon=True)  # /dev/zero: main's hash never returned
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), f"{named}: verifying the tag's checksums did not end"
    assert result["problem"] is not None and str(named) in result["problem"], result
    assert "symbolic link" in result["problem"], result
    assert "verify" in result, f"{named}: the checksums passed"


def test_a_file_planted_beside_a_checkpoints_listed_files_is_refused(tmp_path):
    """DeepSpeed's ZeRO-3 consolidation and universal conversion glob the tag directory: a file there
    that its marker does not list (or a link to a directory) is read with no checksum compared, so a
    tag holding one is refused before anything loads it; universal.py's own entries are not. (The
    export of a real ZeRO-3 tag with such a file: test_export_checkpoint.)"""
    from dflash_dist.trainer import checkpoint

    tag = _tag_with_files(tmp_path)
    meta = json.loads((tag / checkpoint.MARKER).read_text())
    (tag / "universal" / "zero").mkdir(parents=True)  # universal.py's copy and leftovers: its own records
    (tag / "universal" / "zero" / "x_optim_states.pt").write_bytes(b"")
    (tag / ".universal.tmp-7").mkdir()
    (tag / "latest_universal").write_text(".universal.tmp-7")
    checkpoint.verify_checksums(tag, meta)
    (tag / "zero" / "a_optim_states.pt").write_bytes(b"planted")
    (tag / "elsewhere").symlink_to(tmp_path, target_is_directory=True)
    assert checkpoint.unlisted_files(tag, list(meta["files"])) == ["elsewhere", "zero/a_optim_states.pt"]
    with pytest.raises(checkpoint.ResumeError, match=r"holds elsewhere, zero/a_optim_states.pt, which "
                       rf"{checkpoint.MARKER} does not list"):  # fmt: skip
        checkpoint.verify_checksums(tag, meta)


# ---------------------------------------------------------------- paths named in a run plan
def _plan_for(cfg, **changes):
    from data_pipeline.ledger import CaptureData
    from dflash_dist.capture.data_prep import ingested_paths
    from dflash_dist.orchestration.run_plan import DataPlan, RunPlan
    from dflash_dist.target.loading import TargetIdentity
    from dflash_dist.trainer.resume import ResumeDecision
    from tests.helpers.drafter import small_drafter

    prov = make_prov()
    data = DataPlan(str(ingested_paths(cfg, "train")[0]), None, CaptureData(None, None, 4, "0" * 64))
    tag = ResumeDecision(str(cfg.out / "checkpoints" / "step_2"), 2, 1, 1, "0" * 64)
    fields = dict(
        stages=("train",),
        resume="auto",
        resume_from=tag,
        target_dir=str(cfg.target.path),
        identity=TargetIdentity(
            str(cfg.target.path), "t", prov.target_hash, prov.layer_ids, prov.hidden_size, prov.dtype
        ),
        expected=prov,
        drafter=small_drafter().config,
        data=data,
        num_samples=4,
        made_by="leader",
    )
    return RunPlan(**{**fields, **changes})


@pytest.mark.parametrize("field", ["own", "train_jsonl", "target_dir", "resume_from"])
def test_a_plan_naming_paths_outside_the_run_is_refused(tmp_path, field):
    """A Slurm task reads the plan another task wrote to <out>/plans/<key>.json (the key is the job
    id: predictable). One naming conversations, a model or a checkpoint elsewhere was obeyed."""
    from dataclasses import replace

    from dflash_dist.orchestration.run_plan import PipelineError, plan_path, share_plan, write_plan
    from dflash_dist.trainer.resume import ResumeDecision
    from tests.helpers.config import config_from

    cfg = config_from({"run": {"out_dir": str(tmp_path / "out")}, "target": {"kind": "hf", "path": str(tmp_path / "t")},
                       "data": {"train_path": "x.jsonl"}})  # fmt: skip
    plan = _plan_for(cfg)
    elsewhere = tmp_path / "elsewhere"
    if field == "train_jsonl":
        plan = replace(plan, data=replace(plan.data, train_jsonl=str(elsewhere / "private.jsonl")))
    elif field == "target_dir":
        plan = replace(plan, target_dir=str(elsewhere / "model"))
    elif field == "resume_from":
        plan = replace(plan, resume_from=ResumeDecision(str(elsewhere / "step_9"), 9, 1, 1, "0" * 64))
    key = "train-7-step-0-restart-0"
    write_plan(plan_path(cfg.out, key), plan)
    if field == "own":
        assert share_plan(cfg, ("train",), "auto", key=key, leader=False, wait_s=5) == plan
        return
    with pytest.raises(PipelineError, match=rf"{plan_path(cfg.out, key)}: names .*{elsewhere}"):
        share_plan(cfg, ("train",), "auto", key=key, leader=False, wait_s=5)


def test_tensorboard_event_files_cannot_be_planted_ahead_as_links(tmp_path):
    """TensorBoard names an event file `events.out.tfevents.<seconds>.<host>.<pid>.<n>` and opens it
    "wb" through a link. Links planted under every name the next minute could give (the pid and n
    guessed here exactly, as a neighbour on the node could nearly) had the writer truncate the
    linked file and write its events there."""
    import time

    from tensorboard.summary.writer import event_file_writer

    from dflash_dist.trainer.metrics import Metrics

    victim, before = _victim(tmp_path)
    tb = tmp_path / "tb" / "train"
    tb.mkdir(parents=True)
    n, now = event_file_writer._global_uid._value, int(time.time())
    for t in range(now - 5, now + 60):
        (tb / f"events.out.tfevents.{t:010d}.{socket.gethostname()}.{os.getpid()}.{n}").symlink_to(victim)
    metrics = Metrics(tb, purge_step=3)
    metrics.log(3, {"train/loss": 1.0})
    metrics.close()
    assert victim.read_bytes() == before, "the event file was written through a planted link"
    written = [p for p in tb.iterdir() if not p.is_symlink()]
    assert len(written) == 1 and written[0].stat().st_size > 0, written
