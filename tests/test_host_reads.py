"""Host reads of device data per steady-state training step (bench/host_reads.py, on the CPU): every one
drains the GPU's queue, so a change that adds one fails here, naming its site.

- The trainer (trainer/loop.py with the one-kernel AdamW step, `train.optimizer_step: fused`, on the CPU's
  engine: its gathered form; the GPU's in-place form is the bench case below): a step between log steps
  reads nothing back and makes no blocking upload (a host tensor copied to the device without non_blocking
  also waits for the queue); a log step reads exactly the log's values.
- The bench's step under `direct+fused+leangrads` on the engine the GPU gets (bf16, overlap_comm;
  `deepspeed_config(on_gpu=True)`), with DeepSpeed's CUDA-only synchronize branches taken: one device
  synchronize per micro-batch remains, DeepSpeed's own at the end of each backward under overlap_comm;
  none with the word "epiwait" (zero_step.wait_on_device), with or without "nogather" (the trainer's GPU form).

Before issue 24's sync cut each micro-batch also made the loss's nonzero over the supervised slots and its
block count (`int(keep.sum())`), DeepSpeed's throughput timer synchronized in every forward and step(), and
under decay weighting the loss copied its slot weights to the device (blocking).
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import pytest
import torch

from dflash_dist.actors.trainer_group import default_extensions_dir, train_job
from dflash_dist.config import load_config
from dflash_dist.model.loss import Anchors, sample_anchors
from dflash_dist.trainer.ds_config import build_lr_schedule, build_optimizer, deepspeed_config
from tests.helpers.drafter import small_drafter
from tests.helpers.tiny import NUM_SAMPLES, make_cfg, write_shards

os.environ.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_train_step as bts  # noqa: E402
from host_reads import HostReads  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# what a log step reads (trainer/loop.py _log): the queued steps' losses, the window's sums and
# per-sample rows, the grad norm and the lean step's skip counter; one drain per log step
LOG_READS = {
    ("cpu", "dflash_dist/trainer/step_log.py", "reduce"): 2,  # StepLogs.reduce losses, Window.reduce sums
    ("cpu", "dflash_dist/trainer/step_log.py", "per_sample"): 1,
    ("item", "dflash_dist/trainer/loop.py", "_log"): 1,  # float(grad_norm)
    ("item", "dflash_dist/trainer/engine.py", "skipped_steps"): 1,  # the lean step's device counter
}
# DeepSpeed 0.19.8's independent_gradient_partition_epilogue: with overlap_comm a device synchronize
# after the last reduce bucket of every backward, before it drops the reduced gradients (its ordering)
EPILOGUE = ("synchronize", "deepspeed/runtime/zero/stage_1_and_2.py", "independent_gradient_partition_epilogue")


def _sites(reads) -> collections.Counter:
    """(kind, file, function) -> count: line numbers left out, so edits elsewhere in a file keep the test."""
    out = collections.Counter()
    for r in reads:
        where, func = r.site.split(" ", 1)
        out[(r.kind, where.rsplit(":", 1)[0], func)] += 1
    return out


def _show(title: str, reads) -> str:
    return title + "\n" + "\n".join(f"  {r.kind} {r.site}  <- {' <- '.join(reversed(r.stack[-6:]))}" for r in reads)


def test_a_read_made_by_the_with_machinery_is_sited_at_the_with_statement():
    """A read that contextlib's own code makes (an ExitStack callback run at the block's end) is sited
    at the caller's frame, not in contextlib.py: host_reads skips the standard library's with/ExitStack
    and functools frames. It listed them as bare names ("contextlib.py"), which no frame's full path
    starts with, so the site was contextlib.py's `_exit_wrapper`."""
    import contextlib

    t = torch.ones(3)
    reads = HostReads()
    reads.mark(t)

    def step() -> None:
        with contextlib.ExitStack() as stack:
            stack.callback(float, t.sum())  # float(sum) at the block's end, called from contextlib

    with reads:
        step()
    assert [r.kind for r in reads.reads] == ["item"], reads.reads
    site = reads.reads[0].site
    assert site.startswith("tests/test_host_reads.py:") and site.endswith(" step"), site
    assert not any("contextlib.py" in frame for frame in reads.reads[0].stack), reads.reads[0].stack


