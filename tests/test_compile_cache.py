"""torch.compile's and Triton's caches (whose contents are unpickled or loaded as code) live in a
directory only this user can write: set by every entry point when unset, created 0700, and a
directory someone else owns or can write refused (dflash_dist/compile_cache.py)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from dflash_dist.compile_cache import CACHE_VARS, CacheDirError, use_private_cache_dirs
from tests.helpers.config import UNREAD_TRAIN_PATH, config_from

VARS = tuple(CACHE_VARS)  # TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def other_users(path: Path) -> Path:
    """A directory owned by another user (root may give one away; anyone else gets /usr, root's)."""
    if os.getuid() != 0:
        return Path("/usr")
    path.mkdir(mode=0o700)
    os.chown(path, 12345, 12345)
    return path


def test_unset_variables_get_private_directories_of_this_users_cache(tmp_path):
    """Not torch's /tmp/torchinductor_<user> (another user can create it first), nor ~/.triton:
    $XDG_CACHE_HOME/dflash-dist/{inductor,triton}, created with mode 0700."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    chosen = use_private_cache_dirs(env)
    root = tmp_path / "xdg" / "dflash-dist"
    assert chosen == {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TRITON_CACHE_DIR": str(root / "triton")}
    assert all(env[var] == chosen[var] for var in VARS)
    assert all(mode(Path(d)) == 0o700 and os.stat(d).st_uid == os.getuid() for d in chosen.values())
    assert not any(d.startswith(tempfile.gettempdir() + "/torchinductor_") for d in chosen.values())
    assert use_private_cache_dirs(env) == chosen  # again: the same directories, accepted


def test_a_user_set_directory_is_respected_created_private_and_checked(tmp_path):
    env = {var: str(tmp_path / "mine" / var.lower()) for var in VARS}
    assert use_private_cache_dirs(dict(env)) == env
    assert all(mode(Path(d)) == 0o700 for d in env.values())
    os.chmod(env["TRITON_CACHE_DIR"], 0o755)  # the user's own, not writable by others: fine
    assert use_private_cache_dirs(dict(env)) == env


@pytest.mark.parametrize("bits", [0o777, 0o770, 0o1777])
def test_a_cache_dir_others_can_write_is_refused(tmp_path, bits):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, bits)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(shared), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    with pytest.raises(CacheDirError) as info:
        use_private_cache_dirs(env)
    text = str(info.value)
    assert f"TORCHINDUCTOR_CACHE_DIR={shared} is writable by" in text and f"mode {bits:04o}" in text
    assert "mkdir -m 700" in text and "unset it" in text
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(shared) and mode(shared) == bits  # nothing changed behind the user


def test_a_cache_dir_another_user_owns_is_refused_as_is_a_symlink_to_it(tmp_path):
    theirs = other_users(tmp_path / "theirs")
    uid = os.stat(theirs).st_uid
    with pytest.raises(CacheDirError, match=rf"TRITON_CACHE_DIR={theirs} is owned by uid {uid}, not by you"):
        use_private_cache_dirs({"TRITON_CACHE_DIR": str(theirs), "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    link = tmp_path / "link"
    link.symlink_to(theirs)
    with pytest.raises(CacheDirError, match="not by you"):
        use_private_cache_dirs({"TORCHINDUCTOR_CACHE_DIR": str(link), "XDG_CACHE_HOME": str(tmp_path / "xdg")})


def test_a_default_directory_someone_else_created_first_is_refused(tmp_path):
    """The default path itself pre-created by another user (or left group-writable): refused, with
    what to do, rather than used."""
    root = tmp_path / "xdg" / "dflash-dist"
    root.mkdir(parents=True)
    (root / "triton").mkdir()
    os.chmod(root / "triton", 0o777)
    with pytest.raises(CacheDirError, match=r"TRITON_CACHE_DIR=.*triton is writable by group and others.*chmod 700"):
        use_private_cache_dirs({"XDG_CACHE_HOME": str(tmp_path / "xdg")})


def test_the_cli_refuses_an_unsafe_cache_dir_before_it_runs_anything(tmp_path, monkeypatch, capsys):
    from launcher.cli import main

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared))
    monkeypatch.setenv("TRITON_CACHE_DIR", "x")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert main(["build-target", str(tmp_path / "missing.yaml")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dflash-dist build-target: error: TORCHINDUCTOR_CACHE_DIR=") and "Traceback" not in err

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")  # unset: the private default, then the command runs
    assert main(["build-target", str(tmp_path / "missing.yaml")]) == 2  # its own config error
    assert "config error" in capsys.readouterr().err
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "xdg" / "dflash-dist" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "xdg" / "dflash-dist" / "triton")


def actor_options(cfg) -> dict:
    from dflash_dist.actors.evaluator_actor import evaluator_actor_options
    from dflash_dist.actors.target_worker import target_actor_options
    from dflash_dist.actors.trainer_group import trainer_actor_options

    return {"target": target_actor_options(cfg), "trainer": trainer_actor_options(cfg),
            "evaluator": evaluator_actor_options(cfg)}  # fmt: skip


def tiny_cfg(tmp_path):
    return config_from({"target": {"path": str(tmp_path)}, "data": {"train_path": UNREAD_TRAIN_PATH}})


def test_every_actor_gets_the_checked_directories_in_its_runtime_env(tmp_path, monkeypatch):
    """The driver's choice reaches each role's actors whatever environment their node's raylet
    has; a driver with an unsafe directory starts no actor."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for var in VARS:
        monkeypatch.setenv(var, "x")
        monkeypatch.delenv(var)
    root = tmp_path / "xdg" / "dflash-dist"
    want = {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TRITON_CACHE_DIR": str(root / "triton")}
    for role, options in actor_options(tiny_cfg(tmp_path)).items():
        assert options["runtime_env"] == {"env_vars": want}, role
    os.chmod(root / "inductor", 0o775)
    with pytest.raises(CacheDirError, match="writable by its group"):
        actor_options(tiny_cfg(tmp_path))


def test_a_ray_actor_runs_with_the_drivers_directories(ray_cluster, tmp_path, monkeypatch):
    """Real Ray: the raylet was started before the driver chose the directories (as on a cluster
    started by `ray start`); an actor with the role options still gets them, and its own check
    on its node accepts them."""

    @ray_cluster.remote
    class Probe:
        def env(self) -> dict[str, str]:
            use_private_cache_dirs()
            return {var: os.environ[var] for var in VARS}

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "tri"))
    options = actor_options(tiny_cfg(tmp_path))["trainer"]
    probe = Probe.options(num_cpus=0.5, runtime_env=options["runtime_env"]).remote()
    assert ray_cluster.get(probe.env.remote()) == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind"),
                                                   "TRITON_CACHE_DIR": str(tmp_path / "tri")}  # fmt: skip
    assert mode(tmp_path / "ind") == 0o700
