"""The one-kernel AdamW overlapped with the next forward (zero_step.install(overlap=True), opt-in: bench word
`overlap`): the in-place step (fused_adamw.step_group_in_place, no gather) runs on a side stream, the largest
partition group cut at the module boundaries the forward meets in turn (`forward_stages`: the drafter's fc,
hidden norm, layers, final norm), and the next forward waits, at each stage's forward pre-hook, only for the
update of that stage's weights. The AdamW kernels (~15 ms a step at the 27B shape on an H100, memory-bound at
93% of HBM) then run beside the next forward's GEMMs instead of before them.

Exactly what runs: the same compiled kernel over the same gradient, master, moment and bf16 views, one call a
chunk instead of one a group; the kernel is elementwise, so every element's arithmetic and inputs are the
unchunked step's (bitwise: tests/test_step_overlap.py on CPU, its gpu test on CUDA). Groups other than the
largest (the 1-D norm gains, ~0.01% of the parameters) run whole, first.

Ordering, on CUDA:
- the side stream waits for the compute stream first (the gradients, the norm, the clip divisor);
- after each chunk an event; a stage's pre-hook makes the compute stream wait for the event after the last
  chunk holding any of its parameters (in-order stream: every earlier chunk is done too); the root module's
  pre-hook waits for parameters in no stage, its post-hook for everything, so the backward and all later work
  see the whole update;
- everything that reads the weights or the optimizer state outside a forward calls `join` first
  (engine.save_checkpoint / load_checkpoint / gathered_drafter; the bench's uninstall);
- the gradient tensors, the clip divisor and the skip flag were allocated on the compute stream and are
  released by the step while the side stream may still read them: each is marked with record_stream, so the
  caching allocator reuses its memory only after the side stream's work queued so far.
With data-parallel ranks > 1 the all-gather of the updated partitions must follow every chunk: the compute
stream joins before it, so the overlap gains nothing there (the step's per-rank share is 1/N anyway); at one
rank there is no all-gather (DeepSpeed skips it) and the overlap is whole.
On the CPU (no streams) the chunks run inline, in the same order: the same results, no overlap.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence

import torch
from torch import nn


def forward_stages(module: nn.Module) -> list[nn.Module]:
    """The modules whose parameters the training forward reads, in the order it first reads them: the module's own
    `forward_stages()`, or its drafter's (trainer/engine.py's training module holds the drafter)."""
    for owner in (module, getattr(module, "drafter", None)):
        stages = getattr(owner, "forward_stages", None)
        if callable(stages):
            return list(stages())
    raise ValueError(
        f"the optimizer-forward overlap needs the module's forward stages: {type(module).__name__} (and its "
        "drafter, if any) has no forward_stages(); turn the overlap off"
    )


class StepOverlap:
    """The side stream, the parameter-to-stage map and the hooks of one engine (zero_step.install makes it)."""

    def __init__(self, opt, root: nn.Module, stages: Sequence[nn.Module]) -> None:
        self.opt = opt
        stage_of: dict[int, int] = {}
        for s, m in enumerate(stages, start=1):  # 0: parameters in no stage (the root's pre-hook waits for them)
            for p in m.parameters():
                stage_of.setdefault(id(p), s)
        # per group: the start of each parameter in its bit16 flat buffer, ascending, and the parameter's stage
        self.starts: list[list[int]] = []
        self.stage_at: list[list[int]] = []
        for i, flat in enumerate(opt.bit16_groups_flat):
            rows = sorted((_offset(p, flat, i), stage_of.get(id(p), 0)) for p in opt.round_robin_bit16_groups[i])
            self.starts.append([o for o, _ in rows])
            self.stage_at.append([s for _, s in rows])
        self.largest = max(range(len(opt.bit16_groups_flat)), key=lambda i: opt.bit16_groups_flat[i].numel())
        dev = opt.single_partition_of_fp32_groups[0].device
        self.side = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
        self.waits: dict[int, object] = {}  # stage -> the event its next forward waits for (one-shot)
        self.pending = False
        self.handles = [root.register_forward_pre_hook(lambda _m, _a: self.wait(0)),
                        root.register_forward_hook(lambda _m, _a, _o: self.join())]  # fmt: skip
        for s, m in enumerate(stages, start=1):
            self.handles.append(m.register_forward_pre_hook(functools.partial(self._pre_hook, s)))

    def _pre_hook(self, stage: int, _module, _args) -> None:
        self.wait(stage)

    # ---------------------------------------------------------------- the step's side
    def chunks(self, i: int, sizes: Sequence[int], partition_start: int) -> list[tuple[int, int, set[int]]]:
        """Group i's in-place list (entry lengths `sizes`, laid end to end from flat element `partition_start`)
        cut into runs of entries: (first entry, end entry, the stages whose parameters those entries hold).
        The largest group: a run per stage in partition order (an entry with no parameter of its own, a pad or
        the tail, goes with the parameter before it); any other group: one run."""
        if not sizes:
            return []
        stages, at = [], partition_start
        for n in sizes:
            k = bisect.bisect_right(self.starts[i], at) - 1
            stages.append(self.stage_at[i][k] if k >= 0 else 0)
            at += n
        if i != self.largest:
            return [(0, len(sizes), set(stages))]
        out: list[tuple[int, int, set[int]]] = []
        for e, s in enumerate(stages):
            if out and s in out[-1][2]:
                out[-1] = (out[-1][0], e + 1, out[-1][2])
            else:
                out.append((e, e + 1, {s}))
        return out

    def order(self, groups: Sequence[int]) -> list[int]:
        """The groups in launch order: the small ones whole first, then the largest in its stage chunks."""
        return [i for i in groups if i != self.largest] + [i for i in groups if i == self.largest]

    def begin(self) -> None:
        """Before the step's launches: the side stream waits for the compute stream's work so far."""
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream(self.side.device))
        self.pending = True

    def stream(self):
        """The context the step's launches run in: the side stream on CUDA, the current one on the CPU."""
        import contextlib

        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def hand_over(self, tensors) -> None:
        """Tensors of the compute stream the side stream reads and the step then releases: their memory is
        reused only after the side stream's work queued so far (record_stream)."""
        if self.side is None:
            return
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(self.side)

    def done(self, stages: set[int]) -> None:
        """After a chunk's launch: the stages whose parameters it updated wait, at their next forward, for it
        (and so for every earlier chunk)."""
        if self.side is None:
            return
        event = torch.cuda.Event()
        event.record(self.side)
        for s in stages:
            self.waits[s] = event

    # ---------------------------------------------------------------- the forward's side
    def wait(self, stage: int) -> None:
        """The compute stream waits for the last update of `stage`'s parameters (no-op if none is pending)."""
        event = self.waits.pop(stage, None)
        if event is not None:
            torch.cuda.current_stream(self.side.device).wait_event(event)

    def join(self) -> None:
        """The compute stream waits for the whole step (every chunk); the weights and the optimizer state are
        then safe to read anywhere."""
        if not self.pending:
            return
        if self.side is not None:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
        self.waits.clear()
        self.pending = False

    def remove(self) -> None:
        """join, then take the hooks off (zero_step.uninstall)."""
        self.join()
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _offset(p: torch.Tensor, flat: torch.Tensor, group: int) -> int:
    """p's first element in its group's flat bit16 buffer (DeepSpeed points each parameter's data there)."""
    byte = p.data_ptr() - flat.data_ptr()
    if byte % p.element_size() or not 0 <= byte // p.element_size() < max(flat.numel(), 1):
        raise RuntimeError(
            f"a parameter of partition group {group} does not lie in the group's flat bit16 buffer: the "
            "optimizer-forward overlap needs DeepSpeed's ZeRO-1/2 layout (turn the overlap off)"
        )
    return byte // p.element_size()