def test_a_trainer_step_reads_nothing_back_between_log_steps(tiny, tmp_path, single_rank_gloo):
    from dflash_dist.trainer.loop import Trainer

    shards = tmp_path / "shards"
    write_shards(shards, tiny["prov"], tiny["samples"], done=True)
    cfg = make_cfg(tmp_path / "run", tiny["target_dir"], world_size=1, micro_batch_size=1, grad_accum=2,
                   optimizer_step="fused", position_weighting="decay", log_every=4, checkpoint_every=1000,
                   histogram_every=1000, max_steps=8)  # fmt: skip
    trainer = Trainer(cfg, train_job(cfg, tiny["target_dir"], shards, tiny["prov"], tiny["drafter"],
                                     num_samples=NUM_SAMPLES))  # fmt: skip
    reads = HostReads()
    reads.mark_engine(trainer.engine)
    per_step: dict[int, list] = collections.defaultdict(list)
    uploads: dict[int, list] = collections.defaultdict(list)

    def measured(fn, after_step: bool):
        def run(*a, **k):
            step = trainer.state.step + (0 if after_step else 1)
            if step < 5:  # warm: the kernel compiles, DeepSpeed's throughput timer started timing at step 3
                return fn(*a, **k)
            before, up = len(reads.reads), len(reads.uploads)
            with reads:
                out = fn(*a, **k)
            per_step[step] += reads.reads[before:]
            uploads[step] += reads.uploads[up:]
            return out

        return run

    trainer.train_step = measured(trainer.train_step, after_step=False)
    trainer._log = measured(trainer._log, after_step=True)
    try:
        assert trainer.run().steps == 8
    finally:
        reads.remove_hooks()
    assert sorted(per_step) == [5, 6, 7, 8]
    for step in (5, 6, 7):
        assert per_step[step] == [], _show(f"step {step} read device data:", per_step[step])
        # host -> device copies: none blocking (that waits for the queue: the decay weights did), the
        # batch's and its supervised rows' non-blocking (pinned features; the rest pageable, small)
        blocking = [u for u in uploads[step] if u.kind == "h2d blocking"]
        assert blocking == [], _show(f"step {step} blocking uploads:", blocking)
        assert _sites(uploads[step]) == {
            # per micro-batch: input_ids, features, loss_mask, target_argmax, anchor positions and keep
            ("h2d non_blocking", "dflash_dist/trainer/batching.py", "move"): 2 * 6,
            ("h2d non_blocking", "dflash_dist/trainer/loop.py", "train_step"): 2,  # supervised rows
        }, _show(f"step {step} uploads:", uploads[step])
    assert _sites(per_step[8]) == LOG_READS, _show("log step 8:", per_step[8])
    print(reads.table(steps=4))


# the two cuts' sites, as the bench words "dstimer" and "devrows" put them back (the step before 2026-12-06)
BEFORE_CUTS = {
    ("synchronize", "deepspeed/utils/timer.py", "start"): 3,  # the throughput timer, every forward's prologue
    ("synchronize", "deepspeed/utils/timer.py", "stop"): 3,  # ... and every engine.step()
    ("nonzero", "dflash_dist/model/loss.py", "dflash_loss"): 3,  # the supervised rows found on the device
}


@pytest.mark.parametrize("words", ["", "+epiwait", "+epiwait+nogather", "+dstimer+devrows", "+dedup0+lastrows"])
def test_the_bench_step_under_direct_fused_leangrads_syncs_once_per_micro_batch(words, single_rank_gloo):
    """The GPU's engine config on the CPU (bf16, overlap_comm, the 27B shape's bucket rule), the setting
    issue 24's eighth lease profiled, the bench's batches with their host-found supervised rows: one
    synchronize per micro-batch, DeepSpeed's epilogue; none with "epiwait" (zero_step.wait_on_device: there the
    compute stream waits on the reduction stream instead), nor with "epiwait+nogather" (the form the trainer's GPU
    engine gives `train.optimizer_step: fused`: zero_step.trainer_options). "dstimer+devrows" (the
    bench's words for the step before the cuts, so that a lease measures them side by side) put
    DeepSpeed's timer synchronizes and the loss's nonzero back, and only those. "dedup0+lastrows" (the drafter's
    row cuts, on with the GPU's kernel sets; this drafter runs the torch set) add none."""
    import deepspeed

    cfg = load_config(None, ["target.kind=tiny_stdlib", "train.max_steps=20", "train.position_weighting=dpace"])
    module = bts.BenchForward(small_drafter().train(), "data", None, "dense", "dpace").to(torch.bfloat16)
    optimizer = build_optimizer(cfg, module, fused=True)
    ds = deepspeed_config(cfg, 1, True, hidden_size=32)
    assert ds["zero_optimization"]["overlap_comm"] and ds["bf16"]["enabled"]
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds, dist_init_required=False,
                                      lr_scheduler=build_lr_schedule(cfg, optimizer, 20))  # fmt: skip
    bts.apply_setting(engine, bts.parse_setting("direct+fused+leangrads" + words))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(7):
        ids, mask = torch.randint(0, 60, (1, 24), generator=g), torch.ones(1, 24)
        a = sample_anchors(mask, 4, g)
        args = (ids, torch.randn(1, 24, 96, generator=g).bfloat16(), mask, ids, a.positions, a.keep)
        batches.append(bts.Batch.of(args, ids, mask, Anchors(a.positions, a.keep), 4))
    for b in batches[:4]:  # warm, past DeepSpeed's throughput timer's start step
        loss, _ = engine(*b, rows=b.rows)
        engine.backward(loss)
        engine.step()
    reads = HostReads(gpu_branches=True)
    reads.mark_engine(engine)
    with reads:
        for b in batches[4:]:
            loss, _ = engine(*b, rows=b.rows)
            engine.backward(loss)
            engine.step()
    reads.remove_hooks()
    print(reads.table(steps=3))
    want = {"": {EPILOGUE: 3}, "+epiwait": {}, "+epiwait+nogather": {},
            "+dstimer+devrows": {EPILOGUE: 3, **BEFORE_CUTS},
            "+dedup0+lastrows": {EPILOGUE: 3}}[words]  # the drafter's row cuts (on with the GPU's kernels) read nothing
    assert _sites(reads.reads) == want, _show("the bench's step read device data:", reads.reads)
