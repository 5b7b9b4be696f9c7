"""Makes this process look like a machine with fla *and* Triton to transformers, on a CPU machine
without Triton: `fla.ops.gated_delta_rule` imports (transformers' test for picking fla), and its
two kernels fail on CPU tensors with the error fla's Triton kernels raise there. Activated by
putting this directory first on PYTHONPATH (tests/test_tiny_target.py); child processes (Ray
workers) inherit it. Everything else of fla is the installed package."""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

FLA_CPU_ERROR = "Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)"
CALLS_FILE = os.environ.get("DFLASH_FLA_SHIM_CALLS")  # appended to on each refused call


def _kernel(name):
    def kernel(*args, **kwargs):
        if CALLS_FILE:
            with open(CALLS_FILE, "a") as f:
                f.write(name + "\n")
        raise ValueError(FLA_CPU_ERROR)

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__module__ = "fla.ops.gated_delta_rule"
    return kernel


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    NAMES = ("fla.ops", "fla.ops.gated_delta_rule")

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.NAMES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == "fla.ops")

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        if module.__name__ == "fla.ops":
            real = importlib.util.find_spec("fla")  # other fla.ops submodules: the real files (they need triton)
            module.__path__ = [os.path.join(p, "ops") for p in real.submodule_search_locations]
        else:
            module.chunk_gated_delta_rule = _kernel("chunk_gated_delta_rule")
            module.fused_recurrent_gated_delta_rule = _kernel("fused_recurrent_gated_delta_rule")


sys.meta_path.insert(0, _Finder())
