"""Shared fixtures; their builders and the other shared helpers are in tests/helpers/. The golden
fixtures the tests read are in-repository copies (tests/golden, tests/golden_swa: data files only)
of ../shared/golden* (their source, with the READMEs that say what each tensor is);
test_golden_copies checks the copies equal the source when it is there. DFLASH_GOLDEN_DIR
overrides the full-attention set. A missing golden directory is an error, not a skip."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# Bytecode is cached. With PYTHONDONTWRITEBYTECODE set (this machine's image sets it) and the venv
# installed with --no-compile, no .pyc is ever written, and every Python process the tests start
# (CLI runs, Ray workers and actors, DeepSpeed ranks, srun tasks, bench workers: hundreds) compiled
# torch, transformers, deepspeed and ray from source again: ~8 s of a core each (import of the four:
# 13 s without the cache, 5 s with it, on the loaded 2-core machine). Cleared here, before any test
# starts a process, the first import of each module writes its __pycache__ (.gitignore'd) and the
# rest read it. Nothing a test checks depends on it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# One ninja for every process. DeepSpeed JIT-compiles its shm comm op into one TORCH_EXTENSIONS_DIR
# per venv, with the `ninja` first on PATH: the venv's (pip's, a DeepSpeed dependency: 1.13) or the
# system's (Debian's 1.11). The two do not take each other's build log as up to date, so every switch
# rebuilt the op (40-120 s on 2 cores): the tests that put the venv on PATH (the README's Ray head,
# the Slurm jobs) alternated with those that did not (pytest run as .venv/bin/pytest, CI's way), three
# rebuilds a run. With the venv's bin first everywhere, as in an activated venv, it is built once.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
# A loaded 2-core machine can take longer than Ray's default to start a raylet; the tests' Ray
# heads (in-process and in the CLIs they start) wait up to 3 minutes instead of failing.
os.environ.setdefault("RAY_raylet_start_wait_time_s", "180")
# Every Ray cluster of the tests lives on 127.0.0.1. Ray reads this once, when `ray` is first
# imported (ray_constants.ENABLE_RAY_CLUSTER): set after that import, `ray.init(address=
# "127.0.0.1:P")` resolves the address to the host's external IP, where the GCS (bound to 127.0.0.1)
# never answers, and hangs. Test modules set it too, but collection imports some of them after
# another module has imported ray, so it is set here, before any test module is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


# The slow tier: modules that start Ray clusters, DeepSpeed process groups, Slurm daemons or
# whole pipeline runs (`pytest -m slow`); the fast tier is everything else (`pytest -m "not slow"`,
# pure logic and tiny in-process models). A plain `pytest` runs both, as CI does.
SLOW_MODULES = {
    "test_capture_faults", "test_elastic", "test_faults", "test_launch_ray", "test_loss_curve", "test_multinode",
    "test_pipeline", "test_publish_faults", "test_recapture_run", "test_rendezvous", "test_resume", "test_safe_load",
    "test_slurm", "test_step_source", "test_trainer", "test_bench_quality_run", "test_ray_temp",
    "test_multinode_setup",
}


def pytest_collection_modifyitems(config, items):
    """Mark the slow tier; run `gpu` tests only when the marker expression names them (`-m gpu`),
    so `pytest`, `pytest -m slow` and `pytest -m "not slow"` never pick them on a CPU machine."""
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES or "ray_cluster" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
    if "gpu" not in (config.option.markexpr or ""):
        gpu = [item for item in items if item.get_closest_marker("gpu")]
        if gpu:
            config.hook.pytest_deselected(items=gpu)
            items[:] = [item for item in items if not item.get_closest_marker("gpu")]


def pytest_runtest_logreport(report):
    """With DFLASH_TEST_FAILURES=FILE, each failure's report is appended to FILE as it happens. The
    device scripts stop a test group at its time limit, and pytest prints tracebacks only at the
    session's end: a kill lost the H100 lease's one failure (2026-12-05) but for its name."""
    path = os.environ.get("DFLASH_TEST_FAILURES")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"==== {report.nodeid} ({report.when}) FAILED\n{report.longreprtext}\n")


GOLDEN_SETS = ("golden", "golden_swa")  # tests/<name> copies ../shared/<name>


def golden_path(name: str = "golden") -> Path:
    if name == "golden" and os.environ.get("DFLASH_GOLDEN_DIR"):
        return Path(os.environ["DFLASH_GOLDEN_DIR"])
    return REPO / "tests" / name


def _golden(name: str) -> Path:
    path = golden_path(name)
    if not (path / "drafter_config.json").is_file():
        pytest.fail(f"golden fixtures not found at {path} (in-repo copy of ../shared/{name})")
    return path


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return _golden("golden")


@pytest.fixture(scope="session")
def golden_swa_dir() -> Path:
    """The sliding-window set: ../golden with layer_types [sliding, full], sliding_window 8."""
    return _golden("golden_swa")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


RANK_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _restore_rank_env():
    """torch.distributed's rank environment as each test (and module) found it: tests and module
    fixtures that run a rank in this process set it in os.environ (as the product's rank processes
    do), and a later test reading the job's environment (a Slurm head honours MASTER_ADDR) must not
    see theirs. Module scope too: a module fixture runs before any test's save."""
    before = {k: os.environ.get(k) for k in RANK_ENV}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


