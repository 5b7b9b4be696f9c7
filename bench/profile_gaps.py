"""Where a profiled step leaves the GPU idle: the gaps between kernels (all streams merged), the
largest with the kernels on either side and the host op that launched the kernel ending the gap.

Issue 24's eighth lease measured the 27B step at 230.6 ms wall with 217.7 ms of kernels: >= 12.9 ms
a step with no kernel running, more than the 10 ms between 4.49 and 4.7 samples/s. The wall minus
busy figure cannot say where; this does, from the profiler's own events:

    gaps = idle_gaps(kernel_intervals(prof), host_ops(prof))
    print(gap_report(gaps, steps=2, ops=host_ops(prof), stacks=host_stacks(prof)))

The gap's end says which host op the GPU waited for; `ops` adds why the host was behind: the last
synchronizing runtime call before it (the host waited for the GPU to drain its queue, then had to
launch from an empty one) and the outermost host ops running during the gap; `stacks` (a profile
taken with_stack=True) the Python frames of the op that launched the kernel ending the gap.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Gap:
    start_us: float  # the GPU's last kernel (of any stream) ended here
    end_us: float  # and the next one started here
    before: str  # the kernel that ended last
    after: str  # the kernel that ends the gap
    launched_by: str  # the innermost host op running just before `after` started ("" if none)

    @property
    def us(self) -> float:
        return self.end_us - self.start_us


def kernel_intervals(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every device kernel and copy the profiler saw, by start."""
    out = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CUDA]  # fmt: skip
    return sorted(out)


MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: bench_train_step launches one at each profiled step's start


def steady(kernels: list[tuple[float, float, str]], skip: int = 1) -> tuple[list[tuple[float, float, str]], int]:
    """The kernels from the start of the (skip+1)-th step marker (`MARKER`, launched first in each step) on, and
    how many steps that window holds. A profile starts after a synchronize: the first step's forward then
    launches from an empty queue, and the host is behind the GPU for tens of kernels, gaps a step of training
    never has (the previous optimizer step's ~16 ms of AdamW keep the host ahead). Without markers, everything."""
    marks = [i for i, k in enumerate(kernels) if MARKER in k[2]]
    if len(marks) <= skip:
        return kernels, max(len(marks), 1)
    return kernels[marks[skip]:], len(marks) - skip


