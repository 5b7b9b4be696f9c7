"""Host reads of device data in a training step, found on the CPU: each place where a GPU run waits
for the device (a sync point, after which the GPU's queue drains), with its call stack.

On a GPU, a host read of a device tensor (`.item()`, `float()`/`int()`/`bool()`, `.tolist()`,
`.cpu()`, `.numpy()`), an op whose output size depends on device data (`nonzero`, boolean-mask
indexing, `unique`, `masked_select`, `repeat_interleave` without `output_size`) and an explicit
device synchronize (DeepSpeed's `get_accelerator().synchronize()`, `torch.cuda.synchronize()`)
block the host until the queued kernels finish. On the CPU nothing waits, so `HostReads` tells
them apart by where the data lives on a GPU: a DeepSpeed engine's state and its module's forward
inputs (the batch on the device) are device tensors (`mark_engine`), and so is every op's output
with a device tensor among its inputs (a TorchDispatchMode follows them). Reads of other tensors
(the host batch before its copy, gloo control tensors) are host work, not counted. Missed: a factory
tensor made on the compute device (`torch.zeros(..., device=dev)`) and read before any device
tensor touches it; `torch.tensor(data, device=dev)` (a blocking upload).

Host -> device copies through `Tensor.to` are listed in `uploads`: "h2d blocking" (no non_blocking:
the host waits for the queue, as for a read) or "h2d non_blocking" (asynchronous from pinned memory;
from pageable memory the driver may wait). On the CPU a move to a gloo group's device looks the
same, so they are not counted as reads.

    reads = HostReads(gpu_branches=True)
    reads.mark_engine(engine)        # its state, and from now on its module's inputs
    with reads:
        ... one step ...
    print(reads.table(steps=1))

`gpu_branches`: DeepSpeed's CPU accelerator `resolves_data_dependency()`, so DeepSpeed skips the
synchronize it makes on CUDA with overlap_comm; with this set the functions that make it
(SYNC_AFTER_DATA_DEPENDENCY) see False and synchronize (a no-op on the CPU, counted).
tests/test_host_reads.py asserts the counts per step of the trainer and of bench_train_step's step.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import linecache
import sys
import threading
import traceback
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
# ops whose output size (or value on the host) depends on device data: each waits for the device
SYNC_OPS = {
    aten._local_scalar_dense: "item",  # .item(), float(), int(), bool(), __index__
    aten.nonzero: "nonzero",
    aten.masked_select: "masked_select",
    aten._unique: "unique",
    aten._unique2: "unique",
    aten.unique_dim: "unique",
    aten.unique_consecutive: "unique",
    aten.bincount: "bincount",
    aten.equal: "equal",
    aten.is_nonzero: "item",
}
ROOT = Path(__file__).resolve().parents[1]
# frames never named as a site: torch, this module, and the standard library's with/ExitStack and functools
# machinery (their files by full path: a frame's filename is absolute, so their bare names never matched)
_SKIP = (str(Path(torch.__file__).parent), str(Path(__file__).resolve()), "<frozen", contextlib.__file__,
         functools.__file__)


@dataclass(frozen=True)
class Read:
    kind: str  # item, nonzero, tolist, cpu, synchronize, ...
    site: str  # innermost frame outside torch: "path:line function"
    caller: str  # innermost frame in this repository ("" when the site is one)
    stack: tuple[str, ...]  # the frames outside torch, outermost first


def _frames() -> list[traceback.FrameSummary]:
    return [f for f in traceback.extract_stack()[:-2] if not f.filename.startswith(_SKIP)]


def _ours(filename: str) -> bool:
    """A file of this repository (not of a virtual environment inside it, as tests/setup_and_run.sh makes)."""
    return filename.startswith(str(ROOT)) and "site-packages" not in Path(filename).parts


def _where(f: traceback.FrameSummary) -> str:
    """"path:line function": a package's path from its site-packages, this repository's from its root."""
    path = Path(f.filename)
    parts = path.parts
    if "site-packages" in parts:
        name = "/".join(parts[parts.index("site-packages") + 1 :])
    else:
        try:
            name = str(path.resolve().relative_to(ROOT))
        except ValueError:
            name = str(path)
    return f"{name}:{f.lineno} {f.name}"


# DeepSpeed 0.19.8's functions that synchronize the device right after `resolves_data_dependency()` is
# False (CUDA, overlap_comm) and use it for nothing else that needs a CUDA stream: the end of each backward.
# allreduce_and_copy (train.zero_grad_reduce=reduce: a synchronize per reduce bucket) and
# _allreduce_noncontiguous_bucket_preserving_fp32 also record_stream on the answer, which the CPU cannot.
SYNC_AFTER_DATA_DEPENDENCY = {"independent_gradient_partition_epilogue", "_flush_coalesced_reduction_zero12"}


def _repeats_without_size(args, kwargs) -> bool:
    """repeat_interleave with a tensor of repeats and no output_size: its size is their sum."""
    tensor_repeats = len(args) > 1 and isinstance(args[1], torch.Tensor)
    return tensor_repeats and kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)


def _gpu_branch() -> bool:
    return sys._getframe(1).f_code.co_name not in SYNC_AFTER_DATA_DEPENDENCY


class HostReads(TorchDispatchMode):
    """Records every host read of a device tensor and every device synchronize while active."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compiled regions (the one-kernel AdamW, the compiled kernel sets, flex) run as compiled: on a GPU
        a compiled kernel reads nothing on the host, and dynamo refuses to compile under other modes."""
        return True

    def __init__(self, gpu_branches: bool = False) -> None:
        super().__init__()
        self._device: weakref.WeakSet = weakref.WeakSet()  # storages that live on the device on a GPU
        self.reads: list[Read] = []
        self.uploads: list[Read] = []  # host -> device copies (Tensor.to), by site
        self.gpu_branches = gpu_branches
        self._off = 0  # > 0: inside our own bookkeeping
        self._thread = threading.get_ident()
        self._undo: list = []
        self._hooks: list = []

    # -------------------------------------------------------------- which tensors are on the device
    def mark(self, *tensors: torch.Tensor) -> None:
        """These tensors live on the device."""
        for t in tensors:
            self._device.add(t.untyped_storage())

    def mark_engine(self, engine) -> None:
        """A DeepSpeed engine's module (parameters, buffers, and from now on its forward's inputs: the
        batch on the device) and its optimizer: every tensor among the ZeRO optimizer's attributes
        (flat partitions, fp32 masters, buffers; two levels of containers) and the client optimizer's
        parameters and state."""
        module = engine.module
        self.mark(*module.parameters(), *module.buffers())
        self._hooks.append(module.register_forward_pre_hook(self._mark_inputs, with_kwargs=True, prepend=True))
        opt = engine.optimizer
        inner = getattr(opt, "optimizer", opt)
        self.mark(*(p for g in inner.param_groups for p in g["params"]))
        self.mark(*(v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)))

        def walk(o, depth: int) -> None:
            if isinstance(o, torch.Tensor):
                self.mark(o)
            elif depth < 3 and isinstance(o, dict):
                for v in list(o.values()):
                    walk(v, depth + 1)
            elif depth < 3 and isinstance(o, (list, tuple)):
                for v in o:
                    walk(v, depth + 1)

        if opt is not inner:
            walk(vars(opt), 0)

    def _mark_inputs(self, _module, args, kwargs):
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self._device.add(t.untyped_storage())

    def on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage() in self._device

    # -------------------------------------------------------------- recording
    def _record(self, kind: str) -> None:
        frames = _frames()
        ours = [f for f in frames if _ours(f.filename)]
        site = _where(frames[-1]) if frames else "?"
        caller = _where(ours[-1]) if ours and ours[-1] is not frames[-1] else ""
        self.reads.append(Read(kind, site, caller, tuple(_where(f) for f in frames)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._off:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not any(self.on_device(t) for t in inputs):
            return out
        packet = func.overloadpacket
        if packet in SYNC_OPS:
            self._record(SYNC_OPS[packet])
        elif packet in (aten.index, aten.index_put, aten.index_put_) and any(
            t is not None and t.dtype == torch.bool for t in (args[1] if len(args) > 1 else ())
        ):
            self._record("bool-mask index")
        elif packet is aten.repeat_interleave and _repeats_without_size(args, kwargs):
            self._record("repeat_interleave")
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._device.add(t.untyped_storage())
        for arg, value in zip(func._schema.arguments, args):  # in-place and out= writes (one tensor or a list:
            if arg.alias_info is not None and arg.alias_info.is_write:  # _foreach_copy_ into a flat partition's views)
                for t in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(t, torch.Tensor):
                        self._device.add(t.untyped_storage())
        return out

    # -------------------------------------------------------------- reads that dispatch no op
    def _wrap_tensor_method(self, name: str, kind: str, host_copy: bool) -> None:
        original = getattr(torch.Tensor, name)
        mode = self

        def wrapper(t, *a, **k):
            if not mode._off and threading.get_ident() == mode._thread and mode.on_device(t):
                mode._record(kind)
                if host_copy:  # on a GPU the result is a host copy: later host reads of it wait for nothing
                    return mode._host_copy(original, t, *a, **k)
            return original(t, *a, **k)

        setattr(torch.Tensor, name, wrapper)
        self._undo.append(lambda: setattr(torch.Tensor, name, original))

    def _wrap_to(self) -> None:
        """Tensor.to: a move to the host (the call's source line names "cpu") of a device tensor is a
        read (a host copy returned); a move of a host tensor to another device is an upload (`uploads`,
        module docstring), returned as is: what reaches the engine's module is marked there."""
        original = torch.Tensor.to
        mode = self

        def to(t, *a, **k):
            dev = k.get("device")
            if dev is None and a and isinstance(a[0], (str, torch.device)):
                dev = a[0]
            if mode._off or dev is None or threading.get_ident() != mode._thread:
                return original(t, *a, **k)
            frame = sys._getframe(1)
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
            if "cpu" in line:
                if mode.on_device(t):
                    mode._record("to(cpu)")
                    return mode._host_copy(original, t, *a, **k)
                return original(t, *a, **k)
            if mode.on_device(t):
                return original(t, *a, **k)
            blocking = not k.get("non_blocking", len(a) > 1 and a[1] is True)
            frames = _frames()
            mode.uploads.append(Read("h2d blocking" if blocking else "h2d non_blocking", _where(frames[-1]), "",
                                     tuple(_where(f) for f in frames)))  # fmt: skip
            return original(t, *a, **k)

        torch.Tensor.to = to
        self._undo.append(lambda: setattr(torch.Tensor, "to", original))

    def _host_copy(self, fn, t, *a, **k):
        self._off += 1
        try:
            return fn(t, *a, **k).clone()
        finally:
            self._off -= 1

    def __enter__(self):
        self._thread = threading.get_ident()  # the dispatch mode is this thread's; so are the wrappers
        self._wrap_tensor_method("tolist", "tolist", False)
        self._wrap_tensor_method("numpy", "numpy", False)
        self._wrap_tensor_method("cpu", "cpu", True)
        self._wrap_to()
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        sync = acc.synchronize

        def synchronize(*a, **k):
            if threading.get_ident() == self._thread:
                self._record("synchronize")
            return sync(*a, **k)

        acc.synchronize = synchronize
        self._undo.append(lambda: vars(acc).pop("synchronize", None))
        if self.gpu_branches:
            acc.resolves_data_dependency = _gpu_branch
            self._undo.append(lambda: vars(acc).pop("resolves_data_dependency", None))
        cuda_sync = torch.cuda.synchronize

        def cuda_synchronize(*a, **k):
            if threading.get_ident() == self._thread:
                self._record("synchronize")
            return cuda_sync(*a, **k)

        torch.cuda.synchronize = cuda_synchronize
        self._undo.append(lambda: setattr(torch.cuda, "synchronize", cuda_sync))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            while self._undo:
                self._undo.pop()()

    def remove_hooks(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()

    # -------------------------------------------------------------- reports
    def counts(self) -> collections.Counter:
        """(kind, site, caller) -> count."""
        return collections.Counter((r.kind, r.site, r.caller) for r in self.reads)

    def table(self, steps: int = 1) -> str:
        rows = sorted(self.counts().items(), key=lambda kv: (-kv[1], kv[0]))
        lines = [f"{'per step':>8}  {'kind':16s} site  <- nearest project frame"]
        for (kind, site, caller), n in rows:
            lines.append(f"{n / steps:8.2f}  {kind:16s} {site}" + (f"  <- {caller}" if caller else ""))
        return "\n".join(lines)