_rank_env = pytest.fixture(autouse=True)(_restore_rank_env)
_rank_env_module = pytest.fixture(autouse=True, scope="module")(_restore_rank_env)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models on a shared 2-core machine: intra-op threads only add contention (one module
    measured 10x, another 30x slower with them). Use as `pytestmark = pytest.mark.usefixtures(...)`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reset_deepspeed_groups() -> None:
    """After destroy_process_group in a test process: forget DeepSpeed's cached process groups,
    so the next in-process engine builds fresh ones (a stale one is 'not registered')."""
    from deepspeed.utils import groups

    for name, value in list(vars(groups).items()):
        if name.startswith("_") and name.isupper() and ("GROUP" in name or "MPU" in name):
            setattr(groups, name, {} if isinstance(value, dict) else None)


@pytest.fixture
def single_rank_gloo(monkeypatch):
    """A one-rank gloo process group (DeepSpeed's init) for an in-process Trainer; after the test
    it is destroyed and DeepSpeed's cached groups are forgotten. The env is undone by monkeypatch,
    so later subprocesses do not inherit a stale port."""
    import torch.distributed as dist

    from dflash_dist.actors.ports import free_ports
    from dflash_dist.actors.trainer_group import join_group

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_ports(1, "127.0.0.1")[0]))
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    join_group(dict(os.environ), on_gpu=False)  # the product's rendezvous: the store on MASTER_ADDR only
    yield
    dist.destroy_process_group()
    reset_deepspeed_groups()


