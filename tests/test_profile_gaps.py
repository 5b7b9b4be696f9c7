"""bench/profile_gaps.py: the idle stretches between kernels of a profiled step, with the kernels on
either side and the host op that launched the next kernel."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import profile_gaps as pg  # noqa: E402


def test_gaps_merge_streams_and_name_both_sides_and_the_launcher():
    kernels = [
        (0.0, 10.0, "gemm_a"),
        (5.0, 30.0, "copy_on_side_stream"),  # overlaps gemm_a: busy until 30
        (12.0, 20.0, "norm"),  # inside the side stream's run: no gap at 10
        (130.0, 140.0, "gemm_b"),  # 100 us with nothing running, after the side-stream copy
        (141.0, 150.0, "tiny"),  # 1 us
    ]
    ops = [
        (100.0, 200.0, "aten::linear"),
        (110.0, 128.0, "aten::mm"),  # innermost op running 5 us before gemm_b starts
        (120.0, 124.0, "cudaLaunchKernel"),  # the runtime's call is skipped
        (135.0, 140.5, "aten::add"),
    ]
    gaps = pg.idle_gaps(kernels, ops)
    assert [(g.start_us, g.end_us) for g in gaps] == [(30.0, 130.0), (140.0, 141.0)]
    first = gaps[0]
    assert (first.us, first.before, first.after) == (100.0, "copy_on_side_stream", "gemm_b")
    assert first.launched_by == "aten::mm"
    assert gaps[1].launched_by == "aten::add"  # at 136 us both aten::linear and aten::add run: the inner one
    assert [g.us for g in pg.idle_gaps(kernels, ops, min_us=5.0)] == [100.0]
    report = pg.gap_report(gaps, steps=1, top=1)
    assert "idle between kernels: 0.10 ms a step in 2 gaps" in report
    assert "100-1000 us: 1 gaps, 0.10 ms" in report and "0-10 us: 1 gaps, 0.00 ms" in report
    assert "100.0 us  after 'copy_on_side_stream' before 'gemm_b' (launched in aten::mm)" in report
    assert report.count(" us  after ") == 1  # top=1


def test_a_real_profile_gives_host_ops_and_no_kernels_on_cpu():
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (a @ a).relu().sum()
    ops = pg.host_ops(prof)
    names = {name for _, _, name in ops}
    assert {"aten::mm", "aten::relu", "aten::sum"} <= names
    assert all(start <= end for start, end, _ in ops) and ops == sorted(ops)
    assert pg.kernel_intervals(prof) == []
    assert pg.gap_report(pg.idle_gaps([], ops), steps=1).startswith("idle between kernels: 0.00 ms a step in 0 gaps")


def test_the_context_of_a_gap_says_why_the_host_was_behind():
    """gap_context: the last synchronizing runtime call before the gap's end and the op it ran in (the host
    waited for the GPU to drain, then launched from an empty queue), the part of the gap the host spent in no
    op (Python) and the ops it started in it; a later sync or one that ends after the gap is not it."""
    kernels = [(0.0, 100.0, "gemm"), (400.0, 450.0, "adamw")]
    ops = [
        (60.0, 105.0, "aten::item"),  # ends inside the gap: the sync's op
        (61.0, 104.0, "cudaStreamSynchronize"),
        (120.0, 160.0, "aten::zeros"),
        (125.0, 130.0, "aten::fill_"),
        (200.0, 240.0, "aten::zeros"),
        (300.0, 398.0, "aten::_foreach_copy_"),  # launches adamw's kernel... after 2 us more
        (380.0, 395.0, "cudaLaunchKernel"),
        (500.0, 510.0, "cudaDeviceSynchronize"),  # after the gap: not it
    ]
    (gap,) = pg.idle_gaps(kernels, ops)
    assert (gap.start_us, gap.end_us, gap.launched_by) == (100.0, 400.0, "aten::_foreach_copy_")
    lines = pg.gap_context(gap, sorted(ops))
    assert lines[0] == "last sync: cudaStreamSynchronize in aten::item, 43 us long, ended 296 us before the gap's end"
    # in ops: 100-105 (item), 120-160, 200-240, 300-398 -> 183 of 300 us; no op: 117 us
    assert lines[1] == "host in no op for 117 us of it (Python); started 4 ops: aten::zeros x2, aten::fill_ x1, " \
                       "aten::_foreach_copy_ x1"
    report = pg.gap_report([gap], steps=1, ops=ops)
    assert "               last sync: cudaStreamSynchronize in aten::item" in report
    assert "last sync" not in pg.gap_report([gap], steps=1)  # without ops: the gap alone, as before


def test_host_stacks_name_the_projects_frames_of_each_op():
    from torch.profiler import ProfilerActivity, profile

    from dflash_dist.model.attention import attend

    q = torch.randn(1, 2, 8, 16)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        attend(q, q, q, None, scale=0.25)
    stacks = pg.host_stacks(prof)
    sdpa = [f for (_, name), f in stacks.items() if name == "aten::scaled_dot_product_attention"]
    assert sdpa and "dflash_dist/model/attention.py" in sdpa[0][0], sdpa
    with profile(activities=[ProfilerActivity.CPU]) as plain:
        attend(q, q, q, None, scale=0.25)
    assert pg.host_stacks(plain) == {}


def test_label_syncs_names_the_line_behind_each_synchronize():
    """Under label_syncs a torch.cuda.synchronize (directly, or through DeepSpeed's accelerator) runs in a profiler
    range `sync@FILE:LINE` of the caller past the wrappers, which gap_context then names as the sync's op; torch's
    own function is back afterwards. (No CUDA here: the real call raises inside the range, which is still recorded.)"""
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator  # what get_accelerator() is on a GPU
    from torch.profiler import ProfilerActivity, profile

    real = torch.cuda.synchronize
    with pg.label_syncs(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for call in (torch.cuda.synchronize, CUDA_Accelerator().synchronize):
            with contextlib.suppress(AssertionError, RuntimeError):
                call()  # line A
    assert torch.cuda.synchronize is real
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if text.endswith("# line A"))
    names = [name for _, _, name in pg.host_ops(prof) if name.startswith("sync@")]
    assert names == [f"sync@tests/test_profile_gaps.py:{line}"] * 2, names


def test_the_steady_window_starts_at_the_second_step_marker():
    """steady(): a profile begins after a synchronize, so its first step launches from an empty queue (gaps that
    training never has); the window from the second marker kernel on counts only the steps after it."""
    marker = "at::cuda::(anonymous namespace)::spin_kernel(long)"
    kernels = [
        (0.0, 1.0, marker), (300.0, 310.0, "fwd_gemm_step1"),  # a 299 us gap: the host was behind
        (400.0, 401.0, marker), (402.0, 410.0, "fwd_gemm_step2"),
        (500.0, 501.0, marker), (505.0, 510.0, "fwd_gemm_step3"),
    ]
    window, steps = pg.steady(kernels)
    assert window == kernels[2:] and steps == 2
    assert [g.us for g in pg.idle_gaps(window)] == [1.0, 90.0, 4.0]  # the 299 us start-up gap is out
    assert pg.steady(kernels, skip=2) == (kernels[4:], 1)
    plain = [(0.0, 1.0, "gemm"), (5.0, 6.0, "norm")]  # no markers (an older profile): everything, one step
    assert pg.steady(plain) == (plain, 1)
    assert pg.steady(kernels[:2]) == (kernels[:2], 1)  # one marker: nothing to skip to
