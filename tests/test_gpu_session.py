"""bench/gpu_session.sh and bench/gpu_watch.sh, the chain of a lease (bench/LEASES.md, "Lease A"), run
here as they run on the device: the real scripts, with stand-ins on PATH for the commands that need the
GPU or the wheels (python3, nvidia-smi) and for tar's extraction of the wheels' Ray into /tmp/site. A
stand-in `timeout` records each limit and runs the real one. Every stand-in call is one line in CALLS,
so the order of the steps, their limits and arguments are checked from what the scripts ran, and the
status file is the one the scripts wrote."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

SESSION = REPO / "bench" / "gpu_session.sh"
WATCH = REPO / "bench" / "gpu_watch.sh"

# python3: each bench/test the chain starts, by its arguments. STANDIN_FAIL: comma-separated steps that
# exit 1; STANDIN_HANG: steps that sleep 60 s (as a stuck GPU test). The product run's test leaves what a
# finished run leaves (shards/DONE unless STANDIN_NO_DONE, gpu_summary.json), and may move the deadline
# as a later call would (STANDIN_NEW_DEADLINE). The bench writes its --out as the real one does when it
# finishes runs, unless it fails (then it writes results.json without runs, as after a calibration failure).
PYTHON3 = r"""#!/bin/bash
printf 'python3 %s\n' "$*" >>"$STANDIN_CALLS"
is() { case ",${1}," in *",$2,"*) return 0 ;; esac; return 1; }
act() {  # act STEP: fail or hang as asked
    is "${STANDIN_HANG:-}" "$1" && exec sleep 60
    is "${STANDIN_FAIL:-}" "$1" && exit 1
    return 0
}
arg() {  # arg FLAG ARGS...: the value after FLAG (the last one)
    local flag=$1 v= prev=; shift
    for a in "$@"; do [ "$prev" = "$flag" ] && v=$a; prev=$a; done
    echo "$v"
}
case "$*" in
    "-m pip install"*) act install ;;
    "-c import torch"*) echo "2.11.0 5.24.0 3.6.0" ;;
    "-c from dflash_dist.actors.trainer_group"*) echo "$STANDIN_EXT" ;;
    *test_cuda_bf16_lean_step_matches_deepspeeds_step*) act preflight ;;
    "-m pytest -m gpu -v"*)
        for t in ${STANDIN_TEST_FAILS:-}; do  # as tests/conftest.py's hook records a failing test
            printf '==== tests/test_fused.py::%s[compile] (call) FAILED\nAssertionError\n' "$t" \
                >>"$DFLASH_TEST_FAILURES"
        done
        act gpu_tests ;;
    "-m launcher.cli build-target"*) act build ;;
    "-m launcher.cli run"*) act mid_run ;;
    *tests/test_gpu_mid.py*)
        echo "DFLASH_MID_GPU_OUT=${DFLASH_MID_GPU_OUT:-}" >>"$STANDIN_CALLS"
        mkdir -p "$DFLASH_MID_GPU_OUT/shards" "$DFLASH_MID_GPU_OUT/eval"
        [ -n "${STANDIN_NO_DONE:-}" ] || touch "$DFLASH_MID_GPU_OUT/shards/DONE"
        echo '{"tau_chain": {"1200": 2.6}}' >"$DFLASH_MID_GPU_OUT/gpu_summary.json"
        echo '{"step": 1200}' >"$DFLASH_MID_GPU_OUT/eval/step_1200.json"
        echo "cli output" >"$DFLASH_MID_GPU_OUT/cli.log"
        [ -z "${STANDIN_NEW_DEADLINE:-}" ] || echo "$STANDIN_NEW_DEADLINE" >"$QBENCH_DEADLINE_FILE"
        act mid ;;
    *bench/bench_train_step.py*) act train_step; echo '{}' >"$(arg --json "$@")" ;;
    *bench/cost_model.py*) act cost ;;
    *bench/bench_quality_run.py*)
        out=$(arg --out "$@")
        mkdir -p "$out"
        if [ "$(arg --workers "$@")" = 0 ]; then step=qbench_inline; else step=qbench; fi
        if is "${STANDIN_FAIL:-}" "$step"; then echo '{"runs": []}' >"$out/results.json"; exit 2; fi
        act "$step"
        echo '{"runs": [{"variant": "default", "seed": 0, "status": "done"}]}' >"$out/results.json"
        echo "| default | 0 |" >"$out/table.md"
        is "${STANDIN_RC1:-}" "$step" && exit 1 ;;  # a run failed, others finished
    *) echo "stand-in python3: unexpected $*" >&2; exit 99 ;;