def host_ops(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of the host-side ops on the thread that launched the most kernels'
    runtime calls (the training thread), by start."""
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    launches: dict[int, int] = {}
    for e in cpu:
        if e.name.startswith(("cudaLaunch", "cuLaunch")):
            launches[e.thread] = launches.get(e.thread, 0) + 1
    main = max(launches, key=launches.get) if launches else None
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in cpu if main is None or e.thread == main)


# runtime calls after which the host has waited for the device (cudaMemcpy without Async waits too)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
_OUR_FRAMES = ("dflash_dist", "deepspeed", "bench/", "liger_kernel", "torch/nn/modules")


_SKIP_FRAMES = ("deepspeed/accelerator/", "torch/cuda/")  # wrappers: the caller above them is named


@contextlib.contextmanager
def label_syncs():
    """While it is open, each torch.cuda.synchronize (DeepSpeed's accelerator calls it too) runs inside a
    profiler range named `sync@FILE:LINE` of its caller (past DeepSpeed's and torch's wrappers), so a profile
    names the Python line behind each cudaDeviceSynchronize without with_stack's host cost."""
    real = torch.cuda.synchronize

    def synchronize(device=None):
        frame = sys._getframe(1)
        while frame is not None and any(k in frame.f_code.co_filename for k in _SKIP_FRAMES):
            frame = frame.f_back
        where = "?" if frame is None else f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"
        with torch.profiler.record_function(f"sync@{where}"):
            return real(device)

    torch.cuda.synchronize = synchronize
    try:
        yield
    finally:
        torch.cuda.synchronize = real


def _short(path: str) -> str:
    """`path` from its package or repository folder on (site-packages/deepspeed/..., dflash_dist/..., bench/...)."""
    parts = path.replace(os.sep, "/").split("/")
    for i, part in enumerate(parts):
        if part in ("site-packages", "dist-packages"):
            return "/".join(parts[i + 1 :])
        if part in ("dflash_dist", "bench", "tests", "launcher", "data_pipeline"):
            return "/".join(parts[i:])
    return "/".join(parts[-2:])


def host_stacks(prof) -> dict[tuple[float, str], tuple[str, ...]]:
    """(start us, name) of each host op -> its Python frames (innermost first) of this project, DeepSpeed,
    liger and torch's modules; empty unless the profile was taken with_stack=True (the frames are the op's
    `stack`, or, as torch records them since 2.x, the enclosing python_function events)."""
    out = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or "): " in e.name:
            continue
        frames = list(e.stack or ())
        parent = e.cpu_parent
        while not frames and parent is not None:  # collect the enclosing Python frames, innermost first
            if "): " in parent.name:
                frames += [parent.name] + _python_parents(parent)
                break
            parent = parent.cpu_parent
        ours = tuple(f for f in frames if any(k in f for k in _OUR_FRAMES))
        if ours:
            out[(e.time_range.start, e.name)] = ours
    return out


def _python_parents(e) -> list[str]:
    names, parent = [], e.cpu_parent
    while parent is not None:
        if "): " in parent.name:
            names.append(parent.name)
        parent = parent.cpu_parent
    return names


def _outermost(ops: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The ops no other op of `ops` (sorted by start) encloses."""
    top: list[tuple[float, float, str]] = []
    for op in ops:
        if not top or op[0] >= top[-1][1]:
            top.append(op)
    return top


def gap_context(gap: Gap, ops: list[tuple[float, float, str]], top: list[tuple[float, float, str]] | None = None,
                stacks: dict | None = None) -> list[str]:  # fmt: skip
    """Why the host was behind at `gap`: the last synchronizing call that ended before the gap did (and the
    op it ran in), how much of the gap the host spent in no op (Python between ops: `top`, the outermost ops,
    by default computed from `ops`) and which ops it started in it, and the launching op's frames."""
    lines = []
    sync = None
    for start, end, name in ops:
        if start >= gap.end_us:
            break
        if (name in SYNC_CALLS or name.startswith(SYNC_CALLS[:3])) and end <= gap.end_us:
            sync = (start, end, name)
    if sync is not None:
        within = [o for o in ops if o[0] <= sync[0] and o[1] >= sync[1] and not o[2].startswith(("cuda", "cu"))]
        inner = max(within, key=lambda o: o[0])[2] if within else "?"
        lines.append(f"last sync: {sync[2]} in {inner}, {sync[1] - sync[0]:.0f} us long, ended "
                     f"{gap.end_us - sync[1]:.0f} us before the gap's end")  # fmt: skip
    covered = sum(max(0.0, min(end, gap.end_us) - max(start, gap.start_us))
                  for start, end, _ in (top if top is not None else _outermost(ops)))  # fmt: skip
    started: dict[str, int] = {}
    for start, _, name in ops:
        if gap.start_us <= start < gap.end_us and not name.startswith(("cuda", "cu")):
            started[name] = started.get(name, 0) + 1
    ranked = sorted(started.items(), key=lambda kv: -kv[1])[:4]
    lines.append(f"host in no op for {gap.us - covered:.0f} us of it (Python); started {sum(started.values())} ops"
                 + (": " + ", ".join(f"{k[:40]} x{n}" for k, n in ranked) if ranked else ""))  # fmt: skip
    if stacks:
        cands = [(start, f) for (start, name), f in stacks.items() if name == gap.launched_by and start <= gap.end_us]
        if cands:
            lines.append("launched from: " + " <- ".join(max(cands)[1][:3]))
    return lines


def _launcher(ops: list[tuple[float, float, str]], starts: list[float], t: float, lead_us: float) -> str:
    """The innermost (latest-starting) op that encloses t - lead_us, skipping the runtime's launch calls."""
    probe = t - lead_us
    i = bisect.bisect_right(starts, probe)
    best = ""
    for start, end, name in reversed(ops[max(0, i - 256) : i]):  # ops nest: an encloser starts shortly before
        if start <= probe <= end and not name.startswith(("cuda", "cu")):
            best = name
            break
    return best


def idle_gaps(kernels: list[tuple[float, float, str]], ops: list[tuple[float, float, str]] = (), min_us: float = 0.0,
              lead_us: float = 5.0) -> list[Gap]:  # fmt: skip
    """Every stretch with no kernel running between the first kernel's start and the last one's end,
    at least `min_us` long, in time order. Overlapping kernels (several streams) count as busy while
    any runs. `lead_us`: how long before a kernel's start its launch is looked for among `ops`."""
    kernels = sorted(kernels)
    ops = sorted(ops)
    starts = [o[0] for o in ops]
    gaps: list[Gap] = []
    busy_until, last = None, ""
    for start, end, name in kernels:
        if busy_until is not None and start - busy_until > min_us and start > busy_until:
            gaps.append(Gap(busy_until, start, last, name, _launcher(ops, starts, start, lead_us)))
        if busy_until is None or end >= busy_until:
            busy_until, last = end, name
    return gaps


def gap_report(gaps: list[Gap], steps: int, top: int = 15, width: int = 60, ops=None, stacks=None) -> str:
    """Idle per step in all, by size class, and the `top` largest gaps with their neighbours (with `ops`, the
    host ops, and `stacks`, host_stacks: gap_context's lines under each)."""
    total = sum(g.us for g in gaps)
    lines = [f"idle between kernels: {total / 1e3 / steps:.2f} ms a step in {len(gaps) / steps:.0f} gaps"]
    classes = ((0, 10), (10, 100), (100, 1000), (1000, float("inf")))
    parts = []
    for lo, hi in classes:
        sel = [g.us for g in gaps if lo <= g.us < hi]
        label = f">= {lo:g} us" if hi == float("inf") else f"{lo:g}-{hi:g} us"
        parts.append(f"{label}: {len(sel) / steps:.0f} gaps, {sum(sel) / 1e3 / steps:.2f} ms")
    lines.append("  by size (a step): " + "; ".join(parts))
    by_launcher: dict[str, float] = {}
    for g in gaps:
        by_launcher[g.launched_by or "?"] = by_launcher.get(g.launched_by or "?", 0.0) + g.us
    ranked = sorted(by_launcher.items(), key=lambda kv: -kv[1])[:8]
    lines.append("  by the host op launching the next kernel (ms a step): "
                 + "; ".join(f"{k[:40]} {v / 1e3 / steps:.2f}" for k, v in ranked))  # fmt: skip
    lines.append(f"  the {min(top, len(gaps))} largest:")
    ops = sorted(ops) if ops else None  # once, not for each gap (tens of thousands of host ops a profile)
    outer = _outermost(ops) if ops else None
    for g in sorted(gaps, key=lambda g: -g.us)[:top]:
        lines.append(f"  {g.us:9.1f} us  after {g.before[:width]!r} before {g.after[:width]!r}"
                     f" (launched in {g.launched_by[:40] or '?'})")  # fmt: skip
        if ops:
            lines += [f"               {line}" for line in gap_context(g, ops, outer, stacks)]
    return "\n".join(lines)
