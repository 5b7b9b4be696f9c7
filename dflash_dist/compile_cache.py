"""Where torch.compile and Triton keep what they compiled: a directory only this user can write.

Inductor caches under TORCHINDUCTOR_CACHE_DIR, by default /tmp/torchinductor_<user>, and its FX
graph and AOT autograd caches unpickle what they read there; Triton caches compiled kernels and
launcher libraries it loads (dlopen) under TRITON_CACHE_DIR, by default ~/.triton/cache. Another
local user can create /tmp/torchinductor_<you> before you do, and whatever they put there then
runs in your process. So every entry point (the CLI, hence every Slurm script, and each Ray actor
on its own node) calls `use_private_cache_dirs` before anything compiles:

- unset: each variable is set to a directory of this user's cache, `$XDG_CACHE_HOME/dflash-dist/`
  (`~/.cache/dflash-dist/` without it): `inductor/` and `triton/`, created with mode 0700;
- set (the user's choice, respected): the directory is created with mode 0700 if missing;
- either way the directory must then be owned by this user and not writable by group or others
  (nor a symlink someone else owns); otherwise a `CacheDirError` names the variable, the
  directory, its owner and mode, and what to do. Nothing is chmod'ed or chown'ed behind the
  user's back.

`actor_runtime_env()` puts the values in each Ray actor's runtime env (the actor options), so the
driver's choice (the default or the user's) reaches every actor whatever environment its node's
raylet was started with; the actor checks it again on its node before it compiles anything.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

CACHE_VARS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
APP_DIR = "dflash-dist"


class CacheDirError(RuntimeError):
    """A compile cache directory another user could write (or does own)."""


def default_cache_root(env: dict[str, str] | os._Environ = os.environ) -> Path:
    """$XDG_CACHE_HOME/dflash-dist, or ~/.cache/dflash-dist (a relative XDG_CACHE_HOME is ignored, as the
    XDG spec says)."""
    xdg = env.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / APP_DIR


def cache_dir_problem(path: Path) -> str | None:
    """Why `path` is not a private directory of this user, or None."""
    uid = os.getuid()
    try:
        link = os.lstat(path)
        st = os.stat(path)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (uid, 0):
        return f"is a symlink owned by uid {link.st_uid}, not by you (uid {uid})"
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by you (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"is writable by {'group and others' if st.st_mode & stat.S_IWOTH else 'its group'} "
            f"(mode {stat.S_IMODE(st.st_mode):04o})"
        )
    return None


def _make_private(path: Path) -> None:
    """mkdir with mode 0700 (parents too); an existing directory is left as it is (checked after)."""
    if path.parent != path and not path.parent.exists():
        _make_private(path.parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    os.chmod(path, 0o700)  # exactly 0700 whatever the umask


def use_private_cache_dirs(env: dict[str, str] | os._Environ = os.environ) -> dict[str, str]:
    """Set (if unset), create (if missing) and check both cache variables in `env` (the process's
    environment by default); returns {variable: directory}. Raises CacheDirError."""
    chosen = {}
    for var, sub in CACHE_VARS.items():
        user_set = bool(env.get(var))
        path = Path(env[var]) if user_set else default_cache_root(env) / sub
        path = Path(os.path.abspath(path))
        try:
            _make_private(path)
        except OSError as e:
            problem = f"cannot be created ({e.strerror or e})"
        else:
            problem = cache_dir_problem(path)
        if problem:
            how = (f"point {var} at a directory you own with mode 0700 (mkdir -m 700 DIR), or unset it to use "
                   f"{default_cache_root(env) / sub}") if user_set else (
                   f"fix or remove it (chmod 700 / rm -r, if it is yours), or set {var} to a directory you own "
                   "with mode 0700")  # fmt: skip
            raise CacheDirError(
                f"{var}={path} {problem}: torch.compile / Triton load and run what they find there (pickled "
                f"graphs, compiled kernels), so it must be a directory only you can write; {how}"
            )
        env[var] = str(path)
        chosen[var] = str(path)
    return chosen


def actor_runtime_env() -> dict[str, dict[str, str]]:
    """A Ray actor's `runtime_env` option: this process's checked cache directories as env_vars
    (Ray merges them into the job's runtime env, every other field inherited); the actor checks
    them again on its own node (`use_private_cache_dirs` at its start)."""
    return {"env_vars": use_private_cache_dirs()}