esac
exit 0
"""


def _standins(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real_timeout, real_tar, real_chmod = shutil.which("timeout"), shutil.which("tar"), shutil.which("chmod")
    scripts = {
        "python3": PYTHON3,
        "nvidia-smi": "#!/bin/sh\necho 'name, memory.total'\necho 'NVIDIA H200, 143771 MiB'\n",
        # the real timeout (its process group, its signals), each call recorded
        "timeout": f'#!/bin/sh\nprintf \'timeout %s\\n\' "$*" >>"$STANDIN_CALLS"\nexec {real_timeout} "$@"\n',
        # the wheels' Ray is not extracted into this machine's /tmp/site; gpu_watch's packing is the real tar
        "tar": f'#!/bin/sh\ncase "$*" in *-xJf*) exit 0 ;; esac\nexec {real_tar} "$@"\n',
        "chmod": f'#!/bin/sh\ncase "$*" in */tmp/site/*) exit 0 ;; esac\nexec {real_chmod} "$@"\n',
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    ext = tmp_path / "ext"
    (ext / "op").mkdir(parents=True)
    (ext / "op" / "lock").write_text("")  # a JIT build's lock the stopped gpu tests left
    keep = ("PATH", "LANG", "LC_ALL", "TMPDIR")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        HOME=str(tmp_path / "home"),
        STANDIN_CALLS=str(tmp_path / "calls"),
        STANDIN_EXT=str(ext),
        QBENCH_DEADLINE_FILE=str(tmp_path / "deadline"),
        GPU_TESTS_GRACE_S="2",
        OUT=str(tmp_path / "out"),
    )
    return env


def _session(tmp_path: Path, deadline_in: int | None = 600, **extra: str) -> tuple[list[str], list[str], float]:
    """Run the chain to its end: (status lines, stand-in calls, seconds)."""
    env = _standins(tmp_path)
    env.update(RUN=str(tmp_path / "run"), **extra)
    if deadline_in is not None:
        (tmp_path / "deadline").write_text(f"{int(time.time()) + deadline_in}\n")
    t0 = time.monotonic()
    subprocess.run(["bash", str(SESSION), str(tmp_path / "gpu")], env=env, cwd=tmp_path, timeout=60, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    took = time.monotonic() - t0
    status = (tmp_path / "gpu" / "status").read_text().splitlines()
    return status, (tmp_path / "calls").read_text().splitlines(), took


def _steps(status: list[str]) -> list[tuple[str, str]]:
    """(name, rc) of every step that ended, in the order they ended."""
    return [(x.split()[1], x.split()[2].removeprefix("rc=")) for x in status if x.startswith("end ")]


def _limits(calls: list[str]) -> dict[str, str]:
    """Each timeout-run command's limit, by a word naming it: the step's log names the step."""
    out = {}
    for line in calls:
        if not line.startswith("timeout "):
            continue
        words = line.split()[1:]
        while words[0].startswith("-"):
            words = words[2:] if words[0] in ("-k", "-s") else words[1:]
        limit, cmd = words[0], " ".join(words[1:])
        for key, name in (("pip install", "install"), ("lean_step", "preflight"), ("build-target", "build"),
                          ("cli run", "mid_run"), ("test_gpu_mid.py", "mid"), ("bench_train_step", "train_step"),
                          ("cost_model", "cost"), ("--workers 0", "qbench_inline"), ("bench_quality_run", "qbench"),
                          ("bash -c", "gpu_tests"), ("pytest -m gpu -v", "gpu_tests_group")):  # fmt: skip
            if key in cmd:
                out.setdefault(name, limit)
                break
    return out


def _bench_args(calls: list[str]) -> list[list[str]]:
    return [c.split()[2:] for c in calls if c.startswith("python3 bench/bench_quality_run.py")]


def test_the_chain_runs_every_step_in_order_with_its_limit(tmp_path):
    status, calls, took = _session(
        tmp_path, TRAIN_STEP="1", TRAIN_STEP_SETTINGS="direct+fused+leangrads",
        QBENCH_ARGS="--workers 7 --schedule product --variants default,decay",
    )  # fmt: skip
    assert _steps(status) == [("install", "0"), ("preflight", "0"), ("build", "0"), ("gpu_tests", "0"), ("mid", "0"),
                              ("train_step", "0"), ("cost", "0"), ("qbench", "0")], status  # fmt: skip
    assert status[-1].startswith("done ") and took < 10, (status, took)
    started = [x.split()[1] for x in status if x.startswith("start ")]
    assert started[:4] == ["install", "preflight", "gpu_tests", "build"]
    limits = _limits(calls)
    budget = int(next(x for x in status if x.startswith("qbench budget")).split()[2].removesuffix("s"))
    assert 600 - 15 - 5 <= budget <= 600 - 15, status  # the deadline file less the tail
    assert {k: limits[k] for k in ("install", "preflight", "build", "mid", "train_step", "cost", "gpu_tests")} == {
        "install": "180", "preflight": "150", "build": "540", "mid": "900", "train_step": "240", "cost": "150",
        "gpu_tests": "600"}  # fmt: skip
    assert limits["qbench"] == str(budget + 90) and limits["gpu_tests_group"] == "200"
    assert sum(c.startswith("timeout -k 30 ") for c in calls) == 7  # a step that outlives TERM is killed
    (bench,) = _bench_args(calls)
    assert bench[bench.index("--time-budget-s") + 1] == str(budget)
    assert bench[bench.index("--run") + 1] == str(tmp_path / "run")
    assert " ".join(bench[-6:]) == "--workers 7 --schedule product --variants default,decay"
    assert f"DFLASH_MID_GPU_OUT={tmp_path / 'run'}" in calls  # the product run goes where the bench reads it
    assert not any("launcher.cli run" in c for c in calls)  # the preflight passed: no fallback run
    steps = [c for c in calls if c.startswith("python3 bench/bench_train_step.py")]
    assert len(steps) == 1 and "--settings direct+fused+leangrads" in steps[0]
    gpu = tmp_path / "gpu"
    assert json.loads((gpu / "gpu_summary.json").read_text()) == {"tau_chain": {"1200": 2.6}}
    assert (gpu / "mid_eval" / "step_1200.json").is_file() and (gpu / "quality" / "table.md").is_file()
    assert not (tmp_path / "ext" / "op" / "lock").exists()  # the JIT lock a stopped test could leave is gone
    assert "NVIDIA H200" in (gpu / "gpu.txt").read_text()


def test_a_failing_step_stops_only_what_needs_it(tmp_path):
    """The preflight fails: the product run falls back to DeepSpeed's optimizer step. The install, the
    build, the product run's test and the trainer step fail, the gpu tests hang: every later step still
    runs, the gpu tests are stopped a grace after the build, and the chain ends with its `done` line."""
    status, calls, took = _session(tmp_path, STANDIN_FAIL="install,preflight,build,mid,train_step",
                                   STANDIN_HANG="gpu_tests", TRAIN_STEP="1")  # fmt: skip
    assert _steps(status) == [("install", "1"), ("preflight", "1"), ("build", "1"), ("gpu_tests", "143"),
                              ("mid_run", "0"), ("mid", "1"), ("train_step", "1"), ("cost", "0"),
                              ("qbench", "0")], status  # fmt: skip
    assert "preflight failed: the product run uses train.optimizer_step=deepspeed" in status
    assert "gpu_tests stopped when the build had ended" in status
    (run,) = [c for c in calls if c.startswith("python3 -m launcher.cli run")]
    assert run.endswith(f"--out {tmp_path / 'run'} --resume auto train.optimizer_step=deepspeed")
    assert status[-1].startswith("done ") and took < 15, (status, took)


def test_fast_kernels_that_fail_their_gpu_test_beside_the_build_are_not_trained_on(tmp_path):
    """The fast-kernels gpu test fails beside the build (its report in DFLASH_TEST_FAILURES): the product
    run trains on the torch kernels, with the optimizer fallback too when the preflight failed; another
    test's failure changes nothing."""
    status, calls, _ = _session(tmp_path, STANDIN_TEST_FAILS="test_gpu_fast_kernels_match_torch_in_bf16")
    assert "fast kernels failed their gpu test: the product run uses train.kernels=torch" in status
    (run,) = [c for c in calls if c.startswith("python3 -m launcher.cli run")]
    assert run.endswith(f"--out {tmp_path / 'run'} --resume auto train.kernels=torch")
    both = tmp_path / "both"
    both.mkdir()
    status, calls, _ = _session(both, STANDIN_FAIL="preflight",
                                STANDIN_TEST_FAILS="test_gpu_fast_kernels_match_torch_in_bf16")  # fmt: skip
    (run,) = [c for c in calls if c.startswith("python3 -m launcher.cli run")]
    assert run.endswith("--resume auto train.optimizer_step=deepspeed train.kernels=torch")
    other = tmp_path / "other"
    other.mkdir()
    status, calls, _ = _session(other, STANDIN_TEST_FAILS="test_gpu_rope_layout_and_in_place_norm_are_bitwise")
    assert not any("launcher.cli run" in c for c in calls) and not any("train.kernels" in x for x in status)


