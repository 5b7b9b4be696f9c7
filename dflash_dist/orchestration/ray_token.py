"""The environment that makes Ray processes demand and send a token, and the token of a run's own
local cluster.

Ray 2.60 authenticates every gRPC and dashboard request with a token when `RAY_AUTH_MODE=token`.
The multi-node launchers (launcher/ray_auth.py: cluster YAMLs, Slurm) build on `auth_env` and
`with_auth`. A single-node run starts its own cluster on 127.0.0.1 (`pipeline.ray_session`);
left to Ray, that cluster's token would be generated into ~/.ray/auth_token with the umask's
mode (0644 by default), where every local user could read it and submit work, i.e. run code as
the run's user, to the run's cluster. `local_cluster_auth` instead gives the cluster a token that
lives in the environment of this process and its children only (/proc/PID/environ is readable by
the owner alone) and is never written to disk.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path

TOKEN_BYTES = 32  # 64 hex characters
TOKEN_VARS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")  # the two ways of giving a token (with_auth keeps one)
AUTH_VARS = ("RAY_AUTH_MODE", *TOKEN_VARS)

_PROCESS_TOKEN: str | None = None  # local_cluster_auth's token, one per process


def new_token() -> str:
    return secrets.token_hex(TOKEN_BYTES)


def auth_env(*, token: str | None = None, token_path: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The variables that make Ray processes demand (server) and send (client) a token: the token
    itself (`token`, for processes of one job) or a file holding it (`token_path`)."""
    if (token is None) == (token_path is None):
        raise ValueError("auth_env: give exactly one of token, token_path")
    if token is not None:
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}


def with_auth(env: dict[str, str], **kwargs: str | os.PathLike[str] | None) -> dict[str, str]:
    """`env` with auth_env(**kwargs), and without the other way of giving a token (Ray would
    prefer RAY_AUTH_TOKEN over a file, and a user's variable over ours)."""
    out = {k: v for k, v in env.items() if k not in TOKEN_VARS}
    return out | auth_env(**kwargs)


def set_auth(environ: MutableMapping[str, str], **kwargs: str | os.PathLike[str] | None) -> None:
    """`with_auth` applied to `environ` in place (os.environ: this process and the ones it starts)."""
    for key in TOKEN_VARS:
        environ.pop(key, None)
    environ.update(auth_env(**kwargs))


def _reload_ray_auth() -> None:
    """Make this process's Ray read the token settings again. Ray's loader keeps the first token
    it found for the life of the process; a driver that had started or joined another cluster
    earlier would otherwise send that one (Ray's own tests reset it the same way)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@contextmanager
def local_cluster_auth() -> Iterator[str | None]:
    """Token auth for a Ray cluster this process starts on this node, with a token of this
    process that is never written to disk (yielded, for `reach_hint`); the environment as it was
    afterwards. A user who set RAY_AUTH_MODE chose how their clusters authenticate: then nothing
    changes (yields None)."""
    global _PROCESS_TOKEN
    if "RAY_AUTH_MODE" in os.environ:
        yield None
        return
    if _PROCESS_TOKEN is None:
        _PROCESS_TOKEN = new_token()
    before = {k: os.environ.get(k) for k in AUTH_VARS}
    set_auth(os.environ, token=_PROCESS_TOKEN)
    _reload_ray_auth()
    try:
        yield _PROCESS_TOKEN
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _reload_ray_auth()


def reach_hint(token: str, where: str) -> str:
    """How the run's user reaches the cluster of `local_cluster_auth` from another shell (`ray status`,
    `ray job submit`, the dashboard's token prompt): its token is in no file, but in the environment
    of the processes that Ray started from this one (its GCS, raylet), which /proc shows to their owner
    only. This process's own /proc/PID/environ does not show it (set after it started)."""
    holder = None
    for entry in Path("/proc").iterdir():
        try:
            ppid = int(next(x for x in (entry / "status").read_text().splitlines() if x.startswith("PPid:")).split()[1])
            if ppid == os.getpid() and f"RAY_AUTH_TOKEN={token}".encode() in (entry / "environ").read_bytes():
                holder = entry.name
                break
        except (OSError, ValueError, StopIteration):  # not a process, gone, or not ours to read
            continue
    if holder is None:
        return f"{where} demands this run's token, which is in no file and in no process that Ray started here"
    return (
        f"{where} demands this run's token, which is in no file: to reach it from another shell as this user, "
        f"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=\"$(tr '\\0' '\\n' < /proc/{holder}/environ | "
        "sed -n 's/^RAY_AUTH_TOKEN=//p')\""
    )
