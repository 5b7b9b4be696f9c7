"""bench/bench_capture_kernels.py: capture's compiled kernels alone in other compile modes, each compared bit for
bit with the capture's own compile (the bench decides whether a faster mode keeps the features)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_capture_kernels as bck  # noqa: E402


def test_each_variant_is_timed_and_compared_with_the_capture_kernel(capsys):
    rows = bck.main(["--device", "cpu", "--tokens", "16", "--hidden", "32", "--inter", "48", "--iters", "2",
                     "--kernels", "silu_mul"])
    assert [r["variant"] for r in rows] == ["capture (width static)", "all dims dynamic", "static", "eager"]
    assert all(r["kernel"] == "silu_mul" and r["ms"] > 0 for r in rows)
    assert rows[0]["bitwise"] and rows[0]["max_abs_diff"] == 0.0  # the reference against itself
    # a pointwise kernel sums nothing: every compile gives the capture kernel's bits
    assert rows[1]["bitwise"] and rows[2]["bitwise"]
    # another token count: the capture's compile and the all-dynamic one reuse their graph, the static one does not
    assert [r["recompiled_at_other_tokens"] for r in rows[:3]] == [False, False, True]
    out = capsys.readouterr().out
    assert "silu_mul       static" in out and "vs the capture kernel" in out
    args, nbytes = bck.inputs("add_rms_norm", 16, 32, 48, "cpu")
    assert len(args) == 4 and nbytes == 4 * 16 * 32 * 2  # residual and x read, sum and norm written


def test_each_norm_is_timed_as_capture_and_the_former_compile_run_it():
    """The four norms as capture compiles them (width static), as the former dynamic=True compile did, and fully
    static, with Parameter weights as the model's: neither the capture's nor the former compile compiles again at
    another token count, a fully static compile does; every variant computes the same norm (on the CPU the former
    compile's bits equal the capture's, as they would for any width here; on a GPU the bench says). (24 tokens: a
    token count equal to a head width, 16 here, would add dynamo's duck-sizing guard, one more compile.)"""
    names = ["rms_norm", "add_rms_norm", "gated_rms_norm", "norm_rope"]
    rows = bck.main(["--device", "cpu", "--tokens", "24", "--hidden", "640", "--inter", "48", "--iters", "2",
                     "--kernels", ",".join(names)])
    assert [r["kernel"] for r in rows] == [n for n in names for _ in range(3)]
    assert {r["variant"] for r in rows} == {"capture (width static)", "former (dynamic=True)", "static"}
    for r in rows:
        assert r["recompiled_at_other_tokens"] == (r["variant"] == "static"), r
        assert r["max_abs_diff"] < 0.1, r  # bf16 values of order 1: a rounding, not another function
        if r["variant"] == "former (dynamic=True)":
            assert r["bitwise"], r
    (args, nbytes) = bck.inputs("gated_rms_norm", 16, 5120, 48, "cpu")
    assert args[0].shape == (1, 16, 48, 128) and nbytes == 3 * 16 * 48 * 128 * 2  # Qwen3.5-27B's GDN output norm
    (args, _) = bck.inputs("norm_rope", 16, 5120, 48, "cpu")
    assert args[0].shape == (1, 16, 24, 256) and args[1].shape == (1, 16, 4, 256) and args[5].shape == (1, 16, 64)


def test_the_capture_bench_times_fused2_before_its_copy_cuts_beside_it():
    """bench_capture.py's fused2copies mode: fused2 with its copy cuts off, for before/after in one run."""
    import bench_capture

    v = bench_capture.Variant.parse("32768:keep:fused2copies")
    assert (v.mode, v.fused) == ("fused2copies", True)
    assert str(v) == "32768:keep:fused2copies"