def test_the_bench_budget_is_read_from_the_deadline_file_when_the_bench_starts(tmp_path):
    """A later call may move the deadline while the chain runs: the bench gets what the file says then."""
    status, calls, _ = _session(tmp_path, deadline_in=100, STANDIN_NEW_DEADLINE=str(int(time.time()) + 400))
    (bench,) = _bench_args(calls)
    budget = int(bench[bench.index("--time-budget-s") + 1])
    assert 400 - 15 - 5 <= budget <= 400 - 15 and f"qbench budget {budget}s" in status
    assert bench[-2:] == ["--workers", "7"]  # QBENCH_ARGS' default


@pytest.mark.parametrize("deadline", ["none", "garbage"])
def test_without_a_deadline_the_bench_gets_the_fixed_budget(tmp_path, deadline):
    if deadline == "garbage":
        (tmp_path / "deadline").write_text("soon\n")
    status, calls, _ = _session(tmp_path, deadline_in=None, QBENCH_BUDGET_S="300")
    assert "qbench budget 285s" in status and _bench_args(calls)[0][5] == "285"


def test_the_bench_is_skipped_and_says_so_with_under_120_s_or_no_shards(tmp_path):
    short, no_shards = tmp_path / "short", tmp_path / "no_shards"
    short.mkdir()
    no_shards.mkdir()
    status, calls, _ = _session(short, deadline_in=130)  # 130 s less the tail
    (skipped,) = [x for x in status if x.startswith("qbench skipped: ")]
    left = int(skipped.split()[2].removesuffix("s"))  # 115 less the seconds the chain took
    assert 110 <= left <= 115 and skipped == f"qbench skipped: {left}s left before the deadline, under 120", status
    assert not _bench_args(calls) and status[-1].startswith("done ")
    status, calls, _ = _session(no_shards, STANDIN_NO_DONE="1")
    assert f"qbench skipped: no {no_shards / 'run'}/shards/DONE (the product run's capture did not finish)" in status
    assert not _bench_args(calls) and status[-1].startswith("done ")