class _SharedBuild:
    """A tiny fixture built once per session and handed to each module as a view (`view`): the build runs
    on one intra-op thread (bitwise what 1 and 2 threads build; tiny_eval's trained export differs at 4),
    and after each module a check that it left every file under the root (path, size, mtime) and every
    sample's tensors as built. A module that changed them fails, naming what it changed, and the next
    module gets a fresh build: a test that must change the target copies it to its tmp_path first."""

    def __init__(self, name: str, build, tmp_path_factory, dirname: str):
        self.name, self.build, self.factory, self.dirname = name, build, tmp_path_factory, dirname
        self.built = None

    def _files(self, root: Path) -> dict:
        return {p.relative_to(root): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}

    @staticmethod
    def _tensors(built: dict) -> list:
        return [(s.input_ids, s.loss_mask, s.features, s.target_argmax) for s in built.get("samples", ())]

    def view(self, request):
        import copy

        if self.built is None:
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                built = self.build(self.factory.mktemp(self.dirname))
            finally:
                torch.set_num_threads(before)
            tensors = [[t.clone() for t in ts] for ts in self._tensors(built)]
            self.built = (built, self._files(built["root"]), tensors)
        built, files, tensors = self.built
        view = dict(built)  # the module's own dict, samples list, config and prompts; the files are shared
        if "samples" in view:
            view["samples"] = list(view["samples"])
        if "cfg" in view:
            view["cfg"] = view["cfg"].model_copy(deep=True)
        if "prompts" in view:
            view["prompts"] = copy.deepcopy(view["prompts"])
        yield view
        now = self._files(built["root"])
        changed = sorted(str(p) for p in set(now) | set(files) if now.get(p) != files.get(p))
        samples = [s.key for s, ts, was in zip(built.get("samples", ()), self._tensors(built), tensors)
                   if not all(torch.equal(a, b) for a, b in zip(ts, was))]  # fmt: skip
        if changed or samples:
            self.built = None  # the next module builds its own
            pytest.fail(f"{request.module.__name__} changed the session's `{self.name}` fixture, which other modules "
                        f"share: files under {built['root']}: {changed}; samples: {samples}. A test that changes "
                        "the target copies it to its tmp_path first.")


@pytest.fixture(scope="session")
def _tiny_shared(tmp_path_factory):
    from tests.helpers.tiny import make_tiny

    return _SharedBuild("tiny", make_tiny, tmp_path_factory, "trainer")


@pytest.fixture(scope="session")
def _tiny_eval_shared(tmp_path_factory):
    from tests.helpers.eval_target import make_tiny_eval

    return _SharedBuild("tiny_eval", make_tiny_eval, tmp_path_factory, "tiny")


@pytest.fixture(scope="module")
def tiny(_tiny_shared, request):
    """The trainer tests' tiny target: saved, its captured samples, provenance and drafter shape
    (tests/helpers/tiny.py). Built once per session (3.5 s of CPU a build), shared read-only."""
    yield from _tiny_shared.view(request)


@pytest.fixture(scope="module")
def tiny_eval(_tiny_eval_shared, request):
    """The evaluator tests' tiny target with a tokenizer, two drafter exports (random, trained)
    and the eval config (tests/helpers/eval_target.py). Built once per session (4.5 s of CPU a
    build), shared read-only; each module gets its own copy of the config and prompts."""
    yield from _tiny_eval_shared.view(request)


@pytest.fixture(scope="module")
def ray_cluster():
    """A real local Ray cluster for one test module, started and stopped by the test (never `ray stop`)."""
    import ray

    from dflash_dist.actors.trainer_group import default_extensions_dir
    from dflash_dist.orchestration.ray_system import NO_PRESTART

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _system_config=NO_PRESTART,  # as a run's own local cluster: no idle workers that no actor takes
        _node_ip_address="127.0.0.1",  # every agent of the node on loopback, whatever ray read at import
        log_to_driver=True,
        runtime_env={
            "env_vars": {
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or default_extensions_dir(),
            }
        },
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def readme_run(tmp_path_factory):
    """The README's main command (`ray job submit ... -- dflash-dist run configs/tiny.yaml`, the
    whole tiny config, every process seeing fla as usable), run once for the tests that check it
    (tests/readme_run.py). It fails here, with the job's output, if the job failed."""
    from tests.readme_run import submit_readme_run

    run = submit_readme_run(tmp_path_factory.mktemp("readme"))
    if run.proc.returncode != 0:
        pytest.fail(f"ray job submit failed ({run.proc.returncode}) after {run.took_s:.0f}s:\n{run.logs}")
    return run


@pytest.fixture(scope="session")
def mid_cpu_run(tmp_path_factory):
    """configs/mid_gpu.yaml at CPU size run once (tests/helpers/mid.py): (run dir, target). Read by
    test_mid_config (the product path end to end) and test_bench_quality_run (the bench's default
    trains as its trainer did); neither writes into it."""
    from tests.helpers.mid import run_mid_cpu

    return run_mid_cpu(tmp_path_factory.mktemp("mid"))
