"""Where the Ray clusters we start keep their session files: inside a directory only this user can enter.

Ray 2.60 makes its temp directory and every directory of a session in it mode 0777, "so others
can use it" (`try_to_create_directory`, chmod on every start): /tmp/ray by default, and also a
`--temp-dir`/`_temp_dir` given, whatever mode it was made with (a `mkdtemp` directory, 0700,
became 0777; measured). There, without a sticky bit, live the unix sockets our Ray processes
connect to, the log files they write, and `runtime_resources/`, where a working_dir package
already present under its content hash is used as found. Any local user of the node could
replace a socket, plant a link where a log is written, or a package our processes import. So
the temp directory is `ray/` inside a fresh `mkdtemp` directory: Ray opens its own directory
wide, but its parent (0700, ours) lets nobody else reach it. The parent is made where Ray
itself would put its directory ($RAY_TMPDIR, else $TMPDIR, else /tmp: a user who moved Ray off a
small /tmp keeps its logs and spilled objects off it), unless Ray's socket paths under it could
pass the 107 bytes a unix socket path may have: then under /tmp, said in the log. It is removed
when the node stops, unless the run failed (a Slurm worker node: its own Ray, or the job; see
launcher/slurm_ray.run_worker): then its Ray logs stay there, and the log says where.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator

RAY_DIR = "ray"  # the directory Ray is given, inside the private one
SOCKET_PATH_MAX = 107  # bytes of a unix socket path (sun_path, 108 with its NUL; Ray checks it)
# what Ray puts below its temp directory, at the longest: a session (its start time and a pid of up to
# 7 digits) and the plasma store's socket, ".N"-numbered if one is there already
_SOCKET_TAIL = len("/session_2026-12-05_20-55-02_123456_4194304/sockets/plasma_store.99")
_RANDOM = 8  # the characters mkdtemp adds

log = logging.getLogger(__name__)


def ray_temp_base(tag: str = "") -> str:
    """Where Ray would keep its directory (Ray's own rule: $RAY_TMPDIR, else $TMPDIR, else /tmp) if
    its longest socket path below `<base>/dfray-<tag>XXXXXXXX/ray` fits SOCKET_PATH_MAX, else /tmp."""
    base = os.path.abspath(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp")
    longest = len(os.fsencode(os.path.join(base, f"dfray-{tag}{'X' * _RANDOM}", RAY_DIR))) + _SOCKET_TAIL
    if base == "/tmp":
        return base
    too_long = f"Ray's socket paths there could pass the {SOCKET_PATH_MAX} bytes a unix socket path may have"
    if longest > SOCKET_PATH_MAX or not os.path.isdir(base):
        why = too_long if longest > SOCKET_PATH_MAX else "no such directory"
        log.info("Ray's temp directory goes under /tmp, not %s: %s", base, why)
        return "/tmp"
    return base


def make_private_ray_temp(tag: str = "") -> str:
    """A new temp directory for one Ray node (`<mkdtemp 0700>/ray`; Ray creates `ray/` itself):
    remove its parent, `os.path.dirname` of it, when the node has stopped."""
    return os.path.join(tempfile.mkdtemp(prefix=f"dfray-{tag}", dir=ray_temp_base(tag)), RAY_DIR)


@contextlib.contextmanager
def private_ray_temp(tag: str = "") -> Iterator[str]:
    """make_private_ray_temp for the life of the block; its parent is removed after a block that ended
    normally or was stopped (Ctrl-C, SystemExit), and kept after one that failed with an error
    (release_ray_temp)."""
    temp_dir = make_private_ray_temp(tag)
    failed = False
    try:
        yield temp_dir
    except Exception:
        failed = True
        raise
    finally:
        release_ray_temp(temp_dir, keep=failed)


def release_ray_temp(temp_dir: str, keep: bool, why: str = "the run failed") -> None:
    """Remove a make_private_ray_temp directory's parent, or, for a run that failed (`keep`; `why`
    says what failed), leave it and say where its Ray logs are: the raylet's, the GCS's and every
    worker's output, which Ray kept in /tmp/ray before the directories were private, and which a
    failure is read from."""
    if keep and os.path.isdir(temp_dir):
        log.warning("Ray's logs of this run are kept in %s/session_*/logs on %s (%s; remove the directory %s when "
                    "done)", temp_dir, socket.gethostname(), why, os.path.dirname(temp_dir))  # fmt: skip
        return
    shutil.rmtree(os.path.dirname(temp_dir), ignore_errors=True)