def test_a_bench_that_finishes_no_run_runs_once_more_in_one_process(tmp_path):
    """As in the fourth lease: every worker's calibration failed (rc 2, results.json without a run). The
    chain runs the bench again with --workers 0 for what the deadline leaves; its results are the ones
    under quality/ (the failed attempt's under quality_workers/). A bench that finished runs is not rerun."""
    status, calls, _ = _session(tmp_path, STANDIN_FAIL="qbench", QBENCH_ARGS="--workers 7 --variants default")
    assert _steps(status)[-2:] == [("qbench", "2"), ("qbench_inline", "0")], status
    assert "qbench finished no run (rc=2): once more with --workers 0" in status
    first, again = _bench_args(calls)
    assert " ".join(first[-4:]) == "--workers 7 --variants default"
    assert " ".join(again[-6:]) == "--workers 7 --variants default --workers 0"  # the last --workers counts
    assert int(again[again.index("--time-budget-s") + 1]) <= int(first[first.index("--time-budget-s") + 1])
    gpu = tmp_path / "gpu"
    assert json.loads((gpu / "quality_workers" / "results.json").read_text()) == {"runs": []}
    assert json.loads((gpu / "quality" / "results.json").read_text())["runs"][0]["status"] == "done"
    assert status[-1].startswith("done ")
    (tmp_path / "rc1").mkdir()
    status, calls, _ = _session(tmp_path / "rc1", STANDIN_RC1="qbench")
    assert _steps(status)[-1] == ("qbench", "1") and len(_bench_args(calls)) == 1 and status[-1].startswith("done ")


def test_gpu_watch_packs_what_the_chain_wrote_so_far(tmp_path):
    """A watch call during the bench (no `done` yet; its seconds spent): it prints the status and the
    bench's table as they stand, and packs the chain's files and the product run's records into $OUT."""
    env = _standins(tmp_path)
    log, run = tmp_path / "gpu", tmp_path / "run"
    (log / "quality").mkdir(parents=True)
    (log / "status").write_text("start qbench 1\n")
    (log / "quality" / "results.json").write_text('{"runs": [{"status": "done"}]}\n')
    (log / "quality" / "table.md").write_text("| default | 0 |\n")
    (run / "eval").mkdir(parents=True)
    (run / "gpu_summary.json").write_text("{}\n")
    (run / "eval" / "step_300.json").write_text("{}\n")
    (run / "cli.log").write_text("[eval] tau per checkpoint\n")
    done = subprocess.run(["bash", str(WATCH), "0", str(log), str(run)], env=env, capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    assert done.returncode == 0, done
    assert "start qbench 1" in done.stdout and "| default | 0 |" in done.stdout and "[eval] tau" in done.stdout
    with tarfile.open(tmp_path / "out" / "gpu.tgz") as tar:
        names = set(tar.getnames())
    assert {"gpu/status", "gpu/quality/results.json", "gpu/quality/table.md", "gpu/run/gpu_summary.json",
            "gpu/run/eval/step_300.json", "gpu/run/cli_tail.log"} <= names, names  # fmt: skip


def test_gpu_watch_exits_3_on_a_fresh_machine(tmp_path):
    """No status file (the call got a fresh machine): exit 3 after its 30 one-second waits, nothing packed.
    A stand-in sleep makes the waits instant."""
    env = _standins(tmp_path)
    (tmp_path / "bin" / "sleep").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "bin" / "sleep").chmod(0o755)
    done = subprocess.run(["bash", str(WATCH), "500", str(tmp_path / "gpu")], env=env, capture_output=True,
                          text=True, timeout=20)  # fmt: skip
    assert done.returncode == 3 and "the chain and its files are gone" in done.stderr, done
    assert not (tmp_path / "out").exists()


def test_lease_a_started_and_watched_in_one_call(tmp_path):
    """Call A of bench/LEASES.md in miniature: the chain started with setsid in the background, then
    a watch call that ends when the chain's `done` line is written, with the whole chain in its archive."""
    env = _standins(tmp_path)
    env.update(RUN=str(tmp_path / "run"), TRAIN_STEP="1", TRAIN_STEP_SETTINGS="direct+lean")
    (tmp_path / "deadline").write_text(f"{int(time.time()) + 300}\n")
    cmd = (f"setsid {SESSION} {tmp_path / 'gpu'} >/dev/null 2>&1 </dev/null & sleep 1; "  # as LEASES.md runs them
           f"{WATCH} 40 {tmp_path / 'gpu'} {tmp_path / 'run'}")  # fmt: skip
    t0 = time.monotonic()
    done = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and time.monotonic() - t0 < 20, done
    assert "end qbench rc=0" in done.stdout and "\ndone " in done.stdout and "| default | 0 |" in done.stdout
    with tarfile.open(tmp_path / "out" / "gpu.tgz") as tar:
        names = set(tar.getnames())
    assert {"gpu/status", "gpu/quality/results.json", "gpu/train_step.json", "gpu/mid.log", "gpu/qbench.log",
            "gpu/gpu_summary.json"} <= names, names  # fmt: skip


def test_a_failure_is_on_disk_before_its_group_is_killed(tmp_path):
    """The device scripts stop a test group at its limit (timeout's TERM, then KILL), and pytest
    prints tracebacks only at the session's end. With DFLASH_TEST_FAILURES (set by gpu_session.sh
    and gpu_env.sh) the project's conftest appends each failure's report as it happens: a group
    killed while a later test hangs still leaves the earlier failure's assertion on disk. The limit
    is reached once the later test hangs: SIGALRM to `timeout` is its own timer's expiry (TERM to the
    group, exit 124), so the group is killed as at its limit without waiting out a fixed one."""
    import signal

    hanging = tmp_path / "hanging"
    tests = tmp_path / "test_group.py"
    tests.write_text(
        "import pathlib, time\n\n"
        "def test_fails():\n    assert 1 + 1 == 3, 'the failure we need to read'\n\n"
        f"def test_hangs():\n    pathlib.Path({str(hanging)!r}).touch()\n    time.sleep(600)\n"
    )
    failures = tmp_path / "test_failures.log"
    env = dict(os.environ, DFLASH_TEST_FAILURES=str(failures))
    cmd = ["timeout", "-k", "2", "300", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-p", "tests.conftest", str(tests)]  # fmt: skip
    group = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not hanging.exists() and group.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if group.poll() is None:
        group.send_signal(signal.SIGALRM)  # the group's limit is reached while test_hangs runs
    out, err = group.communicate(timeout=60)
    assert hanging.exists() and group.returncode in (124, 137), out + err  # killed while test_hangs ran
    assert "the failure we need to read" not in out  # pytest never got to print it
    text = failures.read_text()
    assert "test_group.py::test_fails (call) FAILED" in text and "the failure we need to read" in text
    assert "test_hangs" not in text
